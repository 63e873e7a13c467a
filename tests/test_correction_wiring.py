"""Token TIS wired end to end, against an independent float64 reference (the audit of why TIS
trailed uncorrected training in the first CPU study, docs/correction.md).

A real OpenRLHF `Actor` around a small Qwen2 is trained one step by the fork's actor trainer on rollouts of
a second, perturbed copy of it (the stand-in for an INT8 engine, μ). The rollouts go through upstream's own
plumbing, where an off-by-one would hide: `SamplesGenerator._process_response_into_experience` (the
`rollout_log_probs[1:]` slice), `Experience.concat_experiences` (right padding), the actor forward for π_old
and the replay buffer's split / re-pad. The reference recomputes everything per sample in float64 from the
token lists alone:

    w_t = min(π_old(a_t) / μ(a_t), 2)                     (weight from π_old, not π_θ; detached)
    ℓ_t = −w_t · min(ρ_t A_t, clip(ρ_t, 0.8, 1.2) A_t),   ρ_t = π_θ(a_t) / π_old(a_t)
    L   = Σ_t ℓ_t / N,   N = every action token of the batch (padding excluded)

and the test compares the gradient the trainer backpropagated with the reference's.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_actor_wiring import make_args, make_trainer

from openrlhf_tis import patches

patches.apply_platform_patches("cpu")  # openrlhf.models imports flash_attn at module level
from openrlhf.models import Actor  # noqa: E402
from openrlhf.trainer.ppo_utils import NaiveReplayBuffer  # noqa: E402
from openrlhf.trainer.ppo_utils.experience import Experience  # noqa: E402
from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator  # noqa: E402

from openrlhf_tis.correction import preset  # noqa: E402
from openrlhf_tis.trainer import ppo_actor  # noqa: E402

VOCAB, PAD = 64, 0
PROMPTS = [[5, 9, 3], [7, 2, 11, 4, 6], [8, 13], [10, 12, 14, 15]]  # different lengths: padding moves responses
LENGTHS = [6, 3, 8, 5]
ADVANTAGES = [1.0, -0.5, 0.8, -1.2]
CAP = 2.0


def tiny_lm(seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         pad_token_id=PAD, attn_implementation="eager")
    model = Qwen2ForCausalLM(config).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)  # peaked next-token distributions, as a trained model has
    return model


def perturbed(model, scale: float, seed: int):
    """A copy of `model` whose every weight moved by `scale` times its own spread (a coarse engine / an update)."""
    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std())
    return out


def token_logprobs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """log p(response[k] | prompt + response[:k]) under `model`, by its own forward (grad if enabled)."""
    logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def sample_rollouts(engine64):
    """Responses sampled from μ (the float64 engine), with μ's log-prob of each sampled token."""
    g = torch.Generator().manual_seed(0)
    rollouts = []
    with torch.no_grad():
        for prompt, length in zip(PROMPTS, LENGTHS, strict=True):
            response, mu = [], []
            for _ in range(length):
                logp = torch.log_softmax(engine64(torch.tensor([prompt + response])).logits[0, -1], -1)
                token = int(torch.multinomial(logp.exp(), 1, generator=g))
                response.append(token)
                mu.append(float(logp[token]))
            rollouts.append((prompt, response, mu))
    return rollouts


def vllm_response(prompt, response, mu) -> dict:
    """What upstream's agent returns for one sample: μ as a list over the whole observation, 0.0 on the prompt."""
    return {"prompt": "", "label": "", "observation_tokens": prompt + response,
            "action_ranges": [(len(prompt), len(prompt) + len(response))],
            "rollout_log_probs": [0.0] * len(prompt) + mu, "reward": 0.0, "scores": 0.0, "extra_logs": {}}


def actor_of(model) -> Actor:
    """upstream's Actor around an HF model object (its constructor sets packing_samples only for a path)."""
    actor = Actor(model)
    actor.packing_samples = False
    return actor


class GradRecorder:
    """The optimizer: keeps the gradient of each step instead of applying it."""

    def __init__(self, params):
        self.params = list(params)
        self.grads: list[torch.Tensor] = []

    def step(self):
        self.grads.append(torch.cat([p.grad.reshape(-1).clone() for p in self.params]))

    def zero_grad(self):
        for p in self.params:
            p.grad = None


