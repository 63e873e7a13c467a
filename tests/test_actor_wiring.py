"""The correction wired into upstream's PPO actor, exercised without Ray or DeepSpeed.

The actor trainer is built around a small torch policy and a stand-in strategy, so upstream's own
`training_step` / `ppo_train` run unchanged with the fork's loss inside them.
"""

from __future__ import annotations

import math
import runpy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from openrlhf_tis import patches

patches.apply_platform_patches("cpu")  # openrlhf.models imports flash_attn at module level
import openrlhf.trainer.ray.ppo_actor as upstream_actor  # noqa: E402
from openrlhf.models import PolicyLoss  # noqa: E402
from openrlhf.trainer.ppo_utils import NaiveReplayBuffer  # noqa: E402
from openrlhf.trainer.ppo_utils.experience import Experience, split_experience_batch  # noqa: E402

from openrlhf_tis import metric_names as names  # noqa: E402
from openrlhf_tis.correction import (  # noqa: E402
    CorrectionConfig,
    CorrectionConfigError,
    from_upstream,
    policy_loss,
    preset,
)
from openrlhf_tis.run_spec import ClusterPlan, RunSpec  # noqa: E402
from openrlhf_tis.trainer import bypass, ppo_actor  # noqa: E402
from openrlhf_tis.trainer.policy_loss import CorrectionPolicyLoss  # noqa: E402

VOCAB, B, T = 11, 4, 9


class TinyPolicy(nn.Module):
    """Stands in for openrlhf.models.Actor: same call signature, log-probs of the sampled tokens."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, sequences, action_mask, attention_mask=None, return_output=False, ring_attn_group=None,
                packed_seq_lens=None, return_entropy=False):
        logits = self.head(self.emb(sequences))[:, :-1]
        logp = torch.log_softmax(logits, -1)
        lp = logp.gather(-1, sequences[:, 1:, None]).squeeze(-1)[:, -action_mask.shape[1]:] * action_mask.float()
        entropy = -(logp.exp() * logp).sum(-1)
        out = SimpleNamespace(entropy=entropy, aux_loss=torch.zeros(()))
        return (lp, out) if return_output else lp


class Strategy:
    ring_attn_group = None
    accumulated_gradient = 1

    def __init__(self, args):
        self.args = args

    def backward(self, loss, model, optimizer):
        loss.backward()

    def optimizer_step(self, optimizer, model, scheduler, name=None):
        optimizer.step()
        optimizer.zero_grad()

    def get_grad_norm(self, model):
        return 0.0

    def is_rank_0(self):
        return True

    def all_reduce(self, data):
        return data

    def print(self, *args):
        pass


def make_args(correction: CorrectionConfig, **upstream):
    """The hierarchized arguments an actor receives, its run spec resolving to `correction`."""
    adv = dict(is_correction_level="off", is_correction_mode="mask", is_correction_gating="ratio",
               is_correction_threshold=[0.5, 5.0])
    adv.update(upstream)
    return SimpleNamespace(
        fork=SimpleNamespace(spec=RunSpec(ClusterPlan("cpu", "a test"), correction)),
        actor=SimpleNamespace(eps_clip_low_high=(0.2, 0.2), dual_clip=None, loss_agg_mode="token-mean",
                              policy_loss_type="ppo", entropy_coef=None, aux_loss_coef=0.0),
        algo=SimpleNamespace(kl=SimpleNamespace(use_loss=False, init_coef=0.0), advantage=SimpleNamespace(**adv)),
        train=SimpleNamespace(dynamic_batch_enable=False, max_epochs=1),
        ds=SimpleNamespace(packing_samples=False, tensor_parallel_size=1, ring_attn_size=1),
    )


def make_trainer(cls, args, seed=0):
    """An actor trainer as upstream's __init__ leaves it, minus the vLLM sync group and DeepSpeed."""
    trainer = object.__new__(cls)
    trainer.strategy = Strategy(args)
    trainer.args = args
    trainer.actor = TinyPolicy(seed)
    trainer.ema_model = None
    trainer.actor_optim = torch.optim.SGD(trainer.actor.parameters(), lr=0.1)
    trainer.actor_scheduler = SimpleNamespace(get_last_lr=lambda: [0.1])
    trainer.max_epochs = 1
    trainer.aux_loss = False
    trainer.dataloader_pin_memory = False
    trainer.replay_buffer = NaiveReplayBuffer(2, 0, True, False, False)
    trainer.actor_loss_fn = PolicyLoss(
        is_correction_level=args.algo.advantage.is_correction_level,
        is_correction_mode=args.algo.advantage.is_correction_mode,
        is_correction_gating=args.algo.advantage.is_correction_gating,
        is_correction_threshold=args.algo.advantage.is_correction_threshold,
    )
    if cls is not upstream_actor.ActorPPOTrainer:
        trainer._setup_correction()
    return trainer


