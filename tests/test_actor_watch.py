"""An actor of the run dead of an error ends the driver in one line naming it (cli/actor_watch.py): upstream
waited on the dead vLLM engine's peers until the driver was killed (244 s in the report). The decision and the line
are checked on Ray's own death-cause messages, the wake-up of the main thread without Ray, and the whole path on a real
run whose engine's constructor raises (in the extended tier: `bash scripts/run_tests.sh extended`)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time

import pytest
from _support import processes_naming, train_argv
from ray.core.generated.common_pb2 import ActorDeathCause, ActorDiedErrorContext

from openrlhf_tis.cli.actor_watch import (
    WAKE_SIGNAL,
    ActorDeath,
    ActorWatch,
    death_in_error,
    failure_cause,
    first_failure,
    with_root_cause,
)
from openrlhf_tis.cli.stall import Stall
from openrlhf_tis.cli.train_ppo_ray import ACTOR_DIED_EXIT
from openrlhf_tis.demo.task import write_prompts

KV_ERROR = ("ValueError: Available memory on node 0 (5.12/7.76 GiB) on kv cache allocation is less than requested "
            "memory for kv (976562.50 GiB). Decrease --kv-cache-memory-bytes, VLLM_CPU_KVCACHE_SPACE, or reduce CPU "
            "memory used by other processes.")
# What Ray files for an actor whose constructor raised (Ray 2.55, an engine of a real run).
CREATION_FAILED = (
    "\x1b[36mray::PrecisionRolloutRayActor.__init__()\x1b[39m (pid=4242, ip=127.0.0.1, actor_id=ab12, "
    "repr=<openrlhf_tis.rollout.engine_actor.PrecisionRolloutRayActor object at 0x7f>)\n"
    '  File "/venv/lib/python3.11/site-packages/vllm/v1/worker/cpu_worker.py", line 219, in '
    "determine_available_memory\n    raise ValueError(\n" + KV_ERROR + "\n")
WORKER_DIED = ("The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit "
               "detail: Worker unexpectedly exits with a connection error code 2. End of file. There are some "
               "potential root causes. (1) The process is killed by SIGKILL by OOM killer due to high memory usage.")


def _creation_failed(text: str) -> ActorDeathCause:
    cause = ActorDeathCause()
    cause.creation_task_failure_context.formatted_exception_string = text
    return cause


def _died(reason: int, message: str = WORKER_DIED) -> ActorDeathCause:
    cause = ActorDeathCause()
    cause.actor_died_error_context.reason = reason
    cause.actor_died_error_context.error_message = message
    return cause


def _record(name: str, cause: ActorDeathCause, end: int, state: str = "DEAD", pid: int = 4242) -> dict:
    return {"ActorClassName": name, "Pid": pid, "State": state, "EndTime": end, "DeathCause": cause}


def test_a_constructor_that_raised_is_a_failure_named_by_its_exception_line():
    assert failure_cause(_creation_failed(CREATION_FAILED)) == KV_ERROR
    pydantic = ("ray::X.__init__() (pid=1)\n  File \"a.py\", line 1, in f\n"
                "pydantic_core._pydantic_core.ValidationError: 1 validation error for VllmConfig\n"
                "  Value error, max_model_len 99999 exceeds the model's 512 [type=value_error]\n")
    assert failure_cause(_creation_failed(pydantic)) == (
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for VllmConfig Value error, max_model_len "
        "99999 exceeds the model's 512 [type=value_error]")  # a message over several lines, on one
    assert failure_cause(_creation_failed("no exception line\nthe last one\n")) == "the last one"
    assert len(failure_cause(_creation_failed("ValueError: " + "x" * 5000))) == 600


def test_a_dead_worker_or_node_is_a_failure_and_a_death_on_purpose_is_not():
    assert failure_cause(_died(ActorDiedErrorContext.WORKER_DIED)) == (
        "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: "
        "Worker unexpectedly exits with a connection error code 2. End of file.")  # Ray's guesses dropped
    assert failure_cause(_died(ActorDiedErrorContext.NODE_DIED, "The node died.")) == "The node died."
    oom = ActorDeathCause()
    oom.oom_context.error_message = "Task was killed due to the node running low on memory.\nMemory on the node..."
    assert failure_cause(oom) == "Task was killed due to the node running low on memory. Memory on the node..."
    for reason in (ActorDiedErrorContext.RAY_KILL, ActorDiedErrorContext.OUT_OF_SCOPE,
                   ActorDiedErrorContext.OWNER_DIED, ActorDiedErrorContext.REF_DELETED):
        assert failure_cause(_died(reason, "ended")) is None, reason
    exit_actor = "Worker exit type: INTENDED_USER_EXIT Worker exit detail: Worker exits by an user request."
    assert failure_cause(_died(ActorDiedErrorContext.WORKER_DIED, exit_actor)) is None
    assert failure_cause(ActorDeathCause()) is None


def test_the_first_failure_is_the_earliest_death_of_an_error_and_its_line_names_the_actor():
    records = [
        _record("_TisPPOTrainer", _died(ActorDiedErrorContext.OUT_OF_SCOPE), end=1),
        _record("PolicyModelActor", _died(ActorDiedErrorContext.WORKER_DIED), end=30, pid=7),
        _record("PrecisionRolloutRayActor", _creation_failed(CREATION_FAILED), end=20),
        _record("ReferenceModelActor", _creation_failed(CREATION_FAILED), end=5, state="ALIVE"),
    ]
    death = first_failure(records)
    assert death == ActorDeath("PrecisionRolloutRayActor", 4242, KV_ERROR)
    assert str(death) == f"the Ray actor PrecisionRolloutRayActor (pid 4242) died: {KV_ERROR}"
    assert first_failure(records[:1]) is None and first_failure([]) is None


ENGINE_CORE_FAILED = "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"
# The end of the engine actor's worker log (Ray's worker-*-<pid>.err) in that run: vLLM's engine core process wrote
# its error there, then the actor's creation task failed with vLLM's pointer to it.
ENGINE_LOG = (
    "(EngineCore pid=17592) ERROR 11-28 02:18:01 [core.py:1510] " + KV_ERROR + "\n"
    "Process EngineCore:\nTraceback (most recent call last):\n"
    '  File "/venv/lib/python3.11/site-packages/vllm/v1/worker/cpu_worker.py", line 219, in '
    "determine_available_memory\n    raise ValueError(\n" + KV_ERROR + "\n"
    "Exception raised in creation task: The actor died because of an error raised in its creation task, "
    "\x1b[36mray::PrecisionRolloutRayActor.__init__()\x1b[39m (pid=16774, ip=192.0.2.2)\n"
    '  File "/venv/lib/python3.11/site-packages/vllm/v1/engine/utils.py", line 1431, in wait_for_engine_startup\n'
    "    raise RuntimeError(\n" + ENGINE_CORE_FAILED + "\n")


def test_an_engine_core_that_failed_to_start_is_named_by_the_root_cause_in_the_actors_log():
    death = ActorDeath("PrecisionRolloutRayActor", 16774, ENGINE_CORE_FAILED)
    assert with_root_cause(death, ENGINE_LOG) == ActorDeath("PrecisionRolloutRayActor", 16774,
                                                            KV_ERROR + " (in its vLLM engine core process)")
    assert with_root_cause(death, "") == death  # the log is on another node
    assert with_root_cause(death, "killed\n" + ENGINE_CORE_FAILED) == death  # no error before vLLM's own
    other = ActorDeath("PolicyModelActor", 7, "ValueError: bad")
    assert with_root_cause(other, ENGINE_LOG) == other  # the actor's own error is the cause


def _spin(seconds: float) -> None:
    """The main thread busy in Python (as in ray.get's loop, which checks for signals every second)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.01)


def test_the_watch_interrupts_the_main_thread_at_a_failure_and_stops_cleanly():
    before = signal.getsignal(WAKE_SIGNAL)
    reads = []

    def read():
        reads.append(time.monotonic())
        return [_record("PrecisionRolloutRayActor", _creation_failed(CREATION_FAILED), end=1)] if len(reads) > 2 else []

    watch = ActorWatch(read, log_tail=lambda pid: ENGINE_LOG, poll_s=0.05).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            _spin(10)
    finally:
        watch.stop()
    assert watch.woke_main and watch.death.cause == KV_ERROR and len(reads) == 3
    assert signal.getsignal(WAKE_SIGNAL) == before
    watch.stop()  # again: nothing to do

    quiet = ActorWatch(lambda: [_record("A", _died(ActorDiedErrorContext.RAY_KILL), end=1)], poll_s=0.05).start()
    try:
        import _thread

        _thread.interrupt_main(WAKE_SIGNAL)  # the signal from elsewhere, with no failure seen: ignored
        _spin(0.5)
    finally:
        quiet.stop()
    assert not quiet.woke_main and quiet.death is None and signal.getsignal(WAKE_SIGNAL) == before


def test_the_watch_interrupts_the_main_thread_at_a_stall_when_no_actor_died():
    stall = Stall("generate samples", 31.0, ("PrecisionRolloutRayActor (pid 9)",))
    checks = []

    def check():
        checks.append(1)
        return stall if len(checks) > 1 else None

    watch = ActorWatch(lambda: [], poll_s=0.05, stall_check=check).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            _spin(10)
    finally:
        watch.stop()
    assert watch.woke_main and watch.stalled == stall and watch.death is None and len(checks) == 2


# Ray's words for an actor killed by ray.kill, and for one whose process was SIGKILLed (Ray 2.55, seen in the
# controller's ray.get on a real engine).
RAY_KILLED = "The actor is dead because it was killed by `ray.kill`."
SIGKILLED = ("The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit "
             "detail: Worker unexpectedly exits with a connection error code 2. End of file. Some common causes "
             "include: (1) the process was killed by the OOM killer due to high memory usage, (2) ray stop --force was "
             "called, or (3) the worker crashed unexpectedly due to SIGSEGV or another unexpected error.")


def _in_controller(cause: BaseException, pickled: bool = False):
    """What the driver's ray.get on the controller's fit raises when its own ray.get raised `cause`, built with Ray's
    own classes as Ray builds it. An ActorDiedError does not pickle here (Ray keeps its text in a RayError instead);
    it did in a real run's controller (`pickled`: it is kept as the cause)."""
    from ray.exceptions import RayTaskError

    trace = (f"Traceback (most recent call last):\n  File \"ppo_trainer.py\", line 1, in fit\n"
             f"{type(cause).__module__}.{type(cause).__name__}: {cause}")
    err = RayTaskError("fit", trace, cause, proctitle="ray::_TisPPOTrainer.fit", pid=300, ip="127.0.0.1")
    if pickled:
        err.cause = cause
    return err.as_instanceof_cause()


def _actor_died(message: str, pid: int = 4242):
    from ray.exceptions import ActorDiedError

    return ActorDiedError(ActorDiedErrorContext(class_name="PrecisionRolloutRayActor", actor_id=bytes(16), pid=pid,
                                                node_ip_address="127.0.0.1", ray_namespace="ns", error_message=message))


@pytest.mark.parametrize("pickled", [False, True])
def test_a_death_upstream_saw_first_is_named_from_rays_error(pickled):
    assert death_in_error(_in_controller(_actor_died(RAY_KILLED), pickled)) == ActorDeath("PrecisionRolloutRayActor",
                                                                                          4242, RAY_KILLED)
    assert death_in_error(_in_controller(_actor_died(SIGKILLED), pickled)) == ActorDeath(
        "PrecisionRolloutRayActor", 4242, "The actor is dead because its worker process has died. Worker exit type: "
        "SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits with a connection error code 2. End of file.")
    assert death_in_error(_actor_died(RAY_KILLED, pid=0)).pid == 0  # Ray omits a pid it does not know


def test_an_engine_whose_engine_core_died_is_named_and_any_other_error_keeps_its_traceback():
    from ray.exceptions import RayTaskError
    from vllm.v1.engine.exceptions import EngineDeadError

    dead = EngineDeadError()
    in_engine = RayTaskError("generate_responses", "Traceback (most recent call last):\n  File \"core_client.py\", "
                             f"line 1, in get_output\nvllm.v1.engine.exceptions.EngineDeadError: {dead}", dead,
                             proctitle="ray::PrecisionRolloutRayActor.generate_responses", pid=77, ip="127.0.0.1")
    death = death_in_error(_in_controller(in_engine.as_instanceof_cause()))
    assert death == ActorDeath("PrecisionRolloutRayActor", 77, f"vllm.v1.engine.exceptions.EngineDeadError: {dead}",
                               what="lost its vLLM engine core process")
    assert str(death).startswith("the Ray actor PrecisionRolloutRayActor (pid 77) lost its vLLM engine core process: ")
    assert death_in_error(_in_controller(ValueError("a bug in the controller"))) is None
    assert death_in_error(ValueError("not Ray's")) is None


# Ray's start, then the engine's until its KV cache is sized: 190-255 s on 2 cores busy with another run (load 7-11),
# the driver ending ~13 s after the engine core's error. Without the watch it was still waiting 6 min after it.
TIMEOUT_S = 420


def _run(argv: list[str], cwd, env: dict[str, str]) -> tuple[int, str, float]:
    """The CLI's exit code, stderr and seconds; a driver still waiting after TIMEOUT_S fails the test."""
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    start = time.monotonic()
    try:
        _, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        pytest.fail(f"the driver was still waiting after {TIMEOUT_S} s:\n{stderr[-4000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, stderr, time.monotonic() - start


@pytest.mark.e2e  # a real run: Ray, DeepSpeed, a vLLM engine
@pytest.mark.extended  # a start of a run that only fails: the decision and the line are checked above without one
def test_an_engine_whose_constructor_raised_ends_the_driver_in_one_line(tiny_model_dir, tmp_path):
    """vLLM-CPU raises a ValueError in the engine's constructor when its KV cache (VLLM_CPU_KVCACHE_SPACE, GiB) is
    larger than the node's free memory: the report's failure, made certain. Upstream's driver waited without end."""
    write_prompts(tmp_path / "prompts.jsonl", 4)
    argv = train_argv(tiny_model_dir, tmp_path, 1, 1, load=False)
    ray_tmp = tempfile.mkdtemp(prefix="rw", dir="/tmp")  # short (Ray's socket paths), and ours to check afterwards
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    env.update(VLLM_CPU_KVCACHE_SPACE="1000000", RAY_TMPDIR=ray_tmp)  # a million GiB
    try:
        code, stderr, seconds = _run(argv, tmp_path, env)
        lines = stderr.strip().splitlines()
        assert code == ACTOR_DIED_EXIT, stderr[-6000:]
        expected = re.compile(r"openrlhf_tis\.cli\.train_ppo_ray: error: the Ray actor PrecisionRolloutRayActor "
                              r"\(pid \d+\) died: ValueError: Available memory on node .* VLLM_CPU_KVCACHE_SPACE, .* "
                              r"\(in its vLLM engine core process\); kept no step and no checkpoint; start again with "
                              r"the same command")
        assert expected.fullmatch(lines[-1]), stderr[-6000:]
        # the driver's own console holds no traceback and no KeyboardInterrupt (Ray's copy of the engine's log may)
        assert not any(line.startswith("Traceback") or "KeyboardInterrupt" in line for line in lines), stderr[-6000:]
        deadline = time.monotonic() + 30  # the session's watchdog sweeps what Ray's shutdown left (cli/lifetime.py)
        while processes_naming(ray_tmp) and time.monotonic() < deadline:
            time.sleep(1)
        assert processes_naming(ray_tmp) == {}
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    print(f"stopped after {seconds:.1f} s: {lines[-1]}")
