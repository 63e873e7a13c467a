"""Filtered reads of token dumps without loading everything.

Two levels of pruning keep a query on millions of rows well under a second: the step range picks
files by name (one file per dumped step, so other steps are never opened), and the other filters are
pushed into DuckDB's Parquet scan, which reads only the projected columns, skips row groups whose
statistics exclude the filter, and filters while it decodes rather than after.

Why DuckDB: benchmarks/bench_runs.py times the same seven queries on a 5M-token dump (627 step files)
with DuckDB, pyarrow.dataset and polars, taking turns (figures: docs/measurements.md). pyarrow decodes every
projected column before filtering and is slower on selective queries over all steps. DuckDB and polars tie on
speed; DuckDB imports in half the time (the console command starts faster) and notebooks can run their own SQL
on tokens/*.parquet.

A file that cannot be read is reported by name (RunStoreWarning) and the query returns the rest.
"""

from __future__ import annotations

import math
import numbers
import os
import threading
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import duckdb
import numpy as np
import pandas as pd

from openrlhf_tis.runs.layout import RunStoreWarning, existing_dir, token_files
from openrlhf_tis.runs.schema import COLUMNS, MASK_REASON_CODES, MASK_REASONS, NOT_COMPARED, SCHEMA

RunPaths = str | os.PathLike | Sequence[str | os.PathLike]
StepRange = tuple[int | None, int | None]
Steps = int | StepRange | range  # one step, an inclusive (lo, hi) with open ends as None, or a Python range
ProbRange = tuple[float | None, float | None]

_connection: duckdb.DuckDBPyConnection | None = None
_connection_lock = threading.Lock()


def _cursor() -> duckdb.DuckDBPyConnection:
    """A cursor on one in-memory DuckDB, made on first use (a connection costs ~20 ms; a cursor ~0)."""
    global _connection
    with _connection_lock:
        if _connection is None:
            _connection = duckdb.connect(":memory:")
        return _connection.cursor()


def token_steps(run_dir: str | os.PathLike) -> list[int]:
    """Steps of a run that have a token dump."""
    return list(token_files(run_dir))


def _as_runs(run_dir: RunPaths) -> tuple[list[Path], bool]:
    if isinstance(run_dir, (str, os.PathLike)):
        return [Path(run_dir)], False
    return [Path(p) for p in run_dir], True


def _in_range(step: int, steps: StepRange | None) -> bool:
    if steps is None:
        return True
    lo, hi = steps
    return (lo is None or step >= lo) and (hi is None or step <= hi)


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _step_selection(steps: Steps | None) -> tuple[StepRange | None, Callable[[int], bool]]:
    """`steps` as inclusive SQL bounds plus the test a dumped step must pass for its file to be read.

    A strided range reads exactly its steps: each dump file holds one step, so picking files is exact.
    """
    if steps is None:
        return None, lambda step: True
    if _is_int(steps):
        return (int(steps), int(steps)), lambda step: step == steps
    if isinstance(steps, range):
        if not steps:
            return (1, 0), lambda step: False
        ends = (steps[0], steps[-1]) if steps.step > 0 else (steps[-1], steps[0])
        return ends, steps.__contains__
    if isinstance(steps, (tuple, list)) and len(steps) == 2 and all(v is None or _is_int(v) for v in steps):
        bounds = tuple(None if v is None else int(v) for v in steps)
        return bounds, lambda step: _in_range(step, bounds)
    raise TypeError(f"steps must be a step number, an inclusive (lo, hi) tuple (None for an open end) or a range, "
                    f"got {steps!r}")


