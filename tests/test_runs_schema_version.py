"""Dumps of an older schema version still read (missing optional columns get their documented meaning);
NaN log-probs that Parquet statistics hide."""

from __future__ import annotations

import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from openrlhf_tis.runs import TokenDumpWriter, query_tokens
from openrlhf_tis.runs.layout import token_file
from openrlhf_tis.runs.schema import SCHEMA_VERSION

VERSION_KEY = b"openrlhf_tis.token_dump.schema_version"
# A "version 0" dump as an early writer made it: no schema metadata, float64/int64 columns, and none of
# token_text, old_logprob, masked, step.
V0_ROLLOUT = np.log([0.9, 0.05, 0.5, 0.002])
V0_TRAIN = np.log([0.8, 0.1, 0.5, 0.004])
V0_REASON = np.array([0, 1, 0, 3], dtype=np.int8)


def _write_v0(path) -> None:
    table = pa.table({
        "sample_id": np.array([0, 0, 1, 1]), "prompt_id": np.array([0, 0, 0, 0]),
        "position": np.array([0, 1, 0, 1]), "token_id": np.array([11, 12, 13, 14]),
        "rollout_logprob": V0_ROLLOUT, "train_logprob": V0_TRAIN, "is_weight_raw": np.exp(V0_TRAIN - V0_ROLLOUT),
        "is_weight": np.array([0.9, 0.0, 1.0, 0.0]), "mask_reason": pa.array(V0_REASON, pa.int8()),
        "advantage": np.ones(4), "entropy": np.ones(4), "reward": np.ones(4),
    })
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)


def _v1_columns(n: int) -> dict[str, np.ndarray]:
    return {
        "sample_id": np.zeros(n), "prompt_id": np.zeros(n), "position": np.arange(n), "token_id": np.arange(n),
        "token_text": [f"w{i}" for i in range(n)], "rollout_logprob": np.full(n, -0.5),
        "old_logprob": np.full(n, -0.4), "train_logprob": np.full(n, -0.3), "is_weight_raw": np.ones(n),
        "is_weight": np.ones(n), "mask_reason": np.array([0, 2] * (n // 2)), "advantage": np.zeros(n),
        "entropy": np.zeros(n), "reward": np.zeros(n),
    }


@pytest.fixture()
def mixed_run(tmp_path):
    run = tmp_path / "run"
    writer = TokenDumpWriter(run)
    for step in (2, 3):
        writer.write_step(step, _v1_columns(4))
    _write_v0(token_file(run, 1))
    return run


def test_current_dumps_carry_the_version(mixed_run):
    assert pq.read_schema(token_file(mixed_run, 2)).metadata[VERSION_KEY] == str(SCHEMA_VERSION).encode()
    assert VERSION_KEY not in (pq.read_schema(token_file(mixed_run, 1)).metadata or {})


def test_version0_dump_reads_with_defaults(mixed_run):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is skipped as unreadable
        got = query_tokens(mixed_run, reason_names=False)
    assert len(got) == 12
    (mixed_run.parent / "nothing").mkdir()  # a run without dumps: an empty result of the same dtypes
    empty = query_tokens(mixed_run.parent / "nothing")
    assert dict(got.dtypes.drop("mask_reason")) == dict(empty.dtypes.drop("mask_reason"))
    old = got[got["step"] == 1]  # step read from the file name
    assert old["position"].tolist() == [0, 1, 0, 1]
    assert old["token_text"].isna().all() and old["old_logprob"].isna().all()
    assert old["masked"].tolist() == [False, True, False, True]  # from mask_reason != 0
    np.testing.assert_allclose(old["train_logprob"], V0_TRAIN.astype(np.float32))
    assert (old["routing_mismatch_count"] == -1).all() and old["routing_mismatch_layers"].isna().all()  # not compared
    new = got[got["step"] > 1]
    assert new["token_text"].tolist() == ["w0", "w1", "w2", "w3"] * 2 and (new["old_logprob"] == -0.4).all()


def test_version0_dump_filters(mixed_run):
    masked = query_tokens(mixed_run, masked_only=True, columns=["step", "sample_id", "position"])
    assert list(masked.itertuples(index=False, name=None)) == [(1, 0, 1), (1, 1, 1), (2, 0, 1), (2, 0, 3), (3, 0, 1),
                                                             (3, 0, 3)]
    low = query_tokens(mixed_run, steps=(1, 1), prob_range=(0.0, 0.1), columns=["position", "mask_reason"])
    assert low["position"].tolist() == [1, 1] and low["mask_reason"].tolist() == ["bounds", "veto"]
    only_old = query_tokens(mixed_run, steps=(1, 1), columns=["token_text", "old_logprob", "masked"])
    assert len(only_old) == 4 and only_old["token_text"].isna().all()


def test_nan_log_probs_never_match_a_probability_range(tmp_path):
    """Parquet statistics omit NaN (min/max are finite here); a NaN μ must still fail every μ bound."""
    columns = _v1_columns(4)
    columns["rollout_logprob"] = np.array([-1.0, np.nan, -3.0, -0.5])
    TokenDumpWriter(tmp_path).write_step(1, columns)
    assert pq.ParquetFile(token_file(tmp_path, 1)).metadata.row_group(0).column(6).statistics.min == -3.0
    for prob_range, expected in [((0.01, None), [0, 2, 3]), ((0.1, 1.0), [0, 3]), ((None, 0.5), [0, 2])]:
        got = query_tokens(tmp_path, prob_range=prob_range, columns=["position"])
        assert got["position"].tolist() == expected, prob_range


def test_a_dump_without_routing_reads_beside_one_with_it(mixed_run):
    """A version-3 dump (no routing columns) and a version-4 one of an MoE run read together; the routing filter
    keeps only the tokens whose routing differed, never an older dump's."""
    columns = _v1_columns(4)
    columns["routing_mismatch_layers"] = np.array([np.array([], np.int16), np.array([5, 2], np.int16), None,
                                                   np.array([0], np.int16)], dtype=object)
    TokenDumpWriter(mixed_run).write_step(4, columns)
    v3 = pq.read_table(token_file(mixed_run, 3)).drop(["routing_mismatch_count", "routing_mismatch_layers"])
    pq.write_table(v3.replace_schema_metadata({VERSION_KEY: b"3"}), token_file(mixed_run, 3))
    got = query_tokens(mixed_run, steps=(3, 4), columns=["step", "routing_mismatch_count", "routing_mismatch_layers"])
    assert got["routing_mismatch_count"].tolist() == [-1] * 4 + [0, 2, -1, 1]
    assert [None if v is None else list(v) for v in got["routing_mismatch_layers"]] == [None] * 4 + [[], [5, 2], None,
                                                                                                   [0]]
    differed = query_tokens(mixed_run, routing_mismatched=True, columns=["step", "position"])
    assert list(differed.itertuples(index=False, name=None)) == [(4, 1), (4, 3)]
