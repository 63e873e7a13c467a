"""Benchmark of the run store's token dumps: bytes per token, write cost, and filtered-query engines.

Generates a synthetic run in the run-store layout (tokens/step_*.parquet written by TokenDumpWriter,
the same path the trainer uses), then times the same filtered queries with each engine and prints one
table with timings and ratios to the run store's own `query_tokens` (DuckDB, files pruned by step
name). Every engine must return the same row count, or the benchmark stops.

    .venv/bin/python benchmarks/bench_runs.py                 # 5M rows (~1 min to generate on 2 cores)
    .venv/bin/python benchmarks/bench_runs.py --rows 200000   # quick look

Engines: the store's reader (DuckDB on the files named in the step range), DuckDB and pyarrow.dataset
on a glob of all files (pruning by row-group statistics only), pyarrow.dataset on the files named in
the step range, and polars on those files when it is installed (pip install polars; not a dependency).
Timings are warm (page cache hot), the best of --repeat runs with the engines taking turns, and include
building the pandas DataFrame.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.compute as pc
import pyarrow.dataset as ds

from openrlhf_tis.run_spec import DumpPlan
from openrlhf_tis.runs import TokenDumpWriter, mask_reason_codes, query_tokens
from openrlhf_tis.runs.layout import TOKEN_FILE_PATTERN, TOKENS_DIR, token_files
from openrlhf_tis.runs.query import _float32_bound, where_clause
from openrlhf_tis.runs.schema import SCHEMA

DEFAULT_DUMP_EVERY, DEFAULT_DUMP_SAMPLES = DumpPlan().steps, DumpPlan().samples  # the run's, unless flags say


class FakeTokenizer:
    """Decodes ids to word-like strings so token_text has a realistic dictionary."""

    def decode(self, ids: list[int]) -> str:
        token = ids[0]
        return (" " if token % 3 else "") + "tok" + format(token, "x")


def make_step(step: int, samples: int, mean_len: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """One dumped step: `samples` responses of geometric-ish lengths, probabilities skewed towards 1."""
    lengths = np.clip(rng.normal(mean_len, mean_len / 4, samples).astype(int), 8, 4 * mean_len)
    n = int(lengths.sum())
    sample_id = np.repeat(np.arange(samples), lengths)
    position = np.concatenate([np.arange(length) for length in lengths])
    # Most sampled tokens have p close to 1; ~15% come from a log-uniform tail down to 1e-4 (where the
    # mismatch lives), so ~4% have p < 0.01.
    tail = rng.random(n) < 0.15
    rollout = np.where(tail, rng.uniform(math.log(1e-4), 0.0, n), np.log(np.clip(rng.beta(2.0, 0.25, n), 1e-8, 1.0)))
    old = rollout + rng.normal(0, 0.03, n)
    train = old + rng.normal(0, 0.01, n)
    raw = np.exp(old - rollout)
    bounds = (raw < 0.5) | (raw > 2.0)
    veto_samples = rng.random(samples) < 0.02
    nan = rng.random(n) < 1e-4
    codes = mask_reason_codes(bounds=bounds, veto=veto_samples[sample_id], nan=nan)
    advantage = rng.normal(0, 1, samples)[sample_id]
    return {
        "sample_id": sample_id,
        "prompt_id": sample_id // 4,
        "position": position,
        "token_id": np.minimum(rng.zipf(1.3, n), 49151) - 1,
        "rollout_logprob": rollout,
        "old_logprob": old,
        "train_logprob": train,
        "is_weight_raw": raw,
        "is_weight": np.where(codes == 0, np.minimum(raw, 2.0), 0.0),
        "mask_reason": codes,
        "advantage": advantage,
        "entropy": rng.exponential(0.8, n),
        "reward": rng.random(samples)[sample_id],
    }


def generate(run_dir: Path, rows: int, samples: int, mean_len: int, seed: int = 0) -> dict[str, float]:
    writer = TokenDumpWriter(run_dir, tokenizer=FakeTokenizer())
    rng = np.random.default_rng(seed)
    written, step, write_s = 0, 0, 0.0
    while written < rows:
        step += DEFAULT_DUMP_EVERY
        columns = make_step(step, samples, mean_len, rng)
        start = time.perf_counter()
        writer.write_step(step, columns)
        write_s += time.perf_counter() - start
        written += len(columns["token_id"])
    return {"rows": written, "steps": step // DEFAULT_DUMP_EVERY, "write_s": write_s}


# --- the queries: (name, kwargs of query_tokens) -------------------------------------------------------
def queries(last_step: int) -> list[tuple[str, dict]]:
    mid = last_step // 2 // DEFAULT_DUMP_EVERY * DEFAULT_DUMP_EVERY
    return [
        ("one step, all columns", dict(steps=(mid, mid))),
        ("20 steps, all columns", dict(steps=(mid, mid + 19 * DEFAULT_DUMP_EVERY))),
        ("masked only, all steps", dict(masked_only=True, columns=["step", "sample_id", "position",
                                                                     "rollout_logprob", "train_logprob",
                                                                     "mask_reason"])),
        ("p<0.01, all steps", dict(prob_range=(0.0, 0.01), columns=["step", "rollout_logprob", "train_logprob"])),
        ("one sample, all steps", dict(samples=[3], columns=["step", "position", "token_text", "rollout_logprob",
                                                              "train_logprob", "is_weight"])),
        ("half the steps, masked, p in [0.1,0.9]", dict(steps=(1, mid), masked_only=True, prob_range=(0.1, 0.9))),
        ("scan: 3 columns, all rows", dict(columns=["step", "rollout_logprob", "train_logprob"])),
    ]


def _files(run_dir: Path, steps) -> list[str]:
    lo, hi = steps if steps else (None, None)
    return [os.fspath(p) for s, paths in token_files(run_dir).items()
            if (lo is None or s >= lo) and (hi is None or s <= hi) for p in paths]


def _where(q: dict) -> str:
    return where_clause(steps=q.get("steps"), samples=q.get("samples"), masked_only=q.get("masked_only", False),
                        prob_range=q.get("prob_range"))


def engine_store(run_dir: Path) -> Callable[[dict], pd.DataFrame]:
    """The run store's own reader (DuckDB over the files whose name is in the step range)."""
    return lambda q: query_tokens(run_dir, reason_names=False, **q)


