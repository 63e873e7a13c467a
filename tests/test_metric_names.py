"""The registry of metric keys (metric_names.py) against what actually writes each key.

Every name the registry holds must be produced by its writer: the correction core (run on a batch that
turns every option on), upstream's trainer (the key is a literal in openrlhf's source), or the fork's
trainer (a trainer module imports the name; staleness metrics are also computed). A name in none of
these groups fails, so a new name cannot be added without saying who writes it.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import openrlhf
import pytest
import torch

from openrlhf_tis import metric_names as registry
from openrlhf_tis.correction import CorrectionConfig, RejectionCriterion, compute_correction
from openrlhf_tis.moe.routing_metrics import RoutingTally
from openrlhf_tis.runs.health import FallWatch
from openrlhf_tis.trainer.staleness import staleness_metrics

REPO = Path(__file__).resolve().parent.parent
UPSTREAM_SOURCE = Path(openrlhf.__file__).parent

# Who writes each name that is not a mismatch/* or correction/* key (those are the core's).
UPSTREAM = ("REWARD_MEAN", "RESPONSE_LENGTH_MEAN", "STEP_SECONDS", "TIMING_GENERATION", "TIMING_MAKE_EXPERIENCE",
            "TIMING_PPO_TRAIN", "TIMING_BROADCAST", "UPSTREAM_REWARD", "UPSTREAM_RESPONSE_LENGTH", "UPSTREAM_KL",
            "UPSTREAM_FILTERED")
FORK_TRAINER = ("STALENESS_MEAN", "STALENESS_MAX", "STALENESS_SPANNING_SYNC", "STALENESS_DROPPED",
                "REWARD_NONFINITE", "REWARD_DROPPED", "QUEUE_WAIT", "LOGPROB_COVERAGE", "INT8_SYNC_PREFIX",
                "FP8_SYNC_PREFIX",
                "TOKEN_DUMP_SECONDS", "TOKEN_DUMP_TOKENS", "SYNC_CHECK_SECONDS", "SYNC_WEIGHTS_SECONDS",
                "SYNC_BASELINE", "SYNC_GAP_MEAN", "SYNC_GAP_MAX", "SYNC_EXCESS", "SYNC_VLLM_PROBE_CHANGE",
                "SYNC_TRAINER_PROBE_CHANGE", "SYNC_VLLM_LOGPROB_CHANGE", "EVAL_PREFIX", "EVAL_START_PREFIX")
HEALTH = ("HEALTH_ESS_WORST", "HEALTH_FALL_WARNING")  # runs/health.py's FallWatch, on the trainer's lines (HealthPart)
ROUTING = ("MOE_AGREEMENT", "MOE_TOKENS_DIFFERED", "MOE_K3_DIFFERED", "MOE_K3_SAME")
"""moe/routing_metrics.py's RoutingTally, added to the actor's step status by trainer/moe_replay.py."""
# Groups of names, not keys; their members are checked through the names above.
NOT_KEYS = ("MISMATCH", "CORRECTION", "PROB_BUCKET_EDGES", "BUCKET_NAMES", "REWARD_KEYS",
            "RESPONSE_LENGTH_KEYS", "MISMATCH_KEYS", "MASKED_KEYS", "ENTROPY_KEYS", "WEIGHT_RAW_STATS",
            "WEIGHT_STATS", "BUCKET_GAP_KEYS", "BUCKET_FRAC_KEYS", "BY_LAG", "LAG_STALE", "ADAPTIVE_KEYS", "MOE")


def _registry_names() -> dict[str, object]:
    return {n: v for n, v in vars(registry).items() if n.isupper() and not n.startswith("_")}


def _core_keys() -> set[str]:
    names = _registry_names()
    keys = {v for n, v in names.items() if n not in NOT_KEYS and isinstance(v, str)
            and v.startswith((registry.MISMATCH, registry.CORRECTION))}
    return keys | {*registry.BUCKET_GAP_KEYS, *registry.BUCKET_FRAC_KEYS}


def _everything_on() -> tuple[dict[str, float], CorrectionConfig]:
    """The core's metrics with every option on: rejection, veto, OPSM, self-normalization, both entropies."""
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 6, generator=gen) * 3
    rollout = old + 0.3 * torch.randn(4, 6, generator=gen)
    cfg = CorrectionConfig(mode="mask", lower=0.5, upper=2.0, veto_threshold=1e-3, opsm_delta=0.0,
                           batch_normalize=True, rejection=(RejectionCriterion("k3", "mean", None, 1.0),))
    out = compute_correction(old, rollout, torch.ones(4, 6), cfg, log_probs=old, advantages=-torch.ones(4, 6),
                             entropy=torch.ones(4, 6))
    return out.metrics, cfg