def _float32_bound(value: float, upper: bool) -> float:
    """The float32 bound equivalent to `value` for float32 data: x >= v <=> x >= ceil32(v) (floor for <=).

    Log-probs are stored as float32; comparing them against the float64 log of a probability would
    otherwise depend on which side the engine casts, and differ from numpy by one ulp at the edges.
    """
    bound = np.float32(value)
    # float(...) matters: numpy 2 compares a float32 with a Python float in float32, hiding the gap.
    if not upper and float(bound) < value:
        bound = np.nextafter(bound, np.float32(np.inf))
    if upper and float(bound) > value:
        bound = np.nextafter(bound, np.float32(-np.inf))
    return float(bound)


def _int_list(values: Iterable[int]) -> str:
    return ", ".join(str(int(v)) for v in sorted(set(values))) or "NULL"


def where_clause(
    steps: StepRange | None = None,
    samples: Iterable[int] | None = None,
    prompts: Iterable[int] | None = None,
    masked_only: bool = False,
    reasons: Iterable[str] | None = None,
    prob_range: ProbRange | None = None,
    lags: StepRange | None = None,
    routing_mismatched: bool = False,
) -> str:
    """The SQL filter of a query. Values are rendered from ints and floats only, never from raw text."""
    terms = []
    if steps is not None:  # files are chosen by step already; this keeps the row filter exact too
        lo, hi = steps
        if lo is not None:
            terms.append(f"step >= {int(lo)}")
        if hi is not None:
            terms.append(f"step <= {int(hi)}")
    if samples is not None:
        terms.append(f"sample_id IN ({_int_list(samples)})")
    if prompts is not None:
        terms.append(f"prompt_id IN ({_int_list(prompts)})")
    if lags is not None:  # inclusive, either end None for open; dumps without the column read lag 0
        lo, hi = lags
        if lo is not None:
            terms.append(f"lag >= {int(lo)}")
        if hi is not None:
            terms.append(f"lag <= {int(hi)}")
    if masked_only:
        terms.append("masked")
    if routing_mismatched:  # dumps without routing read -1: none of their tokens matches
        terms.append("routing_mismatch_count > 0")
    if reasons is not None:
        names = list(reasons)
        unknown = [r for r in names if r not in MASK_REASON_CODES]
        if unknown:
            raise ValueError(f"unknown mask reasons {unknown}; known: {list(MASK_REASON_CODES)}")
        terms.append(f"mask_reason IN ({_int_list(MASK_REASON_CODES[r] for r in names)})")
    if prob_range is not None:
        # p >= lo  <=>  log p >= log lo: filter the stored log-prob, no new column is computed.
        lo, hi = prob_range
        terms.append("NOT isnan(rollout_logprob)")  # DuckDB orders NaN above every number; it has no probability
        if lo is not None and lo > 0:
            terms.append(f"rollout_logprob >= {_float32_bound(math.log(lo), upper=False)!r}")
        if hi is not None and hi > 0:
            terms.append(f"rollout_logprob <= {_float32_bound(math.log(hi), upper=True)!r}")
        elif hi is not None:  # p <= 0: only tokens of probability exactly 0
            terms.append("rollout_logprob = '-inf'::FLOAT" if hi == 0 else "FALSE")
    return " AND ".join(terms) or "TRUE"


# The row order query_tokens promises. Files alone do not give it: the parts of a step
# (step_000012.part001.parquet, ...) each hold some samples, and a writer may store rows in any order.
ORDER = ("step", "sample_id", "position")
_ORDER_BY = "ORDER BY " + ", ".join(ORDER)


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _empty(columns: list[str]) -> pd.DataFrame:
    return SCHEMA.remove_metadata().empty_table().select(columns).to_pandas()


# How a column that a dump lacks is read (an older writer, or the optional columns of schema.py):
# `step` from the file name (layout.token_file), `masked` from the reason code, `old_logprob` NaN as in
# bypass mode, `lag` 0 (older dumps come from synchronous runs), `routing_mismatch_count` -1 (not compared: no dump
# before version 4 holds routing); any other missing column reads as NULL.
_MISSING_DEFAULTS = {
    "step": r"CAST(regexp_extract(filename, 'step_(\d+)[^/\\]*$', 1) AS INTEGER)",
    "masked": "mask_reason <> 0",
    "old_logprob": "'NaN'::FLOAT",
    "lag": "0",
    "routing_mismatch_count": str(NOT_COMPARED),
}
_SQL_TYPES = {"int8": "TINYINT", "int16": "SMALLINT", "int32": "INTEGER", "float": "FLOAT", "bool": "BOOLEAN",
              "string": "VARCHAR", "list<item: int16>": "SMALLINT[]"}
