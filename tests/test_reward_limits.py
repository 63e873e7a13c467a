"""A reward that never returns or returns what upstream cannot use stops with a message:
`--reward.timeout_s` bounds every reward_func call, in the try-out before Ray starts and on the engines, and every
result must hold one number per query; either failure names the script, the prompt and the limit or the value."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray
from _support import error_line, execute_prompts, refused, with_value
from openrlhf.utils.agent import SingleTurnAgentExecutor

from openrlhf_tis.cli import train_ppo_ray
from openrlhf_tis.rollout.reward_calls import (
    MAX_TIMEOUT_S,
    call_within,
    call_within_async,
    default_executor_threads,
)
from openrlhf_tis.rollout.reward_executor import (
    LoudRewardExecutor,
    RewardFunctionError,
    limit_reward_calls,
    make_rewards_loud,
)
from openrlhf_tis.run_spec import RewardPlan
from openrlhf_tis.trainer.step_part import RewardLimitPart

PROMPT = "'1 + 1?'"  # conftest's prompt file, as the messages quote it


def _script(tmp_path: Path, body: str, name: str = "reward.py") -> Path:
    path = tmp_path / name
    path.write_text("import time\nfrom pathlib import Path\n\n\ndef reward_func(queries, prompts, labels):\n"
                    + textwrap.indent(textwrap.dedent(body), "    "))
    return path


def _never_returning(tmp_path: Path) -> tuple[Path, Path]:
    """A reward_func that sleeps until the test is over (a `release` file appears; 120 s at most, so that even a
    broken limit cannot hang the suite); returns (script, release)."""
    release = tmp_path / "release"
    body = f"""\
    deadline = time.monotonic() + 120
    while not Path({str(release)!r}).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return {{'rewards': 0.0}}
