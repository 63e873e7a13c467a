"""Sync vs async training, and the fork's own cost per step, measured side by side in one run.

    python benchmarks/bench_async.py [--model default|tiny] [--steps 5] [--modes sync,async1,async2,bare]

Every mode trains the main job's recipe (pipeline/main_job.py: INT8 rollouts, the demo task, this CPU's trainer
dtype) for `--steps` steps through the pipeline's own runner, without held-out evaluation:
- sync:    the main job's features on: token TIS, mismatch metrics, token dumps every 4th step, the run
           store, the sync check at every 4th sync;
- async1 / async2: the same with `--train.async_enable --train.async_queue_size 1 / 2`;
- bare:    upstream's code path as far as the CPU allows: correction off (upstream's PPO loss), no token dumps,
           no sync check. The run store stays (its one fsync'd line a step is how steps are timed here), and
           so do the CPU patches the stack needs to run at all.
A step's wall time is the gap between consecutive metrics lines (the first step, which holds the warm-up, is
left out); where it goes comes from upstream's `timing/*` and the fork's `sync/*_s`, `run_store/*_s` and
`timing/queue_wait` (async: the trainer blocked on the rollout queue). In async mode generation overlaps
training, so the parts need not add up to the wall time.
Time it alone: Ray workers run at nice 15, so anything else on the machine slows them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from openrlhf_tis.metric_names import (
    QUEUE_WAIT,
    SYNC_CHECK_SECONDS,
    TIMING_BROADCAST,
    TIMING_GENERATION,
    TIMING_MAKE_EXPERIENCE,
    TIMING_PPO_TRAIN,
    TOKEN_DUMP_SECONDS,
    UPSTREAM_RESPONSE_LENGTH,
)
from openrlhf_tis.pipeline.main_job import job_params
from openrlhf_tis.pipeline.train import run_training
from openrlhf_tis.pipeline.train_params import TrainParams
from openrlhf_tis.runs.layout import atomic_write
from openrlhf_tis.runs.reader import read_metrics_records
from openrlhf_tis.viz.stats import t_interval

MODES: dict[str, tuple[dict, list[str]]] = {  # name -> (train.ipynb parameters, extra training flags)
    "sync": ({}, []),
    "async1": ({}, ["--train.async_enable", "--train.async_queue_size", "1"]),
    "async2": ({}, ["--train.async_enable", "--train.async_queue_size", "2"]),
    "bare": ({"correction": "off", "token_dump_every": 0}, ["--vllm.sync_check_steps", "0"]),
}
PARTS = [("generation", TIMING_GENERATION), ("make exp.", TIMING_MAKE_EXPERIENCE), ("ppo train", TIMING_PPO_TRAIN),
         ("sync", TIMING_BROADCAST), ("sync check", SYNC_CHECK_SECONDS), ("dump", TOKEN_DUMP_SECONDS),
         ("queue wait", QUEUE_WAIT)]
RUN_TIMES = "run_seconds.json"  # under --out: each finished mode's whole-run wall time, so a re-run resumes


def run_mode(name: str, model: str, steps: int, out: Path) -> dict[str, float]:
    """Train one mode (unless `out` already holds its finished run: the benchmark resumes); its step wall times
    and parts (steps 2..N), mean response length and the whole run's wall time."""
    run_dir, times = out / name, out / RUN_TIMES
    run_s = json.loads(times.read_text()) if times.is_file() else {}
    if name not in run_s or len(read_metrics_records(run_dir)) < steps:
        overrides, flags = MODES[name]
        base = job_params(out / "task", model)
        params = TrainParams.checked({**base, **overrides, "steps": steps, "eval_prompts": "", "run_dir": str(run_dir),
                                      "extra_args": [*base["extra_args"], *flags]}, where=name)
        started = time.perf_counter()
        run_training(params, cache=out / ".models")
        run_s[name] = time.perf_counter() - started
        atomic_write(times, json.dumps(run_s, indent=1))
    records = read_metrics_records(run_dir)
    walls = [b["wall_time"] - a["wall_time"] for a, b in zip(records, records[1:], strict=False)]
    row = {"run_s": run_s[name], "step": t_interval(walls),
           "resp. len": statistics.fmean(r[UPSTREAM_RESPONSE_LENGTH] for r in records[1:])}
    for label, key in PARTS:
        values = [r[key] for r in records[1:] if key in r]
        row[label] = statistics.fmean(values) if values else float("nan")
    return row


def table(rows: dict[str, dict]) -> str:
    """Markdown: one row per mode, the step wall time with its 95% t-interval over steps and as a ratio to sync,
    the mean response length (steps of longer responses take longer), then where a step goes."""
    ref = rows["sync"]["step"].estimate if "sync" in rows else None
    head = ["mode", "s / step (95% CI)", "vs sync", "resp. len", *[label for label, _ in PARTS], "run (s)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, row in rows.items():
        step = row["step"]
        ratio = f"{step.estimate / ref:.2f}x" if ref else "-"
        parts = [f"{row[label]:.2f}" if row[label] == row[label] else "-" for label, _ in PARTS]
        lines.append(f"| {name} | {step.estimate:.1f} ({step.low:.1f}–{step.high:.1f}) | {ratio} | "
                     f"{row['resp. len']:.1f} | " + " | ".join(parts) + f" | {row['run_s']:.0f} |")
    if ref and "bare" in rows:
        bare = rows["bare"]["step"].estimate
        lines.append(f"\nfork cost (sync with the main job's features / bare): {ref / bare:.3f}x per step")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct) or 'tiny'")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--modes", default="sync,async1,async2,bare")
    parser.add_argument("--out", default=None, help="working directory (default: a temporary one); a mode whose "
                        "finished run it holds is not run again")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown or args.steps < 2:
        parser.error(f"--modes: unknown {unknown}; known {list(MODES)}" if unknown else "--steps: at least 2")
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_async_")).resolve()
    rows = {}
    for mode in modes:
        print(f"[bench_async] {mode}: {args.steps} steps of {args.model} under {out / mode}", file=sys.stderr)
        rows[mode] = run_mode(mode, args.model, args.steps, out)
    print(table(rows))


if __name__ == "__main__":
    main()
