"""Run store writer side: metrics.jsonl appends and repair, config.json and the resume check, atomic writes."""

from __future__ import annotations

import argparse
import json
import types
import warnings

import numpy as np
import pytest
import torch

from openrlhf_tis.runs import OVERRIDE_FLAG, RunConfigMismatch, check_resume, load_metrics, read_run_config
from openrlhf_tis.runs.config import fingerprint, resolve_config
from openrlhf_tis.runs.layout import CONFIG_FILE, METRICS_FILE, RunStoreWarning, atomic_write, token_file
from openrlhf_tis.runs.store import RunWriter  # the trainer's import path must keep working

ORIGIN = {"versions": {"python": "3"}, "git": {"revision": "abc", "branch": "main", "dirty": False}, "time": "t"}


def _args(**overrides):
    values = {"actor.eps_clip": 0.2, "rollout.temperature": 1.0, "logger.run_dir": "runs/a", "ckpt.path": "c1",
              "data.prompt_dataset": "d.jsonl"}
    values.update(overrides)
    return argparse.Namespace(**values)


def test_metrics_one_line_per_step_scalars_only(tmp_path):
    writer = RunWriter(tmp_path)
    assert writer.append_metrics(1, {"loss": torch.tensor(0.5), "n": 3, "np": np.float32(2.0), "text": ["no"],
                                     "vec": torch.tensor([1.0, 3.0]), "nan": float("nan")})
    lines = (tmp_path / METRICS_FILE).read_text().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["step"] == 1 and record["loss"] == 0.5 and record["n"] == 3.0 and record["vec"] == 2.0
    assert "text" not in record and np.isnan(record["nan"]) and "wall_time" in record


def test_resume_skips_stored_steps_and_repairs_torn_line(tmp_path):
    writer = RunWriter(tmp_path)
    for step in (1, 2, 3):
        writer.append_metrics(step, {"x": step})
    with open(tmp_path / METRICS_FILE, "ab") as f:
        f.write(b'{"step": 4, "x": ')  # killed mid-line
    resumed = RunWriter(tmp_path)
    assert resumed.last_step == 3
    assert (tmp_path / METRICS_FILE).read_bytes().endswith(b"\n")
    assert not resumed.append_metrics(2, {"x": 99})  # redone step after a checkpoint: kept once
    assert resumed.append_metrics(4, {"x": 4})
    frame = load_metrics(tmp_path)
    assert frame["step"].tolist() == [1, 2, 3, 4] and frame["x"].tolist() == [1, 2, 3, 4]


def test_rewind_drops_later_steps_and_dumps(tmp_path):
    writer = RunWriter(tmp_path)
    for step in range(1, 6):
        writer.append_metrics(step, {"x": step})
        atomic_write(token_file(tmp_path, step), b"dump")
    assert writer.rewind(3) == 2
    assert load_metrics(tmp_path)["step"].tolist() == [1, 2, 3]
    assert sorted(p.name for p in (tmp_path / "tokens").iterdir()) == [f"step_00000{s}.parquet" for s in (1, 2, 3)]
    assert writer.append_metrics(4, {"x": 40}) and load_metrics(tmp_path)["x"].tolist() == [1, 2, 3, 40]


def test_atomic_write_keeps_old_file_on_error(tmp_path):
    path = tmp_path / "f.bin"
    atomic_write(path, b"old")

    def fail(f):
        f.write(b"partial")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        atomic_write(path, fail)
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]


def test_writer_removes_stale_temp_files(tmp_path):
    (tmp_path / "tokens").mkdir()
    stale = tmp_path / "tokens" / ".tmp-step_000001.parquet.xyz"
    stale.write_bytes(b"half")
    RunWriter(tmp_path)
    assert not stale.exists()


def test_resolve_config_flat_and_nested_agree():
    flat = argparse.Namespace(**{"actor.eps_clip": 0.2, "actor.lr": 1e-6, "seed": 1, "paths": ("a", "b")})
    nested = types.SimpleNamespace(actor=types.SimpleNamespace(eps_clip=0.2, lr=1e-6), seed=1, paths=("a", "b"))
    assert resolve_config(flat) == resolve_config(nested) == {
        "actor.eps_clip": 0.2, "actor.lr": 1e-6, "paths": ["a", "b"], "seed": 1}


