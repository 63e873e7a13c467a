"""Benchmark of the token explorer's interactions on a large run store (goal: every one under 300 ms).

Builds the synthetic run of benchmarks/bench_runs.py (its generator, 5 M token rows by default, ~630
step files) or reuses one, then drives a `TokenExplorer` the way a user does, through its widgets, and
times each interaction end to end: the run-store queries, the step figure's PNG, the HTML of the
response and the widget updates (in a kernel the browser's rendering comes on top).

    .venv/bin/python benchmarks/bench_explorer.py --dir /tmp/bench_store      # generate once, keep, reuse
    .venv/bin/python benchmarks/bench_explorer.py --rows 200000               # quick look (temp dir)

`--dir` is the same flag as bench_runs.py's, so both benchmarks can share one generated store.
"""

from __future__ import annotations

import itertools
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow.dataset as ds
from bench_runs import bench_store, store_arguments

from openrlhf_tis.runs.layout import token_files
from openrlhf_tis.viz.explorer import TokenExplorer

GOAL_MS = 300.0


def interactions(ex: TokenExplorer, run_dir: Path) -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    """Each interaction as (untimed preparation, timed action); every action changes the view, so none
    repeats the state the last one left."""
    steps = itertools.cycle(ex.steps[len(ex.steps) // 3::max(1, len(ex.steps) // 7)])
    filters = itertools.cycle(["masked", "all", "truncated", "all", "veto", "all"])
    ranges = itertools.cycle([(-3.0, 0.0), (-8.0, -1.0), (-2.0, -0.5), (ex.prob.min, ex.prob.max)])
    worst = itertools.count()

    def nothing() -> None:
        pass

    def change_sample() -> None:
        others = [s for s in ex.samples if s != ex.sample.value]
        ex.sample.value = others[len(others) // 2]

    def unfilter_if_empty() -> None:  # a filter can leave no token to click (the synthetic run truncates none)
        if not ex.worst.options:
            ex.show.value, ex.prob.value = "all", (ex.prob.min, ex.prob.max)

    def click_worst() -> None:
        options = [value for _, value in ex.worst.options]
        ex.worst.value = options[next(worst) % len(options)]

    return {
        "open run": (nothing, lambda: ex.open(run_dir)),
        "change step": (nothing, lambda: setattr(ex.step, "value", next(steps))),
        "change sample": (nothing, change_sample),
        "toggle filter": (nothing, lambda: setattr(ex.show, "value", next(filters))),
        "change prob range": (nothing, lambda: setattr(ex.prob, "value", next(ranges))),
        "click worst token": (unfilter_if_empty, click_worst),
    }


def main(argv: list[str] | None = None) -> int:
    args = store_arguments(__doc__.split("\n\n")[0], 7, "times each interaction is timed").parse_args(argv)
    with bench_store(args, "bench_explorer_") as run_dir:
        rows = ds.dataset([os.fspath(p) for paths in token_files(run_dir).values() for p in paths]).count_rows()
        start = time.perf_counter()
        ex = TokenExplorer(run_dir)
        first_open = (time.perf_counter() - start) * 1e3
        print(f"run store: {rows:,} token rows, {len(ex.steps)} dumped steps, ~{len(ex.step_tokens):,} tokens per "
              f"step; first TokenExplorer(run_dir): {first_open:.0f} ms")

        actions = interactions(ex, run_dir)
        times: dict[str, list[float]] = {name: [] for name in actions}
        for _ in range(args.repeat):  # interactions take turns, so load from other jobs hits them alike
            for name, (prepare, action) in actions.items():
                prepare()
                start = time.perf_counter()
                action()
                times[name].append((time.perf_counter() - start) * 1e3)

        print(f"\n{args.repeat} times each, milliseconds, {os.cpu_count()} cores (goal: < {GOAL_MS:.0f} ms):")
        width = max(map(len, times))
        print(f"{'interaction':<{width}}  {'median':>8}  {'max':>8}")
        slow = []
        for name, values in times.items():
            print(f"{name:<{width}}  {statistics.median(values):8.1f}  {max(values):8.1f}")
            if max(values) >= GOAL_MS:
                slow.append(name)
        print("every interaction under the goal" if not slow else f"over {GOAL_MS:.0f} ms at least once: {slow}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
