"""The suite's budget, as a pytest plugin (tests/conftest.py loads it): a test that starts Ray, as every real run
does, must carry @pytest.mark.e2e, so the fast tiers (`-m "not e2e"`) stay fast and a new real run is seen."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest


def _ray_sessions(root: str) -> list[str]:
    ray_dir = os.path.join(root, "ray")
    return sorted(n for n in os.listdir(ray_dir) if n.startswith("session_2")) if os.path.isdir(ray_dir) else []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    """Outside the e2e tier each test gets a Ray temp dir of its own (RAY_TMPDIR: Ray, and every process the test
    starts, put a cluster's session there), so a cluster started by the test is seen whoever else runs Ray on the
    machine. Short, under /tmp: Ray's socket paths must fit in 107 bytes."""
    if item.get_closest_marker("e2e") is None:
        item.ray_tmpdir = tempfile.mkdtemp(prefix="rt", dir="/tmp")
        item.ray_tmpdir_before = os.environ.get("RAY_TMPDIR")
        os.environ["RAY_TMPDIR"] = item.ray_tmpdir
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    yield
    root = getattr(item, "ray_tmpdir", None)
    if root is None:
        return
    if item.ray_tmpdir_before is None:
        os.environ.pop("RAY_TMPDIR", None)
    else:
        os.environ["RAY_TMPDIR"] = item.ray_tmpdir_before
    sessions = _ray_sessions(root)
    shutil.rmtree(root, ignore_errors=True)
    if sessions:
        pytest.fail(f"{item.nodeid} started a Ray cluster ({sessions[0]}) without @pytest.mark.e2e: real runs cost "
                    "minutes and belong to the e2e tier (pyproject.toml markers)", pytrace=False)