def trained_batch(actor: Actor, rollouts) -> Experience:
    """Rollouts -> experience (π_old from the actor) -> replay buffer -> the collated training batch."""
    make = SamplesGenerator._process_response_into_experience
    samples = [make(None, vllm_response(*r), max_len=128) for r in rollouts]
    exp = Experience.concat_experiences(samples, PAD)
    with torch.no_grad():
        exp.action_log_probs = actor(exp.sequences, exp.action_mask, attention_mask=exp.attention_mask)
    exp.advantages = torch.tensor(ADVANTAGES)[:, None] * exp.action_mask
    exp.info = {}
    buffer = NaiveReplayBuffer(len(rollouts), 0, True, False, False)
    buffer.append(exp)
    return buffer.collate_fn([buffer[i] for i in range(len(buffer))])


def reference_gradient(policy64, old64, rollouts, weighted: bool = True) -> torch.Tensor:
    """∇ of the TIS loss (or, weighted=False, the uncorrected one) written out per sample in float64."""
    n = sum(len(r[1]) for r in rollouts)
    loss = torch.zeros((), dtype=torch.float64)
    for (prompt, response, mu), adv in zip(rollouts, ADVANTAGES, strict=True):
        with torch.no_grad():
            old = token_logprobs(old64, prompt, response)
        lp = token_logprobs(policy64, prompt, response)
        w = torch.clamp(torch.exp(old - torch.tensor(mu, dtype=torch.float64)), max=CAP) if weighted else 1.0
        rho = torch.exp(lp - old)
        surrogate = torch.minimum(rho * adv, torch.clamp(rho, 0.8, 1.2) * adv)
        loss = loss - (w * surrogate).sum() / n
    policy64.zero_grad()
    loss.backward()
    return torch.cat([p.grad.reshape(-1) for p in policy64.parameters()])


@pytest.fixture(scope="module")
def setup():
    base = tiny_lm(0)
    engine64 = perturbed(base, 0.5, seed=1).double()  # μ: far enough from π_old that weights spread and truncate
    rollouts = sample_rollouts(engine64)
    actor = actor_of(base)
    batch = trained_batch(actor, rollouts)
    return base, actor, rollouts, batch


def test_rollout_and_old_logprobs_sit_on_the_sampled_tokens(setup):
    """μ and π_old of action token k are the log-probs of response[k] (no shift), padding carries none."""
    base, _, rollouts, batch = setup
    old64 = copy.deepcopy(base).double()
    action = batch.action_mask.bool()
    assert int(action.sum()) == sum(LENGTHS)
    for row, (prompt, response, mu) in enumerate(rollouts):  # the buffer keeps the samples' order
        torch.testing.assert_close(batch.rollout_log_probs[row][action[row]].double(),
                                   torch.tensor(mu, dtype=torch.float64), rtol=0, atol=1e-6)
        with torch.no_grad():
            want_old = token_logprobs(old64, prompt, response)
        torch.testing.assert_close(batch.action_log_probs[row][action[row]].double(), want_old, rtol=0, atol=1e-5)
        assert batch.sequences[row, 1:][action[row]].tolist() == response


def test_tis_step_backpropagates_the_reference_gradient(setup):
    base, actor, rollouts, batch = setup
    cfg = preset("tis")
    trainer = make_trainer(ppo_actor.CorrectionActorPPOTrainer, make_args(cfg))
    # π_θ ≠ π_old, as on a later mini-batch: the weight must come from π_old/μ and the clip from π_θ/π_old.
    policy = perturbed(base, 0.05, seed=2)
    trainer.actor = actor_of(policy)
    trainer.actor_optim = recorder = GradRecorder(trainer.actor.parameters())
    status = trainer.training_step(batch, kl_ctl=0.0, step=0)

    old64 = copy.deepcopy(base).double()
    want = reference_gradient(copy.deepcopy(policy).double(), old64, rollouts)
    got = recorder.grads[0].double()
    assert (got - want).norm() < 1e-4 * want.norm()
    # The weights matter here, so the comparison can tell TIS from the uncorrected loss.
    off = reference_gradient(copy.deepcopy(policy).double(), old64, rollouts, weighted=False)
    assert (off - want).norm() > 0.05 * want.norm()

    # What the step logged is what it used: the weights' mean and the share truncated at the cap.
    ratios = torch.cat([torch.exp(token_logprobs(old64, p, r).detach() - torch.tensor(mu, dtype=torch.float64))
                        for p, r, mu in rollouts])
    metrics = status["metrics"]
    assert 0 < float((ratios > CAP).double().mean()) < 0.5  # the cap binds on some tokens, not all
    assert float(metrics["correction/weight_mean"]) == pytest.approx(float(ratios.clamp(max=CAP).mean()), rel=1e-5)
    assert float(metrics["correction/truncated_frac"]) == pytest.approx(float((ratios > CAP).double().mean()))
