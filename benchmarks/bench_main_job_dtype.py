"""The main job's training step in each trainer dtype on this CPU, side by side (the trainer's profile for the studies).

Why: bench_train_dtype.py times a bare forward+backward; what decides the CPU default is the whole step the main
job runs (rollout, π_old forward, PPO update through DeepSpeed, weight sync). This runs the main job's recipe
(pipeline/main_job.py: SmolLM2-135M, the demo task, 4 prompts x 4 samples, bf16 rollouts) for --steps steps once per
dtype, held-out evaluation off, and prints the median over steps 2..N (step 1 warms caches) of each timing part, with
the ratio to the first dtype. Run it on an otherwise idle machine: both dtypes share it, one after the other.

    python benchmarks/bench_main_job_dtype.py [--steps 4] [--dtypes fp32 bf16] [--out work/bench_main_job_dtype]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import numpy as np

from openrlhf_tis.metric_names import STEP_SECONDS, TIMING_GENERATION, TIMING_MAKE_EXPERIENCE, TIMING_PPO_TRAIN
from openrlhf_tis.pipeline.main_job import job_params
from openrlhf_tis.pipeline.train import run_training
from openrlhf_tis.pipeline.train_params import TrainParams
from openrlhf_tis.runs.reader import read_metrics_records

PARTS = {"step": STEP_SECONDS, "generation": TIMING_GENERATION, "π_old + rewards": TIMING_MAKE_EXPERIENCE,
         "PPO update": TIMING_PPO_TRAIN}


def step_parts(out: Path, dtype: str, steps: int, model: str) -> dict[str, float]:
    """Median seconds of each part over steps 2..`steps` of a fresh main-job run trained in `dtype`."""
    run_dir = out / f"run_{dtype}"
    shutil.rmtree(run_dir, ignore_errors=True)
    base = job_params(out / "task", model)
    params = TrainParams(**{**base, "steps": steps, "train_dtype": dtype, "rollout_precision": "bf16",
                            "correction": "off", "eval_prompts": "", "token_dump_every": 0, "run_dir": str(run_dir)})
    run_training(params, cache=out / ".models")
    records = read_metrics_records(run_dir)[1:]
    return {name: float(np.median([r[key] for r in records if key in r])) for name, key in PARTS.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="steps per dtype (>= 2: step 1 is not counted)")
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct) or a model directory")
    parser.add_argument("--out", default="work/bench_main_job_dtype")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error(f"--steps must be >= 2 (step 1 warms caches and is not counted), got {args.steps}")
    out = Path(args.out).resolve()
    results = {dtype: step_parts(out, dtype, args.steps, args.model) for dtype in args.dtypes}
    first = args.dtypes[0]
    print(f"| trainer dtype | {' | '.join(f'{part} (s)' for part in PARTS)} | step vs {first} |")
    print("|---|" + "---|" * (len(PARTS) + 1))
    for dtype, parts in results.items():
        ratio = parts["step"] / results[first]["step"]
        print(f"| {dtype} | {' | '.join(f'{parts[p]:.2f}' for p in PARTS)} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
