"""The weight sync, trainer to engines, in one place: what is sent, received, re-quantized and reloaded.

One sync, in the order it runs (a CPU run; on CUDA upstream's NCCL path sends and its `WorkerWrap` receives):

    send.py       trainer rank 0: parameters grouped into a few flat buckets of one dtype, broadcast over
                  the sync group (patches/cpu_weight_sync.py makes upstream's `broadcast_to_vllm` call it)
    checkpoint_layout.py  each parameter as its checkpoint holds it (a transformers 5 Mixtral's fused experts
                  back to the per-expert tensors the engine loaded at its start)
    group.py      the sync group both ends join: a private gloo group with the `broadcast` upstream calls
    receive.py    each engine worker (a vLLM worker extension): buffers the buckets until the sync's last
    requantize.py what the engine must load: the trainer's float weights as they are, or quantized onto the
                  rollout plan's INT8 grid (pure torch, whichever device holds the tensors), with its statistics
    reload.py     one `reload_weights` through vLLM's layer-wise reload, then what the reload leaves stale
                  (the tied head's packed copy, the fp32 head's cached cast)

A sync's statistics (the INT8 re-quantization's saturation, error and time) are its receive's return value: the
engine actor keeps the last sync's (rollout/engine_actor.py `last_sync_stats`) and the controller asks the
engines for them (trainer/step_part.py `SyncCostPart`), so they reach the run's metrics from any node.
"""
