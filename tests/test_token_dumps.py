"""Per-token dumps wired into training, without Ray: the actor trainer's collection and the controller's plan.

The actor trainer is the one of test_actor_wiring.py (a tiny torch policy, upstream's own `ppo_train` /
`training_step`); dumped columns are checked against values computed here independently, in float64.
"""

from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from openrlhf.trainer.ppo_utils import NaiveReplayBuffer
from test_actor_wiring import B, TinyPolicy, make_args, make_experience, make_trainer

from openrlhf_tis.correction import CorrectionConfig, losses, preset
from openrlhf_tis.moe.routing_batch import ROUTED_EXPERTS
from openrlhf_tis.run_spec import DumpPlan
from openrlhf_tis.runs import MASK_REASON_CODES, query_tokens, token_steps
from openrlhf_tis.runs.tokens import select_samples
from openrlhf_tis.trainer import ppo_actor, step_part, token_dumps
from openrlhf_tis.trainer.token_dumps import TokenDumpPlan

GROUP = 2  # n_samples_per_prompt of the fake step


def _trainer(cfg: CorrectionConfig, micro_batch: int = B, epochs: int = 1, loss_type: str = "ppo"):
    args = make_args(cfg)
    args.actor.policy_loss_type = loss_type
    trainer = make_trainer(ppo_actor.CorrectionActorPPOTrainer, args)
    trainer.replay_buffer = NaiveReplayBuffer(micro_batch, 0, True, False, False)
    trainer.max_epochs = epochs
    return trainer


def _experience(seed: int = 0, spread: float = 0.3, first_id: int = 0):
    """make_experience's batch as upstream's experience maker hands it over: numbered, with rewards."""
    exp = make_experience(seed=seed, spread=spread)
    exp.index = list(range(first_id, first_id + B))
    exp.rewards = torch.arange(B, dtype=torch.float32) * 0.5 - 1.0
    exp.prompts = [f"question {i // GROUP}" for i in exp.index]
    exp.info["staleness_lag"] = torch.tensor([float(i % 3) for i in exp.index])  # as the controller stamps it
    return exp


def _fit(trainer, experience) -> dict:
    """What the Ray actor does for one step: append (PolicyModelActor.append), fit = ppo_train + clear."""
    trainer.append_experience(experience)
    status = trainer.ppo_train(kl_ctl=0.0)
    trainer.replay_buffer.clear()
    return status


def _train(trainer, experience, run_dir, ids=tuple(range(B)), step: int = 1) -> dict:
    trainer.token_dump_plan = TokenDumpPlan(step=step, run_dir=str(run_dir), sample_ids=tuple(ids), group_size=GROUP)
    return _fit(trainer, experience)


def _expected(seed: int, spread: float, roll_edit=None) -> pd.DataFrame:
    """One row per action token, from the inputs and the untrained policy (its state at the first update)."""
    exp = _experience(seed, spread)
    if roll_edit is not None:
        roll_edit(exp.rollout_log_probs)
    with torch.no_grad():
        lp, out = TinyPolicy(0)(exp.sequences, exp.action_mask, return_output=True)
    am = exp.action_mask.numpy()
    width = am.shape[1]
    rows = []
    for i in range(B):
        for pos, j in enumerate(np.flatnonzero(am[i])):
            rows.append(dict(sample_id=i, position=pos, token=int(exp.sequences[i, -width + j]),
                             rollout=float(exp.rollout_log_probs[i, j]), old=float(exp.action_log_probs[i, j]),
                             train=float(lp[i, j]), ent=float(out.entropy[i, -width + j]),
                             adv=float(exp.advantages[i, j]), rew=float(exp.rewards[i])))
    return pd.DataFrame(rows)


def _dump(run_dir) -> pd.DataFrame:
    return query_tokens(run_dir, reason_names=False)


def _merged(got: pd.DataFrame, want: pd.DataFrame) -> pd.DataFrame:
    merged = got.merge(want, on=["sample_id", "position"], how="outer", validate="one_to_one", indicator=True)
    assert (merged["_merge"] == "both").all(), merged[merged["_merge"] != "both"]
    return merged


