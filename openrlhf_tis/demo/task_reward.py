"""Reward of the demo task (`--reward.remote_url <this file>`): 1 when the final answer is right.

OpenRLHF 0.11.2 imports this file inside each vLLM engine and calls reward_func(queries, prompts,
labels) once per sample: the query is the decoded prompt + response (special tokens kept), the prompt
the formatted prompt. The rule is `openrlhf_tis.demo.task.score`; the held-out set (--eval.dataset)
is scored by this same function, so eval pass1 is held-out accuracy. `tagged`, `answered` and
`digit_share` are logged beside it (extra_logs) to show whether the answer format is being learnt.
`shaped_rewards` adds a dense term for models that never answer right (demo/dense_reward.py).
"""

from openrlhf_tis.demo.task import score

LOGGED = ("correct", "tagged", "answered", "digit_share")


def _response(query: str, prompt: str) -> str:
    if not query.startswith(prompt):
        # Scoring the whole query would read the question's own operands as an answer.
        raise ValueError(f"the query does not start with its prompt; cannot find the response in {query[-200:]!r}")
    return query[len(prompt):]


def shaped(scores: dict[str, float], digit_weight: float) -> float:
    """The reward of one scored response: correct + digit_weight × digit_share."""
    return scores["correct"] + digit_weight * scores["digit_share"]


def shaped_rewards(queries, prompts, labels, digit_weight: float) -> dict:
    """`shaped` for each query, in upstream's reward_func result format."""
    scores = [score(_response(q, p), label) for q, p, label in zip(queries, prompts, labels, strict=True)]
    rewards = [shaped(s, digit_weight) for s in scores]
    logs = {key: [s[key] for s in scores] for key in LOGGED}
    if len(scores) == 1:  # upstream's per-sample call expects plain floats
        rewards, logs = rewards[0], {key: values[0] for key, values in logs.items()}
    return {"rewards": rewards, "scores": rewards, "extra_logs": logs}


def reward_func(queries, prompts, labels):
    return shaped_rewards(queries, prompts, labels, digit_weight=0.0)
