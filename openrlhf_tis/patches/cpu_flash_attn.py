"""CPU patch: let `openrlhf.models` import without the flash-attn package.

openrlhf/models/ring_attn_utils.py:3-4 imports `flash_attn.bert_padding` and
`flash_attn.utils.distributed` at module level, so the whole PPO path needs flash-attn, which only
builds against CUDA. Stand-in modules (openrlhf_tis.patches.flash_attn_standin, pure torch) are put in
`sys.modules` only while `openrlhf.models.ring_attn_utils` is imported and removed right after: the
names upstream bound keep working (used by --ds.packing_samples), while transformers and everything
else still see flash-attn as absent. Applied only where flash_attn is not installed.
"""

from __future__ import annotations

import contextlib
import sys
import types

from openrlhf_tis.import_hooks import around_import, is_available
from openrlhf_tis.upstream_guards import require_version

from . import flash_attn_standin

NAME = "cpu_flash_attn"
DEVICES = ("cpu", "cuda")
_TARGET = "openrlhf.models.ring_attn_utils"
_STANDIN_MODULES = ("flash_attn", "flash_attn.bert_padding", "flash_attn.utils", "flash_attn.utils.distributed")


def _standin_tree() -> dict[str, types.ModuleType]:
    mods = {name: types.ModuleType(name) for name in _STANDIN_MODULES}
    for name, fn in (
        ("index_first_axis", flash_attn_standin.index_first_axis),
        ("pad_input", flash_attn_standin.pad_input),
        ("unpad_input", flash_attn_standin.unpad_input),
        ("rearrange", flash_attn_standin.rearrange),
    ):
        setattr(mods["flash_attn.bert_padding"], name, fn)
    mods["flash_attn.utils.distributed"].all_gather = flash_attn_standin.all_gather
    mods["flash_attn"].bert_padding = mods["flash_attn.bert_padding"]
    mods["flash_attn"].utils = mods["flash_attn.utils"]
    mods["flash_attn.utils"].distributed = mods["flash_attn.utils.distributed"]
    return mods


@contextlib.contextmanager
def _standins_present():
    standins = _standin_tree()
    sys.modules.update(standins)
    try:
        yield
    finally:
        for name in standins:
            sys.modules.pop(name, None)


def apply() -> bool:
    if is_available("flash_attn"):
        return False
    require_version("openrlhf", "==0.11.2", patch=NAME)
    return around_import(_TARGET, _standins_present)