def make_experience(seed=0, spread=0.3) -> Experience:
    g = torch.Generator().manual_seed(seed)
    seqs = torch.randint(0, VOCAB, (B, T), generator=g)
    attn = torch.ones(B, T, dtype=torch.long)
    attn[1, -2:] = 0
    am = torch.zeros(B, T - 1, dtype=torch.bool)
    am[:, 3:] = True
    am[1, -2:] = False
    with torch.no_grad():
        old = TinyPolicy(seed=1)(seqs, am)  # π_old: a slightly different policy than the trained one
    roll = (old + torch.randn(old.shape, generator=g) * spread) * am
    adv = torch.randn(B, 1, generator=g).expand(B, T - 1) * am
    return Experience(sequences=seqs, attention_mask=attn, action_mask=am, action_log_probs=old,
                      rollout_log_probs=roll, advantages=adv.contiguous(), info={})


def test_fork_classes_substitutes_the_policy_actor():
    from openrlhf_tis.patches import fork_classes

    fork_classes.apply()
    assert upstream_actor.PolicyModelActor is ppo_actor.PolicyModelActor
    plain = ppo_actor.PolicyModelActor.__ray_metadata__.modified_class.__ray_actor_class__
    assert issubclass(plain, ppo_actor._UpstreamPolicyModelActor)
    # upstream's CLI module binds the name at import: a fresh run of it (as the fork's runpy does) sees ours.
    namespace = runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="not_main")
    assert namespace["PolicyModelActor"] is ppo_actor.PolicyModelActor


def test_the_actor_reads_the_run_spec_and_refuses_arguments_without_one():
    args = make_args(preset("tis"), is_correction_level="token", is_correction_mode="clip")
    trainer = make_trainer(ppo_actor.CorrectionActorPPOTrainer, args)
    assert trainer.correction == preset("tis")  # the spec's, not a re-mapping of upstream's flags
    del args.fork  # arguments from upstream's own CLI: the fork's actor does not guess the run from them
    with pytest.raises(RuntimeError, match="no run spec in the arguments.*openrlhf_tis.cli.train_ppo_ray"):
        make_trainer(ppo_actor.CorrectionActorPPOTrainer, args)


