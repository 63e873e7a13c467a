"""Checks on a model named by path or hub id, shared by the training CLI and the calibration command."""

from __future__ import annotations

import os
import re

from openrlhf_tis.errors import UsageError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def check_model_path(flag: str, path: str | None, *, required: bool = False) -> None:
    """A model must be a local directory with a config.json, or a hub id when the hub is reachable."""
    if not path:
        if required:
            raise UsageError(flag, "is required")
        return
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise UsageError(flag, f"{path!r} is a directory without config.json, not a Hugging Face model")
        return
    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
    if offline or not _HUB_ID.match(path):
        raise UsageError(flag, f"model path {path!r} does not exist" + (" (HF_HUB_OFFLINE is set)" if offline else ""))
