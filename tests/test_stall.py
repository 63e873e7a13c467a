"""The stall bound (trainer/stage_board.py, cli/stall.py): what the controller publishes, how the driver judges it on
its own clock, the line it ends with, and the flag refused before Ray starts. Every case is worked out by hand on a
fake clock; the whole path on a real run is tests/test_e2e_stops.py."""

from __future__ import annotations

import math

import pytest

from openrlhf_tis.cli.stall import (
    DEFAULT_STALL_TIMEOUT_S,
    FLAG,
    Stall,
    StallCheck,
    StallJudge,
    check_stall_timeout,
    kill_stalled,
)
from openrlhf_tis.errors import UsageError
from openrlhf_tis.trainer.stage_board import GENERATE, SYNC, TRAIN, StageBoard, StageRecord


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_board_publishes_each_stage_change_at_once_and_progress_at_most_once_a_second():
    clock, published = Clock(), []
    board = StageBoard(published.append, clock)
    with board.stage(GENERATE, ("e1",)):  # count 1 at t=0
        clock.now = 0.4
        board.progress()  # count 2: 0.4 s since the last record, not published
        clock.now = 0.99
        board.progress()  # count 3: not published
        clock.now = 1.0
        board.progress()  # count 4: 1 s since t=0, published
        clock.now = 1.5
        with board.stage(TRAIN, ("p1", "p2")):  # count 5
            pass  # count 6: back in GENERATE
        clock.now = 2.0
        board.progress()  # count 7: 0.5 s since the record at t=1.5, not published
    assert published == [StageRecord(GENERATE, ("e1",), 1), StageRecord(GENERATE, ("e1",), 4),
                         StageRecord(TRAIN, ("p1", "p2"), 5), StageRecord(GENERATE, ("e1",), 6),
                         StageRecord(None, (), 8)]  # leaving the loop: no stage, never bounded
    assert all(StageRecord.decode(record.encode()) == record for record in published)


def test_the_board_leaves_a_stage_when_its_body_raises():
    published = []
    board = StageBoard(published.append, Clock())
    with pytest.raises(ValueError), board.stage(SYNC, ("p1",)):
        raise ValueError("the sync failed")
    assert published[-1] == StageRecord(None, (), 2)


def test_a_stage_is_stalled_once_neither_it_nor_its_count_moved_for_the_bound():
    judge = StallJudge(10.0)
    a = StageRecord(GENERATE, ("e1",), 3)
    assert judge.observe(None, 0.0) is None  # nothing published yet: start-up is not bounded
    assert judge.observe(a, 5.0) is None  # first seen at t=5
    assert judge.observe(a, 14.9) is None  # 9.9 s
    assert judge.observe(a, 15.0) == a and judge.stalled_for(15.0) == 10.0
    moved = StageRecord(GENERATE, ("e1",), 4)  # a finished response
    assert judge.observe(moved, 16.0) is None
    assert judge.observe(moved, 25.9) is None and judge.observe(moved, 26.0) == moved
    other = StageRecord(TRAIN, ("p1",), 4)  # a new stage with the same count still moves
    assert judge.observe(other, 27.0) is None and judge.observe(other, 36.9) is None
    done = StageRecord(None, (), 9)
    assert judge.observe(done, 40.0) is None and judge.observe(done, 4000.0) is None  # outside the loop: never


def test_a_stall_names_its_stage_and_the_class_and_pid_of_each_actor_it_waits_on():
    clock = Clock()
    records = iter([StageRecord(SYNC, ("aa", "bb", "cc"), 7)] * 3)
    table = {"aa": {"ActorClassName": "_CorrectionPolicyModelActor", "Pid": 11},
             "bb": {"ActorClassName": "PrecisionRolloutRayActor", "Pid": 22}}
    check = StallCheck(60.0, read=lambda: next(records), actors=lambda: table, clock=clock)
    assert check() is None  # t=0: first seen
    clock.now = 59.0
    assert check() is None
    clock.now = 61.5
    stall = check()
    assert stall == Stall(SYNC, 61.5, ("_CorrectionPolicyModelActor (pid 11)", "PrecisionRolloutRayActor (pid 22)",
                                       "actor cc"), ("aa", "bb", "cc"))  # cc: an actor the GCS no longer lists
    assert str(stall) == ("stalled: sync weights made no progress for 62 s, waiting on _CorrectionPolicyModelActor "
                          "(pid 11), PrecisionRolloutRayActor (pid 22), actor cc; raise --train.stall_timeout_s or set "
                          "it to 0 to disable the bound")


def test_the_stalled_actors_on_this_node_get_sigkill_and_the_others_ray_kill():
    stall = Stall(SYNC, 40.0, ("a (pid 1)", "b (pid 2)", "c (pid 3)", "actor d"), ("a", "b", "c", "d"))
    table = {key: {"Pid": pid, "Address": {"NodeID": node}}
             for key, pid, node in (("a", 1, "here"), ("b", 2, "there"), ("c", 3, "here"), ("x", 9, "here"))}
    signalled, ray_killed = [], []
    kill_stalled(stall, table, "here", signalled.append, ray_killed.append)
    assert signalled == [1, 3] and ray_killed == ["b"]  # d: gone from the GCS; x: not waited on


@pytest.mark.parametrize("seconds", [-1.0, -1e-9, math.nan, math.inf])
def test_a_bound_that_is_not_a_finite_number_of_seconds_at_least_zero_is_refused(seconds):
    assert "must be a finite number of seconds >= 0" in check_stall_timeout(seconds)


@pytest.mark.parametrize("seconds", [0.0, 0.5, DEFAULT_STALL_TIMEOUT_S])
def test_zero_and_positive_bounds_are_accepted(seconds):
    assert check_stall_timeout(seconds) is None


def test_the_cli_refuses_a_negative_bound_before_ray_naming_the_flag(valid_argv):
    import ray

    from openrlhf_tis.cli import train_ppo_ray

    with pytest.raises(UsageError) as refusal:
        train_ppo_ray.parse([*valid_argv, FLAG, "-5"], cpu=True)
    assert str(refusal.value).startswith(FLAG) and "got -5.0" in str(refusal.value)
    assert not ray.is_initialized()
