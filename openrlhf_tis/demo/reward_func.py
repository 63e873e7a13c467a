"""Rule-based reward for the arithmetic demo task (`--reward.remote_url <this file>`).

OpenRLHF 0.11.2 calls reward_func(queries, prompts, labels) once per sample (lists of length 1;
query = decoded prompt + response) and expects plain floats. A random tiny model almost never writes
the answer, so a dense term (share of digits in the response) keeps group advantages non-zero.
"""


def reward_func(queries, prompts, labels):
    query, prompt, label = queries[0], prompts[0], labels[0]
    response = query[len(prompt):] if query.startswith(prompt) else query
    digits = sum(c.isdigit() for c in response) / max(1, len(response))
    reward = float(label in response) + digits
    return {"rewards": reward, "scores": reward, "extra_logs": {"digit_frac": digits}}
