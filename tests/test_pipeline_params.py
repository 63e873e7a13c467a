"""Notebook parameters, grid files and the training command a notebook builds (no kernel, no Ray)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import nbformat
import pytest

from openrlhf_tis.params import ParameterError, ParamObject, param, positive
from openrlhf_tis.pipeline.execute import NOTEBOOKS
from openrlhf_tis.pipeline.notebooks import NOTEBOOK_SOURCES
from openrlhf_tis.pipeline.sweep import Cell, load_grid
from openrlhf_tis.pipeline.train import check_training_command, resolve_prompts
from openrlhf_tis.pipeline.train_params import TrainParams


@dataclass(frozen=True)
class Spec(ParamObject):
    steps: int = param(2, "steps", (int,), check=positive, flag="--steps")
    mode: str = param("a", "mode", (str,), ("a", "b"))
    options: dict = param({}, "options", (dict,), flag="--opt.")
    extra: list = param([], "extra", (list,))


def test_defaults_are_filled_and_given_values_kept():
    assert Spec.checked({"mode": "b"}) == Spec(steps=2, mode="b", options={}, extra=[])
    assert Spec.checked({"mode": "b"}).values() == {"steps": 2, "mode": "b", "options": {}, "extra": []}


def test_list_and_dict_defaults_are_never_shared_between_objects():
    first, second = Spec(), Spec.checked({})
    first.options["key"] = 1
    first.extra.append("--x")
    assert second.options == {} and second.extra == [] and Spec().options == {} and Spec().extra == []


def test_flags_come_in_field_order_and_as_flags_replaces_values():
    spec = Spec(steps=3, options={"a": 1, "b": "x"})
    assert spec.flag_argv() == ["--steps", "3", "--opt.a", "1", "--opt.b", "x"]
    assert spec.flag_argv(steps=None) == ["--opt.a", "1", "--opt.b", "x"]  # None leaves the flag out
    assert spec.flag_argv(steps="7", options={}) == ["--steps", "7"]
    with pytest.raises(TypeError, match="no parameters \\['stepz'\\]"):
        spec.flag_argv(stepz=1)


@pytest.mark.parametrize("values, fault", [
    ({"stepz": 3}, "unknown parameter 'stepz'"),
    ({"steps": 0}, "steps = 0: must be > 0"),
    ({"steps": "3"}, "steps = '3': must be int, got str"),
    ({"steps": True}, "must be int, got bool"),  # bool is an int subclass; a flag is never a count
    ({"mode": "c"}, "must be one of ['a', 'b']"),
])
def test_every_fault_is_named_and_the_accepted_list_shown(values, fault):
    with pytest.raises(ParameterError) as err:
        Spec.checked(values, where="here")
    text = str(err.value)
    assert text.startswith("here: ") and fault in text
    assert "steps = 2  # steps" in text and "mode = 'a'  # mode" in text and "extra = []  # extra" in text


@pytest.mark.parametrize("name, typed, expected", [
    ("lr", "1", 1.0),  # papermill -p lr 1 gives an int: a float parameter takes it exactly
    ("int8_weight_bits", "6", "6"),  # ... and a string parameter its digits
    ("refresh_seconds", "3", 3),  # int is one of its types: kept as it is
    ("lr", "2e-5", 2e-5),
])
def test_values_typed_by_papermill_are_taken_when_they_convert_without_loss(name, typed, expected):
    from papermill.cli import _resolve_type  # how `papermill -p NAME VALUE` types VALUE

    value = getattr(TrainParams.checked({name: _resolve_type(typed)}), name)
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize("name, value, fault", [
    ("lr", 2**53 + 1, "must be float, got int"),  # no float holds it exactly
    ("lr", True, "must be float, got bool"),
    ("steps", 2.0, "must be int, got float"),  # a float is never taken for a count
    ("int8_weight_bits", 6.0, "--vllm.int8_weight_bits: invalid choice: 6.0"),
    ("int8_weight_bits", -3, "--vllm.int8_weight_bits: invalid choice: '-3'"),  # the CLI's words
    ("int8_weight_bits", 3, "--vllm.int8_weight_bits: invalid choice: '3'"),
    ("correction_options", {"upper": "3"}, "--algo.correction.upper takes a float, got '3'"),
])
def test_values_that_would_change_in_conversion_are_still_refused(name, value, fault):
    with pytest.raises(ParameterError, match=fault):
        TrainParams.checked({name: value})


def test_from_notebook_reads_plain_values_only_and_refuses_injected_unknowns():
    import os

    namespace = {"steps": 3, "os": os, "In": [], "_": 1, "TrainParams": TrainParams, "display": print}
    defaults = {k: v for k, v in TrainParams().values().items() if k != "steps"}
    assert TrainParams.from_notebook({**namespace, **defaults}, "train") == TrainParams(steps=3)
    with pytest.raises(ParameterError, match="train.ipynb parameters: unknown parameter 'stpes'"):
        TrainParams.from_notebook({"stpes": 3}, "train")


def test_committed_notebooks_are_the_generated_ones():
    """The parameters cell comes from the spec: a drifted notebook would accept names the checks refuse."""
    for name, build in NOTEBOOK_SOURCES.items():
        committed = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
        assert committed == build(), f"notebooks/{name}.ipynb is stale: python -m openrlhf_tis.pipeline.notebooks"
        tagged = [c for c in committed.cells if "parameters" in c.metadata.get("tags", [])]
        assert len(tagged) == 1 and not any(c.get("outputs") for c in committed.cells if c.cell_type == "code")


@pytest.mark.parametrize("name", sorted(NOTEBOOK_SOURCES))
def test_each_notebook_checks_its_parameters_against_its_own_spec(name, tmp_path, monkeypatch):
    """Run a notebook's parameters cell and check cell (no kernel): the check accepts every default, so it
    imported the spec the parameters cell was generated from, and refuses a name that spec lacks."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sweep.toml").write_text("[grid]\nseed = [1]\n")  # the sweep's default grid file
    cells = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4).cells
    parameters, check = cells[1].source, cells[2].source
    defaults = {}
    exec(parameters, {}, defaults)
    namespace: dict = {}
    exec(parameters + "\n" + check, namespace)
    assert namespace["params"].values() == defaults
    with pytest.raises(ParameterError, match=f"{name}.ipynb parameters: unknown parameter 'not_a_parameter'"):
        exec(parameters + "\nnot_a_parameter = 1\n" + check, {})


