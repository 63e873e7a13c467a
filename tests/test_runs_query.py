"""Run store reader side: token queries against a pandas reference, damaged files, run listing, summary, CLI."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from openrlhf_tis.runs import (
    COLUMNS,
    MASK_REASONS,
    RunStoreWarning,
    RunWriter,
    TokenDumpWriter,
    list_runs,
    query_tokens,
    summary,
    token_steps,
)
from openrlhf_tis.runs import cli as runs_cli
from openrlhf_tis.runs.layout import token_file
from openrlhf_tis.runs.query import decode_reasons

STEPS = (1, 5, 10, 15, 20)
ROOT = Path(__file__).resolve().parents[1]


def _step_columns(step: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    samples, length = 6, rng.integers(3, 12, 6)
    sample_id = np.repeat(np.arange(samples), length)
    n = len(sample_id)
    rollout = np.log(rng.uniform(1e-4, 1.0, n))
    rollout[rng.random(n) < 0.03] = np.nan  # damaged log-probs must never match a probability range
    rollout[rng.random(n) < 0.02] = -np.inf
    codes = rng.choice(list(MASK_REASONS), size=n, p=[0.7, 0.1, 0.05, 0.05, 0.05, 0.05])
    return {
        "sample_id": sample_id, "prompt_id": sample_id // 2,
        "position": np.concatenate([np.arange(k) for k in length]), "token_id": rng.integers(0, 100, n),
        "token_text": [f"t{i}" for i in rng.integers(0, 100, n)],
        "rollout_logprob": rollout, "old_logprob": rollout + 0.01, "train_logprob": rollout + rng.normal(0, 0.1, n),
        "is_weight_raw": rng.lognormal(0, 0.3, n), "is_weight": rng.uniform(0, 2, n), "mask_reason": codes,
        "advantage": rng.normal(size=samples)[sample_id], "entropy": rng.exponential(size=n),
        "reward": rng.random(samples)[sample_id], "lag": rng.integers(0, 3, samples)[sample_id],
    }


def _make_run(run_dir: Path, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    writer, dumps, frames = RunWriter(run_dir), TokenDumpWriter(run_dir), []
    for step in range(1, STEPS[-1] + 1):
        writer.append_metrics(step, {"rollout/reward_mean": 0.1 * step, "mismatch/k3_kl": 1.0 / step,
                                     "correction/masked_frac": 0.05})
        if step in STEPS:
            cols = _step_columns(step, rng)
            dumps.write_step(step, cols)
            frame = pd.DataFrame({k: v for k, v in cols.items()})
            frame.insert(0, "step", step)
            frames.append(frame)
    return pd.concat(frames, ignore_index=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    return root, {name: _make_run(root / name, seed) for seed, name in enumerate(("a", "b"))}


def _reference(ref: pd.DataFrame, steps, samples, masked_only, prob_range, lags=None) -> pd.DataFrame:
    keep = np.ones(len(ref), bool)
    if lags is not None:
        keep &= (ref["lag"] >= (lags[0] if lags[0] is not None else -1)) & \
            (ref["lag"] <= (lags[1] if lags[1] is not None else 10**9))
    if steps is not None:
        lo, hi = steps
        keep &= (ref["step"] >= (lo if lo is not None else -1)) & (ref["step"] <= (hi if hi is not None else 10**9))
    if samples is not None:
        keep &= ref["sample_id"].isin(samples)
    if masked_only:
        keep &= ref["mask_reason"] != 0
    if prob_range is not None:
        lp = ref["rollout_logprob"].astype(np.float32).astype(np.float64)  # what is stored
        lo, hi = prob_range
        keep &= lp.notna()
        if lo is not None and lo > 0:
            keep &= lp >= math.log(lo)
        if hi is not None:
            keep &= lp <= (math.log(hi) if hi > 0 else -math.inf)
    return ref[keep]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    steps=st.none() | st.tuples(st.none() | st.integers(0, 21), st.none() | st.integers(0, 21)),
    samples=st.none() | st.sets(st.integers(0, 7), max_size=3),
    masked_only=st.booleans(),
    prob_range=st.none() | st.tuples(st.none() | st.floats(0, 1), st.none() | st.floats(0, 1)),
    lags=st.none() | st.tuples(st.none() | st.integers(0, 3), st.none() | st.integers(0, 3)),
)
def test_query_filters_match_pandas_reference(runs, steps, samples, masked_only, prob_range, lags):
    root, refs = runs
    got = query_tokens(root / "a", steps=steps, samples=samples, masked_only=masked_only, prob_range=prob_range,
                       columns=["step", "sample_id", "position", "rollout_logprob", "mask_reason"], reason_names=False,
                       lags=lags)
    want = _reference(refs["a"], steps, samples, masked_only, prob_range, lags)
    keys = ["step", "sample_id", "position"]
    assert got[keys].values.tolist() == want[keys].values.tolist()
    assert np.array_equal(got["rollout_logprob"].to_numpy(), want["rollout_logprob"].to_numpy(np.float32),
                          equal_nan=True)
    assert got["mask_reason"].tolist() == want["mask_reason"].tolist()


@pytest.mark.parametrize("steps", [5, np.int64(10), 3, range(5, 16), range(1, 21, 10), range(20, 0, -5), range(7, 7),
                                   (None, 5), [10, None]])
def test_steps_take_a_step_a_range_or_bounds(runs, steps):
    root, refs = runs
    ref = refs["a"]
    if isinstance(steps, (tuple, list)):
        lo, hi = (-1 if steps[0] is None else steps[0]), (10**9 if steps[1] is None else steps[1])
        wanted = [s for s in STEPS if lo <= s <= hi]
    else:
        wanted = list(steps) if isinstance(steps, range) else [int(steps)]
    got = query_tokens(root / "a", steps=steps, reason_names=False)
    expected = ref[ref["step"].isin(wanted)]
    assert got["step"].tolist() == expected["step"].tolist()
    assert got["position"].tolist() == expected["position"].tolist()


@pytest.mark.parametrize("steps", ["5", 2.5, (1, 2, 3), True])
def test_steps_of_another_kind_are_a_type_error(runs, steps):
    root, _ = runs
    with pytest.raises(TypeError, match="steps must be"):
        query_tokens(root / "a", steps=steps)


def test_query_all_columns_types_and_values(runs):
    root, refs = runs
    got = query_tokens(root / "a")
    assert list(got.columns) == list(COLUMNS)
    assert str(got["step"].dtype) == "int32" and str(got["rollout_logprob"].dtype) == "float32"
    assert got["masked"].tolist() == (refs["a"]["mask_reason"] != 0).tolist()
    assert got["mask_reason"].astype(str).tolist() == [MASK_REASONS[c] for c in refs["a"]["mask_reason"]]
    assert got["token_text"].tolist() == refs["a"]["token_text"].tolist()
    assert np.allclose(got["reward"], refs["a"]["reward"].astype(np.float32))


def test_query_several_runs_prompts_and_reasons(runs):
    root, refs = runs
    got = query_tokens([root / "a", root / "b"], prompts=[1], reasons=["veto", "nan"], columns=["step", "prompt_id"])
    for name in ("a", "b"):
        ref = refs[name]
        want = ref[(ref["prompt_id"] == 1) & ref["mask_reason"].isin([3, 4])]
        assert (got["run"] == name).sum() == len(want)
    assert set(got["prompt_id"]) <= {1} and list(got.columns) == ["run", "step", "prompt_id"]
    with pytest.raises(ValueError, match="unknown mask reasons"):
        query_tokens(root / "a", reasons=["truncated"])
    with pytest.raises(ValueError, match="unknown token columns"):
        query_tokens(root / "a", columns=["nope"])


def test_empty_results_keep_dtypes(runs, tmp_path):
    root, _ = runs
    for frame in (query_tokens(root / "a", steps=(2, 4)), query_tokens(tmp_path)):
        assert len(frame) == 0 and list(frame.columns) == list(COLUMNS)
        assert str(frame["sample_id"].dtype) == "int32"


def test_corrupt_dump_named_and_rest_read(runs, tmp_path):
    root, refs = runs
    run = tmp_path / "a"
    shutil.copytree(root / "a", run)
    bad = token_file(run, 10)
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])  # truncated
    token_file(run, 15).write_bytes(b"PAR1 garbage")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = query_tokens(run, columns=["step", "sample_id"])
    named = [str(w.message) for w in caught if issubclass(w.category, RunStoreWarning)]
    assert sorted(m.split(":")[0] for m in named) == sorted([str(bad), str(token_file(run, 15))])
    assert sorted(set(got["step"])) == [1, 5, 20]
    assert len(got) == int(refs["a"]["step"].isin([1, 5, 20]).sum())
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        info = summary(run)  # the summary still comes out
    assert info["tokens"]["rows"] == len(got)


def _scrambled_run(run_dir: Path, seed: int) -> pd.DataFrame:
    """Dumps written out of order: steps in random order, each step split into parts holding interleaved
    samples (as data-parallel ranks write them), rows shuffled inside every file. Returns what was written."""
    rng = np.random.default_rng(seed)
    dumps, frames = TokenDumpWriter(run_dir), []
    for step in rng.permutation([3, 8, 12, 20]):
        cols = _step_columns(int(step), rng)
        frame = pd.DataFrame(cols)
        frame.insert(0, "step", int(step))
        frames.append(frame)
        for part in range(3):
            rows = frame[frame["sample_id"] % 3 == (part + 1) % 3].sample(frac=1.0, random_state=int(rng.integers(99)))
            dumps.write_step(int(step), {k: rows[k].to_numpy() for k in cols}, part=part)
    return pd.concat(frames, ignore_index=True)


@pytest.mark.parametrize("damaged", [False, True], ids=["one_scan", "file_by_file"])
def test_rows_come_in_step_sample_position_order(tmp_path, damaged):
    written = _scrambled_run(tmp_path / "run", seed=7)
    if damaged:  # an unreadable file sends the query down the file-by-file path
        token_file(tmp_path / "run", 99).write_bytes(b"PAR1 garbage")
    want = written.sort_values(["step", "sample_id", "position"], ignore_index=True)
    assert not want["token_id"].equals(written["token_id"])  # the dumps really are out of order
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RunStoreWarning)
        got = query_tokens(tmp_path / "run", columns=["step", "sample_id", "position", "token_id"])
        only = query_tokens(tmp_path / "run", columns=["token_id", "entropy"])  # sort keys not asked for
        some = query_tokens(tmp_path / "run", steps=(8, 12), samples={0, 4, 5}, columns=["sample_id", "position"])
    keys = ["step", "sample_id", "position", "token_id"]
    assert got[keys].values.tolist() == want[keys].values.tolist()
    assert list(only.columns) == ["token_id", "entropy"]
    assert only["token_id"].tolist() == want["token_id"].tolist()
    assert np.allclose(only["entropy"].to_numpy(), want["entropy"].to_numpy(np.float32))
    subset = want[want["step"].isin([8, 12]) & want["sample_id"].isin([0, 4, 5])]
    assert some.values.tolist() == subset[["sample_id", "position"]].values.tolist()


def test_decode_reasons_unknown_code_is_nan():
    cat = decode_reasons(np.array([0, 3, 99]))
    assert cat[0] == "kept" and cat[1] == "veto" and pd.isna(cat[2])


def test_list_runs_and_summary(runs):
    root, refs = runs
    listed = list_runs(root)
    assert listed["run"].tolist() == ["a", "b"]
    assert listed["steps"].tolist() == [20, 20] and listed["token_steps"].tolist() == [len(STEPS)] * 2
    assert token_steps(root / "a") == list(STEPS)
    info = summary(root / "a")
    assert info["steps"] == 20 and info["missing_steps"] == 0
    assert info["reward"]["key"] == "rollout/reward_mean" and info["reward"]["slope"] == pytest.approx(0.1)
    assert info["mismatch"]["key"] == "mismatch/k3_kl" and info["mismatch"]["last"] < info["mismatch"]["first"]
    assert info["masked"]["source"] == "metrics:correction/masked_frac"
    ref = refs["a"]
    assert info["tokens"]["rows"] == len(ref)
    assert info["tokens"]["masked_fraction"] == pytest.approx((ref["mask_reason"] != 0).mean())
    assert info["tokens"]["by_reason"]["veto"] == int((ref["mask_reason"] == 3).sum())
    json.dumps(info)  # JSON-ready


def test_summary_tolerates_missing_keys(tmp_path):
    writer = RunWriter(tmp_path)
    for step in (1, 2, 4):
        writer.append_metrics(step, {"vllm_kl": 0.1, "other": 1})
    info = summary(tmp_path)
    assert info["reward"] is None and info["mismatch"]["key"] == "vllm_kl"
    assert info["masked"] is None and info["tokens"] is None and info["missing_steps"] == 1


def test_cli_list_and_show(runs, capsys, tmp_path):
    root, _ = runs
    assert runs_cli.main(["list", str(root)]) == 0
    out = capsys.readouterr().out
    assert "a" in out and "b" in out and "20" in out
    shutil.copytree(root, tmp_path / "root")
    RunWriter(tmp_path / "root" / "c", config={"seed": 1}, origin={"git": {"revision": "f00dfeed" * 5}, "time": "t"})
    assert runs_cli.main(["list", str(tmp_path / "root")]) == 0  # runs with and without config.json
    out = capsys.readouterr().out
    assert "f00dfeed" in out and " c " in out
    assert runs_cli.main(["show", "a", "--root", str(root)]) == 0
    out = capsys.readouterr().out
    assert "rollout/reward_mean" in out and "mismatch/k3_kl" in out and "token dumps: 5 steps" in out
    assert "held-out" not in out  # no heldout_kept.json: no row
    kept = {"schema": 1, "policy": "trainer weights", "dtype": "bf16", "n_samples": 1, "seed": 0, "questions": 2,
            "before": {"pass1": 0.25, "passk": 0.25}, "after": {"pass1": 0.75, "passk": 0.75}}
    (tmp_path / "root" / "a" / "heldout_kept.json").write_text(json.dumps(kept))
    assert runs_cli.main(["show", "a", "--root", str(tmp_path / "root")]) == 0
    out = capsys.readouterr().out
    row = out[out.index("held-out pass1"):]  # first = the base model, last = the saved final model
    assert [c.strip() for c in row.split("│")[1:3]] == ["0.25", "0.75"]
    assert "kept policy (trainer" in row and "bf16)" in row
    assert runs_cli.main(["show", str(root / "b"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["run"] == "b"
    assert runs_cli.main(["show", "missing", "--root", str(root)]) == 2


@pytest.mark.parametrize("name", ["[bold]a", "\x1b[2J", "a\x07"])
def test_run_names_are_printed_as_text_never_as_markup_or_terminal_codes(tmp_path, capsys, name):
    """`show 'runs/[/bold]'` crashed (rich markup), a folder `[bold]a` was listed as `a`, and one holding escape
    sequences (clear the screen, ring the bell) reached the terminal raw."""
    root = tmp_path / "runs"
    RunWriter(root / name, config={"seed": 1}).append_metrics(1, {"loss": 1.0})
    shown = name.replace("\x1b", "\\x1b").replace("\x07", "\\x07")
    assert runs_cli.main(["list", str(root)]) == 0
    out = capsys.readouterr().out
    assert f"│ {shown} " in out and "\x1b" not in out and "\x07" not in out
    assert runs_cli.main(["show", name, "--root", str(root)]) == 0
    out = capsys.readouterr().out
    assert out.split()[0] == shown and "\x1b" not in out and "\x07" not in out
    assert runs_cli.main(["show", "runs/[/bold]", "--root", str(root)]) == 2
    assert capsys.readouterr().out.startswith("no run directory at runs/[/bold] or ")


def test_a_symlink_loop_lists_each_run_once(tmp_path):
    root = tmp_path / "runs"
    RunWriter(root / "a", config={"seed": 1}).append_metrics(1, {"loss": 1.0})
    (root / "more").mkdir()
    (root / "more" / "loop").symlink_to(root)  # runs/more/loop/more/loop/... -> runs
    (root / "latest").symlink_to(root / "a")
    assert list(list_runs(root)["run"]) == ["a"]


def test_show_names_each_place_it_looked_at_once(tmp_path, capsys):
    """Regression: `show` on an empty directory named the same path twice."""
    empty = tmp_path / "empty"
    empty.mkdir()
    assert runs_cli.main(["show", str(empty)]) == 2
    assert capsys.readouterr().out.strip() == f"{empty} holds no run (no config.json, metrics.jsonl or tokens/ yet)"
    assert runs_cli.main(["show", str(tmp_path / "gone")]) == 2
    assert capsys.readouterr().out.strip() == f"no run directory at {tmp_path / 'gone'}"
    assert runs_cli.main(["show", "gone", "--root", str(tmp_path)]) == 2  # two places: each named once
    assert capsys.readouterr().out.strip() == f"no run directory at gone or {tmp_path / 'gone'}"


def test_benchmark_tiny(capsys):
    spec = importlib.util.spec_from_file_location("bench_runs", ROOT / "benchmarks" / "bench_runs.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--rows", "20000", "--samples", "4", "--mean-len", "200", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "bytes/token" in out and "store: DuckDB" in out


def test_prob_range_edges_exact(runs):
    """Bounds at exactly a stored probability: float32 storage must not flip the inclusive edges."""
    root, refs = runs
    stored = refs["a"]["rollout_logprob"].astype(np.float32)
    for value in stored[np.isfinite(stored)].iloc[:25]:
        p = math.exp(float(value))
        for prob_range in ((p, None), (None, p), (p, p)):
            got = query_tokens(root / "a", prob_range=prob_range, columns=["rollout_logprob"])
            assert len(got) == len(_reference(refs["a"], None, None, False, prob_range)), prob_range
