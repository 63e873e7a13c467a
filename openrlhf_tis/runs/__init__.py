"""The run store (docs/design.md §6): one directory per run, written atomically, read back as DataFrames.

Writing: `RunWriter` (config.json + metrics.jsonl), `TokenDumpWriter` (tokens/step_*.parquet) with
`should_dump` / `select_samples` / `flatten_response_tokens`. Reading: `list_runs`, `load_metrics`,
`query_tokens`, `summary`. Console: `openrlhf-tis-runs list|show` (runs/cli.py).
"""

from openrlhf_tis.runs.config import OVERRIDE_FLAG, RunConfigMismatch, check_resume, read_run_config, resolve_config
from openrlhf_tis.runs.layout import RunStoreWarning
from openrlhf_tis.runs.query import decode_reasons, mask_reason_counts, query_tokens, token_steps
from openrlhf_tis.runs.reader import list_runs, load_metrics
from openrlhf_tis.runs.schema import COLUMNS, MASK_REASON_CODES, MASK_REASONS, SCHEMA, mask_reason_codes
from openrlhf_tis.runs.store import RunWriter
from openrlhf_tis.runs.summary import summary
from openrlhf_tis.runs.tokens import (
    TokenDumpWriter,
    flatten_response_tokens,
    select_samples,
    should_dump,
)

__all__ = [
    "COLUMNS",
    "MASK_REASON_CODES",
    "MASK_REASONS",
    "OVERRIDE_FLAG",
    "SCHEMA",
    "RunConfigMismatch",
    "RunStoreWarning",
    "RunWriter",
    "TokenDumpWriter",
    "check_resume",
    "decode_reasons",
    "flatten_response_tokens",
    "list_runs",
    "load_metrics",
    "mask_reason_codes",
    "mask_reason_counts",
    "query_tokens",
    "read_run_config",
    "resolve_config",
    "select_samples",
    "should_dump",
    "summary",
    "token_steps",
]
