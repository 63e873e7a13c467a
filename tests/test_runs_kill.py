"""A run killed at any moment leaves every run-store file readable, and resuming fills the history exactly.

A child process (its own process group, like a training job with a helper process writing a second
part of each token dump, as data-parallel ranks would) writes steps in a loop; the test SIGKILLs the
whole group at random moments, checks every file, and resumes from a "checkpoint" a few steps back.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import pyarrow.parquet as pq

from openrlhf_tis.runs import RunStoreWarning, load_metrics, query_tokens, read_run_config
from openrlhf_tis.runs.layout import METRICS_FILE, token_files

ROWS = 10_000
LAST_STEP = 60

CHILD = textwrap.dedent(
    """
    import subprocess, sys, time
    import numpy as np
    from openrlhf_tis.runs import RunWriter, TokenDumpWriter

    role, run_dir, start, end, rows = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])

    def columns(step):
        rng = np.random.default_rng(step)
        f = lambda: rng.normal(size=rows)
        ids = np.arange(rows)
        return dict(sample_id=ids // 500, prompt_id=ids // 1000, position=ids % 500, token_id=ids % 97,
                    rollout_logprob=f(), train_logprob=f(), is_weight_raw=f(), is_weight=f(), advantage=f(),
                    entropy=f(), reward=f(), mask_reason=(ids % 11 == 0).astype(np.int8))

    if role == "part":  # a second process writing its own part of each step's dump
        dumps = TokenDumpWriter(run_dir)
        for step in range(start, end + 1):
            dumps.write_step(step, columns(step), part=1)
            time.sleep(0.02)
        sys.exit(0)

    writer = RunWriter(run_dir, config={"actor.eps_clip": 0.2, "logger.run_dir": run_dir},
                       origin={"versions": {}, "git": {}, "time": "t"})
    print("ready", flush=True)
    helper = subprocess.Popen([sys.executable, "-c", CODE, "part", *sys.argv[2:]])
    dumps = TokenDumpWriter(run_dir)
    for step in range(start, end + 1):
        dumps.write_step(step, columns(step))
        writer.append_metrics(step, {f"metric/{i:03d}": step + i / 1000 for i in range(300)})
        time.sleep(0.02)  # the rest of a training step; writes take about as long
    sys.exit(helper.wait())
    """
)


def _spawn(run_dir, start: int) -> subprocess.Popen:
    code = "CODE = " + repr(CHILD) + "\n" + CHILD
    return subprocess.Popen(
        [sys.executable, "-c", code, "main", str(run_dir), str(start), str(LAST_STEP), str(ROWS)],
        start_new_session=True,  # its own process group, so killpg takes the helper too
        stdout=subprocess.PIPE,
    )


def _check_readable(run_dir) -> int:
    """Every complete metrics line is JSON, every dump file reads whole; returns the last logged step."""
    metrics = run_dir / METRICS_FILE
    raw = metrics.read_bytes() if metrics.exists() else b""
    for line in raw[: raw.rfind(b"\n") + 1].splitlines():
        json.loads(line)
    for paths in token_files(run_dir).values():
        for path in paths:
            assert pq.read_table(path).num_rows == ROWS, path
    if (run_dir / "config.json").exists():
        read_run_config(run_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RunStoreWarning)  # a torn last line is allowed right after a kill
        frame = load_metrics(run_dir)
    return int(frame["step"].max()) if len(frame) else 0


def test_sigkill_of_process_group_leaves_readable_files_and_resume_is_exact(tmp_path):
    run_dir = tmp_path / "run"
    rng = random.Random(0)
    start, kills, progress = 1, 0, []
    while kills < 6:
        child = _spawn(run_dir, start)
        if kills % 2:  # from spawn: may land in start-up, the config check or the first writes
            time.sleep(rng.uniform(0.2, 2.0))
        else:  # from "ready": lands among the step writes
            child.stdout.readline()
            time.sleep(rng.uniform(0.0, 1.2))
        if child.poll() is not None:  # finished before the kill: run again from the start
            child.communicate()
            start = 1
            continue
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        child.stdout.close()
        kills += 1
        last = _check_readable(run_dir)
        progress.append(last)
        # A checkpoint is a step every process has finished (ranks move in lockstep in training; here the
        # helper runs free), taken a couple of steps back: those steps are trained and logged again.
        dumps = token_files(run_dir)
        done_by_both = next((s for s in range(1, LAST_STEP + 1) if len(dumps.get(s, [])) < 2), LAST_STEP + 1) - 1
        start = max(1, min(last, done_by_both) - 2)
    assert any(0 < last < LAST_STEP for last in progress), progress  # some kills landed mid-run
    print("last logged step after each kill:", progress)
    child = _spawn(run_dir, start)
    child.communicate(timeout=300)
    assert child.returncode == 0

    with warnings.catch_warnings():
        warnings.simplefilter("error", RunStoreWarning)  # no torn, corrupt or duplicate line is left
        frame = load_metrics(run_dir)
        tokens = query_tokens(run_dir, columns=["step"])
    assert frame["step"].tolist() == list(range(1, LAST_STEP + 1))
    assert len((run_dir / METRICS_FILE).read_bytes().splitlines()) == LAST_STEP
    assert frame["metric/007"].tolist() == [s + 0.007 for s in range(1, LAST_STEP + 1)]
    dumps = token_files(run_dir)
    assert list(dumps) == list(range(1, LAST_STEP + 1)) and all(len(paths) == 2 for paths in dumps.values())
    assert tokens["step"].value_counts().eq(2 * ROWS).all()
    assert not [p for p in (run_dir / "tokens").iterdir() if p.name.startswith(".")]  # temp files cleaned
    assert read_run_config(run_dir)["resumes"]  # each resume that got past start-up is recorded
