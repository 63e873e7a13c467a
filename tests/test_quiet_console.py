"""The main job's console and HTML report carry no build noise, yet a real failure shows in full.

The tiny-model main job runs for real (papermill, the kernel building the tiny model, which imports DeepSpeed
and so its op probe, the training CLI) with a file the CLI refuses (the main job's own check reads flag values
only), so it fails in seconds, before Ray starts.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e
NOISE = ["collect2", "cannot find -laio", "ld returned"]
REFUSED = ["--eval.dataset", "no_such_eval.jsonl"]


@pytest.fixture(scope="module")
def failed_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("main_job")
    # ipykernel does not capture file descriptors 1 and 2 under pytest (PYTEST_CURRENT_TEST): a person's kernel does
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    job = subprocess.run([sys.executable, "-m", "openrlhf_tis.pipeline.main_job", "--out", str(out), "--model", "tiny",
                          "--set", "steps=1", *REFUSED],
                         capture_output=True, text=True, timeout=900, env=env)
    (report,) = (out / "runs").glob("*/report.html")
    return job, report.read_text()


def test_the_console_shows_the_failure_and_no_build_noise(failed_job):
    job, _ = failed_job
    console = job.stdout + job.stderr
    assert job.returncode != 0
    assert not [word for word in NOISE if word in console], console
    assert "TrainingFailed" in console and "training exited with code 2" in console
    assert "--eval.dataset" in console  # the cause, from the tail of train.log


def test_the_report_shows_the_failure_and_no_build_noise(failed_job):
    _, report = failed_job
    assert not [word for word in NOISE if word in report]
    assert "TrainingFailed" in report and "--eval.dataset" in report
