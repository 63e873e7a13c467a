"""`openrlhf-tis-sweep GRID OUT`: train.ipynb once per grid cell through papermill, then one comparison report.

A grid file (TOML or JSON) has two tables, both of train.ipynb parameters:

    [base]                      # every cell
    model = "tiny"
    steps = 2
    [grid]                      # the cross product of these lists
    correction = ["off", "tis", "mis_full"]
    rollout_precision = ["bf16", "int8"]
    seed = [1, 2]

`[[grid]]` (a list of grid tables) takes the union of their cross products, in order, a cell named
twice running once: e.g. a reference precision under one correction beside int8 under several.

Every cell is checked before any cell runs (unknown keys, bad values, and the training command it becomes against
the training CLI's own flag checks). Each cell keeps its executed
notebook and run directory under OUT/cells/<cell>/ and a status.json written last: a re-run skips
cells whose status says complete with the same parameters, and retries the others: a failed or changed
cell, or one interrupted before its status (Ctrl-C, a kill), starts afresh with the earlier attempt's run
directory kept as run.attemptN, except that an interrupted cell holding a checkpoint of its own run
resumes from it (`--ckpt.load_enable`). status.json records absolute paths relative to OUT (`portable`), so a
sweep, like a study committed under results/study/, resumes from any checkout path; it records when the attempt
started and how long it took, and keeps the earlier attempts' records (`earlier`), so what a cell cost counts every
attempt (study/cost.py). A failing cell
is recorded with its papermill error (cell and exception) and the sweep goes on; the report
(OUT/report.ipynb and the self-contained OUT/report.html) names it. `touch OUT/STOP` ends a sweep after the cell in
flight (where Ctrl-C would stop that cell): the file is removed, the report drawn over the cells done, and the same
command goes on from the next cell.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shlex
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from openrlhf_tis.cli.run_dir import lock_owner
from openrlhf_tis.params import ParameterError, ParamObject, param
from openrlhf_tis.pipeline.execute import export_html
from openrlhf_tis.pipeline.failure import notebook_error
from openrlhf_tis.pipeline.interrupt import Interrupted, execute_stoppable, kept, resumable, stopped
from openrlhf_tis.pipeline.train import RUN_DIR_FLAGS, check_training_command
from openrlhf_tis.pipeline.train_params import TrainParams
from openrlhf_tis.runs.config import run_started, utc_now
from openrlhf_tis.runs.layout import atomic_write, unique_dir_name
from openrlhf_tis.sigint import INTERRUPTED_EXIT, take_sigint

GRID_TABLES = ("base", "grid")
STATUS_FILE = "status.json"
STOP_FILE = "STOP"  # OUT/STOP: end the sweep after the cell in flight
_PER_CELL = ("run_dir", "untrained_cache")  # set by the sweep for each cell, never by the grid
UNTRAINED_DIR = "untrained"
"""OUT/untrained: the untrained policy's held-out scores, shared by the sweep's cells (trainer/untrained_scores.py).
Not part of a cell's recorded parameters, so cells recorded before it are still done."""
SWEEP_FLAGS = {**RUN_DIR_FLAGS,
               "--logger.run_dir": "the sweep sets it for each cell",
               "--ckpt.load_enable": "the sweep resumes an interrupted cell itself",
               "--logger.run_dir_overwrite": "the sweep starts a failed cell afresh itself",
               "--eval.untrained_cache": "the sweep shares the untrained scores under OUT/untrained itself"}
"""Flags a cell's extra_args must not set, and why: the sweep decides where each cell runs and whether it resumes."""
MAX_CELLS = 1000  # more is a typo or a job for another tool: one CPU cell trains for minutes
CHECK_S = 0.06  # measured: checking one cell (its parameters and training command) on a 2-core EPYC


def _grid_file(value: str) -> str | None:
    return None if Path(value).expanduser().is_file() else f"no such file: {value}"


@dataclass(frozen=True)
class SweepParams(ParamObject):
    """sweep.ipynb's parameters."""

    grid: str = param("sweep.toml", "the grid file (TOML or JSON: tables base and grid)", (str,), check=_grid_file)
    out_dir: str = param("sweeps/out", "where cells, the report and its HTML go", (str,))


@dataclass(frozen=True)
class Cell:
    name: str  # e.g. "correction=tis,rollout_precision=int8,seed=1"
    params: dict[str, Any]  # train.ipynb parameters, run_dir excluded

    @property
    def slug(self) -> str:
        """The cell's directory name (runs.layout.unique_dir_name)."""
        return unique_dir_name(self.name)


@dataclass
class CellResult:
    cell: Cell
    status: str  # complete | failed | skipped (complete earlier)
    run_dir: Path
    notebook: Path
    error: str | None = None
    seconds: float | None = None  # the cell's wall time when it ran (kept in status.json, so a skip reports it too)


