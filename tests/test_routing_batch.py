"""A sample's routed experts from the engine's response to the trainer's router rows (moe/routing_batch.py),
through upstream's own batching helpers, and the step's routing tally (moe/routing_metrics.py RoutingTally).

The routings of these tests are written from the tokens (expert e = token id + layer, shifted per slot), so a routing
that landed on the wrong token, sample or layer reads as a different number, whatever path it took."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from openrlhf.trainer.ppo_utils.experience import (
    Experience,
    make_experience_batch,
    remove_padding_in_sequences,
    split_experience_batch,
)

from openrlhf_tis.moe.routing_batch import (
    ROUTED_EXPERTS,
    batch_routing,
    carry_routing,
    position_log_ratio,
    positions_from_rows,
    router_rows,
    sample_routing,
    sample_routings,
)
from openrlhf_tis.moe.routing_metrics import NO_ROUTE, RoutingTally, routing_metrics

U = NO_ROUTE
LAYERS, K = 3, 2


def _routing_of(tokens: list[int]) -> np.ndarray:
    """(tokens, layers, k): token t in layer l routed to experts (t + l, t + l + 1); the last token NO_ROUTE."""
    out = np.array([[[t + layer, t + layer + 1] for layer in range(LAYERS)] for t in tokens], dtype=np.int16)
    out[-1] = U
    return out


def test_a_sample_routing_is_cut_or_filled_to_the_sample():
    routed = _routing_of([5, 6, 7])
    assert sample_routing(routed, 2).tolist() == routed[:2].tolist()  # upstream cut the sample at --max_len
    filled = sample_routing(routed, 5)
    assert filled.dtype == torch.int16 and filled[:3].tolist() == routed.tolist()
    assert (filled[3:] == U).all()
    with pytest.raises(ValueError, match="tokens, layers, k"):
        sample_routing(routed[:, 0], 3)


def _sample(tokens: list[int], prompt: int) -> Experience:
    """A single-sample Experience as upstream's samples generator builds it, with its routing carried."""
    n = len(tokens)
    action_mask = torch.zeros(n - 1, dtype=torch.bool)
    action_mask[prompt - 1:] = True
    experience = Experience(sequences=torch.tensor([tokens]), attention_mask=torch.ones(1, n, dtype=torch.long),
                            action_mask=action_mask[None], rollout_log_probs=-torch.rand(1, n - 1),
                            response_length=torch.tensor([n - prompt]), total_length=torch.tensor([float(n)]),
                            prompts=["p"], labels=["l"], info={"reward": torch.tensor([1.0])})
    carry_routing(experience, {ROUTED_EXPERTS: _routing_of(tokens)})
    return experience


SAMPLES = [([11, 12, 13, 14, 15], 2), ([21, 22, 23], 1), ([31, 32, 33, 34, 35, 36, 37], 3)]


def test_the_routing_rides_upstreams_batching_onto_its_tokens():
    """Controller: samples concatenated into micro-batches; actor: the replay buffer splits them, drops the padding,
    and collates training micro-batches in another order. Each sample's routing stays on its own tokens."""
    samples = [_sample(tokens, prompt) for tokens, prompt in SAMPLES]
    made = Experience.concat_experiences(samples, pad_token_id=0)  # the experience maker's micro-batch
    assert len(made.info[ROUTED_EXPERTS]) == 3
    engine = batch_routing(made.info[ROUTED_EXPERTS], made.attention_mask)  # what the π_old forward replays
    items = remove_padding_in_sequences(split_experience_batch(made))  # the replay buffer
    batch = make_experience_batch([items[2], items[0]])  # a training micro-batch, shuffled
    trained = batch_routing(batch.info[ROUTED_EXPERTS], batch.attention_mask)
    for routing, sequences, mask in ((engine, made.sequences, made.attention_mask),
                                     (trained, batch.sequences, batch.attention_mask)):
        assert routing.shape == (*sequences.shape, LAYERS, K)
        for i in range(len(sequences)):
            tokens = sequences[i][mask[i].bool()].tolist()
            expected = _routing_of(tokens)
            assert routing[i, :len(tokens)].tolist() == expected.tolist()
            assert (routing[i, len(tokens):] == U).all()  # padding replays nothing


def test_router_rows_by_hand():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    per_position = torch.arange(8).reshape(2, 4)
    assert router_rows(per_position, mask, packed=False).tolist() == list(range(8))  # batch-major, as the block
    assert router_rows(per_position, mask, packed=True).tolist() == [0, 1, 2, 4, 5]  # unpad_input's order
    for packed in (False, True):  # and back to the positions, padding filled where a packed forward had none
        back = positions_from_rows(router_rows(per_position, mask, packed=packed), mask, packed=packed, fill=-7)
        assert back.tolist() == ([[0, 1, 2, 3], [4, 5, 6, 7]] if not packed else [[0, 1, 2, -7], [4, 5, -7, -7]])


