"""Shared fixtures: the CPU platform patches and a tiny locally built model (no hub access)."""

from __future__ import annotations

import os

import pytest

pytest_plugins = ["_budget", "pytester"]  # _budget: a test that starts Ray must be marked e2e (test_budget.py)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session", autouse=True)
def platform_patches():
    """openrlhf cannot even be imported on CPU without them (flash_attn at module level)."""
    from openrlhf_tis import patches

    patches.apply_platform_patches()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from openrlhf_tis.demo.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny_model")


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
    """Modules with a real run first, then those with in-process engines, then the rest (stable within each): under
    pytest-xdist (scripts/run_tests.sh runs `--dist loadscope`, a module per worker at a time) the slow modules start
    at once and the many quick ones fill the gaps, instead of a real run starting last on one worker."""
    rank: dict[str, int] = {}
    for item in items:
        module = item.nodeid.split("::")[0]
        rank[module] = min(rank.get(module, 2), _cost_rank(item))
    items.sort(key=lambda item: rank[item.nodeid.split("::")[0]])
