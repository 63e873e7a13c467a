"""Checks on a model named by path or hub id, shared by the training CLI and the calibration command."""

from __future__ import annotations

import json
import os
import re
import socket
from urllib.parse import urlparse

from openrlhf_tis.errors import UsageError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
HUB_PROBE_TIMEOUT_S = 3.0


def hub_offline() -> bool:
    """Whether the Hugging Face hub is switched off for this process (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE)."""
    return any(os.environ.get(var, "0").strip().lower() not in ("0", "", "false", "no", "off")
               for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def hub_cached(repo_id: str) -> bool:
    """Whether the hub model's config.json is in the local Hugging Face cache (usable offline)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


def hub_reachable(timeout: float = HUB_PROBE_TIMEOUT_S) -> bool:
    """Whether the hub's host (HF_ENDPOINT, default huggingface.co) accepts a connection within `timeout` s,
    so a machine without network is told at once instead of after upstream's download retries."""
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                 timeout=timeout).close()
    except OSError:
        return False
    return True


def check_model_path(flag: str, path: str | None, *, required: bool = False) -> None:
    """A model must be a local directory with a readable config.json, or a hub id that is cached locally or
    can be downloaded (the hub is not switched off and answers)."""
    if not path:
        if required:
            raise UsageError(flag, "is required")
        return
    if os.path.isdir(path):
        config = os.path.join(path, "config.json")
        if not os.path.isfile(config):
            raise UsageError(flag, f"{path!r} is a directory without config.json, not a Hugging Face model")
        try:
            with open(config, encoding="utf-8") as f:
                parsed = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise UsageError(flag, f"{config} is not a readable JSON model config ({err})") from None
        if not isinstance(parsed, dict) or "model_type" not in parsed:
            raise UsageError(flag, f"{config} has no 'model_type': not a Hugging Face model config")
        return
    if not _HUB_ID.match(path):
        raise UsageError(flag, f"model path {path!r} does not exist")
    if hub_cached(path):
        return
    if hub_offline():
        raise UsageError(flag, f"model path {path!r} does not exist, and as a hub id it is not in the local cache "
                         "(HF_HUB_OFFLINE is set)")
    if not hub_reachable():
        raise UsageError(flag, f"model path {path!r} does not exist, and as a hub id it is not in the local cache "
                         "and the hub cannot be reached (no network?)")


def read_model_config(flag: str, path: str) -> dict:
    """config.json of a model `check_model_path` accepted: a local directory's, or a hub id's (from the cache, or
    downloaded when the hub is on)."""
    if os.path.isdir(path):
        config = os.path.join(path, "config.json")
    else:
        from huggingface_hub import hf_hub_download

        try:
            config = hf_hub_download(path, "config.json")
        except Exception as err:  # the hub's errors have no common base beyond this
            raise UsageError(flag, f"config.json of {path!r} cannot be read ({err})") from None
    with open(config, encoding="utf-8") as f:
        return json.load(f)