def test_config_written_with_provenance(tmp_path):
    record = check_resume(tmp_path, _args(), origin=ORIGIN)
    stored = read_run_config(tmp_path)
    assert stored == json.loads(json.dumps(record))
    assert stored["config"]["actor.eps_clip"] == 0.2 and stored["git"]["revision"] == "abc"
    assert stored["fingerprint"] == fingerprint(resolve_config(_args()))


def test_resume_same_config_and_ignored_fields_accepted(tmp_path):
    check_resume(tmp_path, _args(), origin=ORIGIN)
    record = check_resume(tmp_path, _args(**{"logger.run_dir": "elsewhere", "ckpt.path": "c2"}), origin=ORIGIN)
    assert len(record["resumes"]) == 1 and record["resumes"][0]["changed"] == {}


def test_resume_with_different_config_refused_naming_dir_and_flag(tmp_path):
    check_resume(tmp_path, _args(), origin=ORIGIN)
    with pytest.raises(RunConfigMismatch) as err:
        check_resume(tmp_path, _args(**{"actor.eps_clip": 0.3}), origin=ORIGIN)
    message = str(err.value)
    assert str(tmp_path) in message and OVERRIDE_FLAG in message and "actor.eps_clip" in message
    assert read_run_config(tmp_path)["config"]["actor.eps_clip"] == 0.2  # untouched
    with pytest.raises(RunConfigMismatch):
        RunWriter(tmp_path, config=_args(**{"data.prompt_dataset": "other.jsonl"}), origin=ORIGIN)


@pytest.mark.parametrize("now, changed", [("off", {}), ("r3", {"vllm.routing_replay": [None, "r3"]})])
def test_a_run_recorded_before_a_flag_existed_resumes_at_the_flags_neutral_value(tmp_path, now, changed):
    check_resume(tmp_path, _args(), origin=ORIGIN)  # recorded without --vllm.routing_replay
    if changed:
        with pytest.raises(RunConfigMismatch, match="vllm.routing_replay"):
            check_resume(tmp_path, _args(**{"vllm.routing_replay": now}), origin=ORIGIN)
        return
    record = check_resume(tmp_path, _args(**{"vllm.routing_replay": now}), origin=ORIGIN)
    assert record["resumes"][-1]["changed"] == changed


def test_override_accepts_and_records_the_change(tmp_path):
    check_resume(tmp_path, _args(), origin=ORIGIN)
    with pytest.warns(UserWarning, match="changed config"):
        record = check_resume(tmp_path, _args(**{"actor.eps_clip": 0.3}), override=True, origin=ORIGIN)
    assert record["config"]["actor.eps_clip"] == 0.3
    assert record["resumes"][-1]["override"] and record["resumes"][-1]["changed"] == {"actor.eps_clip": [0.2, 0.3]}


def test_corrupt_config_named(tmp_path):
    (tmp_path / CONFIG_FILE).write_text("{not json")
    with pytest.raises(ValueError, match=CONFIG_FILE):
        read_run_config(tmp_path)


def test_load_metrics_reports_corrupt_and_torn_lines_and_reads_rest(tmp_path):
    (tmp_path / METRICS_FILE).write_bytes(
        b'{"step": 1, "x": 1}\n{"step": 2, "x"\n{"step": 3, "x": 3}\n\n{"step": 3, "x": 9}\n{"step": 4, "x')
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        frame = load_metrics(tmp_path)
    assert frame["step"].tolist() == [1, 3] and frame["x"].tolist() == [1, 3]
    messages = [str(w.message) for w in caught if issubclass(w.category, RunStoreWarning)]
    assert len(messages) == 3
    assert all(str(tmp_path / METRICS_FILE) in m for m in messages)
    assert any(":2: corrupt" in m for m in messages) and any("duplicate step 3" in m for m in messages)
    assert any("torn last line" in m for m in messages)


def test_atomic_write_mode_follows_umask(tmp_path):
    path = atomic_write(tmp_path / "f.json", b"{}")
    plain = tmp_path / "g.json"
    plain.write_bytes(b"{}")
    assert path.stat().st_mode & 0o777 == plain.stat().st_mode & 0o777
