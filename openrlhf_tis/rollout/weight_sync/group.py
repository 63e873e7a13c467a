"""The weight-sync group both ends join on a CPU run: a private gloo group with upstream's broadcast API.

Upstream's trainer builds its group with openrlhf/utils/distributed_util.py `stateless_init_process_group`,
which is always a vLLM PyNcclCommunicator: without NCCL it disables itself and its broadcast does nothing (the
engines keep NaN weights and the run exits 0). The trainer's end gets this group through the cpu_weight_sync
patch (`gloo_sync_group`, a drop-in for upstream's function); the engine's end builds it in the worker
extension's `init_process_group` (receive.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class GlooBroadcastGroup:
    """A private gloo group with the `.broadcast(tensor, src, stream=None)` API upstream's sync calls."""

    def __init__(self, host: str, port: int, rank: int, world_size: int):
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        self.rank, self.world_size = rank, world_size
        self._pg = stateless_init_torch_distributed_process_group(host, port, rank, world_size, backend="gloo")

    def broadcast(self, tensor: torch.Tensor, src: int = 0, stream: object = None) -> None:
        """Broadcast in place from group rank `src` (`stream` is a CUDA notion, ignored here)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src  # gloo ranks are group-local: no translation needed
        opts.rootTensor = 0
        self._pg.broadcast([tensor], opts).wait()


def gloo_sync_group(master_address: str, master_port: int, rank: int, world_size: int,
                    device: object = None) -> GlooBroadcastGroup:
    """Drop-in for upstream's `stateless_init_process_group` (same arguments; `device` is a CUDA notion)."""
    return GlooBroadcastGroup(master_address, master_port, rank, world_size)
