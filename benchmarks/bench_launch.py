"""What a start of a run costs, and what two Ray-side settings of the set-up save, side by side.

Why: on a 2-core machine a run of the tiny model spends ≈ 2–3 min starting and seconds per step, so the starts set the
test suite's time (CI's bound is 90 min) and a study cell's. Three costs paid in every start were pure waste:

- Ray prestarts a default worker per CPU when the first driver connects; no actor of a run can use one (each needs the
  run's runtime_env), so they import Ray and idle. cli/ray_cluster.py sets `RAY_prestart_worker_first_driver=0`;
  the `prestart` variant sets it back to 1.
- Bytecode: uv installs without .pyc files and this machine kind sets PYTHONDONTWRITEBYTECODE, so every process of a
  run compiled vLLM, DeepSpeed, transformers and Ray from source at each import; scripts/setup_env.sh now compiles
  the venv once. The `no_bytecode` variant points PYTHONPYCACHEPREFIX at an empty folder (with
  PYTHONDONTWRITEBYTECODE=1), so no process finds a .pyc, as before.
- jsonschema, which `import ray` imports, builds an Earley grammar at import when rfc3987-syntax is installed, in every
  Ray process (driver, agents, actors). scripts/setup_env.sh uninstalls it; the `iri_grammar` variant puts a copy of
  the package back on PYTHONPATH, which every process of the run inherits (`--iri_grammar_dir DIR`, a folder holding
  `rfc3987_syntax/`, whose dependency lark vLLM keeps installed; left out without it).

Each variant launches the same 1-step run of the tiny model (the test suite's run, tests/_support.py `train_argv`),
variants interleaved rep by rep, and times `import ray` in a fresh interpreter beside it:

    python benchmarks/bench_launch.py --reps 2 [--iri_grammar_dir DIR]   # ≈ 3 min a launch on 2 cores

Times are wall clock: run it on an idle machine, or say what else ran (uptime).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from _support import train_argv  # noqa: E402

from openrlhf_tis.demo.tiny_model import build_tiny_model  # noqa: E402


def variants(iri_grammar_dir: Path | None) -> dict[str, dict[str, str]]:
    """Environment overrides per variant: the shipped settings, and each saving undone alone."""
    found = {"shipped": {}, "prestart": {"RAY_prestart_worker_first_driver": "1"},
             "no_bytecode": {"PYTHONPYCACHEPREFIX": tempfile.mkdtemp(prefix="no_pyc_"), "PYTHONDONTWRITEBYTECODE": "1"}}
    if iri_grammar_dir is not None:
        found["iri_grammar"] = {"PYTHONPATH": str(iri_grammar_dir)}
    return found


def import_ray_s(env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import ray"], env=env, check=True, timeout=300)
    return time.perf_counter() - started


def launch_s(model: Path, work: Path, env: dict[str, str]) -> float:
    """Wall time of a 1-step run under `work` (a fresh folder), from the CLI's start to its exit."""
    work.mkdir(parents=True)
    (work / "prompts.jsonl").write_text("".join(json.dumps({"input": f"{i} + 1?", "label": str(i + 1)}) + "\n"
                                                for i in range(4)))
    started = time.perf_counter()
    with open(work / "console.log", "w") as log:
        subprocess.run(train_argv(model, work, 1, dump_every=1, load=False), env=env, stdout=log,
                       stderr=subprocess.STDOUT, check=True, timeout=1800)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--iri_grammar_dir", type=Path, default=None)
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench_launch_"))
    model = build_tiny_model(work / "tiny_model")
    sides = variants(args.iri_grammar_dir)
    times: dict[str, dict[str, list[float]]] = {name: {"import": [], "launch": []} for name in sides}
    for rep in range(args.reps):
        for name, overrides in sides.items():
            env = {**os.environ, **overrides}
            times[name]["import"].append(import_ray_s(env))
            times[name]["launch"].append(launch_s(model, work / f"{name}-{rep}", env))
            print(f"[bench_launch] rep {rep + 1}/{args.reps} {name}: launch {times[name]['launch'][-1]:.1f} s",
                  file=sys.stderr, flush=True)
    base = statistics.mean(times["shipped"]["launch"])
    print(f"\n{'variant':<12} {'import ray (s)':>15} {'launch (s), each':>24} {'mean':>7} {'/ shipped':>10}")
    for name, measured in times.items():
        each = " ".join(f"{t:.1f}" for t in measured["launch"])
        mean = statistics.mean(measured["launch"])
        print(f"{name:<12} {statistics.mean(measured['import']):>15.2f} {each:>24} {mean:>7.1f} {mean / base:>10.2f}")
    print(f"\n{os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f} at the end; runs under {work}")


if __name__ == "__main__":
    main()
