"""A reward that fails, fails the rollout with its own exception and traceback.

Upstream's `SingleTurnAgentExecutor.execute` (openrlhf/utils/agent.py, OpenRLHF 0.11.2) wraps the
reward call in `except Exception` and only logs the error at INFO level; the sample goes on with
reward None and the run dies later in the controller with `'NoneType' object has no attribute 'size'`.
This subclass records the exception in the same task (a ContextVar: each sample's `execute` is its own
asyncio task) and raises it once upstream's `execute` returns, so Ray carries the reward script's own
traceback to the driver. A reward call that returns no `rewards` fails the same way.

Each `reward_func` call is also bounded by `--reward.timeout_s` and its result checked (rollout/reward_calls.py):
one that never returns, or returns what upstream cannot use (not one number per query), fails the rollout with a
RewardFunctionError naming the script, the prompt and the limit or what it returned. The limit reaches the engine
from the controller (`limit_reward_calls`, through the engine actor's `set_reward_timeout`); until then it is the
flag's default.
"""

from __future__ import annotations

import asyncio
import sys
from contextvars import ContextVar
from typing import Any

from openrlhf.utils.agent import SingleTurnAgentExecutor

from openrlhf_tis.rollout.reward_calls import (
    RewardCallTimeout,
    RewardResultError,
    call_within_async,
    check_reward_result,
    check_timeout,
    default_executor_threads,
    describe_call,
    result_message,
    timeout_message,
)
from openrlhf_tis.run_spec import RewardPlan
from openrlhf_tis.upstream_guards import reclass

_failures: ContextVar[list[BaseException] | None] = ContextVar("openrlhf_tis_reward_failures", default=None)


class RewardFunctionError(RuntimeError):
    """The reward script or server answered without a usable reward for a sample, or not in time."""


async def _recording(call):
    try:
        return await call
    except Exception as err:
        failures = _failures.get()
        if failures is not None:
            failures.append(err)
        raise  # upstream logs it and goes on; execute() raises it afterwards


class LoudRewardExecutor(SingleTurnAgentExecutor):
    reward_timeout_s: float = RewardPlan().timeout_s  # per reward_func call; the run's own: limit_reward_calls

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
        """One bounded, checked call per query, as upstream calls the function (one query a call), all at once."""
        calls = [self._limited_call(query, prompt, label)
                 for query, prompt, label in zip(queries_list, prompts_list, labels_list, strict=True)]
        return await _recording(asyncio.gather(*calls))

    async def _limited_call(self, query: str, prompt: str, label: Any) -> Any:
        """reward_func on one query within `reward_timeout_s`; RewardFunctionError naming the script, the prompt and
        the limit or the result when it runs out of time or returns what upstream cannot use.

        No more calls run at once than upstream's `asyncio.to_thread` ran (the default executor's threads), and a
        call's time counts from its start, not from when it was queued."""
        where = describe_call(f"reward_func in {self.reward_endpoints[0]}", prompt, label)
        async with self._reward_slots():
            try:
                result = await call_within_async(self.reward_func, ([query], [prompt], [label]),
                                                 self.reward_timeout_s)
            except RewardCallTimeout:
                raise RewardFunctionError(timeout_message(where, self.reward_timeout_s)) from None
        _check(result, where, queries=1)
        return result

    def _reward_slots(self) -> asyncio.Semaphore:
        """The calls allowed at once: as many as the default executor has threads (made on first use: upstream built
        this object, so no __init__ of ours ran)."""
        slots = self.__dict__.get("_slots")
        if slots is None:
            slots = self._slots = asyncio.Semaphore(default_executor_threads())
        return slots

    async def _fetch_rewards_via_http(self, queries_list, prompts_list, labels_list):
        return await _recording(self._checked_http(queries_list, prompts_list, labels_list))

    async def _checked_http(self, queries_list, prompts_list, labels_list) -> list:
        """Upstream's HTTP call (its retries) within `reward_timeout_s` in all, each server's answer checked like a
        function's. Upstream's own bound is 180 s a try, five tries: a server that never answers held the rollout at
        "Generate samples 0/N" for 15 minutes, then the sample went on without a reward.

        The rollout sends one query a call, so each answer is for one query; with several the count is not checked.
        """
        where = describe_call(f"the reward server {', '.join(self.reward_endpoints)}", prompts_list[0],
                              labels_list[0])
        try:
            results = await asyncio.wait_for(super()._fetch_rewards_via_http(queries_list, prompts_list, labels_list),
                                             self.reward_timeout_s)
        except TimeoutError:
            raise RewardFunctionError(timeout_message(where, self.reward_timeout_s)) from None
        for result in results:
            _check(result, where, queries=1 if len(queries_list) == 1 else None)
        return results


def _check(result: Any, where: str, queries: int | None) -> None:
    """check_reward_result as a RewardFunctionError that says who returned what on which prompt."""
    try:
        check_reward_result(result, queries)
    except RewardResultError as err:
        raise RewardFunctionError(result_message(where, err, result)) from None


def limit_reward_calls(executor: Any, seconds: float) -> bool:
    """Give a loud executor (make_rewards_loud) the run's `--reward.timeout_s`; False for any other executor (a
    user's agent executor calls no reward_func of ours). ValueError for a limit that is not > 0."""
    if not isinstance(executor, LoudRewardExecutor):
        return False
    executor.reward_timeout_s = check_timeout(seconds)
    return True


def make_rewards_loud(executor) -> bool:
    """Re-class upstream's default executor (built in RolloutRayActor.__init__, no factory); True when done.

    A user's own `--train.agent_func_path` executor is left alone.
    """
    if type(executor) is not SingleTurnAgentExecutor and not isinstance(executor, LoudRewardExecutor):
        return False
    reclass(executor, LoudRewardExecutor, supported="==0.11.2", patch="openrlhf_tis/rollout/reward_executor.py",
            overrides=("execute", "_fetch_rewards_via_func", "_fetch_rewards_via_http"))
    return True
