"""What the correction's metrics cost, and the compiled metrics pass that is the default on CUDA.

The correction's cost goals, against upstream's PolicyLoss (OpenRLHF 0.11.2) on the same batch: the loss with every
metric at most 1.25× its peak memory, and at most 2× its kernel launches with the metrics pass compiled (the
CUDA default; eagerly each operation is one launch). The compiled pass must leave training untouched: the
weights and masks stay eager and bit-identical, only the metrics' last bits may move.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

from openrlhf_tis import patches
from openrlhf_tis.correction import compute_correction, metric_names, preset, weights

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_correction as bench  # noqa: E402

patches.apply_platform_patches("cpu")  # openrlhf.models imports flash_attn at module level
from openrlhf.models import PolicyLoss  # noqa: E402


def _batch(B: int = 8, T: int = 64, seed: int = 0) -> list[torch.Tensor]:
    lp, old, roll, adv, am = bench.make_batch(B, T, "cpu", seed=seed)
    roll[0, 3] = float("nan")  # a non-finite rollout log-prob drops its sequence; must stay out of every metric
    return [lp, old, roll, adv, am]


@pytest.mark.parametrize("name", ["off", "tis", "adaptive", "mis_full"])
def test_loss_with_every_metric_holds_at_most_1_25x_upstreams_peak_memory(name):
    steps = bench.loss_steps(bench.make_batch(32, 512, "cpu"), PolicyLoss, compile=False)
    upstream = bench.peak_memory(steps["upstream PolicyLoss, no correction"], "cpu")
    ours = bench.peak_memory(steps[bench.EAGER_ROWS[name]], "cpu")
    plane = 32 * 512 * 4  # one float32 tensor of the batch's shape
    assert upstream >= 6 * plane  # the measurement sees upstream's own temporaries
    assert ours <= 1.25 * upstream, (ours / plane, upstream / plane)


@pytest.fixture(scope="module")
def launches():
    """Kernel launches of one loss + metrics call per bench_correction row, upstream's first."""
    steps = bench.loss_steps(bench.make_batch(8, 64, "cpu"), PolicyLoss, compile=True)
    return {name: bench.kernel_count(fn, "cpu") for name, fn in steps.items()}


@pytest.mark.parametrize("name", ["off", "tis"])
def test_compiled_metrics_keep_the_loss_within_2x_upstreams_kernel_launches(launches, name):
    upstream = launches["upstream PolicyLoss, no correction"]
    assert upstream >= 40  # the count sees upstream's forward and backward
    assert launches[bench.COMPILED_METRICS_ROWS[name]] <= 2 * upstream, launches


@pytest.mark.parametrize("name", ["off", "tis", "mis_full"])
def test_compiling_the_metrics_halves_the_launches(launches, name):
    """mis_full, whose five filters and normalization launch their own kernels, lands at about 2x upstream."""
    assert launches[bench.COMPILED_METRICS_ROWS[name]] < 0.6 * launches[bench.EAGER_ROWS[name]], launches


@pytest.mark.parametrize("name", ["tis", "mis_full", "seq_mis", "opsm"])
def test_compiled_metrics_pass_leaves_weights_and_masks_bit_identical(name):
    lp, old, roll, adv, am = _batch()
    eager = compute_correction(old, roll, am, preset(name, compile_metrics="off"), log_probs=lp, advantages=adv)
    compiled = compute_correction(old, roll, am, preset(name, compile_metrics="on"), log_probs=lp, advantages=adv)
    assert torch.equal(eager.weights, compiled.weights) and torch.equal(eager.mask, compiled.mask)
    assert list(compiled.metrics) == metric_names(preset(name), has_log_probs=True)
    for key, value in eager.metrics.items():
        assert compiled.metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def test_a_new_batch_shape_does_not_recompile_the_metrics():
    from torch._dynamo.utils import counters

    cfg = preset("tis", compile_metrics="on")
    lp, old, roll, _, am = _batch(6, 40, seed=1)
    compute_correction(old, roll, am, cfg)
    graphs = counters["stats"]["unique_graphs"]
    for B, T in ((5, 72), (9, 33)):  # every micro-batch has its own length
        lp, old, roll, _, am = _batch(B, T, seed=B)
        out = compute_correction(old, roll, am, cfg)
        eager = compute_correction(old, roll, am, cfg.replace(compile_metrics="off"))
        assert out.metrics == pytest.approx(eager.metrics, rel=1e-4, abs=1e-6)
    assert counters["stats"]["unique_graphs"] == graphs


def test_auto_compiles_the_metrics_on_cuda_only():
    cfg = preset("tis")
    assert cfg.compile_metrics == "auto"
    assert weights._metric_pass(cfg, torch.device("cpu")) is weights.metric_vector
    assert weights._metric_pass(cfg, torch.device("cuda")) is weights._compiled_metrics(cfg)
    assert weights._metric_pass(cfg.replace(compile_metrics="off"), torch.device("cuda")) is weights.metric_vector


def test_a_failed_compile_falls_back_to_the_eager_metrics_with_one_warning(monkeypatch):
    def broken_compile(fn, **kwargs):
        def run(*args, **kw):
            raise RuntimeError("no working triton")
        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    cfg = preset("icepop", compile_metrics="on", upper=4.0)  # a configuration no other test compiled
    weights._compiled_metrics.cache_clear()
    lp, old, roll, _, am = _batch()
    with pytest.warns(UserWarning, match="metrics run eagerly: torch.compile failed .*no working triton"):
        first = compute_correction(old, roll, am, cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per configuration, not per call
        second = compute_correction(old, roll, am, cfg)
    want = compute_correction(old, roll, am, cfg.replace(compile_metrics="off")).metrics
    assert first.metrics == want and second.metrics == want
    weights._compiled_metrics.cache_clear()


def test_a_resume_may_switch_the_compiled_metrics_or_predate_them():
    from openrlhf_tis.runs.config import fingerprint

    base = {"algo.correction.mode": "truncate", "algo.correction.upper": 2.0}
    assert len({fingerprint(base), *(fingerprint({**base, "algo.correction.compile_metrics": value})
                                     for value in ("auto", "on", "off"))}) == 1
    assert fingerprint({**base, "algo.correction.upper": 3.0}) != fingerprint(base)  # what is trained still counts