@dataclass
class SweepResult:
    results: list[CellResult] = field(default_factory=list)
    report: Path | None = None
    html: Path | None = None

    @property
    def failures(self) -> dict[str, str]:
        return {r.cell.name: r.error or "" for r in self.results if r.status == "failed"}


def load_grid(path: str | Path) -> list[Cell]:
    """The cells of a grid file, each checked against train.ipynb's parameters; raises naming the file and key."""
    path = Path(path)
    try:
        raw = path.read_bytes()
        data = json.loads(raw) if path.suffix == ".json" else tomllib.loads(raw.decode())
    except (OSError, ValueError) as err:  # tomllib and json errors are ValueErrors
        raise ParameterError(f"grid file {path}: cannot read it ({err})") from None
    where = f"grid file {path}"
    if not isinstance(data, dict) or set(data) - set(GRID_TABLES):
        raise ParameterError(f"{where}: unknown top-level keys {sorted(set(data) - set(GRID_TABLES))}; "
                             f"expected the tables {list(GRID_TABLES)}")
    base, grids = data.get("base", {}), data.get("grid", {})
    grids = grids if isinstance(grids, list) else [grids]
    if not isinstance(base, dict) or not all(isinstance(g, dict) for g in grids):
        raise ParameterError(f"{where}: [base] must be a table and [grid] a table or a list of tables")
    fixed = [k for table in (base, *grids) for k in table if k in _PER_CELL]
    if fixed:
        raise ParameterError(f"{where}: sets {fixed}, which the sweep sets per cell")
    axes_list = []
    for axes in grids:
        bad_axes = [k for k, v in axes.items() if not isinstance(v, list) or not v]
        if bad_axes:
            raise ParameterError(f"{where}: [grid] values must be non-empty lists: {bad_axes}")
        axes_list.append(axes)
    count = sum(math.prod(len(v) for v in axes.values()) for axes in axes_list)
    if count > MAX_CELLS:
        sizes = " + ".join(" x ".join(str(len(v)) for v in axes.values()) or "1" for axes in axes_list)
        raise ParameterError(f"{where}: {count} cells ({sizes}), more than the {MAX_CELLS} a sweep takes: checking "
                             f"them alone would take about {count * CHECK_S / 3600:.1f} h, running them far longer; "
                             "split the grid or shorten its lists")
    cells: dict[str, Cell] = {}
    seen: dict[str, str] = {}  # a cell's values -> the name it was first given
    with tqdm(total=count, desc=f"checking {path.name}", unit="cell", disable=count < 50) as progress:
        for axes in axes_list:
            for values in itertools.product(*axes.values()):
                progress.update()
                chosen = dict(zip(axes, values, strict=True))
                params = {**base, **chosen}
                name = ",".join(f"{k}={v if isinstance(v, str) else json.dumps(v)}"
                                for k, v in chosen.items()) or "base"
                same = seen.setdefault(_by_value(params), name)
                if same != name:
                    print(f"[sweep] {where}: cell {name} is cell {same} (the same values): run once", file=sys.stderr)
                    continue
                if name not in cells:
                    check_cell(params, where=f"{where}, cell {name}")
                    cells[name] = Cell(name, params)
    return list(cells.values())


def _by_value(params: dict[str, Any]) -> str:
    """`params` as a key equal for equal values however spelled (1 and 1.0 are one learning rate; True stays a bool)."""
    def value(v: Any) -> Any:
        return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else v

    return json.dumps({k: value(v) for k, v in params.items()}, sort_keys=True)


def check_cell(params: dict[str, Any], where: str) -> None:
    """A cell's parameters, then the training command they become, checked as the training CLI would (its flag
    checks: pipeline/train.py `check_training_command`); raises ParameterError naming `where` and the fault."""
    checked = TrainParams.checked(params, where=where)
    try:
        check_training_command(checked, owned=SWEEP_FLAGS)
    except ParameterError as err:
        raise ParameterError(f"{where}: {err}") from None


