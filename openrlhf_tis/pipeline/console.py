"""Following a run from a terminal: a progress bar over steps and one short line per step.

The training job's own output (Ray, vLLM, DeepSpeed: hundreds of lines) goes to `<run_dir>/train.log`;
a person at the console reads this instead. It follows `metrics.jsonl`, the one record every reader
shares, so it works whatever process runs the job (a notebook under papermill, the CLI).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm

from openrlhf_tis.pipeline.live import step_line
from openrlhf_tis.runs.layout import METRICS_FILE
from openrlhf_tis.runs.reader import read_metrics_records


def follow_run(run_dir: Path, total_steps: int, done: threading.Event, poll_seconds: float = 1.0,
               out: TextIO | None = None) -> list[dict[str, Any]]:
    """Print each new step of `run_dir` until `done` is set (then once more); returns every record seen."""
    printed = 0
    records: list[dict[str, Any]] = []
    # disable=None: the bar only on a terminal; a log file gets the step lines alone, not a redraw per poll.
    with tqdm(total=total_steps, desc="starting Ray, vLLM, DeepSpeed", unit="step", file=out,
              dynamic_ncols=True, disable=None) as bar:
        while True:
            finished = done.wait(poll_seconds)
            if (run_dir / METRICS_FILE).is_file():
                records = read_metrics_records(run_dir)
            if records and not printed:
                bar.set_description("training")
            for record in records[printed:]:
                bar.write(step_line(record, total_steps), file=out)
            bar.update(len(records) - printed)
            printed = len(records)
            if finished:
                return records
