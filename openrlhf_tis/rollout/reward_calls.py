"""One call of a reward script's `reward_func`: bounded in time, and its result checked.

Upstream calls `reward_func(queries, prompts, labels)` with no time limit, so a script that never returns stalls
the rollout, and with it the whole run, without a word. It also takes whatever the call returns: three values or a
string for one query fail steps later in the controller (`a Tensor with 3 elements cannot be converted to Scalar`,
`too many dimensions 'str'`), naming neither the script nor the prompt. The driver's try-out before Ray starts
(cli/reward_probe.py) and the engines' reward executor (rollout/reward_executor.py) both call through here, under
the same limit (`--reward.timeout_s`) and the same result rule.

Python cannot stop a thread, so a call that runs out of time is abandoned, not stopped: it runs on a daemon
thread of its own, which keeps neither the driver nor an engine process alive once the run ends.
"""

from __future__ import annotations

import asyncio
import contextvars
import math
import reprlib
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

TIMEOUT_FLAG = "--reward.timeout_s"  # declared, with its default, by run_spec/plans.py's RewardPlan
_THREAD_NAME = "openrlhf_tis-reward_func"

_short = reprlib.Repr()
_short.maxstring, _short.maxother, _short.maxlist, _short.maxdict, _short.maxlevel = 120, 120, 6, 6, 3


class RewardCallTimeout(Exception):
    """The call did not return within its limit (a class of the fork's: a script's own TimeoutError is not this)."""

    def __init__(self, timeout_s: float):
        super().__init__(timeout_s)  # its only argument: an exception is rebuilt from its args when pickled
        self.timeout_s = timeout_s

    def __str__(self) -> str:
        return f"no return within {self.timeout_s:g} s"


class RewardResultError(ValueError):
    """What is wrong with a reward_func result, in words that follow "reward_func ...": "returned ..."."""


def short_repr(value: Any) -> str:
    """`repr(value)` cut short (long strings, lists and dicts elided), for one line of an error message."""
    return _short.repr(value)


MAX_TIMEOUT_S = 7 * 24 * 3600.0
"""A week: longer than any run, and well within what the waits below accept (threading's TIMEOUT_MAX, about 292
years on Linux, where 1e12 s overflowed inside the limit and was reported as the reward script's failure)."""


def check_timeout(seconds: Any) -> float:
    """`seconds` as a limit: a finite number in (0, MAX_TIMEOUT_S] (ValueError otherwise). There is no "no limit": a
    call that never returns is exactly what the limit is for; a slow reward gets a large value instead."""
    try:
        limit = float(seconds)
    except (TypeError, ValueError):
        raise ValueError(f"must be a number of seconds, got {seconds!r}") from None
    if not (math.isfinite(limit) and limit > 0):
        raise ValueError(f"must be a finite number of seconds > 0, got {seconds!r} (there is no 'no limit': give a "
                         "large value for a reward that needs long)")
    if limit > MAX_TIMEOUT_S:
        raise ValueError(f"must be at most {MAX_TIMEOUT_S:.0f} s (a week), got {seconds!r}")
    return limit


def call_within(fn: Callable[..., Any], args: Sequence[Any], timeout_s: float) -> Any:
    """`fn(*args)` from a synchronous caller (the driver's try-out), abandoned after `timeout_s`
    (RewardCallTimeout); an exception of `fn` is raised as it is, with its own traceback."""
    outcome: list[tuple[Any, BaseException | None]] = []
    finished = threading.Event()

    def run() -> None:
        try:
            outcome.append((fn(*args), None))
        except BaseException as err:  # handed to the caller, whatever it is
            outcome.append((None, err))
        finally:
            finished.set()

    threading.Thread(target=run, name=_THREAD_NAME, daemon=True).start()
    if not finished.wait(timeout_s):
        raise RewardCallTimeout(timeout_s)
    result, error = outcome[0]
    if error is not None:
        raise error
    return result


def default_executor_threads() -> int:
    """How many threads an event loop's default executor runs (concurrent.futures.ThreadPoolExecutor's default):
    upstream's `asyncio.to_thread` ran at most this many reward calls at once."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor() as pool:
        return pool._max_workers


async def call_within_async(fn: Callable[..., Any], args: Sequence[Any], timeout_s: float) -> Any:
    """`fn(*args)` awaited from an event loop (an engine's), abandoned after `timeout_s` (RewardCallTimeout).

    Like upstream's `asyncio.to_thread` (the caller's context variables go with it), but on a daemon thread of its
    own: an abandoned call in the loop's default executor would hold up the process's exit, which joins that pool.
    """
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def deliver(result: Any, error: BaseException | None) -> None:
        if done.done():  # given up on already
            return
        if error is None:
            done.set_result(result)
        else:
            done.set_exception(error if isinstance(error, Exception) else RuntimeError(f"reward_func raised {error!r}"))

    def run() -> None:
        try:
            outcome = (fn(*args), None)
        except BaseException as err:  # handed to the caller, whatever it is
            outcome = (None, err)
        try:
            loop.call_soon_threadsafe(deliver, *outcome)
        except RuntimeError:  # the loop is closed: nobody waits for this call any more
            pass

    context = contextvars.copy_context()
    threading.Thread(target=context.run, args=(run,), name=_THREAD_NAME, daemon=True).start()
    try:
        return await asyncio.wait_for(done, timeout_s)
    except TimeoutError:
        raise RewardCallTimeout(timeout_s) from None


def _count(name: str, values: Any, queries: int | None) -> None:
    """One number per query in `values` (a number, a list or an array of them, a tensor), else RewardResultError;
    with `queries` None, numbers only."""
    import torch

    try:
        n = torch.as_tensor(values, dtype=torch.float64).numel()
    except (TypeError, ValueError, RuntimeError):
        raise RewardResultError(f"returned {name} that are not numbers") from None
    if queries is not None and n != queries:
        raise RewardResultError(f"returned {n} {name} for {queries} quer{'y' if queries == 1 else 'ies'}")


def check_reward_result(result: Any, queries: int | None = 1) -> None:
    """A reward result as upstream reads it: a dict whose `rewards` (and `scores`, when given) hold one number per
    query (numbers only when `queries` is None); RewardResultError saying what is wrong otherwise."""
    if not isinstance(result, Mapping):
        raise RewardResultError(f"returned a {type(result).__name__}, not a dict with 'rewards'")
    if result.get("rewards") is None:
        raise RewardResultError(f"returned no 'rewards' (keys: {', '.join(map(repr, result)) or 'none'})")
    _count("rewards", result["rewards"], queries)
    if result.get("scores") is not None:  # upstream uses them in place of the rewards where given
        _count("scores", result["scores"], queries)


def describe_call(source: str, prompt: Any, label: Any) -> str:
    """Who was called on what, to begin an error message: `reward_func in PATH on prompt '...' (label '...')`."""
    return f"{source} on prompt {short_repr(prompt)} (label {short_repr(label)})"


def timeout_message(where: str, timeout_s: float) -> str:
    """The error of a call that ran out of time (`where`: describe_call's words)."""
    return f"{where} did not return within {timeout_s:g} s (raise {TIMEOUT_FLAG} if it needs longer)"


def result_message(where: str, err: RewardResultError, result: Any) -> str:
    """The error of a call whose result upstream cannot use: what is wrong, then what it was."""
    return f"{where} {err}: {short_repr(result)}"
