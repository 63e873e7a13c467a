# The training flags every GPU recipe shares; sourced by the recipes beside it, never run on its own.
# Set these in the environment (or edit the defaults): MODEL (a hub id or a directory on every node), PROMPTS and
# REWARD (files every node reads), RUN_DIR (the run store and checkpoints: on storage every node reaches, with
# flock, for a multi-node run; docs/gpu.md "Shared storage").
MODEL=${MODEL:-Qwen/Qwen2.5-7B-Instruct}
PROMPTS=${PROMPTS:-$PWD/data/prompts.jsonl}
REWARD=${REWARD:-$PWD/reward.py}
RUN_DIR=${RUN_DIR:-$PWD/runs/gpu-tis}

# GRPO (group-normalised advantages, no KL, so no reference model) with token TIS on bf16 rollouts. Sequences up
# to 4096 tokens; the trainer packs them into micro-batches of at most 16k tokens a GPU (dynamic batch) with
# gradient checkpointing, which is what keeps a 7B model's activations inside an H100 under ZeRO-3. The log-prob
# pass before training packs as many (--rollout.max_tokens_per_gpu), upstream's default (its hybrid-engine example
# sets only --train.max_tokens_per_gpu 16384): a packed pass holds bf16 logits and their log_softmax, 2 x 5 GB at
# 16k tokens of Qwen2.5's 152k vocabulary, twice that at 32k. tests/test_gpu_recipes.py computes each recipe's
# memory per GPU from these flags against an 80 GB card.
RECIPE_FLAGS=(
  --actor.model_name_or_path "$MODEL"
  --data.prompt_dataset "$PROMPTS" --data.input_key input --data.label_key label --data.apply_chat_template
  --data.max_len 4096 --rollout.max_new_tokens 3072
  --reward.remote_url "$REWARD"
  --algo.advantage.estimator group_norm --algo.kl.init_coef 0
  --rollout.n_samples_per_prompt 8 --rollout.batch_size 64 --train.batch_size 512
  --ds.zero_stage 3 --ds.param_dtype bf16 --ds.attn_implementation flash_attention_2
  --actor.gradient_checkpointing_enable --ds.packing_samples
  --train.dynamic_batch_enable --train.max_tokens_per_gpu 16384 --rollout.max_tokens_per_gpu 16384
  --algo.correction.preset tis
  --vllm.sync_check_steps 10
  --logger.run_dir "$RUN_DIR" --ckpt.path "$RUN_DIR/ckpt" --ckpt.output_dir "$RUN_DIR/final" --ckpt.save_steps 20
)

# Four 8-GPU nodes, not colocated: 16 GPUs train (ZeRO-3 across 2 nodes), 16 vLLM engines generate on the other 2,
# weights sync over NCCL (multi_node_ray_job.sh, slurm.sbatch).
MULTI_NODE_PLACEMENT=(
  --actor.num_nodes 2 --actor.num_gpus_per_node 8
  --vllm.num_engines 16 --vllm.tensor_parallel_size 1 --vllm.gpu_memory_utilization 0.85
  --vllm.sync_backend nccl
)
