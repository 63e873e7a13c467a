"""Shared fixtures: the CPU platform patches and a tiny locally built model (no hub access)."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

pytest_plugins = ["_budget", "pytester"]  # _budget: a test that starts Ray must be marked e2e (test_budget.py)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite is a CPU run's process: the engine and trainer classes it builds in-process read the run's device
# (openrlhf_tis.run_device) as every process of a real run does.
os.environ.setdefault("OPENRLHF_TIS_RUN_DEVICE", "cpu")


@pytest.fixture(scope="session", autouse=True)
def platform_patches():
    """openrlhf cannot even be imported on CPU without them (flash_attn at module level)."""
    from openrlhf_tis import patches

    patches.apply_platform_patches("cpu")


@pytest.fixture(autouse=True)
def run_device_kept():
    """A test that runs the CLI's main() in-process makes this process part of its run (OPENRLHF_TIS_RUN_DEVICE, set by
    the driver for everything it starts); the next test is a CPU process again."""
    before = os.environ["OPENRLHF_TIS_RUN_DEVICE"]
    yield
    os.environ["OPENRLHF_TIS_RUN_DEVICE"] = before


@pytest.fixture(autouse=True)
def ctrl_c_kept():
    """The training CLI's stop ignores SIGINT on its way out, and a SIG_IGN disposition left in this process is
    inherited by every command a later test starts, which then cannot be stopped by Ctrl-C (seen in the full suite:
    the Ctrl-C tests timed out). Each test leaves SIGINT as it found it."""
    import signal

    before = signal.getsignal(signal.SIGINT)
    yield
    if signal.getsignal(signal.SIGINT) is not before and before is not None:
        signal.signal(signal.SIGINT, before)


@pytest.fixture()
def without_amx(monkeypatch):
    """This CPU as one without AMX tiles, where vLLM-CPU's oneDNN int8 kernel applies static activation scales; on an
    AMX CPU (Sapphire Rapids and later) static scales are refused (rollout/precision.py), which a test of the static
    path's other checks must not depend on."""
    import torch

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from openrlhf_tis.demo.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny_model")


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory):
    from _support import build_tiny_moe

    return build_tiny_moe(tmp_path_factory.mktemp("models") / "tiny_moe")


@pytest.fixture()
def valid_argv(tiny_model_dir, tmp_path):
    """A minimal command line the training CLI accepts (local model, prompts, reward script, run dir)."""
    import json

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"input": "1 + 1?", "label": "2"}) + "\n")
    reward = tmp_path / "reward.py"
    reward.write_text("def reward_func(queries, prompts, labels):\n    return {\"rewards\": 0.0}\n")
    return ["--actor.model_name_or_path", str(tiny_model_dir), "--reward.remote_url", str(reward),
            "--data.prompt_dataset", str(prompts), "--logger.run_dir", str(tmp_path / "run")]


def _cost_rank(item: pytest.Item) -> int:
    return 0 if item.get_closest_marker("e2e") else 1 if item.get_closest_marker("engine") else 2


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules with a real run first, then those with in-process engines, then the rest (stable within each), so that
    under pytest-xdist the slow work starts at once and the many quick modules fill the other workers."""
    rank: dict[str, int] = {}
    for item in items:
        module = item.nodeid.split("::")[0]
        rank[module] = min(rank.get(module, 2), _cost_rank(item))
    items.sort(key=lambda item: rank[item.nodeid.split("::")[0]])


MACHINE_ALONE = "modules that need the machine to themselves"


@functools.cache
def _needs_machine_alone(module: str) -> bool:
    """Whether a test module marks anything e2e (tests/_budget.py makes every test that starts Ray carry the mark) or
    browser (a Voilà kernel executing a notebook and Chromium rendering it)."""
    path = Path(__file__).resolve().parent.parent / module
    return path.is_file() and any(mark in path.read_text() for mark in ("mark.e2e", "mark.browser"))


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's: unknown when it is not loaded
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """pytest-xdist (scripts/run_tests.sh) hands out a module per worker at a time, so that a module's real run is
    shared by its tests, except that every module with a real run or a browser goes to one worker, one after another.

    Two real runs at once on two cores miss Ray's fixed start-up windows (the raylet waits 15 s for its dashboard
    agent, not configurable in Ray 2.55): seen as a failed launch in a fresh-clone run. A browser test beside a real
    run waited over 180 s for one Voilà page that takes 8 s on a quiet machine (CI, 2 cores). xdist's own `loadgroup`
    cannot group them under pytest 9 (it renames `item._nodeid`, which pytest 9 no longer reads).
    """
    from xdist.scheduler import LoadScopeScheduling

    class HeavyModulesTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::")[0]
            return MACHINE_ALONE if _needs_machine_alone(module) else module

    return HeavyModulesTogether(config, log)
