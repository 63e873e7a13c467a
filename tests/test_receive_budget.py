"""A quantized CUDA sync's receive against the card beside its engine (rollout/receive_budget.py), computed before
Ray starts: hand-computed cases for Qwen2.5-7B (embedding 152064 x 3584) on the cards Ray names."""

from __future__ import annotations

import pytest

from openrlhf_tis.errors import UsageError
from openrlhf_tis.rollout.receive_budget import check_receive_fits, receive_peak_bytes

QWEN25_7B_EMBEDDING = 152064 * 3584  # its largest tensor (and lm_head's)


def _check(**overrides) -> None:
    kwargs = {"precision": "fp8", "colocated": False, "utilization": 0.85, "accelerators": ("H100",),
              "largest_numel": QWEN25_7B_EMBEDDING, "cluster": "4 H100 nodes"}
    check_receive_fits(**{**kwargs, **overrides})


def test_the_peak_is_three_bf16_copies_of_the_largest_tensor():
    assert receive_peak_bytes(QWEN25_7B_EMBEDDING) == 3 * 2 * 544_997_376 == 3_269_984_256


def test_the_multi_node_recipes_setting_fits_an_h100():
    _check()  # 0.15 x 80 GB = 12 GB beside the engine, 3.27 GB needed


def test_a_setting_that_leaves_too_little_is_refused_naming_both_flags_and_the_highest_that_fits():
    with pytest.raises(UsageError) as err:
        _check(utilization=0.97)  # 2.4 GB left
    message = str(err.value)
    assert message.startswith("--vllm.gpu_memory_utilization: 0.97 leaves 2.4 GB of each 80 GB card (4 H100 nodes)")
    assert "--vllm.rollout_precision fp8 sync holds up to 3.3 GB" in message
    assert "use --vllm.gpu_memory_utilization 0.95 or lower" in message  # floor(1 - 3.27 / 80, 2 decimals)
    _check(utilization=0.95)  # which does fit: 4 GB left


@pytest.mark.parametrize(("overrides", "why"), [
    ({"precision": "bf16"}, "upstream's own sync, a tensor at a time"),
    ({"colocated": True}, "the GPU is shared with DeepSpeed's states, not modelled"),
    ({"accelerators": ("RTX-9090",)}, "a card of unknown memory"),
    ({"accelerators": ()}, "no GPU hardware named (logical slots)"),
    ({"largest_numel": None}, "a model that is not a local safetensors directory"),
])
def test_nothing_is_refused_where_it_cannot_be_computed(overrides, why):
    _check(utilization=0.999, **overrides)


def test_a_cluster_of_several_cards_is_judged_on_the_smallest():
    _check(utilization=0.93, accelerators=("H200",))  # 9.9 GB left
    with pytest.raises(UsageError, match="of each 40 GB card"):
        _check(utilization=0.93, accelerators=("H200", "A100"))  # an A100 named so may be the 40 GB one: 2.8 GB left