# Parquet min/max statistics leave NaN out, and DuckDB by default takes them to mean "no NaN": it then
# drops `NOT isnan(x)` and lets a NaN log-prob pass `x >= lo` (duckdb/duckdb#25521). Declare NaN possible.
_READ_OPTIONS = "can_have_nan = true"


def _column_expr(name: str, present: set[str]) -> str:
    """SQL for one schema column over files that may lack it, cast to the schema's type."""
    if name not in present:
        expr = _MISSING_DEFAULTS.get(name, "NULL")
    elif name in _MISSING_DEFAULTS:  # union_by_name gives NULL in the files that lack it
        expr = f"COALESCE({_quote(name)}, {_MISSING_DEFAULTS[name]})"
    else:
        expr = _quote(name)
    return f"CAST({expr} AS {_SQL_TYPES[str(COLUMNS[name][0])]}) AS {_quote(name)}"


def _scan_by_name(cursor: duckdb.DuckDBPyConnection, files: list[Path], columns: list[str],
                  where: str) -> pd.DataFrame:
    """Query files whose columns differ (dumps of several schema versions): columns matched by name.

    `union_by_name` reads every file's schema, which the plain scan skips, so this is only the fallback.
    The filter sits outside the projection that fills missing columns, and DuckDB still pushes it into
    the scan for the columns the files have.
    """
    params = {"files": [os.fspath(f) for f in files]}
    source = f"read_parquet($files, union_by_name = true, filename = true, {_READ_OPTIONS})"
    present = set(cursor.sql(f"SELECT * FROM {source} LIMIT 0", params=params).columns)
    projection = ", ".join(_column_expr(name, present) for name in COLUMNS)
    sql = (f"SELECT {', '.join(map(_quote, columns))} FROM (SELECT {projection} FROM {source}) WHERE {where} "
           f"{_ORDER_BY}")
    return cursor.sql(sql, params=params).to_arrow_table().to_pandas()


def _scan(files: list[Path], columns: list[str], where: str) -> pd.DataFrame:
    """Query all files at once; then, if that fails, by column name (dumps of an older schema version
    lack optional columns), then one by one naming the unreadable ones. Rows come in ORDER.

    Results go through Arrow (`to_arrow_table().to_pandas()`), not DuckDB's `.df()`: measured faster on
    large results and the dtypes are exactly those of an empty result built from the schema.
    """
    sql = (f"SELECT {', '.join(map(_quote, columns))} FROM read_parquet($files, {_READ_OPTIONS}) WHERE {where} "
           f"{_ORDER_BY}")
    cursor = _cursor()
    try:
        return cursor.sql(sql, params={"files": [os.fspath(f) for f in files]}).to_arrow_table().to_pandas()
    except duckdb.Error:
        pass
    try:
        return _scan_by_name(cursor, files, columns, where)
    except duckdb.Error:
        pass
    frames = []
    keyed = [*columns, *(key for key in ORDER if key not in columns)]  # the sort keys, even when not asked for
    for path in files:
        try:
            frames.append(_scan_by_name(cursor, [path], keyed, where))
        except duckdb.Error as err:
            message = str(err).splitlines()[0]
            warnings.warn(f"{path}: unreadable token dump skipped ({message})", RunStoreWarning, stacklevel=3)
    frames = [f for f in frames if len(f)]
    if not frames:
        return _empty(columns)
    frame = pd.concat(frames, ignore_index=True).sort_values(list(ORDER), kind="stable", ignore_index=True)
    return frame[columns]


