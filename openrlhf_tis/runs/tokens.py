"""Per-token dumps: which steps and samples are dumped, and writing one step as one Parquet file.

Dumps are sampled (every N steps, K samples) so disk stays bounded, and each step is written whole
through a temp file and a rename, so a killed run never leaves a half-written dump. The selection is
a pure function of (seed, step) so a resumed run picks the same samples as the run it continues.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from openrlhf_tis.runs.layout import atomic_write, token_file
from openrlhf_tis.runs.schema import (
    COLUMNS,
    LIST_COLUMNS,
    MASK_REASONS,
    NOT_COMPARED,
    OPTIONAL_COLUMNS,
    REQUIRED_COLUMNS,
    SCHEMA,
    TEXT_COLUMNS,
)

# Float columns are stored byte-stream-split: with zstd a few percent smaller than plain (bench_runs.py).
_FLOAT_COLUMNS = [name for name, (dtype, _) in COLUMNS.items() if pa.types.is_floating(dtype)]
_PARQUET_OPTIONS: dict[str, Any] = {
    "compression": "zstd",
    "use_dictionary": list(TEXT_COLUMNS),
    "use_byte_stream_split": _FLOAT_COLUMNS,
    "write_statistics": True,
}


def should_dump(step: int, every_n: int) -> bool:
    """Whether `step` gets a token dump: step 1 (the baseline) and every `every_n`-th; never when every_n <= 0."""
    if every_n <= 0:
        return False
    return step == 1 or step % every_n == 0


def select_samples(num_samples: int, k: int, step: int, seed: int = 0, group_size: int = 1) -> np.ndarray:
    """Sorted indices of the samples to dump at `step`: `k` of `num_samples`, chosen by (seed, step).

    k < 0 dumps all samples, k == 0 none. With `group_size` > 1 (n_samples_per_prompt, samples of a
    prompt adjacent) whole prompt groups are chosen, k rounded up to whole groups, because
    group-relative advantages only make sense next to the group's other responses.
    """
    if k < 0 or k >= num_samples:
        return np.arange(num_samples)
    if k == 0:
        return np.arange(0)
    rng = np.random.default_rng([seed, step])
    if group_size > 1:
        groups = num_samples // group_size
        n_groups = min(groups, -(-k // group_size))
        chosen = np.sort(rng.choice(groups, size=n_groups, replace=False))
        return (chosen[:, None] * group_size + np.arange(group_size)).reshape(-1)
    return np.sort(rng.choice(num_samples, size=k, replace=False))


def to_numpy(value: Any) -> np.ndarray:
    """A column as numpy; torch tensors by duck typing (bf16 has no numpy dtype: floats go via float32)."""
    if hasattr(value, "detach"):
        value = value.detach()
        if value.is_floating_point():
            value = value.float()
        return value.cpu().numpy()
    return np.asarray(value)


def flatten_response_tokens(
    action_mask: Any,
    per_token: Mapping[str, Any],
    per_sample: Mapping[str, Any] | None = None,
    rows: Any = None,
) -> dict[str, np.ndarray]:
    """Turn padded [B, T] batch tensors into flat per-token columns for `TokenDumpWriter.write_step`.

    Keeps the tokens where `action_mask` is set, for the batch rows in `rows` (default: all), in
    (sample, position) order, and adds `position` (0-based within the response). A per-token value may have
    trailing axes ([B, T, ...]: e.g. one flag per MoE layer), kept as [N, ...]. `per_sample` values
    ([B], e.g. sample_id, prompt_id, reward) are repeated on each token of their sample.
    """
    mask = to_numpy(action_mask).astype(bool)
    if mask.ndim != 2:
        raise ValueError(f"action_mask must be [batch, tokens], got shape {mask.shape}")
    rows = np.arange(mask.shape[0]) if rows is None else to_numpy(rows).astype(np.int64)
    mask = mask[rows]
    columns: dict[str, np.ndarray] = {"position": (np.cumsum(mask, axis=1) - 1)[mask]}
    for name, value in per_token.items():
        array = to_numpy(value)
        if array.ndim < 2:
            raise ValueError(f"per-token column {name!r} must be [batch, tokens, ...], got shape {array.shape}")
        array = array[rows]
        if array.shape[:2] != mask.shape:
            raise ValueError(f"per-token column {name!r} has shape {array.shape}, action_mask {mask.shape}")
        columns[name] = array[mask]
    counts = mask.sum(axis=1)
    for name, value in (per_sample or {}).items():
        array = to_numpy(value).reshape(-1)[rows]
        columns[name] = np.repeat(array, counts)
    return columns


def routing_mismatch_layers(differed: Any, compared: Any) -> np.ndarray:
    """The `routing_mismatch_layers` column from per-token flags: `differed` [N, layers] (the engine's and the
    trainer's top-k sets differ in that layer), `compared` [N] (some layer was routed by both). Each entry is the
    ascending int16 layer indices that differed, None where the token was not compared."""
    differed, compared = to_numpy(differed).astype(bool), to_numpy(compared).astype(bool).reshape(-1)
    if differed.ndim != 2 or len(differed) != len(compared):
        raise ValueError(f"routing mismatch: [tokens, layers] flags and [tokens] compared expected, got "
                         f"{differed.shape} and {compared.shape}")
    out = np.empty(len(compared), dtype=object)
    for i in range(len(compared)):
        out[i] = np.flatnonzero(differed[i]).astype(np.int16) if compared[i] else None
    return out


def _layer_lists(step: int, columns: Mapping[str, Any], n: int) -> tuple[pa.Array, np.ndarray]:
    """`routing_mismatch_layers` as an Arrow list array and its lengths as `routing_mismatch_count` (NOT_COMPARED
    where null), checked against a count the writer gave."""
    given = columns.get("routing_mismatch_layers")
    layers = (pa.array(list(given), COLUMNS["routing_mismatch_layers"][0]) if given is not None
              else pa.nulls(n, COLUMNS["routing_mismatch_layers"][0]))
    if len(layers) != n:
        raise ValueError(f"token dump of step {step}: routing_mismatch_layers has {len(layers)} rows, not {n}")
    count = np.where(layers.is_null().to_numpy(zero_copy_only=False), NOT_COMPARED,
                     layers.value_lengths().fill_null(0).to_numpy(zero_copy_only=False)).astype(np.int16)
    if "routing_mismatch_count" in columns and not np.array_equal(to_numpy(columns["routing_mismatch_count"]), count):
        raise ValueError(f"token dump of step {step}: `routing_mismatch_count` disagrees with the length of "
                         "`routing_mismatch_layers` (-1 where null)")
    return layers, count


class TokenDumpWriter:
    """Writes one Parquet file per dumped step under `<run_dir>/tokens/` with the fixed schema (schema.py).

    `tokenizer` (optional, anything with `decode(list[int])`) fills `token_text` when the caller does
    not; decoded ids are cached for the life of the writer.
    """

    def __init__(self, run_dir: str | os.PathLike, tokenizer: Any = None):
        self.dir = Path(run_dir)
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def _token_text(self, token_ids: np.ndarray) -> pa.Array:
        if self.tokenizer is None:
            return pa.nulls(len(token_ids), pa.string())
        unique, inverse = np.unique(token_ids, return_inverse=True)
        for token in unique.tolist():
            if token not in self._texts:
                self._texts[token] = self.tokenizer.decode([token])
        vocab = pa.array([self._texts[t] for t in unique.tolist()], pa.string())
        return pa.DictionaryArray.from_arrays(pa.array(inverse.astype(np.int32)), vocab).cast(pa.string())

    def build_table(self, step: int, columns: Mapping[str, Any]) -> pa.Table:
        """Validate `columns` (equal-length 1-D arrays or tensors named as in schema.COLUMNS) into a table."""
        unknown = set(columns) - set(COLUMNS)
        missing = [name for name in REQUIRED_COLUMNS if name not in columns]
        if unknown or missing:
            raise ValueError(
                f"token dump of step {step}: unknown columns {sorted(unknown)}, missing columns {missing}; "
                f"required: {list(REQUIRED_COLUMNS)}, optional: {sorted(OPTIONAL_COLUMNS)}"
            )
        arrays = {name: to_numpy(value) for name, value in columns.items()
                  if name not in TEXT_COLUMNS and name not in LIST_COLUMNS}
        n = len(arrays["token_id"])
        bad = {name: array.shape for name, array in arrays.items() if array.shape != (n,)}
        if bad:
            raise ValueError(f"token dump of step {step}: columns must be 1-D of length {n}; got {bad}")
        unknown_codes = set(np.unique(arrays["mask_reason"]).tolist()) - set(MASK_REASONS)
        if unknown_codes:
            raise ValueError(f"token dump of step {step}: mask_reason codes {sorted(unknown_codes)} not in "
                             f"MASK_REASONS {MASK_REASONS}")
        codes = arrays["mask_reason"].astype(np.int8)
        if "step" in arrays and not np.all(arrays["step"] == step):
            raise ValueError(f"token dump of step {step}: the `step` column holds other steps; one file is one step")
        if "masked" in arrays and not np.array_equal(arrays["masked"].astype(bool), codes != 0):
            raise ValueError(f"token dump of step {step}: `masked` disagrees with `mask_reason != 0`")
        arrays["mask_reason"] = codes
        arrays["masked"] = codes != 0
        arrays.setdefault("step", np.full(n, step))
        arrays.setdefault("old_logprob", np.full(n, np.nan, dtype=np.float32))
        arrays.setdefault("lag", np.zeros(n, dtype=np.int32))
        layers, arrays["routing_mismatch_count"] = _layer_lists(step, columns, n)
        fields = {"routing_mismatch_layers": layers}
        for name, (dtype, _) in COLUMNS.items():
            if name in LIST_COLUMNS:
                continue
            if name in TEXT_COLUMNS:
                text = columns.get(name)
                fields[name] = (pa.array(list(text), pa.string()) if text is not None
                                else self._token_text(arrays["token_id"]) if name == "token_text"
                                else pa.nulls(n, pa.string()))
                if len(fields[name]) != n:
                    raise ValueError(f"token dump of step {step}: {name} has {len(fields[name])} rows, not {n}")
            else:
                fields[name] = pa.array(arrays[name].astype(dtype.to_pandas_dtype(), copy=False), dtype)
        return pa.Table.from_pydict(fields, schema=SCHEMA)

    def write_step(
        self, step: int, columns: Mapping[str, Any], part: int | None = None, overwrite: bool = False
    ) -> Path | None:
        """Write one step's dump atomically; None when that file exists already (a resumed run keeps it).

        `part` gives each process its own file when several write tokens of the same step (e.g. one per
        data-parallel rank): step_000012.part003.parquet. Readers treat all parts of a step as one.
        """
        path = token_file(self.dir, step, part)
        if path.exists() and not overwrite:
            return None
        table = self.build_table(step, columns)
        return atomic_write(path, lambda f: pq.write_table(table, f, **_PARQUET_OPTIONS))
