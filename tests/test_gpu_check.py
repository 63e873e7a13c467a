"""benchmarks/gpu_check.py, the GPU user's one command, at toy sizes on the CPU: every check runs and prints
its table, the exit status follows the rows, a perturbed reference is caught, and the cli check's reading of
a run directory fails a run that lacks what it must hold."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from openrlhf_tis import metric_names as names
from openrlhf_tis.correction import PRESETS

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"


def _gpu_check(tmp_path: Path, *flags: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    rows = tmp_path / "rows.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--small", "--json", str(rows), *flags],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    return proc, (json.loads(rows.read_text()) if rows.exists() else [])


def test_every_check_runs_on_the_cpu_and_agrees(tmp_path):
    proc, rows = _gpu_check(tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "openrlhf_tis GPU check on cpu" in proc.stdout and "every result as expected" in proc.stdout
    by_check: dict[str, list[dict]] = {}
    for row in rows:
        by_check.setdefault(row["check"], []).append(row)
    assert list(by_check) == ["core", "upstream", "cost", "step", "cli"]
    assert [row["case"] for row in by_check["core"]] == [f"{name} (eager)" for name in PRESETS]
    assert {row["status"] for row in by_check["core"] + by_check["upstream"]} == {"ok"}
    assert [row["case"] for row in by_check["upstream"]] == ["off", "upstream_icepop", "upstream_tis"]
    cost = {row["case"].rsplit(",", 1)[0]: row for row in by_check["cost"]}
    assert cost["upstream PolicyLoss, no correction"]["result"].count("(1.00×)") == 3  # the baseline
    for name in ("off (metrics only)", "tis", "mis_full"):
        assert cost[f"{name} + all metrics, eager"]["status"] in ("goal met", "over goal")
    assert cost["host syncs per call"]["status"].startswith("skipped: CUDA only")
    assert [row["case"].split(" ")[0] for row in by_check["step"]] == ["off", "tis", "mis_full"]
    (cli,) = by_check["cli"]
    assert cli["status"].startswith("skipped: needs a CUDA device")
    for row in rows:  # every row is in the printed table
        assert row["check"] in proc.stdout and row["case"].split(" ")[0] in proc.stdout


def test_a_perturbed_reference_exits_non_zero(tmp_path):
    proc, rows = _gpu_check(tmp_path, "--checks", "core", "--perturb-reference")
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-6000:]
    assert "MISMATCH" in proc.stdout
    status = {row["case"].removesuffix(" (eager)"): row["status"] for row in rows}
    assert set(status) == set(PRESETS)
    for name, entry in PRESETS.items():  # every loss that reads π_old must see it move
        assert (status[name] == "MISMATCH") == (not entry.config.bypass), name


def test_unknown_checks_are_refused(tmp_path):
    proc, _ = _gpu_check(tmp_path, "--checks", "core,gpu")
    assert proc.returncode == 2 and "--checks: unknown ['gpu']" in proc.stderr


# ── the cli check's reading of a finished run (the run itself needs a GPU) ──

def _write_run(run: Path, steps: int, sync_steps: tuple[int, ...], dump_steps: tuple[int, ...]) -> None:
    from openrlhf_tis.runs import RunWriter, TokenDumpWriter

    for step in range(1, steps + 1):
        line = {names.K1_KL: -0.01, names.K3_KL: 0.01, names.CHI2_TOKEN: 0.02, names.KEPT_FRAC: 1.0,
                names.TRUNCATED_FRAC: 0.0}
        if step in sync_steps:
            line[names.SYNC_GAP_MEAN] = 1e-3
        RunWriter(run).append_metrics(step, line)
    for step in dump_steps:
        n = 4
        logp = np.full(n, -1.0)
        TokenDumpWriter(run).write_step(step, {
            "sample_id": np.zeros(n), "prompt_id": np.zeros(n), "position": np.arange(n), "token_id": np.arange(n),
            "rollout_logprob": logp, "old_logprob": logp, "train_logprob": logp, "is_weight_raw": np.ones(n),
            "is_weight": np.ones(n), "mask_reason": np.zeros(n, dtype=int), "advantage": np.zeros(n),
            "entropy": np.ones(n), "reward": np.zeros(n)})


@pytest.fixture()
def gpu_check():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import gpu_check

        yield gpu_check
    finally:
        sys.path.remove(str(SCRIPT.parent))


@pytest.mark.parametrize(("sync_steps", "dump_steps", "failing"), [
    ((1, 2), (1, 2), set()),
    ((2,), (1, 2), {"sync check (every step)"}),
    ((1, 2), (2,), {"token dumps"}),
])
def test_a_run_directory_is_read_for_metrics_sync_checks_and_dumps(tmp_path, gpu_check, sync_steps, dump_steps,
                                                                    failing):
    _write_run(tmp_path / "run", 2, sync_steps, dump_steps)
    rows = list(gpu_check.check_run_dir(tmp_path / "run", steps=2))
    assert {row.case for row in rows if row.status == "MISMATCH"} == failing
    assert {row.status for row in rows} <= {"ok", "MISMATCH"}


def test_a_run_without_metrics_fails_every_row(tmp_path, gpu_check):
    (tmp_path / "run").mkdir()
    rows = list(gpu_check.check_run_dir(tmp_path / "run", steps=2))
    assert [row.status for row in rows] == ["MISMATCH"] * 3


def test_the_cli_run_is_the_documented_one(tmp_path, gpu_check):
    """The command trains the tiny model on one GPU with bf16 rollouts + TIS and dumps every step; every flag
    is one the training CLI accepts (parsed here with its own parser, nothing started)."""
    from openrlhf_tis.cli import train_ppo_ray

    argv = gpu_check.cli_argv(tmp_path)
    assert argv[1:3] == ["-m", "openrlhf_tis.cli.train_ppo_ray"]
    flags = argv[3:]
    value = {flag: flags[i + 1] for i, flag in enumerate(flags[:-1]) if flag.startswith("--")}
    assert value["--vllm.rollout_precision"] == "bf16" and value["--algo.correction.preset"] == "tis"
    assert value["--actor.num_gpus_per_node"] == "1" and "--train.colocate_all" in flags
    assert value["--logger.token_dump_steps"] == "1"
    parsed = train_ppo_ray.build_parser().parse_args(flags)
    assert getattr(parsed, "vllm.num_engines") == 1
