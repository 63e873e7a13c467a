"""Try the reward script once, on the first real prompt, before Ray starts.

Upstream imports a `--reward.remote_url file.py` inside every vLLM engine actor and calls
`reward_func(queries, prompts, labels)` there once per sample; a script that fails to import, raises,
or returns no rewards is only found out minutes later, from an actor. Here it is imported and called
the way upstream calls it (one query; the prompt formatted by upstream's own `preprocess_data`, with
the chat template when `--data.apply_chat_template`), with the prompt as its own query: no response yet.
The call is bounded by `--reward.timeout_s` and its result checked as the engines check it during training
(rollout/reward_calls.py), so a script that never returns or returns what upstream cannot use is refused here.

An `http://` or `https://` reward server is asked the same way, with the request upstream's engines send (a JSON
POST of `query`, `prompts`, `labels`, one query), within the same limit: one that cannot be reached, answers an
HTTP error or no JSON, does not answer in time, or answers what upstream cannot use is refused before Ray starts.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import traceback
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

import torch

from openrlhf_tis.errors import UsageError
from openrlhf_tis.rollout.reward_calls import (
    RewardCallTimeout,
    RewardResultError,
    call_within,
    check_reward_result,
    describe_call,
    result_message,
    timeout_message,
)
from openrlhf_tis.run_spec import RewardPlan


def load_reward_func(path: str):
    """The script's reward_func, imported as upstream's SingleTurnAgentExecutor does."""
    spec = importlib.util.spec_from_file_location("reward_func", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.reward_func


def _where(err: BaseException, path: str) -> str:
    """` at file.py:LINE` for the innermost frame of the script in the traceback (where the user looks)."""
    script = os.path.abspath(path)
    frames = [f for f in traceback.extract_tb(err.__traceback__) if os.path.abspath(f.filename) == script]
    return f" at {os.path.basename(path)}:{frames[-1].lineno}" if frames else ""


def formatted_prompt(record: Mapping[str, Any], args: argparse.Namespace) -> tuple[str, Any]:
    """(prompt, label) of one dataset record exactly as upstream's PromptDataset builds them."""
    from openrlhf.datasets.prompts_dataset import preprocess_data

    template = None
    if getattr(args, "data.apply_chat_template"):
        from openrlhf.utils.utils import get_tokenizer

        tokenizer = get_tokenizer(getattr(args, "actor.model_name_or_path"), None,
                                  use_fast=not getattr(args, "data.disable_fast_tokenizer"))
        template = tokenizer.apply_chat_template
    return preprocess_data(record, getattr(args, "data.input_template"), getattr(args, "data.input_key"),
                           getattr(args, "data.label_key"), template)


def reward_values(result: Any) -> torch.Tensor:
    """The `rewards` of one reward_func result as a flat float64 tensor (its checks: check_reward_result)."""
    return torch.as_tensor(result["rewards"], dtype=torch.float64).reshape(-1)


def _post_json(url: str, payload: Mapping[str, Any], timeout_s: float) -> Any:
    """POST `payload` as JSON to `url`; its answer parsed as JSON (ValueError when it is none)."""
    request = urllib.request.Request(url, data=json.dumps(payload).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as answer:
        return json.loads(answer.read())


def probe_reward_server(flag: str, url: str, record: Mapping[str, Any], args: argparse.Namespace,
                        plan: RewardPlan) -> None:
    """Refuse an HTTP reward server that cannot be reached, answers an error or no JSON, does not answer within the
    run spec's limit (`plan`), or answers no usable reward for `record`, asked as upstream's engines ask it."""
    prompt, label = formatted_prompt(record, args)
    timeout_s = plan.timeout_s
    where = describe_call(f"the reward server {url}", prompt, label)
    payload = {"query": [prompt], "prompts": [prompt], "labels": [label]}
    print(f"[openrlhf_tis] {flag}: asking {url} for the reward of the first prompt ...", file=sys.stderr, flush=True)
    try:
        result = call_within(_post_json, (url, payload, timeout_s), timeout_s)
    except (RewardCallTimeout, TimeoutError):
        raise UsageError(flag, timeout_message(where, timeout_s)) from None
    except urllib.error.HTTPError as err:
        raise UsageError(flag, f"{where} answered HTTP {err.code} {err.reason}") from None
    except urllib.error.URLError as err:
        if isinstance(err.reason, TimeoutError):
            raise UsageError(flag, timeout_message(where, timeout_s)) from None
        raise UsageError(flag, f"reward server {url} cannot be reached: {err.reason}; start it, or check the URL") \
            from None
    except ValueError as err:
        raise UsageError(flag, f"{where} answered no JSON ({err})") from None
    except OSError as err:
        raise UsageError(flag, f"reward server {url} cannot be reached: {err}; start it, or check the URL") from None
    try:
        check_reward_result(result, queries=1)
    except RewardResultError as err:
        raise UsageError(flag, result_message(where, err, result)) from None


def probe_reward_script(flag: str, url: str | None, record: Mapping[str, Any], args: argparse.Namespace,
                        plan: RewardPlan) -> None:
    """Refuse a local reward script that cannot be imported or called on `record`, returns no usable reward, or does
    not return within the run spec's limit (`plan`; the call is abandoned on a daemon thread: rollout/reward_calls.py);
    an HTTP reward server is asked instead (probe_reward_server)."""
    if url and url.startswith(("http://", "https://")):
        probe_reward_server(flag, url, record, args, plan)
        return
    if not url or not url.split(",")[0].endswith(".py"):
        return
    path = url.split(",")[0]  # upstream calls the first script only
    # A script can take long to import (a model, a dataset): say what the start waits on before it does.
    print(f"[openrlhf_tis] {flag}: importing {path} to try reward_func on the first prompt ...", file=sys.stderr,
          flush=True)
    try:
        reward_func = load_reward_func(path)
    except Exception as err:
        raise UsageError(flag, f"reward script {path} fails to import: {type(err).__name__}: {err}"
                         f"{_where(err, path)}") from None
    prompt, label = formatted_prompt(record, args)
    timeout_s = plan.timeout_s
    where = describe_call(f"reward_func in {path}", prompt, label)
    try:
        result = call_within(reward_func, ([prompt], [prompt], [label]), timeout_s)
    except RewardCallTimeout:
        raise UsageError(flag, timeout_message(where, timeout_s)) from None
    except Exception as err:
        raise UsageError(flag, f"reward_func in {path} raised {type(err).__name__}: {err}{_where(err, path)} "
                         f"when tried on the first prompt (label {label!r})") from None
    try:
        check_reward_result(result, queries=1)
    except RewardResultError as err:
        raise UsageError(flag, result_message(where, err, result)) from None
    reward = reward_values(result).item()
    if not math.isfinite(reward):
        print(f"[openrlhf_tis] warning: reward_func in {path} returned {reward} for the first prompt with no "
              f"response; a non-finite reward in training is handled by --reward.nonfinite "
              f"({plan.nonfinite})", file=sys.stderr)
