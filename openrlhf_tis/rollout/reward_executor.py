"""A reward that fails, fails the rollout with its own exception and traceback.

Upstream's `SingleTurnAgentExecutor.execute` (openrlhf/utils/agent.py, OpenRLHF 0.11.2) wraps the
reward call in `except Exception` and only logs the error at INFO level; the sample goes on with
reward None and the run dies later in the controller with `'NoneType' object has no attribute 'size'`.
This subclass records the exception in the same task (a ContextVar: each sample's `execute` is its own
asyncio task) and raises it once upstream's `execute` returns, so Ray carries the reward script's own
traceback to the driver. A reward call that returns no `rewards` fails the same way.
"""

from __future__ import annotations

import sys
from contextvars import ContextVar

from openrlhf.utils.agent import SingleTurnAgentExecutor

from openrlhf_tis.patches._guard import reclass

_failures: ContextVar[list[BaseException] | None] = ContextVar("openrlhf_tis_reward_failures", default=None)


class RewardFunctionError(RuntimeError):
    """The reward script or server answered without a reward for a sample."""


async def _recording(call):
    try:
        return await call
    except Exception as err:
        failures = _failures.get()
        if failures is not None:
            failures.append(err)
        raise  # upstream logs it and goes on; execute() raises it afterwards


class LoudRewardExecutor(SingleTurnAgentExecutor):
    async def execute(self, prompt, label, sampling_params, max_length: int, hf_tokenizer, llm_engine, images=None):
        failures: list[BaseException] = []
        token = _failures.set(failures)
        try:
            output = await super().execute(prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine,
                                           images=images)
        finally:
            _failures.reset(token)
        source = self.reward_endpoints[0] if self.reward_endpoints else "?"
        where = f"the reward of {source} for prompt {prompt[:200]!r}"
        if failures:
            # Printed, not added as a note: Ray copies notes at every hop, so the driver would show it thrice.
            print(f"[openrlhf_tis] {where} (label {label!r}) raised {type(failures[0]).__name__}", file=sys.stderr)
            raise failures[0]
        if self.reward_endpoints and output.get("reward") is None:
            raise RewardFunctionError(f"{where} is missing: the call returned no 'rewards'")
        return output

    async def _fetch_rewards_via_func(self, queries_list, prompts_list, labels_list):
        return await _recording(super()._fetch_rewards_via_func(queries_list, prompts_list, labels_list))

    async def _fetch_rewards_via_http(self, queries_list, prompts_list, labels_list):
        return await _recording(super()._fetch_rewards_via_http(queries_list, prompts_list, labels_list))


def make_rewards_loud(executor) -> bool:
    """Re-class upstream's default executor (built in RolloutRayActor.__init__, no factory); True when done.

    A user's own `--train.agent_func_path` executor is left alone.
    """
    if type(executor) is not SingleTurnAgentExecutor and not isinstance(executor, LoudRewardExecutor):
        return False
    reclass(executor, LoudRewardExecutor, supported="==0.11.2", patch="rollout_engine")
    return True
