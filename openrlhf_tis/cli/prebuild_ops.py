"""`python -m openrlhf_tis.cli.prebuild_ops`: build DeepSpeed's CPU ops once, into TORCH_EXTENSIONS_DIR, for set-up.

scripts/setup_env.sh runs this so that no training run JIT-builds (~90 s) and two checkouts never rebuild over each
other. A set-up killed while it compiled (Ctrl-C, a session's end) leaves torch's build lock behind, and the next
set-up would wait on it forever without a word: the stale locks are cleared first, as a run's start clears them
(cli/build_locks.py). A lock too young to call stale (a set-up killed a moment ago, or a run loading an op) is given
STALE_AFTER_S and looked at again, since torch's waiter never looks twice.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable

from openrlhf_tis.cli.build_locks import STALE_AFTER_S, build_lock_files, clear_stale_build_locks


def deepspeed_builders() -> list:
    """The op builders a CPU run loads: CPU Adam, fused Adam and the shared-memory collectives."""
    from deepspeed.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    return [CPUAdamBuilder(), FusedAdamBuilder(), ShareMemCommBuilder()]


def prebuild(env: dict[str, str], builders: Callable[[], Iterable] = deepspeed_builders,
             sleep: Callable[[float], None] = time.sleep) -> None:
    """Clear the stale build locks under `env`'s extension directory (waiting out young ones once), then load (so
    build) every op."""
    clear_stale_build_locks(env)
    if build_lock_files(env):
        sleep(STALE_AFTER_S + 1)
        clear_stale_build_locks(env)
    for builder in builders():
        builder.load(verbose=False)


if __name__ == "__main__":
    prebuild(dict(os.environ))