def _grid(tmp_path, text: str, suffix: str = ".toml"):
    path = tmp_path / f"grid{suffix}"
    path.write_text(text)
    return path


def test_grid_is_the_cross_product_of_its_lists_over_the_base(tmp_path):
    grid = _grid(tmp_path, '[base]\nsteps = 3\n[grid]\ncorrection = ["off", "tis"]\nseed = [1, 2, 3]\n')
    cells = load_grid(grid)
    assert [c.name for c in cells][:2] == ["correction=off,seed=1", "correction=off,seed=2"]
    assert len(cells) == 6 and all(c.params["steps"] == 3 for c in cells)
    assert {(c.params["correction"], c.params["seed"]) for c in cells} == {(a, b) for a in ("off", "tis")
                                                                           for b in (1, 2, 3)}
    assert len({c.slug for c in cells}) == 6


def test_a_list_of_grids_runs_the_union_of_their_products_once_each(tmp_path):
    grid = _grid(tmp_path, '[base]\nsteps = 3\n'
                 '[[grid]]\nrollout_precision = ["fp32"]\ncorrection = ["off"]\nseed = [1, 2]\n'
                 '[[grid]]\nrollout_precision = ["fp32", "int8"]\ncorrection = ["off", "tis"]\nseed = [1]\n')
    cells = load_grid(grid)
    assert [(c.params["rollout_precision"], c.params["correction"], c.params["seed"]) for c in cells] == [
        ("fp32", "off", 1), ("fp32", "off", 2), ("fp32", "tis", 1), ("int8", "off", 1), ("int8", "tis", 1)]
    assert all(c.params["steps"] == 3 for c in cells) and len({c.name for c in cells}) == 5


def test_json_grids_work_too(tmp_path):
    grid = _grid(tmp_path, json.dumps({"grid": {"extra_args": [[], ["--vllm.fp32_lm_head"]]}}), ".json")
    assert [c.params["extra_args"] for c in load_grid(grid)] == [[], ["--vllm.fp32_lm_head"]]


def test_cells_equal_by_value_run_once_under_the_first_name(tmp_path, capsys):
    """`lr = [1, 1.0]` is one learning rate: one cell, and the console says which spelling was dropped."""
    grid = _grid(tmp_path, '[grid]\nlr = [1, 1.0, 2]\nseed = [1, 2]\n')
    assert [c.name for c in load_grid(grid)] == ["lr=1,seed=1", "lr=1,seed=2", "lr=2,seed=1", "lr=2,seed=2"]
    err = capsys.readouterr().err
    assert "cell lr=1.0,seed=1 is cell lr=1,seed=1 (the same values): run once" in err
    assert "cell lr=1.0,seed=2 is cell lr=1,seed=2" in err


