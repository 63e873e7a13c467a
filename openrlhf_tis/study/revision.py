"""One code revision per study: the commit a study's cells run on, fixed in its folder by the first sitting.

A study compares settings across cells run over days; a code change between cells (to the loss, the actor, the
sampler) would be confounded with whatever the cells vary, as it once was with the seed (docs/study.md). So the
first sitting of a new folder writes `revision.json`, and a sitting on any other revision (or on a dirty tree, which
is no revision) is refused, naming --out. Folders whose cells predate these records are resumed with a warning,
since nothing says what their cells ran on.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from openrlhf_tis.params import ParameterError
from openrlhf_tis.pipeline.sweep import SweepResult, recorded_cells, run_command
from openrlhf_tis.runs.config import git_revision
from openrlhf_tis.runs.layout import atomic_write

REVISION_FILE = "revision.json"


def code_revision() -> str:
    """The git commit this package runs from, '+dirty' when its tracked files differ from it (runs/config.py)."""
    git = git_revision()
    return f"{git['revision'] or 'unknown'}{'+dirty' if git['dirty'] else ''}"


def check_revision(out: Path, revision: str, *, cells: int = 0) -> None:
    """Record `revision` for a new study under `out` (no finished cells yet); refuse a sitting of another revision.
    `cells`: the finished cells already there, which a folder without a record may hold from before the records."""
    path = out / REVISION_FILE
    if path.is_file():
        fixed = json.loads(path.read_text()).get("revision")
        if fixed != revision:
            raise ParameterError(f"--out {out}: its cells ran on code revision {fixed}, this is {revision}: one "
                                 "revision per study; start a new --out (or run from a clone at that revision)")
        return
    if cells:
        print(f"[study] --out {out}: its {cells} finished cells predate the study's revision record, so nothing says "
              f"which code they ran on; this sitting runs {revision} (start a new --out to keep one revision)",
              file=sys.stderr)
        return
    atomic_write(path, (json.dumps({"revision": revision}, indent=1) + "\n").encode())


def check_sitting(parser: argparse.ArgumentParser, out: Path) -> None:
    """A study command's check before its first cell: this checkout's revision against the folder's, refused by
    `parser` naming --out."""
    try:
        check_revision(out, code_revision(), cells=len(recorded_cells(out).results))
    except ParameterError as err:
        parser.error(str(err))


def run_sitting(parser: argparse.ArgumentParser, grid_file: Path, out: Path, title: str) -> SweepResult:
    """A study command's sitting: the revision check, then every cell of `grid_file` not finished yet."""
    check_sitting(parser, out)
    return run_command(parser.prog, grid_file, out, title, whole_folder=True)