def test_importing_the_names_and_the_config_loads_no_torch():
    code = ("import sys, openrlhf_tis.metric_names, openrlhf_tis.correction.config; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
    # guards the test: importing the torch half does load torch
    code = "import sys, openrlhf_tis.correction; openrlhf_tis.correction.compute_correction; " \
           "sys.exit('torch' not in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_every_name_has_a_known_writer():
    names = _registry_names()
    core = {n for n, v in names.items() if isinstance(v, str) and v in _core_keys()}
    unplaced = set(names) - core - set(UPSTREAM) - set(FORK_TRAINER) - set(HEALTH) - set(ROUTING) - set(NOT_KEYS)
    assert not unplaced, f"metric_names.py: say who writes {sorted(unplaced)} (tests/test_metric_names.py)"
    assert not (set(UPSTREAM) | set(FORK_TRAINER) | set(HEALTH) | set(ROUTING) | set(NOT_KEYS)) - set(names), \
        "a listed name left the registry"


def _adaptive() -> dict[str, float]:
    """The core's metrics with the adaptive bound (token truncation only, so not part of `_everything_on`)."""
    old = -torch.rand(4, 6, generator=torch.Generator().manual_seed(1)) * 3
    return compute_correction(old, old + 0.3, torch.ones(4, 6), CorrectionConfig(adaptive_ess_target=0.9)).metrics


def test_the_core_writes_exactly_the_registry_keys():
    metrics, cfg = _everything_on()
    rejection = {registry.rejection_frac_key(c.name) for c in cfg.rejection}
    assert rejection == {"correction/rs_k3_mean_frac"}  # the family's spelling, by hand
    adaptive = {"correction/adaptive_bound", "correction/adaptive_ess", "correction/adaptive_at_max_frac",
                "correction/adaptive_at_min_frac"}  # by hand: what docs and dashboards name
    assert set(registry.ADAPTIVE_KEYS) == adaptive
    assert set(metrics) == _core_keys() - adaptive | rejection  # a fixed bound writes no adaptive_* key
    assert set(_adaptive()) == _core_keys() - {registry.ENTROPY, registry.ENTROPY_SAMPLED}  # no entropy given
    assert metrics[registry.VETOED_FRAC] >= 0 and metrics[registry.NORM_FACTOR] > 0  # the options were on


def test_bucket_names_by_hand():
    assert registry.BUCKET_NAMES == ("p0-0.001", "p0.001-0.01", "p0.01-0.1", "p0.1-0.5", "p0.5-0.9", "p0.9-1")
    assert registry.BUCKET_GAP_KEYS[0] == "mismatch/abs_dlogp_p0-0.001"
    assert registry.BUCKET_FRAC_KEYS[-1] == "mismatch/frac_p0.9-1"


def _upstream_literals() -> set[str]:
    found = set()
    for path in UPSTREAM_SOURCE.rglob("*.py"):
        found |= set(re.findall(r"""["']([A-Za-z_/]+)["']""", path.read_text(encoding="utf-8")))
    return found


@pytest.mark.parametrize("name", UPSTREAM)
def test_upstream_writes_its_names(name):
    assert getattr(registry, name) in _upstream_literals(), f"openrlhf {openrlhf.__version__} no longer writes it"


def _trainer_imports() -> set[str]:
    """Registry names imported by the fork's trainer modules (the writers of FORK_TRAINER)."""
    found = set()
    for path in (REPO / "openrlhf_tis" / "trainer").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module == "openrlhf_tis.metric_names":
                found |= {alias.name for alias in node.names}
    return found


def test_the_fork_trainer_writes_its_names():
    assert set(FORK_TRAINER) - _trainer_imports() == set()
    lags = staleness_metrics([0, 2, 2, 1], partial=[True, False, False, False])
    assert lags == {registry.STALENESS_MEAN: 1.25, registry.STALENESS_MAX: 2.0, "staleness/lag_0": 0.25,
                    "staleness/lag_1": 0.25, "staleness/lag_2": 0.5, registry.STALENESS_SPANNING_SYNC: 0.25}
    assert registry.staleness_lag_key(1) == "staleness/lag_1"


def test_the_fall_watch_writes_its_names():
    written = FallWatch().update(1, {registry.ESS_SEQ: 0.5})
    assert set(written) == {getattr(registry, name) for name in HEALTH}


def test_the_routing_tally_writes_its_names():
    tally = RoutingTally(2)
    tally.add(np.array([[[0, 1], [1, 2]], [[0, 1], [1, 2]]]), np.array([[[1, 0], [2, 3]], [[0, 1], [1, 2]]]),
              np.array([0.1, -0.2]))
    written = tally.metrics()
    assert set(written) == {getattr(registry, name) for name in ROUTING} | {
        registry.moe_agreement_layer_key(0), registry.moe_agreement_layer_key(1)}
    assert registry.moe_agreement_layer_key(3) == "moe/routing_agreement_layer_3"
    assert all(key.startswith(registry.MOE) for key in written)


def test_candidate_lists_hold_only_written_keys():
    metrics, _ = _everything_on()
    written = set(metrics) | {getattr(registry, n) for n in UPSTREAM}
    for group in (registry.REWARD_KEYS, registry.RESPONSE_LENGTH_KEYS, registry.MISMATCH_KEYS, registry.MASKED_KEYS,
                  registry.ENTROPY_KEYS):
        assert set(group) <= written, group