def test_a_grid_too_large_is_refused_at_once_with_its_size(tmp_path):
    axes = "\n".join(f"a{i} = [{', '.join(str(j) for j in range(10))}]" for i in range(6))
    grid = _grid(tmp_path, f"[grid]\n{axes}\n")
    start = time.monotonic()
    with pytest.raises(ParameterError) as err:
        load_grid(grid)
    assert time.monotonic() - start < 5  # before any cell is checked (about 16 h at 57 ms a cell)
    assert str(err.value).startswith(f"grid file {grid}: 1000000 cells (10 x 10 x 10 x 10 x 10 x 10), more than the "
                                     "1000 a sweep takes")


@pytest.mark.parametrize("text, fault", [
    ('[grid]\ncorection = ["tis"]\n', "unknown parameter 'corection'"),
    ('[base]\nsteps = 0\n', "steps = 0: must be > 0"),
    ('[grid]\ncorrection = ["tis", "nope"]\n', "cell correction=nope"),
    ('[grids]\nseed = [1]\n', "unknown top-level keys ['grids']"),
    ('[base]\nrun_dir = "x"\n', "which the sweep sets per cell"),
    ('[grid]\nseed = 1\n', "must be non-empty lists: ['seed']"),
    ('[grid\n', "cannot read it"),
    ('grid = [1, 2]\n', "a table or a list of tables"),
    ('[[grid]]\nseed = [1]\n[[grid]]\nseed = []\n', "must be non-empty lists: ['seed']"),
])
def test_a_bad_grid_is_refused_naming_the_file_and_key(tmp_path, text, fault):
    grid = _grid(tmp_path, text)
    with pytest.raises(ParameterError) as err:
        load_grid(grid)
    assert str(grid) in str(err.value) and fault in str(err.value)


@pytest.mark.parametrize("text, fault", [
    # regression: each passed the grid check, and its cell failed 40 s later inside the training CLI
    ('[base]\nrollout_precision = "int8"\n[grid]\nint8_weight_bits = ["6", "3"]\n',
     # now refused by the grid's own parameter check, in the CLI's words, with no command line built
     "cell int8_weight_bits=3: int8_weight_bits = '3': --vllm.int8_weight_bits: invalid choice: '3'"),
    ('[grid]\nextra_args = [["--train.async_max_lag", "1"]]\n',
     "training CLI flags: --train.async_max_lag: applies to async training only"),
    ('[grid]\nint8_weight_bits = ["6"]\n',  # rollout_precision stays bf16
     "training CLI flags: --vllm.int8_weight_bits: only applies to --vllm.rollout_precision int8, not bf16"),
    ('[grid]\ncorrection = ["tis", "off"]\ncorrection_options = [{upper = 3}]\n',
     "cell correction=off,correction_options={\"upper\": 3}: training CLI flags: --algo.correction.upper: has no "
     "effect here"),
    ('[grid]\nprompts_per_step = [3]\nsamples_per_prompt = [1]\nextra_args = [["--train.batch_size", "4"]]\n',
     "--train.batch_size: 4 is not a multiple of --train.micro_batch_size (3)"),
    # a cell that trained into X, showed "training steps 0/3" and was recorded complete (a rerun skipped it)
    ('[grid]\nseed = [1]\nextra_args = [["--logger.run_dir", "X"]]\n',
     'cell seed=1,extra_args=["--logger.run_dir", "X"]: training CLI flags: extra_args sets --logger.run_dir: the '
     "sweep sets it for each cell"),
    ('[base]\nextra_args = ["--ckpt.pa=elsewhere"]\n[grid]\nseed = [1]\n',  # as argparse reads an abbreviation
     "cell seed=1: training CLI flags: extra_args sets --ckpt.path: the job derives it from run_dir"),
    ('[grid]\nextra_args = [["--ckpt.load_enable"]]\n', "extra_args sets --ckpt.load_enable: the sweep resumes an "
     "interrupted cell itself"),
    ('[grid]\nextra_args = [["--logger.run_dir_overwrite"]]\n', "extra_args sets --logger.run_dir_overwrite"),
])
def test_a_cell_the_training_cli_would_refuse_fails_the_grid_check(tmp_path, text, fault):
    grid = _grid(tmp_path, text)
    with pytest.raises(ParameterError) as err:
        load_grid(grid)
    assert str(err.value).startswith(f"grid file {grid}, cell ") and fault in str(err.value), str(err.value)


def test_a_job_refuses_extra_args_that_move_its_run_and_keeps_a_resume():
    """A notebook or the main job reads metrics, checkpoint and kept model where run_dir puts them."""
    for flag in ("--logger.run_dir", "--ckpt.output_dir"):
        with pytest.raises(ParameterError, match=f"extra_args sets {flag}: the job derives it from run_dir"):
            check_training_command(TrainParams.checked({"extra_args": [flag, "elsewhere"]}))
    check_training_command(TrainParams.checked({"extra_args": ["--ckpt.save_steps", "1", "--ckpt.load_enable"]}))