@pytest.mark.parametrize("name", ["tis", "mis_full", "bypass_ppo", "bypass_reinforce", "geo_rs"])
def test_training_step_uses_the_core_and_returns_metrics(name):
    cfg = preset(name)
    trainer = make_trainer(ppo_actor.CorrectionActorPPOTrainer, make_args(cfg))
    exp = make_experience(spread=0.003 if name in ("mis_full", "geo_rs") else 0.3)  # let Geo-RS keep some
    # The loss the step must take, computed directly with the same policy before the update.
    lp = TinyPolicy(0)(exp.sequences, exp.action_mask)
    want = policy_loss(lp, exp.action_log_probs, exp.advantages, exp.action_mask, exp.rollout_log_probs, cfg)
    status = trainer.training_step(exp, kl_ctl=0.0, step=0)
    metrics = status["metrics"]
    assert metrics["policy_loss"].item() == pytest.approx(want.loss.item(), rel=1e-5, abs=1e-7)
    for key in ("mismatch/k3_kl", "mismatch/chi2_seq", "correction/masked_frac", "correction/ess", "vllm_kl",
                "is_filter_ratio", "ppo_kl", "ppo_clip_ratio"):
        assert key in metrics and status["weights"][key] == "token", key
    assert metrics["mismatch/k3_kl"].item() == pytest.approx(want.correction.metrics["mismatch/k3_kl"], rel=1e-5)
    # The parameters moved: the step really backpropagated the corrected loss.
    assert want.correction.mask.any()
    assert not torch.allclose(trainer.actor.head.weight, TinyPolicy(0).head.weight)


