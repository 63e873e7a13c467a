"""Token-dump writer side: sampling policy, flattening padded batches, mask-reason codes, the Parquet file."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from openrlhf_tis.runs import (
    COLUMNS,
    MASK_REASONS,
    SCHEMA,
    TokenDumpWriter,
    flatten_response_tokens,
    mask_reason_codes,
    select_samples,
    should_dump,
)
from openrlhf_tis.runs.layout import token_file
from openrlhf_tis.runs.schema import MASK_REASON_PRECEDENCE, REQUIRED_COLUMNS
from openrlhf_tis.runs.tokens import routing_mismatch_layers


class _Tokenizer:
    def __init__(self):
        self.calls = 0

    def decode(self, ids):
        self.calls += 1
        return f"<{ids[0]}>"


def _columns(n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    cols = {name: rng.normal(size=n).astype(np.float32) for name in REQUIRED_COLUMNS}
    cols.update(sample_id=np.arange(n) // 4, prompt_id=np.arange(n) // 8, position=np.arange(n) % 4,
                token_id=rng.integers(0, 50, n), mask_reason=rng.integers(0, len(MASK_REASONS), n))
    return cols


def test_should_dump_policy():
    assert [s for s in range(1, 31) if should_dump(s, 10)] == [1, 10, 20, 30]
    assert not any(should_dump(s, 0) for s in range(1, 20))
    assert all(should_dump(s, 1) for s in range(1, 5))


@given(n=st.integers(1, 64), k=st.integers(-1, 70), step=st.integers(1, 10_000), seed=st.integers(0, 3))
def test_select_samples_size_order_and_determinism(n, k, step, seed):
    chosen = select_samples(n, k, step, seed)
    expected = n if k < 0 else min(k, n)
    assert len(chosen) == expected and len(set(chosen.tolist())) == expected
    assert np.all(np.diff(chosen) > 0) and (not len(chosen) or (chosen.min() >= 0 and chosen.max() < n))
    assert np.array_equal(chosen, select_samples(n, k, step, seed))  # a resumed run picks the same samples


@given(groups=st.integers(1, 16), group_size=st.integers(2, 8), k=st.integers(1, 40), step=st.integers(1, 999))
def test_select_samples_whole_groups(groups, group_size, k, step):
    chosen = select_samples(groups * group_size, k, step, group_size=group_size)
    assert len(chosen) % group_size == 0 and len(chosen) >= min(k, groups * group_size)
    for g in set((chosen // group_size).tolist()):
        assert set(range(g * group_size, (g + 1) * group_size)) <= set(chosen.tolist())


@given(st.data())
def test_mask_reason_precedence(data):
    n = data.draw(st.integers(1, 30))
    masks = {name: np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
             for name in data.draw(st.sets(st.sampled_from(MASK_REASON_PRECEDENCE)))}
    codes = mask_reason_codes(n, **masks)
    for i in range(n):
        applying = [name for name in MASK_REASON_PRECEDENCE if name in masks and masks[name][i]]
        assert MASK_REASONS[int(codes[i])] == (applying[0] if applying else "kept")


def test_mask_reason_codes_rejects_unknown():
    with pytest.raises(ValueError, match="unknown mask reasons"):
        mask_reason_codes(3, truncated=np.ones(3, bool))


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_flatten_matches_loop(data):
    b, t = data.draw(st.integers(1, 6)), data.draw(st.integers(1, 9))
    mask = np.array(data.draw(st.lists(st.booleans(), min_size=b * t, max_size=b * t))).reshape(b, t)
    rows = np.array(sorted(data.draw(st.sets(st.integers(0, b - 1), min_size=1))))
    values = np.arange(b * t, dtype=np.float32).reshape(b, t)
    out = flatten_response_tokens(torch.tensor(mask), {"train_logprob": torch.tensor(values).bfloat16()},
                                  {"sample_id": np.arange(b) * 10, "reward": torch.arange(b).float()}, rows)
    expected = [(r * 10, p, values[r, j]) for r in rows for p, j in enumerate(np.flatnonzero(mask[r]))]
    got = list(zip(out["sample_id"].tolist(), out["position"].tolist(), out["train_logprob"].tolist(), strict=True))
    assert [(s, p) for s, p, _ in got] == [(s, p) for s, p, _ in expected]
    assert np.allclose([v for *_, v in got], [float(torch.tensor(v).bfloat16()) for *_, v in expected])
    assert out["reward"].tolist() == [float(s // 10) for s, _, _ in expected]


def test_flatten_shape_errors():
    with pytest.raises(ValueError, match="action_mask"):
        flatten_response_tokens(np.ones(3), {})
    with pytest.raises(ValueError, match="entropy"):
        flatten_response_tokens(np.ones((2, 3)), {"entropy": np.ones((2, 4))})


def test_flatten_keeps_trailing_axes():
    mask = np.array([[0, 1, 1], [1, 0, 0]], dtype=bool)
    flags = np.arange(2 * 3 * 2).reshape(2, 3, 2)  # one value per (sample, token, layer)
    out = flatten_response_tokens(mask, {"flags": flags}, rows=[1, 0])
    assert out["flags"].tolist() == [[6, 7], [2, 3], [4, 5]]  # sample 1 first: `rows` order


def test_write_step_schema_defaults_and_text(tmp_path):
    rng = np.random.default_rng(0)
    cols = _columns(40, rng)
    del cols["mask_reason"]
    cols["mask_reason"] = np.zeros(40, np.int64)
    cols["mask_reason"][::5] = 3
    tokenizer = _Tokenizer()
    writer = TokenDumpWriter(tmp_path, tokenizer=tokenizer)
    path = writer.write_step(7, {k: torch.tensor(v) for k, v in cols.items()})
    assert path == tmp_path / "tokens" / "step_000007.parquet"
    table = pq.read_table(path)
    assert table.schema.remove_metadata() == SCHEMA.remove_metadata() and list(table.column_names) == list(COLUMNS)
    frame = table.to_pandas()
    assert (frame["step"] == 7).all() and frame["old_logprob"].isna().all()
    assert frame["masked"].tolist() == (cols["mask_reason"] != 0).tolist()
    assert frame["token_text"].tolist() == [f"<{i}>" for i in cols["token_id"]]
    assert tokenizer.calls == len(set(cols["token_id"].tolist()))  # each id decoded once
    assert writer.write_step(7, cols) is None  # a resumed run keeps the first dump of a step
    assert writer.write_step(7, cols, part=1) == tmp_path / "tokens" / "step_000007.part001.parquet"


def test_write_step_rejects_bad_columns(tmp_path):
    writer = TokenDumpWriter(tmp_path)
    cols = _columns(10, np.random.default_rng(1))
    with pytest.raises(ValueError, match="missing columns \\['advantage'\\]"):
        writer.write_step(1, {k: v for k, v in cols.items() if k != "advantage"})
    with pytest.raises(ValueError, match="unknown columns \\['bogus'\\]"):
        writer.write_step(1, {**cols, "bogus": cols["entropy"]})
    with pytest.raises(ValueError, match="length 10"):
        writer.write_step(1, {**cols, "entropy": cols["entropy"][:9]})
    with pytest.raises(ValueError, match="mask_reason codes \\[42\\]"):
        writer.write_step(1, {**cols, "mask_reason": np.full(10, 42)})
    with pytest.raises(ValueError, match="mask_reason codes \\[300\\]"):
        writer.write_step(1, {**cols, "mask_reason": np.full(10, 300)})
    with pytest.raises(ValueError, match="other steps"):
        writer.write_step(1, {**cols, "step": np.full(10, 2)})
    with pytest.raises(ValueError, match="masked"):
        writer.write_step(1, {**cols, "mask_reason": np.zeros(10), "masked": np.ones(10, bool)})
    assert not (tmp_path / "tokens").exists() or not any((tmp_path / "tokens").iterdir())


def test_routing_mismatch_layers_by_hand():
    differed = np.array([[0, 0, 0], [1, 0, 1], [1, 1, 1], [0, 1, 0]], dtype=bool)
    compared = np.array([True, True, False, True])  # token 2 was not routed by both: its flags mean nothing
    got = routing_mismatch_layers(differed, compared)
    assert [None if g is None else g.tolist() for g in got] == [[], [0, 2], None, [1]]
    assert all(g.dtype == np.int16 for g in got if g is not None)
    with pytest.raises(ValueError, match="routing mismatch"):
        routing_mismatch_layers(differed[:3], compared)


def test_routing_columns_round_trip_and_count_is_derived(tmp_path):
    cols = _columns(4, np.random.default_rng(2))
    layers = [np.array([3, 17], np.int16), None, np.array([], np.int16), np.array([40], np.int16)]
    writer = TokenDumpWriter(tmp_path)
    writer.write_step(1, {**cols, "routing_mismatch_layers": np.array(layers, dtype=object)})
    writer.write_step(2, cols)  # a run without routing: nothing compared
    frame = pq.read_table(token_file(tmp_path, 1)).to_pandas()
    assert [None if v is None else v.tolist() for v in frame["routing_mismatch_layers"]] == [[3, 17], None, [], [40]]
    assert frame["routing_mismatch_count"].tolist() == [2, -1, 0, 1]
    plain = pq.read_table(token_file(tmp_path, 2)).to_pandas()
    assert plain["routing_mismatch_layers"].isna().all() and (plain["routing_mismatch_count"] == -1).all()
    with pytest.raises(ValueError, match="routing_mismatch_count"):
        writer.write_step(3, {**cols, "routing_mismatch_layers": np.array(layers, dtype=object),
                              "routing_mismatch_count": np.array([2, 0, 0, 1])})  # -1 expected where null