def test_tis_dump_matches_independent_values(tmp_path):
    spread = 0.8  # wide enough that the TIS cap binds on some tokens

    def one_nan(roll):
        roll[2, 5] = math.nan

    exp = _experience(spread=spread)
    one_nan(exp.rollout_log_probs)
    status = _train(_trainer(preset("tis")), exp, tmp_path)
    got = _dump(tmp_path)
    m = _merged(got, _expected(0, spread, one_nan))

    assert token_steps(tmp_path) == [1] and (m["step"] == 1).all()
    assert (m["prompt_id"] == m["sample_id"] // GROUP).all()
    assert (m["prompt_text"] == "question " + (m["sample_id"] // GROUP).astype(str)).all()
    assert (m["lag"] == m["sample_id"] % 3).all()
    assert (m["token_id"] == m["token"]).all()
    for column, want in (("rollout_logprob", "rollout"), ("old_logprob", "old"), ("train_logprob", "train"),
                         ("entropy", "ent"), ("advantage", "adv"), ("reward", "rew")):
        np.testing.assert_allclose(m[column], m[want], rtol=1e-6, atol=1e-6, equal_nan=True, err_msg=column)
    # IS weights in float64 from the stored inputs: raw = π_old/μ, final = min(raw, 2); sample 2 holds a NaN
    # log-prob, so (nonfinite='sequence') its whole response is masked for reason 'nan'.
    nan_sample = m["sample_id"] == 2
    raw = np.exp(m["old"].astype(np.float64) - m["rollout"].astype(np.float64))
    np.testing.assert_allclose(m.loc[~nan_sample, "is_weight_raw"], raw[~nan_sample], rtol=1e-5)
    np.testing.assert_allclose(m.loc[~nan_sample, "is_weight"], np.minimum(raw[~nan_sample], 2.0), rtol=1e-5)
    assert (raw[~nan_sample] > 2.0).any(), "the cap never bound: the test checks nothing"
    assert m.loc[nan_sample, "is_weight_raw"].isna().all() and (m.loc[nan_sample, "is_weight"] == 0).all()
    assert (m["masked"] == nan_sample).all()
    assert (m["mask_reason"] == np.where(nan_sample, MASK_REASON_CODES["nan"], 0)).all()
    # stored in (sample, position) order, positions 0.. within each response, no duplicate token
    assert not got.duplicated(["step", "sample_id", "position"]).any()
    assert got[["sample_id", "position"]].equals(got.sort_values(["sample_id", "position"])[["sample_id", "position"]])
    assert (got.groupby("sample_id")["position"].apply(lambda p: list(p) == list(range(len(p))))).all()
    assert status["run_store/token_dump_tokens"] == len(got) and status["run_store/token_dump_s"] > 0


def test_mask_reasons_follow_their_precedence(tmp_path):
    cfg = CorrectionConfig(level="token", mode="mask", lower=0.5, upper=2.0, veto_threshold=0.01)

    def edit(roll):
        roll[0, 4] = roll[0, 4] - 6.0  # r = e^6 > 1/v: sample 0 is vetoed (also out of bounds there)
        roll[2, 3] = math.nan  # sample 2: a NaN log-prob

    exp = _experience(spread=0.5)
    edit(exp.rollout_log_probs)
    _train(_trainer(cfg), exp, tmp_path)
    m = _merged(_dump(tmp_path), _expected(0, 0.5, edit))
    r = np.exp(m["old"].astype(np.float64) - m["rollout"].astype(np.float64))
    bounds = (r < 0.5) | (r > 2.0)
    want = np.select([m["sample_id"] == 2, m["sample_id"] == 0, bounds], [4, 3, 1], 0)
    assert (m["mask_reason"].to_numpy() == want).all()
    assert (want == 1).any(), "no token out of bounds: the test checks nothing"
    assert (m["masked"] == (want != 0)).all()
    kept = want == 0
    np.testing.assert_allclose(m.loc[kept, "is_weight"], r[kept], rtol=1e-5)
    assert (m.loc[~kept, "is_weight"] == 0).all()


@pytest.mark.parametrize("name", ["bypass_reinforce", "bypass_ppo"])
def test_bypass_dump_has_no_old_logprob(tmp_path, name):
    exp = _experience(spread=0.5)
    _train(_trainer(preset(name)), exp, tmp_path)
    m = _merged(_dump(tmp_path), _expected(0, 0.5))
    assert m["old_logprob"].isna().all()  # π_old is never computed in bypass mode
    raw = np.exp(m["train"].astype(np.float64) - m["rollout"].astype(np.float64))  # π_θ/μ
    np.testing.assert_allclose(m["is_weight_raw"], raw, rtol=1e-5)
    want = np.minimum(raw, 2.0) if name == "bypass_reinforce" else np.ones_like(raw)  # bypass_ppo: ratio in the clip
    np.testing.assert_allclose(m["is_weight"], want, rtol=1e-5)


@pytest.mark.parametrize("name", ["seq_tis", "off"])
def test_gspo_steps_are_dumped_with_their_sequence_weights(tmp_path, name):
    """GSPO's dump holds the same rows as PPO's; its weight is one per sequence, min(Π π_old/μ, 2) for seq_tis."""
    spread = 0.5
    status = _train(_trainer(preset(name), loss_type="gspo"), _experience(spread=spread), tmp_path)
    m = _merged(_dump(tmp_path), _expected(0, spread))
    assert status["run_store/token_dump_tokens"] == len(m)
    np.testing.assert_allclose(m["old_logprob"], m["old"], rtol=1e-6)
    log_r = m["old"].astype(np.float64) - m["rollout"].astype(np.float64)
    raw = np.exp(log_r.groupby(m["sample_id"]).transform("sum")) if name == "seq_tis" else np.exp(log_r)
    np.testing.assert_allclose(m["is_weight_raw"], raw, rtol=1e-5)
    want = np.minimum(raw, 2.0) if name == "seq_tis" else np.ones_like(raw)
    np.testing.assert_allclose(m["is_weight"], want, rtol=1e-5)
    assert not m["masked"].any()
    assert name == "off" or ((raw > 2.0).any() and (raw < 2.0).any()), "the cap binds nowhere or everywhere"


def test_correction_off_masks_nothing(tmp_path):
    def edit(roll):
        roll[1, 3] = math.nan

    exp = _experience()
    edit(exp.rollout_log_probs)
    _train(_trainer(preset("off")), exp, tmp_path)
    m = _merged(_dump(tmp_path), _expected(0, 0.3, edit))
    # plain PPO: the loss reads neither μ nor a weight, so no token is excluded and every weight is 1
    assert not m["masked"].any() and (m["mask_reason"] == 0).all() and (m["is_weight"] == 1).all()
    assert m.loc[m["sample_id"] == 1, "is_weight_raw"].isna().all()


def test_only_planned_samples_at_their_first_update(tmp_path):
    ids = tuple(select_samples(B, 2, step=10, group_size=GROUP))
    torch.manual_seed(123)  # the loader's shuffle
    _train(_trainer(preset("tis"), micro_batch=2, epochs=2), _experience(first_id=0), tmp_path / "two", ids, step=10)
    torch.manual_seed(123)
    _train(_trainer(preset("tis"), micro_batch=2, epochs=1), _experience(first_id=0), tmp_path / "one", ids, step=10)
    two, one = _dump(tmp_path / "two"), _dump(tmp_path / "one")
    assert sorted(two["sample_id"].unique()) == sorted(ids) and len(ids) == GROUP
    assert not two.duplicated(["sample_id", "position"]).any()  # epoch 1 trains them again but adds no row
    # epoch 0 is the same in both runs, so π_θ at the first update is too; epoch 1 would differ
    pd.testing.assert_frame_equal(two, one)


def test_the_dump_reads_the_loss_own_details_and_plain_steps_compute_none(tmp_path, monkeypatch):
    calls = []  # every correction the actor computes: the normalizer's, and one per loss call
    real = losses.compute_correction
    for module in (ppo_actor, losses):
        monkeypatch.setattr(module, "compute_correction",
                            lambda *a, **k: calls.append(k.get("details", False)) or real(*a, **k))
    trainer = _trainer(preset("tis"))
    status = _fit(trainer, _experience())
    assert calls == [False] and "run_store/token_dump_s" not in status and trainer.actor_loss_fn.call is None
    calls.clear()
    _train(trainer, _experience(), tmp_path)
    assert calls == [True]  # the loss's own call carried the details: no second pass for the dump
    calls.clear()
    _fit(trainer, _experience())  # the plan was consumed by the dumped step: not applied again
    assert calls == [False] and token_steps(tmp_path) == [1]


def test_a_failed_write_stops_training(tmp_path):
    blocker = tmp_path / "run"
    blocker.write_text("a file where the run directory should be")
    with pytest.raises(OSError):
        _train(_trainer(preset("tis")), _experience(), blocker)


def test_append_keeps_sample_ids_and_numbers_unindexed_batches():
    trainer = _trainer(preset("tis"))
    actor = object.__new__(ppo_actor._CorrectionPolicyModelActor)
    actor.trainer = trainer
    actor.append(_experience(first_id=4))
    assert [item.index for item in trainer.replay_buffer.items] == [[4], [5], [6], [7]]
    unindexed = _experience()
    unindexed.index = None  # dynamic batching re-packs samples and drops upstream's numbering
    actor.append(unindexed)
    assert [item.index[0] for item in trainer.replay_buffer.items[4:]] == [4, 5, 6, 7]  # rank 0 of 1: position
    assert trainer._local_sample_ids
    plan = TokenDumpPlan(step=3, run_dir="x", sample_ids=(1,))
    actor.set_token_dump(plan)
    assert trainer.token_dump_plan is plan


# ── controller side ──

def _controller_args(run_dir: str | None = "run"):
    return SimpleNamespace(logger=SimpleNamespace(run_dir=run_dir), rollout=SimpleNamespace(n_samples_per_prompt=GROUP),
                           train=SimpleNamespace(seed=42))


def test_plan_names_dumped_steps_and_whole_groups():
    args, dumps = _controller_args(), DumpPlan(steps=3, samples=3)
    assert [s for s in range(1, 10) if step_part.token_dump_plan(args, dumps, s, 16)] == [1, 3, 6, 9]
    plan = step_part.token_dump_plan(args, dumps, 6, 16)
    assert plan.run_dir == args.logger.run_dir and plan.group_size == GROUP
    assert len(plan.sample_ids) == 4 and all(plan.sample_ids[i] // GROUP == plan.sample_ids[i + 1] // GROUP
                                             for i in (0, 2))
    assert plan.sample_ids == tuple(select_samples(16, 3, 6, seed=42, group_size=GROUP))
    assert step_part.token_dump_plan(args, DumpPlan(steps=0, samples=8), 1, 16) is None
    assert step_part.token_dump_plan(_controller_args(run_dir=None), DumpPlan(10, 8), 1, 16) is None
    assert step_part.token_dump_plan(args, DumpPlan(steps=10, samples=0), 1, 16) is None


def test_entropy_from_logits_matches_a_direct_computation():
    logits = torch.randn(3, 7, 5, generator=torch.Generator().manual_seed(0))
    got = token_dumps.response_entropy(SimpleNamespace(logits=logits), (3, 7), width=4, rows=[0, 2])
    logp = torch.log_softmax(logits.double(), -1)
    want = (-(logp.exp() * logp).sum(-1))[:, :-1][:, -4:]  # position t predicts token t+1
    torch.testing.assert_close(got[[0, 2]].double(), want[[0, 2]], rtol=1e-5, atol=1e-6)
    assert torch.isnan(got[1]).all()  # a row not dumped costs nothing
    packed = SimpleNamespace(logits=torch.randn(1, 21, 5))  # no (B, T) layout: unknown, not wrong
    assert torch.isnan(token_dumps.response_entropy(packed, (3, 7), 4, [0])).all()


def test_entropy_capture_leaves_the_policy_as_it_was():
    policy, exp = TinyPolicy(0), make_experience()
    with token_dumps.capture_response_entropy(policy, [1, 3]) as found:
        policy(exp.sequences, exp.action_mask, return_output=True)
        policy(exp.sequences, exp.action_mask, return_output=True)
    assert "forward" not in policy.__dict__ and found["entropy"].shape == exp.action_mask.shape
    assert torch.isfinite(found["entropy"][[1, 3]]).all() and torch.isnan(found["entropy"][[0, 2]]).all()


def test_logits_entropy_is_chunked_exactly(monkeypatch):
    logits = torch.randn(10, 7, generator=torch.Generator().manual_seed(1)) * 3
    whole = token_dumps.logits_entropy(logits)
    monkeypatch.setattr(token_dumps, "ENTROPY_CHUNK_ELEMENTS", 15)  # two rows per chunk
    torch.testing.assert_close(token_dumps.logits_entropy(logits), whole)
    p = torch.softmax(logits.double(), -1)
    torch.testing.assert_close(whole.double(), -(p * p.log()).sum(-1), rtol=1e-5, atol=1e-6)


# Routing replay's columns. Each sample's engine routing (seq T, 3 MoE layers, top-2) picks experts {0, 1} except at
# DIFFER (sample, column, layer), where it picks {0, 2}, and nothing at UNROUTED (sample, column). The stand-in
# trainer routes every token to {1, 0}: the sets differ exactly at DIFFER, in the order of no importance.
DIFFER = {(0, 3, 0), (0, 3, 2), (0, 6, 1), (2, 4, 2), (3, 7, 0)}
UNROUTED = {(1, 5), (2, 4)}
# By hand: the action tokens are columns 3.. (sample 1: 3..5) of the log-prob axis, and a token's routing is that of
# the column that scores it; per (sample, position) the differing layers, None where the engine routed nothing.
EXPECTED_LAYERS = {
    (0, 0): [0, 2], (0, 1): [], (0, 2): [], (0, 3): [1], (0, 4): [],
    (1, 0): [], (1, 1): [], (1, 2): None,
    (2, 0): [], (2, 1): None, (2, 2): [], (2, 3): [], (2, 4): [],
    (3, 0): [], (3, 1): [], (3, 2): [], (3, 3): [], (3, 4): [0],
}


def _engine_routing(sample: int, length: int) -> torch.Tensor:
    routing = torch.tensor([0, 1], dtype=torch.int16).repeat(length, 3, 1)
    for s, column, layer in DIFFER:
        if s == sample:
            routing[column, layer] = torch.tensor([0, 2])
    for s, column in UNROUTED:
        if s == sample:
            routing[column] = -1
    return routing


class _StandInRouting:
    """ActorRouting without a model: the micro-batch's engine routing as the replay builds it, a trainer routing every
    token to {1, 0}."""

    k3_by_cause = True  # R3's

    def __init__(self):
        self.batches = 0

    @contextlib.contextmanager
    def replaying(self, routings, attention_mask):
        from openrlhf_tis.moe.routing_batch import batch_routing
        from openrlhf_tis.trainer.moe_replay import ReplayedBatch

        self.batches += 1
        mask = attention_mask.cpu()
        choice = torch.tensor([1, 0]).repeat(mask.numel(), 3, 1)
        yield ReplayedBatch(batch_routing(routings, mask), SimpleNamespace(trainer_choice=lambda: choice), mask,
                            packed=False)

    def observe(self, batch, log_ratio) -> None:
        pass

    def step_metrics(self, allreduce, device) -> dict:
        return {}


def test_a_replay_run_dumps_each_token_s_differing_layers(tmp_path):
    trainer = _trainer(preset("tis"), micro_batch=2)
    trainer.moe_routing = _StandInRouting()
    experience = _experience()
    experience.info[ROUTED_EXPERTS] = [_engine_routing(i, experience.sequences.shape[1]) for i in experience.index]
    _train(trainer, experience, tmp_path)
    assert trainer.moe_routing.batches == 2  # both micro-batches replayed
    got = _dump(tmp_path)
    layers = {(int(s), int(p)): None if v is None else v.tolist()
              for s, p, v in zip(got["sample_id"], got["position"], got["routing_mismatch_layers"], strict=True)}
    assert layers == EXPECTED_LAYERS
    count = [-1 if v is None else len(v) for v in EXPECTED_LAYERS.values()]
    assert got["routing_mismatch_count"].tolist() == count


def test_a_run_without_routing_dumps_nothing_compared(tmp_path):
    _train(_trainer(preset("tis")), _experience(), tmp_path)
    got = _dump(tmp_path)
    assert (got["routing_mismatch_count"] == -1).all() and got["routing_mismatch_layers"].isna().all()
