"""`python -m openrlhf_tis.pipeline.main_job`: the project's main job, what `scripts/main_job.sh` runs.

Trains the embedded SmolLM2-135M-Instruct on the demo task with INT8 rollouts and the recommended
correction by executing notebooks/train.ipynb with papermill (the executed notebook and its HTML export
are the report), while the console shows a progress bar and one line per step; every log of Ray, vLLM
and DeepSpeed goes to `<run_dir>/train.log`. Sizes follow the CPU: bf16 training where the CPU computes
bf16 natively (AVX-512 BF16 / AMX), smaller steps where bf16 would be emulated.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from openrlhf_tis.pipeline.console import follow_run
from openrlhf_tis.pipeline.execute import execute, export_html
from openrlhf_tis.pipeline.params import ParameterError, check_params
from openrlhf_tis.pipeline.train import TRAIN_PARAMS, log_tail
from openrlhf_tis.runs.reader import load_metrics
from openrlhf_tis.runs.summary import summary
from openrlhf_tis.viz.compare import held_out_key
from openrlhf_tis.viz.curves import held_out


@dataclass(frozen=True)
class CpuProfile:
    name: str
    why: str
    params: dict[str, Any]  # train.ipynb parameters


def native_bf16() -> bool:
    """True where the CPU computes bf16 in hardware; elsewhere torch emulates it (~14x slower rollouts)."""
    import torch

    caps = torch._C._cpu._get_cpu_capability()
    return bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))


def cpu_profile() -> CpuProfile:
    """The main job's sizes for this CPU."""
    if native_bf16():
        return CpuProfile("native-bf16", "this CPU computes bf16 in hardware (AVX-512 BF16/AMX)", {})
    return CpuProfile("emulated-bf16", "this CPU emulates bf16 (no AVX-512 BF16/AMX): fewer, smaller steps", {})


def run_main_job(params: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """Execute train.ipynb for checked `params` while the console follows the run; export the HTML report."""
    run_dir = Path(params["run_dir"])
    notebook = out_dir / "train.ipynb"
    done, failure = threading.Event(), []

    def work() -> None:
        try:
            execute("train", notebook, params, cwd=out_dir)
        except BaseException as err:  # reported by the main thread, after the console stops
            failure.append(err)
        finally:
            done.set()

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    follow_run(run_dir, params["steps"], done)
    thread.join()
    html = export_html(notebook, out_dir / "report.html")
    if failure:
        raise RuntimeError(f"the training notebook failed: {failure[0]}\nreport: {html}\n"
                           f"log tail:\n{log_tail(run_dir / 'train.log', 20)}")
    metrics = load_metrics(run_dir)
    key = held_out_key(metrics)
    _, held = held_out(metrics, key) if key else (None, [])
    return {"run_dir": run_dir, "notebook": notebook, "html": html, "summary": summary(run_dir),
            "held_out": (key, float(held[0]), float(held[-1])) if len(held) else None}


def describe(result: dict[str, Any]) -> str:
    """The closing lines: reward before -> after, mismatch, masking, where the report is."""
    s = result["summary"]

    def trend(part: dict | None, spec: str) -> str:
        if not part or part.get("first") is None:
            return "not logged"
        return f"{format(part['first'], spec)} -> {format(part['last'], spec)}"

    masked = s.get("masked") or {}
    lines = [
        f"steps: {s['steps']}",
        f"reward (first -> last tenth of steps): {trend(s.get('reward'), '.3f')}",
        "held-out: not evaluated" if not result.get("held_out") else
        "held-out {} (before training -> last evaluation): {:.3f} -> {:.3f}".format(*result["held_out"]),
        f"k3 KL(μ‖π_old): {trend(s.get('mismatch'), '.2e')}",
        f"masked fraction (last): {masked.get('last'):.3f}" if masked.get("last") is not None else "masked: not logged",
        f"run: {result['run_dir']}",
        f"report: {result['html']}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="main_job", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="work/main_job", help="working directory (runs, report)")
    parser.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct), 'tiny' or a directory")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="override a train.ipynb parameter (Python literal), e.g. --set steps=5")
    parser.add_argument("extra_args", nargs=argparse.REMAINDER, help="after --: more training CLI flags")
    args = parser.parse_args(argv)
    out = Path(args.out).expanduser().resolve()
    profile = cpu_profile()
    print(f"[main job] CPU profile {profile.name}: {profile.why}", file=sys.stderr)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    overrides = dict(_literal(item) for item in args.set)
    extra = [a for a in args.extra_args if a != "--"]
    try:
        params = check_params({**profile.params, "model": args.model, "run_dir": str(out / "runs" / stamp),
                               **overrides, "extra_args": [*profile.params.get("extra_args", []), *extra]},
                              TRAIN_PARAMS, where="main job")
    except ParameterError as err:
        print(f"main_job: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    out.mkdir(parents=True, exist_ok=True)
    result = run_main_job(params, out / "runs" / stamp)
    print(describe(result))


def _literal(item: str) -> tuple[str, Any]:
    import ast

    name, _, text = item.partition("=")
    try:
        return name, ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return name, text  # a bare word is a string


if __name__ == "__main__":
    main()
