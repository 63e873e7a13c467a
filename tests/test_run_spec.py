"""The run spec (openrlhf_tis/run_spec): resolved once by the driver, applied in one place, read by every process.

The pin: for a handful of flag sets (tests/run_spec_cases.py), what upstream receives is exactly what it received
before the spec existed (tests/data/run_spec_pin.json), the spec's correction and device being the ones the old
namespace carried; and the spec's other parts say what the flags asked, with every `auto` decided.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
from pathlib import Path

import pytest
from run_spec_cases import CASES, PIN, resolve_cases

from openrlhf_tis.correction import preset
from openrlhf_tis.run_spec import SPEC_DEST, ClusterPlan, DumpPlan, RewardPlan, RolloutPlan, RunSpec, SyncPlan, run_spec
from openrlhf_tis.runs.config import (
    ADDED_LATER,
    LEGACY_CORRECTION_KEY,
    RESUME_IGNORED,
    RunConfigMismatch,
    check_resume,
    fingerprint,
    read_run_config,
    resolve_config,
)

OLD_ONLY = ("algo.correction.resolved", "cluster.device", "cluster.resources")  # moved into the spec
STARTED = "logger.wandb.run_name"  # upstream's default is the start time


@pytest.fixture(scope="module")
def resolved() -> dict:
    return resolve_cases(list(CASES))


def _spec_part(flat: dict, part: str) -> dict:
    prefix = f"{SPEC_DEST}.{part}."
    return {k[len(prefix):]: v for k, v in flat.items() if k.startswith(prefix)}


@pytest.mark.parametrize("name", list(CASES))
def test_upstream_receives_what_it_did_before_the_spec(resolved, name):
    old, new = json.loads(PIN.read_text())[name], resolved[name]
    upstream_sees = {k: v for k, v in new.items() if not k.startswith(SPEC_DEST + ".") and k != STARTED}
    assert upstream_sees.pop("cluster.device") == "auto"  # the flag keeps what was asked; the decision is the spec's
    assert {k: upstream_sees.pop(k) for k in ADDED_LATER} == ADDED_LATER  # flags added since: at what the pin did
    assert upstream_sees == {k: v for k, v in old.items() if k not in (*OLD_ONLY, STARTED)}
    assert _spec_part(new, "correction") == json.loads(old["algo.correction.resolved"])  # as the config records it
    assert _spec_part(new, "cluster")["device"] == old["cluster.device"]
    assert _spec_part(new, "cluster")["resources"] == old["cluster.resources"]


def test_the_spec_holds_each_decision(resolved):
    dumps = _spec_part(resolved["cpu_tis_sync_every_dumps"], "dumps")
    sync = _spec_part(resolved["cpu_tis_sync_every_dumps"], "sync")
    assert (dumps, sync) == ({"steps": 2, "samples": 3}, {"every": 4, "check_steps": 1, "check_tolerance": 0.5})
    cpu = dict(map(tuple, _spec_part(resolved["cpu_tis_sync_every_dumps"], "cluster")["cpu_defaults"]))
    assert "ds.attn_implementation" not in cpu and cpu["vllm.sync_backend"] == "gloo"  # the user's eager stays
    int8 = _spec_part(resolved["cpu_int8_icepop_overrides"], "rollout")
    assert (int8["precision"], int8["weight_bits"], int8["scales"], int8["fp8_block"]) == ("int8", 6, "frozen", None)
    assert _spec_part(resolved["cpu_int8_icepop_overrides"], "correction")["upper"] == 3.0
    fp8 = _spec_part(resolved["cuda_fp8_seq_tis"], "rollout")
    assert (fp8["precision"], fp8["fp8_block"], fp8["weight_bits"]) == ("fp8", [128, 128], None)
    assert _spec_part(resolved["cuda_fp8_seq_tis"], "cluster")["cpu_defaults"] == []
    assert resolved["cpu_defaults"][f"{SPEC_DEST}.run_dir"] == resolved["cpu_defaults"]["logger.run_dir"] == \
        "/runs/pinned"  # absolute already: as given
    reward = _spec_part(resolved["cpu_defaults"], "reward")
    assert reward["nonfinite"] == "fail" and reward["timeout_s"] > 0  # the flags' defaults, decided once
    assert _spec_part(resolved["cpu_defaults"], "staleness") == {"max_lag": None}


@pytest.mark.parametrize("name", ["cpu_int8_icepop_overrides", "cpu_upstream_seq_flags"])
def test_a_run_recorded_before_the_spec_resumes_and_a_changed_correction_is_still_refused(resolved, name, tmp_path):
    old, new = json.loads(PIN.read_text())[name], resolved[name]
    check_resume(tmp_path, old, origin={})  # config.json as the version before the spec wrote it
    assert LEGACY_CORRECTION_KEY in read_run_config(tmp_path)["config"]
    changed = dict(new, **{"fork.spec.correction.upper": 9.0})
    with pytest.raises(RunConfigMismatch, match=r"1 field\(s\) differ:\n  fork\.spec\.correction\.upper"):
        check_resume(tmp_path, changed, origin={})  # the legacy record's correction is still compared
    check_resume(tmp_path, new, origin={})  # the same run resumed by this version: accepted
    assert read_run_config(tmp_path)["resumes"][-1]["changed"] == {}


def test_resolving_changes_nothing_and_applying_is_the_one_writer(monkeypatch):
    from openrlhf_tis.cli import resolve as resolve_module

    args = argparse.Namespace(**{"cluster.device": "auto", "algo.advantage.is_correction_level": "off",
                                 "vllm.num_engines": 1, "ds.attn_implementation": "flash_attention_2",
                                 "logger.run_dir": "runs/x"})
    spec = RunSpec(ClusterPlan("cpu", "a test", (("ds.attn_implementation", "sdpa"),)), preset("tis"),
                   run_dir="/abs/runs/x")
    resolve_module.apply_spec(args, spec)
    assert getattr(args, "ds.attn_implementation") == "sdpa" and run_spec(args) is spec
    assert getattr(args, "logger.run_dir") == "/abs/runs/x"
    resolve_module.apply_run_id(args, "0123abcd")
    assert getattr(args, "logger.run_id") == "0123abcd"  # what the actors stamp on their checkpoints
    assert getattr(args, "algo.advantage.is_correction_level") == "token"  # vLLM returns the rollout log-probs
    hierarchized = argparse.Namespace(fork=argparse.Namespace(spec=spec))  # as upstream hands it to its actors
    assert run_spec(hierarchized) is spec
    with pytest.raises(RuntimeError, match="no run spec"):
        run_spec(argparse.Namespace())


def test_the_spec_is_frozen_and_recorded_field_by_field():
    spec = RunSpec(ClusterPlan("cpu", "a test"), preset("icepop"), RolloutPlan("int8", weight_bits=7), SyncPlan(4),
                   DumpPlan(2, 3))
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.sync = SyncPlan()  # type: ignore[misc]
    flat = resolve_config({SPEC_DEST: spec, "train.seed": 1})
    assert flat["fork.spec.rollout.weight_bits"] == 7 and flat["fork.spec.correction.level"] == spec.correction.level
    assert flat["fork.spec.sync.every"] == 4 and flat["fork.spec.dumps.samples"] == 3
    # what a resume may change freely (where the run computes, how often it checks and dumps) is not its identity
    moved = dataclasses.replace(spec, cluster=ClusterPlan("cuda", "elsewhere"), sync=SyncPlan(4, 0, 2.0),
                                dumps=DumpPlan(0, 0), reward=RewardPlan(3600.0, "drop"), run_dir="/moved/run")
    assert fingerprint(flat, RESUME_IGNORED) == fingerprint(resolve_config({SPEC_DEST: moved, "train.seed": 1}),
                                                           RESUME_IGNORED)
    retrained = dataclasses.replace(spec, rollout=RolloutPlan("int8", weight_bits=6))
    assert fingerprint(flat, RESUME_IGNORED) != fingerprint(resolve_config({SPEC_DEST: retrained, "train.seed": 1}),
                                                           RESUME_IGNORED)



def _namespace_writes(source: str) -> list[int]:
    """Lines of `source` that write an attribute of a namespace named `args`, the object upstream receives
    (`setattr(args, ...)`, `args.x = ...`, `self.args.x = ...`, `vars(args)[...] = ...`, `vars(args).update(...)`)."""

    def is_args(node: ast.AST) -> bool:
        return (isinstance(node, ast.Name) and node.id == "args") or (
            isinstance(node, ast.Attribute) and node.attr == "args")

    def is_vars_args(node: ast.AST) -> bool:
        return isinstance(node, ast.Call) and getattr(node.func, "id", None) == "vars" and bool(node.args) and \
            is_args(node.args[0])

    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and node.args and (
                (getattr(node.func, "id", None) == "setattr" and is_args(node.args[0]))
                or (isinstance(node.func, ast.Attribute) and node.func.attr == "update"
                    and is_vars_args(node.func.value))):
            lines.append(node.lineno)
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any((isinstance(t, ast.Attribute) and is_args(t.value))
                   or (isinstance(t, ast.Subscript) and is_vars_args(t.value)) for t in targets):
                lines.append(node.lineno)
    return sorted(lines)


def test_only_cli_resolve_writes_upstreams_namespace():
    """The flags become what upstream receives in one place (cli/resolve.py: apply_spec, apply_run_id); a write
    anywhere else would be a decision the spec does not carry."""
    assert _namespace_writes("setattr(args, 'a', 1)\nself.args.b = 2\nvars(args)['c'] = 3\nx.y = 4\n"
                             "vars(args).update(d)\nsetattr(x, 'a', 1)\n") == [1, 2, 3, 5]  # guards the test
    package = Path(__file__).resolve().parents[1] / "openrlhf_tis"
    writers = {str(path.relative_to(package)): lines for path in sorted(package.rglob("*.py"))
               if (lines := _namespace_writes(path.read_text(encoding="utf-8")))}
    assert set(writers) == {"cli/resolve.py"}, writers
