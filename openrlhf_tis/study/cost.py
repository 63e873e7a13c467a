"""What a study cost: every attempt at every cell, grouped into the sittings that ran them, and the total.

Read from the cells alone (each status.json keeps its attempt's start and seconds and the earlier attempts' records,
pipeline/sweep.py), so a report rebuilt with `--report` on any machine tells the same cost. A failed attempt cost
compute too, so it counts. A sitting is a stretch of attempts run back to back: one that starts more than
SITTING_GAP_S after the previous one ended opens the next, whatever command or session started it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

from openrlhf_tis.pipeline.sweep import STATUS_FILE, read_status
from openrlhf_tis.runs.config import run_started

SITTING_GAP_S = 30 * 60
"""Attempts of one sitting start seconds apart (the next cell starts as the last one ends); sittings, hours apart."""


@dataclass(frozen=True)
class Attempt:
    cell: str
    status: str  # complete | failed
    seconds: float
    started: datetime | None  # None: a record from before starts were kept, with no run config to read it from

    @property
    def ended(self) -> datetime | None:
        return self.started + timedelta(seconds=self.seconds) if self.started else None


def _parse(started: str | None) -> datetime | None:
    return datetime.strptime(started, "%Y-%m-%dT%H:%M:%SZ") if started else None


def attempts(out: Path) -> list[Attempt]:
    """Every timed attempt recorded under `out`/cells, oldest first (those without a start last). A status.json
    written before starts were recorded takes its run's config.json time."""
    found = []
    for cell_dir in sorted(p.parent for p in (Path(out) / "cells").glob(f"*/{STATUS_FILE}")):
        status = read_status(cell_dir)
        if status is None:
            continue
        last = {**status, "started": status.get("started") or run_started(cell_dir / "run")}
        for record in [*status.get("earlier", []), last]:
            if record.get("seconds") is not None:
                found.append(Attempt(status["cell"], record.get("status") or "failed", float(record["seconds"]),
                                     _parse(record.get("started"))))
    return sorted(found, key=lambda a: (a.started is None, a.started or datetime.min))


def sittings(timed: list[Attempt], gap_s: float = SITTING_GAP_S) -> list[list[Attempt]]:
    """`timed` (oldest first, each with a start) split where an attempt starts more than `gap_s` after every
    earlier attempt of its sitting ended."""
    groups: list[list[Attempt]] = []
    for attempt in timed:
        if groups and attempt.started <= max(a.ended for a in groups[-1]) + timedelta(seconds=gap_s):
            groups[-1].append(attempt)
        else:
            groups.append([attempt])
    return groups


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"


def _minutes_each(group: list[Attempt]) -> str:
    done = [a.seconds for a in group if a.status == "complete"]
    return f"{sum(done) / len(done) / 60:.1f}" if done else "–"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def cost_summary(found: list[Attempt]) -> str:
    """One line: total cell time, attempts, cells, failed attempts, sittings."""
    if not found:
        return "no timed attempt"
    failed = [a for a in found if a.status != "complete"]
    timed = [a for a in found if a.started is not None]
    return (f"{_hours(sum(a.seconds for a in found))} of cell time: {len(found)} attempts at "
            f"{len({a.cell for a in found})} cells ({len(failed)} failed, {_hours(sum(a.seconds for a in failed))}) "
            f"in {_count(len(sittings(timed)), 'sitting')}; {_minutes_each(found)} min a finished cell")


def cost_markdown(found: list[Attempt]) -> str:
    """The study's cost: the summary line, a row per sitting, then a row per cell (all its attempts)."""
    if not found:
        return "(no timed attempt)"
    lines = [f"**Compute:** {cost_summary(found)}.", "",
             "| sitting | from (UTC) | to (UTC) | attempts | finished | failed | cell time | min a finished cell |",
             "|---|---|---|---|---|---|---|---|"]
    timed = [a for a in found if a.started is not None]
    for number, group in enumerate(sittings(timed), 1):
        finished = sum(a.status == "complete" for a in group)
        lines.append(f"| {number} | {group[0].started:%Y-%m-%d %H:%M} | {max(a.ended for a in group):%Y-%m-%d %H:%M} "
                     f"| {len(group)} | {finished} | {len(group) - finished} | "
                     f"{_hours(sum(a.seconds for a in group))} | {_minutes_each(group)} |")
    untimed = [a for a in found if a.started is None]
    if untimed:
        lines.append(f"| (no start recorded) | | | {len(untimed)} | {sum(a.status == 'complete' for a in untimed)} | "
                     f"{sum(a.status != 'complete' for a in untimed)} | {_hours(sum(a.seconds for a in untimed))} | "
                     f"{_minutes_each(untimed)} |")
    lines += ["", "| cell | attempts | last | min (all attempts) | last started (UTC) |", "|---|---|---|---|---|"]
    for cell in sorted({a.cell for a in found}):
        mine = [a for a in found if a.cell == cell]
        last = max(mine, key=lambda a: a.started or datetime.min)
        when = f"{last.started:%Y-%m-%d %H:%M}" if last.started else "–"
        lines.append(f"| {cell} | {len(mine)} | {last.status} | {sum(a.seconds for a in mine) / 60:.1f} | {when} |")
    return "\n".join(lines)
