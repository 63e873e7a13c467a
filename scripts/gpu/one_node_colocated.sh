#!/usr/bin/env bash
# One 8-GPU node, the colocated hybrid engine: the actor (8 DeepSpeed ranks) and 8 vLLM engines share every GPU,
# each asleep while the other works (--vllm.enable_sleep, --ds.enable_sleep). bf16 rollouts + token TIS.
# As upstream's own hybrid-engine example: engines capped at half a GPU and without CUDA graphs
# (--vllm.enforce_eager), whose memory a sleeping engine would keep while DeepSpeed trains.
#
#   MODEL=... PROMPTS=... REWARD=... RUN_DIR=... bash scripts/gpu/one_node_colocated.sh [more flags]
#
# Extra flags go last and win (e.g. --ckpt.load_enable to resume). Without RAY_ADDRESS the run starts its own Ray
# on this node; the node's GPUs make it a CUDA run (the first console line says so).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/recipe_flags.sh"

PLACEMENT=(
  --actor.num_nodes 1 --actor.num_gpus_per_node 8
  --vllm.num_engines 8 --vllm.tensor_parallel_size 1
  --train.colocate_all --vllm.enable_sleep --ds.enable_sleep --vllm.gpu_memory_utilization 0.5 --vllm.enforce_eager
)
exec python -m openrlhf_tis.cli.train_ppo_ray "${RECIPE_FLAGS[@]}" "${PLACEMENT[@]}" "$@"
