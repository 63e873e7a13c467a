"""The tiers' guard (tests/_budget.py): a test outside the e2e tier that starts Ray fails, naming the marker."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

INNER = '''
import os
import pytest

def start_ray_here():  # what starting Ray leaves behind: <RAY_TMPDIR>/ray/session_<time>_<pid>
    os.makedirs(os.path.join(os.environ["RAY_TMPDIR"], "ray", "session_2026-11-26_00-00-00_000000_1"))

def test_unmarked_start():
    start_ray_here()

@pytest.mark.e2e
def test_marked_start(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    start_ray_here()

def test_no_start():
    assert os.environ["RAY_TMPDIR"].startswith("/tmp/rt")
'''


def test_a_test_that_starts_ray_without_the_e2e_marker_fails(pytester, monkeypatch):
    monkeypatch.delenv("RAY_TMPDIR", raising=False)
    pytester.syspathinsert(Path(__file__).parent)
    pytester.makeconftest('pytest_plugins = ["_budget"]\n')
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=3, errors=1)
    result.stdout.fnmatch_lines(["*test_unmarked_start started a Ray cluster (session_2026-11-26*) without "
                                 "@pytest.mark.e2e*"])
    assert "RAY_TMPDIR" not in os.environ  # restored after each test


@pytest.mark.e2e
def test_ray_puts_a_cluster_under_ray_tmpdir():
    """The guard's premise, on the real Ray: a cluster started with RAY_TMPDIR set keeps its session there."""
    with tempfile.TemporaryDirectory(prefix="rt", dir="/tmp") as root:
        code = "import ray; ray.init(num_cpus=1, include_dashboard=False); ray.shutdown()"
        for _ in range(3):  # a local start can fail on a loaded machine (issue 55; docs/measurements.md): try again
            start = subprocess.run([sys.executable, "-c", code], env={**os.environ, "RAY_TMPDIR": root},
                                   timeout=300, capture_output=True, text=True)
            if start.returncode == 0:
                break
        assert start.returncode == 0, (f"ray.init failed 3 times (load {os.getloadavg()}):\n"
                                       f"{start.stderr[-3000:]}")
        assert any(n.startswith("session_2") for n in os.listdir(os.path.join(root, "ray")))