def test_a_batch_not_right_padded_is_refused():
    routing = sample_routing(_routing_of([1, 2]), 2)
    with pytest.raises(ValueError, match="right-padded"):
        batch_routing([routing], torch.tensor([[0, 1, 1]]))
    with pytest.raises(ValueError, match="2 routings for a batch of 1"):
        batch_routing([routing, routing], torch.tensor([[1, 1, 0]]))


def test_log_ratio_sits_on_the_predicting_column():
    """Column t of the actor's log-probs scores token t + 1, predicted by the forward at row t."""
    old = torch.tensor([[-1.0, -2.0, -3.0]])
    rollout = torch.tensor([[-1.5, -2.0, float("-inf")]])
    action_mask = torch.tensor([[False, True, True]])
    ratio = position_log_ratio(old, rollout, action_mask, seq_len=4)
    assert math.isnan(ratio[0, 0]) and ratio[0, 1] == 0.0  # a prompt column; an action column
    assert math.isnan(ratio[0, 2]) and math.isnan(ratio[0, 3])  # μ not finite; the last token predicts nothing


ROUTINGS = st.integers(1, 12).flatmap(lambda n: st.tuples(
    st.lists(st.lists(st.sampled_from([(0, 1), (1, 0), (1, 2), (U, U)]), min_size=LAYERS, max_size=LAYERS),
             min_size=n, max_size=n),
    st.lists(st.lists(st.sampled_from([(0, 1), (2, 1), (1, 2)]), min_size=LAYERS, max_size=LAYERS),
             min_size=n, max_size=n),
    st.lists(st.one_of(st.just(float("nan")), st.floats(-3, 3)), min_size=n, max_size=n),
    st.integers(0, n)))


@settings(max_examples=60, deadline=None)
@given(ROUTINGS)
def test_a_step_tally_is_the_sum_of_its_micro_batches(case):
    """Split anywhere (micro-batches, ranks: the all-reduce adds the arrays), the step's metrics are the batch's."""
    engine, trainer, log_ratio, cut = case
    e, t, r = np.array(engine), np.array(trainer), np.array(log_ratio, dtype=np.float64)
    parts = [RoutingTally(LAYERS), RoutingTally(LAYERS)]
    parts[0].add(e[:cut], t[:cut], r[:cut])
    parts[1].add(e[cut:], t[cut:], r[cut:])
    summed = RoutingTally.from_array(parts[0].as_array() + parts[1].as_array()).metrics()
    whole = routing_metrics(e, t, r)
    assert summed.keys() == whole.keys()
    for key, value in whole.items():
        assert summed[key] == pytest.approx(value, rel=1e-12, nan_ok=True)


def test_prompt_tokens_count_in_the_agreement_not_in_the_token_metrics():
    engine = np.array([[[0, 1]], [[0, 1]], [[2, 3]]])
    trainer = np.array([[[0, 2]], [[0, 1]], [[3, 2]]])
    metrics = routing_metrics(engine, trainer, np.array([np.nan, 0.5, 0.1]))  # token 0: a prompt token
    assert metrics["moe/routing_agreement"] == pytest.approx(2 / 3)
    assert metrics["moe/tokens_routing_differed"] == 0.0  # the differing token has no log-ratio
    assert metrics["moe/k3_routing_same"] == pytest.approx(((math.exp(0.5) - 1.5) + (math.exp(0.1) - 1.1)) / 2)
    assert math.isnan(metrics["moe/k3_routing_differed"])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=4), st.integers(0, 3))
def test_sample_routings_undo_batch_routing(lengths, extra):
    """What R2 records per batch (trainer/moe_replay.py `record_own`) rides as one routing per sample, and placed on a
    batch again (`batch_routing`, the π_θ forward's) it lands on the same tokens: any lengths, any padding."""
    width = max(lengths) + extra
    mask = torch.tensor([[1] * n + [0] * (width - n) for n in lengths])
    per_position = torch.arange(len(lengths) * width * LAYERS * K).reshape(len(lengths), width, LAYERS, K) % 97
    routings = sample_routings(per_position, mask)
    assert [tuple(r.shape) for r in routings] == [(n, LAYERS, K) for n in lengths]
    assert all(r.dtype == torch.int16 for r in routings)
    back = batch_routing(routings, mask)
    attended = mask.bool()
    assert torch.equal(back[attended], per_position[attended]) and (back[~attended] == U).all()


def test_sample_routings_refuse_what_they_cannot_cut():
    with pytest.raises(ValueError, match="right-padded"):
        sample_routings(torch.zeros(1, 3, LAYERS, K), torch.tensor([[0, 1, 1]]))
    with pytest.raises(ValueError, match=r"\(batch, seq, layers, k\)"):
        sample_routings(torch.zeros(1, 2, LAYERS, K), torch.tensor([[1, 1, 0]]))