def decode_reasons(codes: pd.Series | np.ndarray) -> pd.Categorical:
    """Stored int8 mask-reason codes as a pandas Categorical of names ('kept', 'veto', ...)."""
    codes = np.asarray(codes, dtype=np.int64)
    known = np.isin(codes, list(MASK_REASONS))
    return pd.Categorical.from_codes(np.where(known, codes, -1), categories=list(MASK_REASONS.values()))


def query_tokens(
    run_dir: RunPaths,
    steps: Steps | None = None,
    samples: Iterable[int] | None = None,
    masked_only: bool = False,
    prob_range: ProbRange | None = None,
    columns: Sequence[str] | None = None,
    *,
    prompts: Iterable[int] | None = None,
    reasons: Iterable[str] | None = None,
    reason_names: bool = True,
    lags: StepRange | None = None,
    routing_mismatched: bool = False,
) -> pd.DataFrame:
    """Token rows of one run (or several: pass a list, a `run` column is added) matching every filter.

    steps: one step, an inclusive (lo, hi) with either end None for open, or a range (exactly its steps).
    samples / prompts: sample_id / prompt_id values.
    masked_only: only tokens excluded from the loss; reasons: only these mask reasons (names of
    schema.MASK_REASONS). prob_range: inclusive (lo, hi) on the rollout probability exp(rollout_logprob).
    lags: inclusive (lo, hi) on the sample's staleness (policy versions behind π_old; async training).
    routing_mismatched: only tokens whose MoE routing differed between the engine and the trainer in some layer.
    columns: the columns to return (default all; fewer is faster). reason_names: `mask_reason` as a
    Categorical of names instead of the stored int code. Rows come in (step, sample, position) order.
    A run directory that does not exist raises FileNotFoundError naming it.
    """
    runs, many = _as_runs(run_dir)
    runs = [existing_dir(run) for run in runs]
    bounds, wanted_step = _step_selection(steps)
    wanted = list(columns) if columns is not None else list(COLUMNS)
    unknown = [c for c in wanted if c not in COLUMNS]
    if unknown:
        raise ValueError(f"unknown token columns {unknown}; known: {list(COLUMNS)}")
    where = where_clause(bounds, samples, prompts, masked_only, reasons, prob_range, lags, routing_mismatched)
    frames = []
    for run in runs:
        files = [p for step, paths in token_files(run).items() if wanted_step(step) for p in paths]
        frame = _scan(files, wanted, where) if files else _empty(wanted)
        if many:
            frame.insert(0, "run", run.name)
        frames.append(frame)
    if not frames:
        return _empty(wanted)
    frame = pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]
    if many:
        frame["run"] = frame["run"].astype("category")
    if reason_names and "mask_reason" in frame:
        frame["mask_reason"] = decode_reasons(frame["mask_reason"].to_numpy())
    return frame


def mask_reason_counts(run_dir: str | os.PathLike, steps: Steps | None = None) -> dict[str, int]:
    """Dumped tokens per mask reason name ('kept' included), counted inside the scan."""
    wanted_step = _step_selection(steps)[1]
    dumps = token_files(existing_dir(run_dir))
    files = [os.fspath(p) for step, paths in dumps.items() if wanted_step(step) for p in paths]
    if not files:
        return {}
    sql = "SELECT mask_reason, count(*) FROM read_parquet($files) GROUP BY mask_reason ORDER BY mask_reason"
    try:
        rows = _cursor().sql(sql, params={"files": files}).fetchall()
    except duckdb.Error:  # a damaged file: fall back to the per-file path, which names it
        codes = query_tokens(run_dir, steps=steps, columns=["mask_reason"], reason_names=False)["mask_reason"]
        rows = list(codes.value_counts().sort_index().items())
    return {MASK_REASONS.get(int(code), f"code{int(code)}"): int(count) for code, count in rows}
