"""The fixed Parquet schema of a token dump (one row per response token of a sampled step).

Fixed so that dumps of different runs and versions read together, and float32 because a dumped
token must stay cheap on disk (benchmarks/bench_runs.py measures bytes per token) while float32
still resolves log-probs to ~1e-7, far below the bf16 mismatch being studied.

`mask_reason` is a small int code rather than a string: it filters and compresses as an int, and
readers turn it into names with `MASK_REASONS`. When several reasons apply to one token the writer
stores the first of `MASK_REASON_PRECEDENCE` (see `mask_reason_codes`).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

SCHEMA_VERSION = 4  # 2: `lag` (async training's staleness); 3: `prompt_text`; 4: `routing_mismatch_*` (MoE)

# Code -> name. Stable: codes are stored on disk, so add new reasons at the end, never renumber.
MASK_REASONS: dict[int, str] = {
    0: "kept",  # the token contributes to the loss
    1: "bounds",  # IS weight outside the mask-mode bounds (IcePop/MIS token or sequence ratio bounds)
    2: "rejection",  # a rejection-sampling criterion (k1/k2/k3 statistics, ratio at any level) rejected it
    3: "veto",  # its sequence holds a token beyond the veto threshold
    4: "nan",  # a non-finite log-prob or weight
    5: "opsm",  # off-policy sequence masking
}
MASK_REASON_CODES: dict[str, int] = {name: code for code, name in MASK_REASONS.items()}
# Which reason is stored when several apply: the most fundamental first (a NaN token is reported as
# NaN even if it also sits in a vetoed sequence).
MASK_REASON_PRECEDENCE = ("nan", "veto", "rejection", "opsm", "bounds")

# Column -> (arrow type, meaning). Order here is the order on disk.
COLUMNS: dict[str, tuple[pa.DataType, str]] = {
    "step": (pa.int32(), "training step (global_step) the tokens were trained on"),
    "sample_id": (pa.int32(), "index of the response among the step's samples (stable across the dump)"),
    "prompt_id": (pa.int32(), "index of the prompt the response answers (samples of a group share it)"),
    "position": (pa.int32(), "0-based index of the token within the response"),
    "token_id": (pa.int32(), "vocabulary id"),
    "token_text": (pa.string(), "decoded text of the token alone (null when no tokenizer was given)"),
    "rollout_logprob": (pa.float32(), "log μ(token): behaviour log-prob returned by vLLM"),
    "old_logprob": (pa.float32(), "log π_old(token) recomputed by the trainer (NaN in bypass mode)"),
    "train_logprob": (pa.float32(), "log π_θ(token) at the first update of the step"),
    "is_weight_raw": (pa.float32(), "importance weight before bounds/truncation"),
    "is_weight": (pa.float32(), "importance weight after bounds, truncation and normalization"),
    "masked": (pa.bool_(), "True when the token is excluded from the loss"),
    "mask_reason": (pa.int8(), "why it is excluded: a code of MASK_REASONS (0 = kept)"),
    "advantage": (pa.float32(), "advantage used in the loss"),
    "entropy": (pa.float32(), "training policy entropy at the token"),
    "reward": (pa.float32(), "the sample's reward, repeated on each of its tokens"),
    "lag": (pa.int32(), "policy versions between the sample's rollout policy and π_old (0: on-policy; async)"),
    "prompt_text": (pa.string(), "the prompt the response answers, repeated on each of its tokens (null when "
                    "the writer did not give it)"),
    "routing_mismatch_count": (pa.int16(), "MoE layers whose top-k expert sets differ between the engine and the "
                               "trainer at the forward position that scores the token (-1: not compared)"),
    "routing_mismatch_layers": (pa.list_(pa.int16()), "those layers' decoder indices, ascending (null: not "
                                "compared; empty: every routed layer agreed)"),
}
SCHEMA = pa.schema(
    [pa.field(name, dtype) for name, (dtype, _) in COLUMNS.items()],
    metadata={b"openrlhf_tis.token_dump.schema_version": str(SCHEMA_VERSION).encode()},
)
# Columns a writer may leave out: `step` is the step written, `token_text` comes from the tokenizer
# (else null), `old_logprob` is NaN (bypass mode has no π_old), `masked` is `mask_reason != 0`, `lag` is 0
# (version-1 dumps predate async training: every run was synchronous), `prompt_text` is null. Text columns are
# dictionary-encoded on disk: a prompt repeated on every token of its response costs one entry.
# The routing columns are filled only in a run whose samples carry the engine's routed experts (routing replay,
# docs/moe.md); elsewhere, and in dumps before version 4, a token was not compared: count -1, layers null. The
# count is the layers' length, written beside them so that a filter on it reads one small int column.
OPTIONAL_COLUMNS = frozenset({"step", "token_text", "old_logprob", "masked", "lag", "prompt_text",
                              "routing_mismatch_count", "routing_mismatch_layers"})
TEXT_COLUMNS = ("token_text", "prompt_text")
REQUIRED_COLUMNS = tuple(name for name in COLUMNS if name not in OPTIONAL_COLUMNS)
LIST_COLUMNS = ("routing_mismatch_layers",)
NOT_COMPARED = -1
"""`routing_mismatch_count` of a token whose routing was not compared."""


def mask_reason_codes(n: int | None = None, **reasons: np.ndarray | None) -> np.ndarray:
    """One int8 code per token from boolean masks named after `MASK_REASONS` (e.g. veto=..., nan=...).

    Each mask is True where that reason excludes the token; where several are True the first of
    `MASK_REASON_PRECEDENCE` wins. Masks given as None are ignored. `n` sizes the result when no
    mask is given.
    """
    unknown = set(reasons) - set(MASK_REASON_PRECEDENCE)
    if unknown:
        raise ValueError(f"unknown mask reasons {sorted(unknown)}; known: {list(MASK_REASON_PRECEDENCE)}")
    arrays = {name: np.asarray(mask, dtype=bool).reshape(-1) for name, mask in reasons.items() if mask is not None}
    if n is None:
        if not arrays:
            raise ValueError("mask_reason_codes needs n when no mask is given")
        n = len(next(iter(arrays.values())))
    codes = np.zeros(n, dtype=np.int8)
    for name in reversed(MASK_REASON_PRECEDENCE):  # later assignment wins, so go lowest precedence first
        if name in arrays:
            codes[arrays[name]] = MASK_REASON_CODES[name]
    return codes