def _arrow_filter(q: dict) -> pc.Expression | None:
    terms = []
    if q.get("steps"):
        terms += [pc.field("step") >= q["steps"][0], pc.field("step") <= q["steps"][1]]
    if q.get("samples"):
        terms.append(pc.field("sample_id").isin(q["samples"]))
    if q.get("masked_only"):
        terms.append(pc.field("masked"))
    if q.get("prob_range"):
        lo, hi = q["prob_range"]
        if lo > 0:
            terms.append(pc.field("rollout_logprob") >= _float32_bound(math.log(lo), upper=False))
        terms.append(pc.field("rollout_logprob") <= _float32_bound(math.log(hi), upper=True))
    expr = None
    for term in terms:
        expr = term if expr is None else expr & term
    return expr


def engine_arrow_pruned(run_dir: Path) -> Callable[[dict], pd.DataFrame]:
    """pyarrow.dataset over the files whose name is in the step range (the store's first implementation)."""
    schema = SCHEMA.remove_metadata()

    def run(q: dict) -> pd.DataFrame:
        dataset = ds.dataset(_files(run_dir, q.get("steps")), schema=schema, format="parquet")
        return dataset.to_table(columns=q.get("columns"), filter=_arrow_filter(q)).to_pandas()
    return run


def engine_arrow_glob(run_dir: Path) -> Callable[[dict], pd.DataFrame]:
    """pyarrow.dataset over the whole tokens/ directory: no pruning by file name, row-group statistics only."""
    def run(q: dict) -> pd.DataFrame:
        dataset = ds.dataset(run_dir / TOKENS_DIR, format="parquet")
        return dataset.to_table(columns=q.get("columns"), filter=_arrow_filter(q)).to_pandas()
    return run


def engine_duckdb_glob(run_dir: Path) -> Callable[[dict], pd.DataFrame]:
    """DuckDB over tokens/step_*.parquet: no pruning by file name, row-group statistics only."""
    import duckdb

    con = duckdb.connect()
    pattern = os.fspath(run_dir / TOKENS_DIR / TOKEN_FILE_PATTERN)

    def run(q: dict) -> pd.DataFrame:
        cols = ", ".join(q.get("columns") or ["*"])
        return con.sql(f"SELECT {cols} FROM read_parquet($p) WHERE {_where(q)}", params={"p": pattern}).df()
    return run


def engine_polars(run_dir: Path) -> Callable[[dict], pd.DataFrame] | None:
    try:
        import polars as pl
    except ImportError:
        return None

    def run(q: dict) -> pd.DataFrame:
        frame = pl.scan_parquet(_files(run_dir, q.get("steps")))
        if q.get("samples"):
            frame = frame.filter(pl.col("sample_id").is_in(q["samples"]))
        if q.get("masked_only"):
            frame = frame.filter(pl.col("masked"))
        if q.get("prob_range"):
            lo, hi = q["prob_range"]
            if lo > 0:
                frame = frame.filter(pl.col("rollout_logprob") >= _float32_bound(math.log(lo), upper=False))
            frame = frame.filter(pl.col("rollout_logprob") <= _float32_bound(math.log(hi), upper=True))
        if q.get("columns"):
            frame = frame.select(q["columns"])
        return frame.collect().to_pandas()
    return run


