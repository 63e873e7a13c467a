"""The demo task: single-digit arithmetic whose final answer a rule can check, split into train and held-out.

Why this task: the embedded SmolLM2-135M-Instruct already knows single-digit sums, differences and
products, but sampled at temperature 1 it rambles, so only about one answer in five ends on the right
number, while greedy decoding gets about two in three right (measured with vLLM, bf16, 32 new tokens).
The skill is there and sampling loses it: a few dozen RL steps can sharpen the policy and the held-out
score moves clearly. The prompt asks for the answer after "Answer:", but the model writes that tag in
only 1-2% of samples, so a rule demanding it would start near zero; the rule reads the number after
the last "Answer:" when there is one and otherwise the last number of the response (how GSM8K-style
graders read free-form answers), and the tag is reported separately.

Problems are all pairs of operands 0..9 under +, - (non-negative results only) and *: 255 distinct
questions, shuffled by a seed and split so that no held-out question is ever trained on. This is the one
task of the project: the main job, the tiny test model, the notebooks and the benchmarks all train on it
and score it with `score` (demo/task_reward.py).
"""

from __future__ import annotations

import json
import operator
import random
import re
from dataclasses import dataclass
from pathlib import Path

OPERATIONS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
INSTRUCTION = "Put the final answer after 'Answer:'."
ANSWER_TAG = re.compile(r"Answer:\s*(-?\d+(?:\.\d+)?)")
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
SPECIAL_TOKEN = re.compile(r"<\|[^|>]*\|>")  # chat markers such as <|im_end|> (queries are decoded with them)


@dataclass(frozen=True)
class Problem:
    a: int
    op: str
    b: int

    @property
    def question(self) -> str:
        return f"What is {self.a} {self.op} {self.b}? {INSTRUCTION}"

    @property
    def answer(self) -> int:
        return OPERATIONS[self.op](self.a, self.b)


def all_problems(max_operand: int = 9) -> list[Problem]:
    """Every question of the task in a fixed order; subtraction only where the result is non-negative."""
    operands = range(max_operand + 1)
    return [Problem(a, op, b) for op in OPERATIONS for a in operands for b in operands if op != "-" or a >= b]


def split(n_eval: int = 64, seed: int = 0, max_operand: int = 9) -> tuple[list[Problem], list[Problem]]:
    """(train, held-out): one seeded shuffle of all problems, the first `n_eval` held out."""
    problems = all_problems(max_operand)
    if not 0 < n_eval < len(problems):
        raise ValueError(f"n_eval must be between 1 and {len(problems) - 1}, got {n_eval}")
    random.Random(seed).shuffle(problems)
    return problems[n_eval:], problems[:n_eval]


def write_jsonl(path: str | Path, problems: list[Problem]) -> Path:
    """One {"input": question, "label": answer} line per problem (--data.input_key input --data.label_key label)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for p in problems:
            f.write(json.dumps({"input": p.question, "label": str(p.answer)}) + "\n")
    return path


def write_prompts(path: str | Path, n: int, seed: int = 0) -> Path:
    """`n` training questions (the train split of `seed`, repeated in order when `n` exceeds it), as one
    {"input", "label"} line each: a run of any length draws only training questions."""
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    train, _ = split(seed=seed)
    return write_jsonl(path, [train[i % len(train)] for i in range(n)])


def write_task(out_dir: str | Path, n_eval: int = 64, seed: int = 0) -> tuple[Path, Path]:
    """`out_dir/train.jsonl` and `out_dir/eval.jsonl`; the same arguments always write the same files."""
    train, held_out = split(n_eval, seed)
    out = Path(out_dir)
    return write_jsonl(out / "train.jsonl", train), write_jsonl(out / "eval.jsonl", held_out)


def final_answer(response: str) -> str | None:
    """The number after the last "Answer:" if the response has one, else its last number, else None."""
    tagged = ANSWER_TAG.findall(response)
    if tagged:
        return tagged[-1]
    numbers = NUMBER.findall(response)
    return numbers[-1] if numbers else None


def score(response: str, label: str) -> dict[str, float]:
    """1.0/0.0 each: `correct` (the final answer equals the label), `tagged` ("Answer: <number>" is
    present), `answered` (the response has a number at all); and `digit_share`, the fraction of the
    response's characters that are digits (0 for an empty response), the dense term of a shaped reward."""
    response = SPECIAL_TOKEN.sub("", response)
    answer = final_answer(response)
    return {
        "correct": float(answer is not None and float(answer) == float(label)),
        "tagged": float(bool(ANSWER_TAG.search(response))),
        "answered": float(answer is not None),
        "digit_share": sum(c.isdigit() for c in response) / max(1, len(response)),
    }