KERNEL_LIKE = """
import sys
sys.stderr = open(sys.argv[1], "w")  # as in a notebook kernel: sys.stderr is not file descriptor 2
from openrlhf_tis.pipeline.train import check_training_command
from openrlhf_tis.pipeline.train_params import TrainParams
check_training_command(TrainParams.checked({}))
assert sys.stderr.name == sys.argv[1]
"""


def test_checking_a_training_command_leaves_the_console_quiet_even_in_a_kernel(tmp_path):
    """The first check imports upstream's CLI, hence DeepSpeed: its accelerator warning and its op probe's compiler
    errors (`ld: cannot find -laio` where libaio is missing) reached the console of a main job or a sweep."""
    import subprocess
    import sys

    stream = tmp_path / "kernel_stderr.txt"
    proc = subprocess.run([sys.executable, "-c", KERNEL_LIKE, str(stream)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, stream.read_text() + proc.stderr
    console = proc.stdout + proc.stderr + stream.read_text()
    assert not [noise for noise in ("Setting accelerator", "collect2", "-laio") if noise in console], console


def test_cell_slugs_are_safe_and_distinct_even_when_names_slug_alike():
    a, b = Cell("extra_args=[\"--a b\"]", {}), Cell("extra_args=[\"--a_b\"]", {})
    assert a.slug != b.slug and "/" not in a.slug and " " not in a.slug


def test_training_command_follows_the_parameters(tmp_path):
    params = TrainParams.checked({"steps": 5, "prompts_per_step": 3, "samples_per_prompt": 4, "correction": "mis_full",
                                  "correction_options": {"upper": 3.0}, "extra_args": ["--algo.correction.upper", "4"],
                                  "run_dir": str(tmp_path / "run")})
    argv = params.argv(tmp_path / "model", tmp_path / "p.jsonl", tmp_path / "run")

    def flag(name):  # the last value given wins, as argparse does
        return argv[len(argv) - 1 - argv[::-1].index(name) + 1]

    assert "--data.max_samples" not in argv  # upstream clips the held-out set with it too; see resolve_prompts
    assert flag("--rollout.batch_size") == "3" and flag("--train.batch_size") == "12"
    assert flag("--train.micro_batch_size") == "6" == flag("--rollout.micro_batch_size")  # divides 12, <= 8
    assert flag("--rollout.n_samples_per_prompt") == "4" and flag("--algo.advantage.estimator") == "group_norm"
    assert flag("--algo.correction.preset") == "mis_full"
    assert flag("--algo.correction.upper") == "4"  # extra_args come last and win over correction_options
    assert argv.index("--algo.correction.upper") < len(argv) - 2


def test_async_queue_trains_asynchronously_only_when_set(tmp_path):
    def argv(**values):
        params = TrainParams.checked({**values, "run_dir": str(tmp_path / "run")})
        return params.argv(tmp_path / "model", tmp_path / "p.jsonl", tmp_path / "run")

    assert "--train.async_enable" not in argv()
    queued = argv(async_queue=2)
    assert "--train.async_enable" in queued and queued[queued.index("--train.async_queue_size") + 1] == "2"
    with pytest.raises(ParameterError, match="async_queue"):
        argv(async_queue=-1)


def test_the_prompt_file_holds_one_rollout_batch_per_step(tmp_path):
    given = tmp_path / "given.jsonl"
    given.write_text("".join(f'{{"input": "q{i}", "label": "{i}"}}\n' for i in range(40)) + "\n")
    run_dir = tmp_path / "runs" / "a"
    written = resolve_prompts(str(given), run_dir, 5 * 3)  # 5 steps x 3 prompts
    assert written.parent == run_dir.parent
    assert written.read_text().splitlines() == given.read_text().splitlines()[:15]
    short = resolve_prompts(str(given), run_dir, 100)  # a shorter file ends the run early, as upstream does
    assert len(short.read_text().splitlines()) == 40
    assert len(resolve_prompts("", run_dir, 6).read_text().splitlines()) == 6  # demo prompts


def test_rerunning_the_check_cell_ignores_names_later_cells_defined():
    namespace = {"steps": 3}
    first = TrainParams.from_notebook(namespace, "train")
    namespace.update(params=first, run_dir_result="x", steps=4)  # later cells ran; the user changed steps
    assert TrainParams.from_notebook(namespace, "train").steps == 4