def time_round_robin(engines: dict[str, Callable[[dict], pd.DataFrame]], q: dict, repeat: int
                     ) -> tuple[dict[str, float], set[int]]:
    """Best time per engine, the engines taking turns within each repeat so that a burst of load from
    other jobs on the machine hits them alike rather than whichever ran during it."""
    best = dict.fromkeys(engines, math.inf)
    counts = set()
    for _ in range(repeat):
        for name, engine in engines.items():
            start = time.perf_counter()
            counts.add(len(engine(q)))
            best[name] = min(best[name], time.perf_counter() - start)
    return best, counts


def store_arguments(description: str, repeat: int, repeat_help: str) -> argparse.ArgumentParser:
    """The flags both run-store benchmarks share (bench_explorer.py reuses this store and its generator)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--rows", type=int, default=5_000_000, help="token rows to generate")
    parser.add_argument("--samples", type=int, default=DEFAULT_DUMP_SAMPLES, help="samples per dumped step")
    parser.add_argument("--mean-len", type=int, default=1000, help="mean response length in tokens")
    parser.add_argument("--repeat", type=int, default=repeat, help=repeat_help)
    parser.add_argument("--dir", type=Path, default=None, help="reuse/keep the generated run here")
    return parser


@contextlib.contextmanager
def bench_store(args: argparse.Namespace, prefix: str) -> Iterator[Path]:
    """The run directory to measure: `--dir` (kept) or a temporary one, generated first when it holds no dumps."""
    tmp = None if args.dir is not None else tempfile.mkdtemp(prefix=prefix)
    run_dir = args.dir if tmp is None else Path(tmp) / "run"
    try:
        if not token_files(run_dir):
            start = time.perf_counter()
            gen = generate(run_dir, args.rows, args.samples, args.mean_len)
            print(f"generated {gen['rows']:,} token rows in {gen['steps']} step files "
                  f"({time.perf_counter() - start:.1f} s; TokenDumpWriter.write_step: "
                  f"{gen['write_s'] / gen['steps'] * 1e3:.1f} ms/step, {gen['rows'] / gen['write_s']:,.0f} rows/s)")
        yield run_dir
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = store_arguments(__doc__.split("\n\n")[0], 5, "timings are the best of this many runs").parse_args(argv)
    with bench_store(args, "bench_runs_") as run_dir:
        files = [p for paths in token_files(run_dir).values() for p in paths]
        total_bytes = sum(p.stat().st_size for p in files)
        rows = ds.dataset([os.fspath(p) for p in files], format="parquet").count_rows()
        per_token = total_bytes / rows
        per_dump = per_token * args.samples * args.mean_len
        print(f"{rows:,} rows, {len(files)} files, {total_bytes / 2**20:.1f} MiB: {per_token:.2f} bytes/token; "
              f"default sampling (every {DEFAULT_DUMP_EVERY} steps, {args.samples} samples x ~{args.mean_len} tokens): "
              f"{per_dump / 2**10:.0f} KiB per dumped step = {per_dump / DEFAULT_DUMP_EVERY / 2**10:.1f} KiB per "
              f"training step")

        last_step = max(token_files(run_dir))
        engines = {"store: DuckDB, by name": engine_store(run_dir),
                   "DuckDB, glob+stats": engine_duckdb_glob(run_dir),
                   "pyarrow.ds, by name": engine_arrow_pruned(run_dir),
                   "pyarrow.ds, glob+stats": engine_arrow_glob(run_dir)}
        polars = engine_polars(run_dir)
        if polars is None:
            print("(polars not installed: skipped; pip install polars to compare)")
        else:
            engines["polars, by name"] = polars
        results = []
        for qname, q in queries(last_step):
            best, counts = time_round_robin(engines, q, args.repeat)
            row = {"query": qname, **best}
            if len(counts) != 1:
                print(f"engines disagree on {qname!r}: row counts {counts}", file=sys.stderr)
                return 1
            row["rows"] = counts.pop()
            results.append(row)
        table = pd.DataFrame(results).set_index("query")
        base = next(iter(engines))
        print(f"\nbest of {args.repeat}, milliseconds (x = time / store time), {os.cpu_count()} cores:")
        lines = []
        for qname, r in table.iterrows():
            cells = [f"{r[e] * 1e3:8.1f} ms ({r[e] / r[base]:4.1f}x)" for e in engines]
            lines.append((qname, int(r["rows"]), cells))
        width = max(len(q) for q, _, _ in lines)
        header = f"{'query':<{width}} {'rows':>9}  " + "  ".join(f"{e[:22]:>22}" for e in engines)
        print(header)
        for qname, n, cells in lines:
            print(f"{qname:<{width}} {n:>9,}  " + "  ".join(f"{c:>22}" for c in cells))
        for e in engines:
            print(f"  {e}: median {statistics.median(table[e]) * 1e3:.1f} ms, max {table[e].max() * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