def test_correction_off_step_matches_upstream_actor():
    exp = make_experience(seed=3)
    ours = make_trainer(ppo_actor.CorrectionActorPPOTrainer, make_args(preset("off")))
    theirs = make_trainer(upstream_actor.ActorPPOTrainer, make_args(preset("off")))
    s_ours = ours.training_step(make_experience(seed=3), kl_ctl=0.0, step=0)
    s_theirs = theirs.training_step(exp, kl_ctl=0.0, step=0)
    assert s_ours["metrics"]["policy_loss"].item() == pytest.approx(s_theirs["metrics"]["policy_loss"].item(),
                                                                    rel=1e-6)
    for a, b in zip(ours.actor.parameters(), theirs.actor.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_upstream_flags_step_matches_upstream_actor():
    flags = dict(is_correction_level="seq", is_correction_mode="mask", is_correction_threshold=[0.8, 1.25])
    resolved = from_upstream("seq", "mask", "ratio", [0.8, 1.25])  # as the driver resolves these flags
    ours = make_trainer(ppo_actor.CorrectionActorPPOTrainer, make_args(resolved, **flags))
    theirs = make_trainer(upstream_actor.ActorPPOTrainer, make_args(resolved, **flags))
    s_ours = ours.training_step(make_experience(seed=4), kl_ctl=0.0, step=0)
    s_theirs = theirs.training_step(make_experience(seed=4), kl_ctl=0.0, step=0)
    assert s_ours["metrics"]["policy_loss"].item() == pytest.approx(s_theirs["metrics"]["policy_loss"].item(),
                                                                    rel=1e-5)
    assert s_ours["metrics"]["vllm_kl"].item() == pytest.approx(s_theirs["metrics"]["vllm_kl"].item(), rel=1e-5)


def test_all_masked_and_nan_rollouts_in_a_step():
    trainer = make_trainer(ppo_actor.CorrectionActorPPOTrainer, make_args(preset("mis_full")))
    exp = make_experience(seed=5)
    exp.rollout_log_probs = torch.full_like(exp.rollout_log_probs, math.nan)
    before = [p.detach().clone() for p in trainer.actor.parameters()]
    status = trainer.training_step(exp, kl_ctl=0.0, step=0)
    assert status["metrics"]["policy_loss"].item() == 0.0
    assert status["metrics"]["correction/nonfinite_frac"].item() == 1.0
    for a, b in zip(before, trainer.actor.parameters(), strict=True):
        torch.testing.assert_close(a, b)  # zero gradient: SGD left every weight where it was


def test_ppo_train_logs_metrics_and_normalizes_over_the_replay_buffer():
    cfg = preset("tis", batch_normalize=True)
    trainer = make_trainer(ppo_actor.CorrectionActorPPOTrainer, make_args(cfg))
    for seed in (6, 7):
        trainer.replay_buffer.append(make_experience(seed=seed))
    status = trainer.ppo_train(kl_ctl=0.0)
    assert "mismatch/k3_kl" in status and "correction/norm_factor" in status
    # The normalizer is the mean kept weight of every item of the buffer, whichever micro-batch holds them.
    items = [it for seed in (6, 7) for it in split_experience_batch(make_experience(seed=seed))]
    ws = torch.cat([(torch.exp(it.action_log_probs - it.rollout_log_probs).clamp(max=2.0))[it.action_mask]
                    for it in items])
    assert status["correction/norm_factor"] == pytest.approx(ws.mean().item(), rel=1e-5)
    assert trainer.actor_loss_fn.normalizer is None  # scoped to its ppo_train: a later step computes its own


@pytest.mark.parametrize("name", ["off", "seq_tis", "geo_rs", "bypass_ppo"])
def test_gspo_step_measures_the_mismatch_as_ppo_does(name):
    """The mismatch does not depend on the loss: GSPO logs PPO's keys, the same mismatch, with GSPO's loss."""
    cfg = preset(name)
    exp_seed, spread = 12, 0.003 if name == "geo_rs" else 0.3
    metrics = {}
    for loss_type in ("ppo", "gspo"):
        args = make_args(cfg)
        args.actor.policy_loss_type = loss_type
        trainer = make_trainer(ppo_actor.CorrectionActorPPOTrainer, args)
        metrics[loss_type] = trainer.training_step(make_experience(seed=exp_seed, spread=spread), kl_ctl=0.0,
                                                   step=0)["metrics"]
    assert set(metrics["gspo"]) == set(metrics["ppo"])
    written = {k for k in metrics["gspo"] if k.startswith((names.MISMATCH, names.CORRECTION))}
    registry = {v for v in vars(names).values() if isinstance(v, str)}
    registry |= {*names.BUCKET_GAP_KEYS, *names.BUCKET_FRAC_KEYS, *map(names.rejection_frac_key,
                                                                      (c.name for c in cfg.rejection))}
    assert names.K3_KL in written and written <= registry, written - registry
    for key in written:  # μ, π_old and (bypass) π_θ are the same on both sides
        assert metrics["gspo"][key].item() == pytest.approx(metrics["ppo"][key].item(), rel=1e-6, abs=1e-9), key
    # ... and the loss is GSPO's: one ratio per sequence, aggregated per sequence (upstream forces it so).
    exp = make_experience(seed=exp_seed, spread=spread)
    lp = TinyPolicy(0)(exp.sequences, exp.action_mask)
    want = policy_loss(lp, exp.action_log_probs, exp.advantages, exp.action_mask, exp.rollout_log_probs, cfg,
                       token_level_loss=False, sequence_ratio=True)
    assert metrics["gspo"]["policy_loss"].item() == pytest.approx(want.loss.item(), rel=1e-5, abs=1e-7)
    if name == "off":  # upstream's own GSPO step, for comparison
        args = make_args(preset("off"))
        args.actor.policy_loss_type = "gspo"
        theirs = make_trainer(upstream_actor.ActorPPOTrainer, args)
        theirs.actor_loss_fn = PolicyLoss(policy_loss_type="gspo")
        up = theirs.training_step(make_experience(seed=exp_seed, spread=spread), kl_ctl=0.0, step=0)["metrics"]
        assert metrics["gspo"]["policy_loss"].item() == pytest.approx(up["policy_loss"].item(), rel=1e-6)


def test_gspo_refuses_a_token_level_correction_in_the_actor():
    args = make_args(preset("tis"))
    args.actor.policy_loss_type = "gspo"
    with pytest.raises(CorrectionConfigError, match="--algo.correction.level"):
        make_trainer(ppo_actor.CorrectionActorPPOTrainer, args)


# ── bypass: the π_old forward is never dispatched ──

class _ForbiddenGroup:
    def async_run_method_batch(self, **_kwargs):
        raise AssertionError("bypass mode must not run the π_old forward")

    def async_run_method(self, **_kwargs):
        raise AssertionError("bypass mode must not touch the actor group")


def test_bypass_experience_maker_skips_the_old_forward(monkeypatch):
    import openrlhf.trainer.ppo_utils.experience_maker as em

    monkeypatch.setattr(em.ray, "put", lambda obj: obj)
    monkeypatch.setattr(em.ray, "get", lambda ref: ref)
    args = make_args(preset("bypass_ppo"))
    args.train.colocate_all = args.train.colocate_actor_ref = args.train.colocate_critic_reward = False
    args.algo.kl.estimator = "k1"
    args.algo.advantage.estimator = "reinforce"
    controller = SimpleNamespace(args=args)
    controller.experience_maker = em.RemoteExperienceMaker(
        _ForbiddenGroup(), None, None, None, SimpleNamespace(value=0.0), SimpleNamespace(args=args), None)
    assert bypass.install_bypass_experience_maker(controller)
    samples = [make_experience(seed=8), make_experience(seed=9)]
    for s in samples:
        s.rewards = torch.zeros(B)
        s.rollout_log_probs[0, 4] = math.nan
    made = controller.experience_maker.make_experience(samples)
    for s in made:
        assert torch.isfinite(s.action_log_probs).all()
        want = torch.nan_to_num(s.rollout_log_probs, nan=0.0) * s.action_mask
        torch.testing.assert_close(s.action_log_probs, want)
    # Not in bypass mode: nothing is switched.
    other = SimpleNamespace(args=make_args(preset("tis")), experience_maker=object())
    assert not bypass.install_bypass_experience_maker(other)


def test_actor_forward_stays_exact_in_bypass_mode(monkeypatch):
    """Bypass skips π_old in the experience maker, never in the actor: the weight-sync check scores with it."""
    calls = []
    monkeypatch.setattr(ppo_actor._UpstreamPolicyModelActor, "forward",
                        lambda self, *a, **k: calls.append(1) or torch.full((3, 5), -1.0))
    actor = object.__new__(ppo_actor._CorrectionPolicyModelActor)
    actor.strategy = Strategy(make_args(preset("bypass_ppo")))
    actor.trainer = SimpleNamespace(correction=preset("bypass_ppo"))
    out = actor.forward(torch.zeros(3, 6, dtype=torch.long), torch.ones(3, 5), torch.ones(3, 6))
    assert calls == [1] and torch.equal(out, torch.full((3, 5), -1.0))


def test_bypass_step_uses_rollout_as_old():
    trainer = make_trainer(ppo_actor.CorrectionActorPPOTrainer, make_args(preset("bypass_ppo")))
    exp = make_experience(seed=10)
    exp.action_log_probs = torch.zeros_like(exp.action_log_probs)  # whatever pi_old the experience carried
    exp.rollout_log_probs[2, 5] = math.inf
    trainer.training_step(exp, kl_ctl=0.0, step=0)
    torch.testing.assert_close(exp.action_log_probs, bypass.rollout_as_old(exp.rollout_log_probs,
                                                                              exp.action_mask))
    assert torch.isfinite(exp.action_log_probs).all()


def test_policy_actor_reclasses_upstreams_trainer(monkeypatch):
    args = make_args(preset("icepop"))

    def upstream_init(self, strategy, pretrain, max_steps=None, vllm_engines=None):
        self.strategy = strategy
        self.trainer = make_trainer(upstream_actor.ActorPPOTrainer, args)

    monkeypatch.setattr(ppo_actor._UpstreamPolicyModelActor, "init_model_from_pretrained", upstream_init)
    actor = object.__new__(ppo_actor._CorrectionPolicyModelActor)
    actor.init_model_from_pretrained(Strategy(args), "unused")
    assert type(actor.trainer) is ppo_actor.CorrectionActorPPOTrainer
    assert isinstance(actor.trainer.actor_loss_fn, CorrectionPolicyLoss)
    assert actor.trainer.correction == preset("icepop")
    status = actor.trainer.training_step(make_experience(seed=11), kl_ctl=0.0, step=0)
    assert "correction/bounds_masked_frac" in status["metrics"]
