"""`openrlhf-tis-runs`: list the runs under a directory, or summarise one run, in the terminal.

    openrlhf-tis-runs list [ROOT]            one line per run (default ROOT: ./runs)
    openrlhf-tis-runs show RUN [--root ROOT] steps, reward and mismatch trends, masked fraction, kept held-out
    openrlhf-tis-runs show RUN --json        the same summary as JSON (for scripts)

Damaged files are reported by name (yellow, on stderr) and the rest is still shown.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd
from rich.console import Console
from rich.table import Table
from rich.text import Text

from openrlhf_tis.runs.layout import is_run_dir
from openrlhf_tis.runs.reader import list_runs
from openrlhf_tis.runs.summary import summary
from openrlhf_tis.sigint import INTERRUPTED_EXIT, take_sigint

_BARS = "▁▂▃▄▅▆▇█"
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def plain(text: Any, style: str = "") -> Text:
    """`text` from the disk or the command line (a folder name, a path, a metric key) as the terminal shows it
    literally: rich reads no markup in it (`runs/[/bold]` crashed `show`), and control characters (a terminal's
    escape sequences) are written as \\xNN instead of being sent to the terminal."""
    return Text(_CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", str(text)), style=style)


def sparkline(values: Sequence[float], width: int = 32) -> str:
    """A series as one line of block characters (means of `width` buckets; gaps for non-finite)."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return ""
    lo, hi = min(finite), max(finite)
    n = len(values)
    buckets = [values[i * n // width:(i + 1) * n // width] for i in range(min(width, n))]
    out = []
    for bucket in buckets:
        vals = [v for v in bucket if v is not None and math.isfinite(v)]
        if not vals:
            out.append(" ")
            continue
        level = 0 if hi == lo else int((sum(vals) / len(vals) - lo) / (hi - lo) * (len(_BARS) - 1) + 0.5)
        out.append(_BARS[level])
    return "".join(out)


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.{digits}g}"
    return str(value)


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def cmd_list(root: str, console: Console) -> int:
    try:
        runs = list_runs(root)
    except (FileNotFoundError, NotADirectoryError) as err:
        console.print(plain(err, "red"), soft_wrap=True)
        return 2
    if runs.empty:
        console.print(Text.assemble("no runs under ", plain(root)))
        return 0
    table = Table(title=Text.assemble("runs under ", plain(root)))
    table.add_column("run", min_width=8, overflow="fold")
    for column in ("created (UTC)", "steps", "last", "dumps", "dump size", "revision"):
        table.add_column(column, justify="left" if column in ("created (UTC)", "revision") else "right", no_wrap=True)
    for row in runs.itertuples():
        # Runs without a config.json have no time or revision (None, or NaN once pandas mixes them).
        created = row.created.replace("T", " ")[:16] if isinstance(row.created, str) else "-"
        revision = row.revision[:8] if isinstance(row.revision, str) else "-"
        last = str(int(row.last_step)) if pd.notna(row.last_step) else "-"
        table.add_row(plain(row.run), created, str(row.steps), last, str(row.token_steps), _bytes(row.token_bytes),
                      revision)
    console.print(table)
    return 0


def _candidates(run: str, root: str) -> list[Path]:
    """Where RUN may be: the path itself, then under ROOT (one place when both name it: an absolute RUN, ROOT '.')."""
    return list(dict.fromkeys((Path(run), Path(root) / run)))


def _not_found(run: str, root: str) -> str:
    """Why RUN names no run: the directory that exists but holds none, else every place looked at."""
    candidates = _candidates(run, root)
    empty = [c for c in candidates if c.is_dir()]
    if empty:
        return f"{empty[0]} holds no run (no config.json, metrics.jsonl or tokens/ yet)"
    return f"no run directory at {' or '.join(map(str, candidates))}"


def cmd_show(run: str, root: str, as_json: bool, console: Console) -> int:
    run_dir = next((c for c in _candidates(run, root) if is_run_dir(c)), None)
    if run_dir is None:
        console.print(plain(_not_found(run, root), "red"), soft_wrap=True)
        return 2
    info = summary(run_dir)
    if as_json:
        print(json.dumps(info, indent=1, default=str))
        return 0
    console.print(Text.assemble(plain(info["run"], "bold"), "  ", plain(info["path"])))
    console.print(f"steps {info['steps']}" + (f" of {info['planned_steps']}" if info["planned_steps"] else "")
                  + f" ({_fmt(info['first_step'])}..{_fmt(info['last_step'])}"
                  + (f", {info['missing_steps']} missing" if info["missing_steps"] else "") + ")"
                  f"   revision {_fmt(info['revision'])}   fingerprint {_fmt(info['fingerprint'])}"
                  f"   resumes {info['resumes']}")
    table = Table()
    table.add_column("quantity / metric", overflow="fold")
    for column in ("first", "last", "slope/step"):
        table.add_column(column, justify="right", no_wrap=True)
    table.add_column("trend", no_wrap=True)
    for label in ("reward", "mismatch", "masked"):
        series = info.get(label)
        if series is None:
            table.add_row(f"{label}\n[dim]not logged[/dim]", "-", "-", "-", "")
        elif "values" in series:
            table.add_row(Text.assemble(f"{label}\n", plain(series["key"], "dim")), _fmt(series["first"], 3),
                          _fmt(series["last"], 3), _fmt(series["slope"], 2), sparkline(series["values"], 20))
        else:
            table.add_row(Text.assemble(f"{label}\n", plain(series["source"], "dim")), "-", _fmt(series["last"], 3),
                          "-", "")
    if kept := info.get("held_out_kept"):  # first = base model, last = the saved final model
        table.add_row(Text.assemble("held-out pass1\n", plain(kept["label"], "dim")), _fmt(kept["pass1_before"], 3),
                      _fmt(kept["pass1_after"], 3), "-", "")
    console.print(table)
    tokens = info.get("tokens")
    if tokens:
        per_token = info["token_bytes"] / tokens["rows"] if tokens["rows"] else float("nan")
        reasons = ", ".join(f"{name} {count}" for name, count in tokens["by_reason"].items()) or "none masked"
        console.print(f"token dumps: {info['token_steps']} steps, {tokens['rows']} tokens, "
                      f"{_bytes(info['token_bytes'])} ({per_token:.1f} B/token); masked "
                      f"{_fmt(tokens['masked_fraction'])} ({reasons})")
    else:
        console.print("token dumps: none")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="openrlhf-tis-runs", description="List and summarise openrlhf_tis runs.")
    sub = parser.add_subparsers(dest="command", required=True)
    p_list = sub.add_parser("list", help="one line per run under ROOT")
    p_list.add_argument("root", nargs="?", default="runs", help="directory holding run directories (default: runs)")
    p_show = sub.add_parser("show", help="summary of one run")
    p_show.add_argument("run", help="run directory, or its name under --root")
    p_show.add_argument("--root", default="runs", help="where to look for RUN given by name (default: runs)")
    p_show.add_argument("--json", action="store_true", help="print the summary as JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    take_sigint()
    parser = build_parser()
    args = parser.parse_args(argv)
    console = Console()
    errors = Console(stderr=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if args.command == "list":
                code = cmd_list(args.root, console)
            else:
                code = cmd_show(args.run, args.root, args.json, console)
        except KeyboardInterrupt:  # it only reads: nothing to undo
            print(f"{parser.prog}: interrupted", file=sys.stderr)
            return INTERRUPTED_EXIT
    for warning in caught:
        errors.print(Text.assemble(("warning:", "yellow"), " ", plain(warning.message)))
    return code


if __name__ == "__main__":
    sys.exit(main())