def read_status(cell_dir: Path) -> dict[str, Any] | None:
    """A cell's status.json, None where there is none (never run, or interrupted before its end) or it is unreadable."""
    try:
        return json.loads((cell_dir / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return None


def portable(params: dict[str, Any], root: Path) -> dict[str, Any]:
    """`params` with every absolute path (a value, or an item of a list value) written relative to `root`: a cell's
    task files and reward then compare equal wherever the checkout lies, and so do an older status.json's absolute
    paths read back under the same root."""

    def rel(value: Any) -> Any:
        return os.path.relpath(value, root) if isinstance(value, str) and os.path.isabs(value) else value

    return {key: [rel(v) for v in value] if isinstance(value, list) else rel(value) for key, value in params.items()}


def run_cell(cell: Cell, out_dir: Path) -> CellResult:
    """Execute train.ipynb for one cell unless it completed before with the same parameters."""
    cell_dir = out_dir / "cells" / cell.slug
    run_dir, notebook = cell_dir / "run", cell_dir / "train.ipynb"
    status = read_status(cell_dir)
    recorded = portable(cell.params, out_dir)
    if status and status.get("status") == "complete" and portable(status.get("params") or {}, out_dir) == recorded:
        return CellResult(cell, "skipped", run_dir, notebook, seconds=status.get("seconds"))
    owner = lock_owner(run_dir)
    if owner is not None:  # an earlier sweep's training outlived it: never move a live run's directory
        return CellResult(cell, "failed", run_dir, notebook, f"{run_dir} is still in use by a training process "
                          f"(pid {owner}); stop it and run the sweep again")
    params = {**cell.params, "run_dir": str(run_dir), "untrained_cache": str(out_dir / UNTRAINED_DIR)}
    earlier = earlier_attempts(status, run_dir)  # read before the run directory is set aside
    if status is None and resumable(run_dir):  # interrupted (no status) after a checkpoint of its own run
        params["extra_args"] = [*params.get("extra_args", []), "--ckpt.load_enable"]
    elif run_dir.exists():  # an earlier failed, changed or interrupted attempt: start the run afresh
        _set_aside(run_dir)
    started, start = utc_now(), time.monotonic()
    try:
        execute_stoppable("train", notebook, params, cwd=cell_dir)  # Ctrl-C: Stopped, no status (interrupted)
        result = CellResult(cell, "complete", run_dir, notebook)
    except Exception as err:  # papermill's error carries the failing cell; anything else is named too
        result = CellResult(cell, "failed", run_dir, notebook, notebook_error(err))
    result.seconds = round(time.monotonic() - start, 1)
    atomic_write(cell_dir / STATUS_FILE, json.dumps(
        {"cell": cell.name, "status": result.status, "params": recorded, "error": result.error,
         "seconds": result.seconds, "started": started, "earlier": earlier}, indent=1).encode())
    return result


def earlier_attempts(status: dict[str, Any] | None, run_dir: Path) -> list[dict[str, Any]]:
    """The records of the attempts a new attempt supersedes, oldest first: each one's status, error, seconds and
    start (a status.json from before `started` was recorded: its run's config.json time, where its run is)."""
    if status is None:
        return []
    last = {"status": status.get("status"), "error": status.get("error"), "seconds": status.get("seconds"),
            "started": status.get("started") or run_started(run_dir)}
    return [*status.get("earlier", []), last]


def _set_aside(run_dir: Path) -> None:
    """Keep an earlier attempt's run directory (never delete results) under a numbered name."""
    run_dir.rename(_attempt_dir(run_dir))


def _attempt_dir(run_dir: Path) -> Path:
    """Where `_set_aside` keeps `run_dir`: the first free run.attemptN beside it."""
    return next(target for n in itertools.count(1)
                if not (target := run_dir.with_name(f"{run_dir.name}.attempt{n}")).exists())


def run_sweep(grid: str | Path, out_dir: str | Path, title: str | None = None, whole_folder: bool = False
              ) -> SweepResult:
    """Every cell of `grid` (checked first), then compare.ipynb over the completed cells, exported to HTML.
    `whole_folder`: the result and the report cover every cell recorded under `out_dir` (a study run a part at a
    time), this grid's as they ran now."""
    cells = load_grid(grid)
    out_dir = Path(out_dir).expanduser().resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    result = SweepResult()
    again = shlex.join(["openrlhf-tis-sweep", str(grid), str(out_dir), *(["--title", title] if title else [])])
    if stop_asked(out_dir):  # left from before this sweep began: it asks nothing of this one
        print(f"[sweep] removed {out_dir / STOP_FILE}, left from before this sweep", file=sys.stderr)
    bar = tqdm(cells, desc="sweep cells", unit="cell")
    for number, cell in enumerate(bar, 1):
        if stop_asked(out_dir):
            bar.close()
            print(f"[sweep] stopped before cell {cell.name} ({number} of {len(cells)}), as {out_dir / STOP_FILE} "
                  f"asked (removed); {again} goes on from it", file=sys.stderr)
            break
        bar.set_postfix_str(cell.name, refresh=True)
        try:
            result.results.append(run_cell(cell, out_dir))
        except KeyboardInterrupt as stop:
            bar.close()
            raise Interrupted(_cell_interrupted(cell, out_dir, result, len(cells), stop, again)) from None
    bar.close()
    if whole_folder:
        ran = {r.cell.name: r for r in result.results}
        result = SweepResult([ran.pop(r.cell.name, r) for r in recorded_cells(out_dir).results] + list(ran.values()))
    return write_report(result, out_dir, title or f"Sweep {Path(grid).name}: {len(cells)} cells", again)


def stop_asked(out_dir: Path) -> bool:
    """True, once, when OUT/STOP exists: it is removed, so the next run of the sweep goes on."""
    try:
        (out_dir / STOP_FILE).unlink()
    except FileNotFoundError:
        return False
    return True


def recorded_cells(out_dir: str | Path) -> SweepResult:
    """The cells under `out_dir` as their status.json files record them, in name order; nothing runs. What a
    report is rebuilt from on any machine (a study's cells are the CPU profile's, see study/dose_response.py)."""
    out_dir = Path(out_dir).expanduser().resolve()
    result = SweepResult()
    for cell_dir in sorted(p.parent for p in (out_dir / "cells").glob(f"*/{STATUS_FILE}")):
        status = read_status(cell_dir)
        if status is None:
            continue
        state = "skipped" if status.get("status") == "complete" else "failed"
        result.results.append(CellResult(Cell(status["cell"], status.get("params") or {}), state, cell_dir / "run",
                                         cell_dir / "train.ipynb", status.get("error"), status.get("seconds")))
    return result


def write_report(result: SweepResult, out_dir: Path, title: str, again: str = "the same command") -> SweepResult:
    """compare.ipynb over the completed cells (failures named at its top): OUT/report.ipynb and report.html.
    `again`: the command that draws it again, named when Ctrl-C stops it."""
    runs = [str(r.run_dir) for r in result.results if r.status != "failed"]
    if runs:
        report = out_dir / "report.ipynb"
        try:
            execute_stoppable("compare", report, {"runs": runs, "failures": result.failures, "title": title},
                              cwd=out_dir)
        except KeyboardInterrupt:
            raise Interrupted(f"interrupted while the comparison report ran; every cell is done; {again} draws "
                              "it again (done cells are skipped)") from None
        result.report, result.html = report, export_html(report, out_dir / "report.html")
    return result


def _cell_interrupted(cell: Cell, out_dir: Path, result: SweepResult, cells: int, stop: KeyboardInterrupt,
                      again: str) -> str:
    """The account of a Ctrl-C in a cell: what stopped, what the cell kept, what the next run does with it."""
    run_dir = out_dir / "cells" / cell.slug / "run"
    done = sum(r.status != "failed" for r in result.results)
    where = f"interrupted in cell {cell.name} ({len(result.results) + 1} of {cells}; {done} done before it)"
    if not run_dir.is_dir():
        return f"{where} before its training started; {again} goes on (done cells are skipped)"
    steps = TrainParams(**cell.params).steps  # checked when the grid was loaded
    then = ("resumes from its checkpoint" if resumable(run_dir) else
            f"starts afresh, this attempt kept as {_attempt_dir(run_dir).name}")
    return (f"{where}: {stopped(getattr(stop, 'jobs', []))}; kept: {kept(run_dir, steps)}; {again} goes on (done "
            f"cells are skipped, this one {then})")


def results_table(result: SweepResult):
    """One row per cell: status, error, run directory (what the sweep notebook shows)."""
    import pandas as pd

    return pd.DataFrame([{"cell": r.cell.name, "status": r.status, "seconds": r.seconds, "error": r.error or "",
                          "run_dir": str(r.run_dir)} for r in result.results]).set_index("cell")


def run_command(prog: str, grid: str | Path, out_dir: str | Path, title: str | None, whole_folder: bool = False
                ) -> SweepResult:
    """run_sweep for a command line: a bad grid exits 2 naming what is wrong, Ctrl-C exits 130 saying what was
    stopped (the sweep and the study end alike)."""
    try:
        return run_sweep(grid, out_dir, title, whole_folder)
    except ParameterError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt as err:  # Interrupted says what was stopped; a bare one came before any cell ran
        print(f"{prog}: {err if isinstance(err, Interrupted) else 'interrupted before any cell ran'}",
              file=sys.stderr)
        raise SystemExit(INTERRUPTED_EXIT) from None


def finish(result: SweepResult) -> None:
    """Print the cells' table and the report's path; exit 1 if a cell failed."""
    print(results_table(result).to_string())
    if result.html:
        print(f"report: {result.html}")
    if result.failures:
        raise SystemExit(1)


def main(argv: list[str] | None = None) -> None:
    take_sigint()
    parser = argparse.ArgumentParser(prog="openrlhf-tis-sweep", description=__doc__.split("\n")[0])
    parser.add_argument("grid", help="grid file (TOML or JSON with tables base and grid)")
    parser.add_argument("out_dir", help="output directory (cells/, report.ipynb, report.html)")
    parser.add_argument("--title", default=None, help="report title")
    args = parser.parse_args(argv)
    finish(run_command(parser.prog, args.grid, args.out_dir, args.title))


if __name__ == "__main__":
    main()