"""
    return _script(tmp_path, body, "sleepy_reward.py"), release


# --- the try-out before Ray starts ------------------------------------------------------------------------------

def test_the_try_out_stops_a_reward_that_never_returns(valid_argv, tmp_path, capsys):
    script, release = _never_returning(tmp_path)
    argv = with_value(valid_argv, "--reward.remote_url", str(script)) + ["--reward.timeout_s", "2"]
    t0 = time.monotonic()
    try:
        line = error_line(refused(argv, capsys))
    finally:
        release.touch()
    assert time.monotonic() - t0 < 30
    assert line.startswith("--reward.remote_url: ") and str(script) in line and PROMPT in line, line
    assert "did not return within 2 s" in line and "--reward.timeout_s" in line, line


def test_an_abandoned_call_keeps_no_process_alive():
    """The try-out's call of a reward_func that never returns runs on a daemon thread: the driver still exits."""
    code = ("import threading\nfrom openrlhf_tis.rollout.reward_calls import RewardCallTimeout, call_within\n"
            "try:\n    call_within(threading.Event().wait, (), 0.5)\n"
            "except RewardCallTimeout as err:\n    print('gave up:', err)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "gave up: no return within 0.5 s" in done.stdout, done.stderr


@pytest.mark.parametrize(("body", "expected"), [
    ("return {'rewards': [1.0, 2.0, 3.0]}", ["returned 3 rewards for 1 query", "[1.0, 2.0, 3.0]"]),
    ("return {'rewards': 'good'}", ["returned rewards that are not numbers", "'good'"]),
    ("return {'rewards': 1.0, 'scores': ['a', 'b']}", ["returned scores that are not numbers", "['a', 'b']"]),
])
def test_the_try_out_names_the_script_the_prompt_and_the_bad_result(valid_argv, tmp_path, capsys, body, expected):
    script = _script(tmp_path, body)
    line = error_line(refused(with_value(valid_argv, "--reward.remote_url", str(script)), capsys))
    assert line.startswith(f"--reward.remote_url: reward_func in {script} on prompt {PROMPT} (label "), line
    assert all(text in line for text in expected), line


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf"])
def test_a_limit_that_is_no_limit_is_refused_naming_the_flag(valid_argv, capsys, value):
    line = error_line(refused(valid_argv + ["--reward.timeout_s", value], capsys))
    assert line.startswith("--reward.timeout_s: ") and "> 0" in line, line


def test_the_default_limit_is_the_engines_default(valid_argv):
    args = train_ppo_ray.parse(valid_argv, cpu=True)
    assert getattr(args, "reward.timeout_s") == RewardPlan().timeout_s == LoudRewardExecutor.reward_timeout_s == 60


# --- on the engines, during training ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _loud(script: Path, timeout_s: float | None = None) -> LoudRewardExecutor:
    """The executor as a run's engine holds it: upstream's, made loud, then told the run's limit."""
    executor = SingleTurnAgentExecutor(str(script))
    assert make_rewards_loud(executor)
    if timeout_s is not None:
        assert limit_reward_calls(executor, timeout_s)
    return executor




def test_an_engine_stops_a_reward_that_never_returns(tmp_path, tokenizer, capsys):
    script, release = _never_returning(tmp_path)
    executor = _loud(script, timeout_s=1)
    t0 = time.monotonic()
    try:
        (failed,) = execute_prompts(executor, tokenizer, ["what is 2 + 2?"])
    finally:
        release.touch()
    assert time.monotonic() - t0 < 30
    assert isinstance(failed, RewardFunctionError), failed
    message = str(failed)
    assert f"reward_func in {script} on prompt 'what is 2 + 2?' (label '4')" in message, message
    assert "did not return within 1 s" in message and "--reward.timeout_s" in message, message
    assert f"the reward of {script} for prompt 'what is 2 + 2?' (label '4') raised RewardFunctionError" in \
        capsys.readouterr().err


def test_only_the_late_sample_fails(tmp_path, tokenizer):
    script = _script(tmp_path, "if 'slow' in prompts[0]:\n    time.sleep(3)\nreturn {'rewards': 1.0}\n")
    slow, fast = execute_prompts(_loud(script, timeout_s=1), tokenizer, ["a slow prompt", "a fast prompt"])
    assert isinstance(slow, RewardFunctionError) and "'a slow prompt'" in str(slow)
    assert fast["reward"] == 1.0


def test_a_call_waiting_for_its_turn_is_not_timed(tmp_path, tokenizer):
    """As many calls run at once as upstream ran (its default executor's threads); the limit is each call's own time:
    four rounds of 0.5 s calls take 2 s, past the 1.5 s limit, and none fails."""
    script = _script(tmp_path, """\
        with LOCK:
            RUNNING[0] += 1
            peak = max(RUNNING)
            RUNNING[1] = peak
        time.sleep(0.5)
        with LOCK:
            RUNNING[0] -= 1
        return {'rewards': 1.0, 'extra_logs': {'peak': peak}}
        """)
    script.write_text("import threading\nLOCK, RUNNING = threading.Lock(), [0, 0]\n" + script.read_text())
    threads = default_executor_threads()
    outputs = execute_prompts(_loud(script, timeout_s=1.5), tokenizer, [f"prompt {i}" for i in range(4 * threads)])
    assert [out["reward"] for out in outputs] == [1.0] * len(outputs), outputs
    assert max(out["extra_logs"]["peak"] for out in outputs) == threads


@pytest.mark.parametrize(("body", "expected"), [
    ("return {'rewards': [1.0, 2.0, 3.0]}", "returned 3 rewards for 1 query: {'rewards': [1.0, 2.0, 3.0]}"),
    ("return {'rewards': 'good'}", "returned rewards that are not numbers: {'rewards': 'good'}"),
    ("return [0.5]", "returned a list, not a dict with 'rewards': [0.5]"),
])
def test_an_engine_names_the_script_the_prompt_and_the_bad_result(tmp_path, tokenizer, body, expected):
    script = _script(tmp_path, body)
    (failed,) = execute_prompts(_loud(script), tokenizer, ["what is 2 + 2?"])
    assert isinstance(failed, RewardFunctionError), failed
    assert str(failed) == f"reward_func in {script} on prompt 'what is 2 + 2?' (label '4') {expected}"


def test_results_upstream_can_use_pass_unchanged(tmp_path, tokenizer):
    script = _script(tmp_path, "import torch\nreturn {'rewards': torch.tensor([0.5]), 'scores': 1, "
                               "'extra_logs': {'n': 2}}\n")
    (output,) = execute_prompts(_loud(script), tokenizer, ["what is 2 + 2?"])
    assert output["reward"].tolist() == [0.5] and output["scores"] == 1 and output["extra_logs"] == {"n": 2}


def test_the_limit_reaches_the_engines_before_the_first_rollout(monkeypatch, tmp_path):
    monkeypatch.setattr(ray, "get", lambda refs: refs)
    told = []
    engine = SimpleNamespace(set_reward_timeout=SimpleNamespace(remote=told.append))
    RewardLimitPart([engine, engine], 7.5).on_start(0)
    assert told == [7.5, 7.5]
    assert not limit_reward_calls(object(), 7.5)  # a user's agent executor: no reward_func of ours
    with pytest.raises(ValueError, match="> 0"):
        limit_reward_calls(_loud(_script(tmp_path, "return {'rewards': 1.0}\n")), 0)


def test_a_limit_too_large_to_wait_on_is_refused_naming_the_flag_and_the_range(valid_argv, capsys):
    """1e12 s overflowed inside the limit (threading's TIMEOUT_MAX) and was reported as the reward script's fault."""
    line = error_line(refused(valid_argv + ["--reward.timeout_s", "1e12"], capsys))
    assert line == f"--reward.timeout_s: must be at most {MAX_TIMEOUT_S:.0f} s (a week), got 1000000000000.0"


def test_the_largest_accepted_limit_is_one_every_wait_takes():
    import asyncio

    assert call_within(lambda x: x + 1, (1,), MAX_TIMEOUT_S) == 2
    assert asyncio.run(call_within_async(lambda x: x + 1, (1,), MAX_TIMEOUT_S)) == 2


# --- an HTTP reward server ------------------------------------------------------------------------------------


@pytest.fixture()
def reward_server():
    """A local reward server whose answer the test picks: `ok` (one reward), `hang` (never answers until the test
    ends), `error` (HTTP 500) or `bad` (three rewards for one query). Yields (url, set_mode, requests seen)."""
    import http.server
    import json
    import threading

    state = {"mode": "ok"}
    seen: list[dict] = []
    release = threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            seen.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            if state["mode"] == "hang":
                release.wait(120)
                return
            if state["mode"] == "error":
                self.send_error(500, "reward model crashed")
                return
            body = json.dumps({"rewards": [1.0] * (3 if state["mode"] == "bad" else 1)}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/get_reward", lambda mode: state.update(mode=mode), seen
    finally:
        release.set()
        server.shutdown()
        server.server_close()


def test_a_reward_server_is_asked_before_ray_as_the_engines_ask_it(valid_argv, reward_server):
    url, _, seen = reward_server
    train_ppo_ray.parse(with_value(valid_argv, "--reward.remote_url", url), cpu=True)
    # conftest's first record; no --data.label_key, so upstream's label is ''
    assert seen == [{"query": ["1 + 1?"], "prompts": ["1 + 1?"], "labels": [""]}]


@pytest.mark.parametrize("mode, expected", [
    ("hang", "did not return within 2 s (raise --reward.timeout_s if it needs longer)"),
    ("error", "answered HTTP 500 reward model crashed"),
    ("bad", "returned 3 rewards for 1 query"),
])
def test_a_reward_server_that_cannot_serve_is_refused_before_ray(valid_argv, reward_server, capsys, mode, expected):
    url, set_mode, _ = reward_server
    set_mode(mode)
    t0 = time.monotonic()
    line = error_line(refused(with_value(valid_argv, "--reward.remote_url", url) + ["--reward.timeout_s", "2"],
                              capsys))
    assert time.monotonic() - t0 < 30
    assert line.startswith(f"--reward.remote_url: the reward server {url} on prompt {PROMPT} (label '') "), line
    assert expected in line, line


def test_a_reward_server_nobody_runs_is_refused_naming_it(valid_argv, capsys):
    from _support import free_port

    url = f"http://127.0.0.1:{free_port()}/get_reward"
    line = error_line(refused(with_value(valid_argv, "--reward.remote_url", url), capsys))
    assert line.startswith(f"--reward.remote_url: reward server {url} cannot be reached: "), line
    assert line.endswith("start it, or check the URL")


def test_an_engine_stops_waiting_for_a_silent_server_at_the_limit(reward_server, tokenizer):
    """Upstream's own bound is 180 s a try and five tries: the rollout sat at 'Generate samples 0/4' for minutes."""
    url, set_mode, _ = reward_server
    set_mode("hang")
    executor = SingleTurnAgentExecutor(url)
    assert make_rewards_loud(executor) and limit_reward_calls(executor, 1)
    t0 = time.monotonic()
    (failed,) = execute_prompts(executor, tokenizer, ["what is 2 + 2?"])
    assert time.monotonic() - t0 < 20
    assert isinstance(failed, RewardFunctionError), failed
    assert str(failed).startswith(f"the reward server {url} on prompt ") and "did not return within 1 s" in str(failed)
