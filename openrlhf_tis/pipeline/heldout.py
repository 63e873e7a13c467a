"""Held-out accuracy of the policy a user keeps: the trainer's saved weights in the trainer's dtype.

The training run scores its held-out set through the rollout engine, so an INT8 run scores the INT8
policy, not the weights it saves and a user deploys. After the training CLI has exited (never inside the
training controller), this scores the base model and the saved final model on the same held-out questions
with one unquantized vLLM-CPU engine each, at the trainer's dtype, with the run's eval temperature and
response length, the same per-question sampling seeds (common random numbers: a gain is not sampling
noise between two draws) and the run's own reward function, exactly as upstream builds its query (the
prompt formatted by upstream's `preprocess_data`, prompt + response decoded with special tokens).

`<run_dir>/heldout_kept.json` (schema 1):
    {"schema": 1, "policy": "trainer weights", "dtype": "fp32", "n_samples": 4, "seed": 42,
     "temperature": 1.0, "max_new_tokens": 32, "eval_prompts": "...", "questions": 64,
     "before": {"model": PATH, "pass1": x, "passk": y, "k": 4, "per_question": [...], "seconds": s,
                "cached": bool},
     "after": {...same, "model": <run_dir>/model}}
`per_question` is each question's mean reward over its samples, in file order; `pass1` their mean;
`passk` the mean over questions of the best of the k = n_samples rewards (upstream's `pass{n}`).
The base model's score is cached under `cache_dir` (pipeline/train.py: ~/.cache/openrlhf_tis/heldout, or
$OPENRLHF_TIS_CACHE/heldout) keyed by everything it depends on (model files and
their mtimes, eval file, reward file, n, seed, dtype, temperature, max tokens), so every cell of a study
seed shares one evaluation.

Run as `python -m openrlhf_tis.pipeline.heldout --run_dir R --base MODEL --eval_prompts F --reward F ...`
(a subprocess of the notebook's job: vLLM never lives in a notebook kernel).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from openrlhf_tis.runs.heldout import KEPT_FILE, SCHEMA, kept_label, pass_at_k
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


def score_model(model: Path, questions: list[tuple[str, str]], reward_func, *, dtype: str, n: int, seed: int,
                temperature: float, max_new_tokens: int, max_len: int) -> dict[str, Any]:
    """Sample `n` responses per question from an unquantized engine on `model` and score them."""
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
    llm = LLM(model=str(model), dtype=DTYPES[dtype], enforce_eager=True, max_model_len=max_len, seed=seed,
              distributed_executor_backend="uni", enable_chunked_prefill=False)
    ids = [tokenizer(prompt, add_special_tokens=False)["input_ids"] for prompt, _ in questions]
    # One seed per question: its samples are drawn from the same random stream whichever model is scored.
    # vLLM gives the j-th of n samples seed + j, so questions are n seeds apart: no stream is shared.
    params = [SamplingParams(n=n, temperature=temperature, max_tokens=max_new_tokens, seed=seed * 1_000_003 + i * n,
                             skip_special_tokens=False) for i in range(len(questions))]
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


def evaluate_kept(run_dir: Path, base: Path, eval_prompts: Path, reward: Path, *, dtype: str, n: int, seed: int,
                  temperature: float, max_new_tokens: int, max_len: int, cache_dir: Path,
                  chat_template: bool = True, input_key: str = "input", label_key: str = "label") -> dict[str, Any]:
    """Score the base model (cached) and `<run_dir>/model`; write and return `<run_dir>/heldout_kept.json`."""
    from transformers import AutoTokenizer

    kept = run_dir / KEPT_MODEL_DIR
    if not (kept / "config.json").is_file():
        raise FileNotFoundError(f"{kept}: the training run saved no final model (--ckpt.output_dir)")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    settings = {"dtype": dtype, "n_samples": n, "seed": seed, "temperature": temperature,
                "max_new_tokens": max_new_tokens, "max_len": max_len, "chat_template": chat_template,
                "input_key": input_key, "label_key": label_key}
    questions = _questions(eval_prompts, AutoTokenizer.from_pretrained(base), input_key, label_key, chat_template)
    reward_func = _load_reward(reward)
    kwargs = {"dtype": dtype, "n": n, "seed": seed, "temperature": temperature, "max_new_tokens": max_new_tokens,
              "max_len": max_len}
    cached = cache_dir / f"base-{cache_key(base, eval_prompts, reward, settings)}.json"
    if cached.is_file():
        before = {**json.loads(cached.read_text(encoding="utf-8")), "cached": True}
    else:
        before = score_model(base, questions, reward_func, **kwargs)
        cache_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(cached, json.dumps(before).encode())
        before = {**before, "cached": False}
    after = {**score_model(kept, questions, reward_func, **kwargs), "cached": False}
    result = {"schema": SCHEMA, "policy": "trainer weights", "dtype": dtype, "n_samples": n, "seed": seed,
              "temperature": temperature, "max_new_tokens": max_new_tokens, "eval_prompts": str(eval_prompts),
              "questions": len(questions), "before": before, "after": after}
    atomic_write(run_dir / KEPT_FILE, json.dumps(result, indent=1).encode())
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="heldout", description=__doc__.split("\n")[0])
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
                           Path(args.reward).resolve(), dtype=args.dtype, n=args.n_samples, seed=args.seed,
                           temperature=args.temperature, max_new_tokens=args.max_new_tokens, max_len=args.max_len,
                           cache_dir=Path(args.cache_dir), chat_template=not args.no_chat_template)
    print(f"[openrlhf_tis] held-out, {kept_label(result)}: pass1 {result['before']['pass1']:.3f} -> "
          f"{result['after']['pass1']:.3f} ({result['questions']} questions x {args.n_samples})", file=sys.stderr)


if __name__ == "__main__":
    main()
