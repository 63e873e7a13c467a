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

