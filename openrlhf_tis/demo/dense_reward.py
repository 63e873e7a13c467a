"""The demo task's reward shaped for a model that never answers right (`--reward.remote_url <this file>`).

The tiny random-weight test model almost never writes the right number, so the exact reward
(demo/task_reward.py) would be 0 for every sample and every group advantage 0: no gradient, nothing
to test. Adding the share of digits in the response keeps the advantages non-zero. The rule and the
logged terms are the task's own (`openrlhf_tis.demo.task.score`); only the weight of the dense term
differs.
"""

from openrlhf_tis.demo.task_reward import shaped_rewards

DIGIT_WEIGHT = 1.0


def reward_func(queries, prompts, labels):
    return shaped_rewards(queries, prompts, labels, digit_weight=DIGIT_WEIGHT)
