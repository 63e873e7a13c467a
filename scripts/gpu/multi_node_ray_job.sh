#!/usr/bin/env bash
# Several GPU nodes (4 x 8 GPUs here) driven by `ray job submit` from a head node, which may have no GPU: the
# cluster's GPUs make the run a CUDA one, not the head's hardware. bf16 rollouts + token TIS.
#
# Before: the fork installed (README, Install) at the same path on every GPU node, `ray start --head` on the head and
# `ray start --address HEAD:6379` on each GPU node; RUN_DIR on storage every node mounts at the same path. The head
# runs the driver, which imports vLLM through upstream's parser: it needs vLLM 0.29.0, OpenRLHF 0.11.2 and the fork,
# not flash-attn or CUDA (pip install -e ".[head]"; pip install openrlhf==0.11.2 --no-deps; docs/gpu.md, The head
# node). Without them the driver stops in one line naming what to install, before it joins the cluster.
#
#   RAY_ADDRESS=http://HEAD:8265 IFNAME=ens5 MODEL=... PROMPTS=... REWARD=... RUN_DIR=/shared/runs/x \
#     bash scripts/gpu/multi_node_ray_job.sh [more flags]
#
# NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME name the network interface the nodes reach each other on (`ip -br addr`):
# without them NCCL and gloo may pick a docker or loopback interface and the first collective hangs. They travel
# in the job's runtime environment, which Ray merges key by key with the one the fork's driver adds (its device,
# upstream's defaults), so every worker and vLLM process gets both.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/recipe_flags.sh"
: "${RAY_ADDRESS:?set RAY_ADDRESS to the dashboard address of the head node, e.g. http://10.0.0.1:8265}"
: "${IFNAME:?set IFNAME to the interface the nodes reach each other on (ip -br addr), e.g. ens5}"

RUNTIME_ENV=$(printf '{"env_vars": {"NCCL_SOCKET_IFNAME": "%s", "GLOO_SOCKET_IFNAME": "%s"}}' "$IFNAME" "$IFNAME")
exec ray job submit --address "$RAY_ADDRESS" --runtime-env-json "$RUNTIME_ENV" --no-wait -- \
  python -m openrlhf_tis.cli.train_ppo_ray "${RECIPE_FLAGS[@]}" "${MULTI_NODE_PLACEMENT[@]}" "$@"
