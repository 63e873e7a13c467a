"""Per-token dumps on the actor side: the controller's plan, and the rows one rank collects of a dumped step.

Run store, docs/design.md §6: before `fit` on a dumped step the controller (trainer/step_part.py TokenDumpPart)
hands the actors a `TokenDumpPlan` (`set_token_dump`). Every replay-buffer item carries its sample id
(trainer/ppo_actor.py `append_experience` keeps upstream's per-step sample index, which the buffer's
split would drop); the planned samples are read off their first training step of the step by a
`TokenDumpCollector`, and each rank writes its rows as one Parquet file when `ppo_train` ends. Steps
without a plan take none of these paths and compute nothing extra.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from openrlhf.utils.loss_utils import _get_dp_group

from openrlhf_tis.correction import CorrectionConfig, PolicyLossOutput
from openrlhf_tis.runs.schema import mask_reason_codes
from openrlhf_tis.runs.tokens import flatten_response_tokens, routing_mismatch_layers
from openrlhf_tis.trainer.policy_loss import LossCall
from openrlhf_tis.trainer.staleness import LAG
from openrlhf_tis.upstream_guards import PatchTargetMissingError, require_version, swapped


@dataclass(frozen=True)
class TokenDumpPlan:
    """What the controller tells the actors before a dumped step: which step, where, which samples.

    `sample_ids` index the step's samples as upstream's experience maker numbers them (prompt order,
    the `group_size` samples of a prompt adjacent), so every rank picks its rows from one global choice.
    """

    step: int
    run_dir: str
    sample_ids: tuple[int, ...]
    group_size: int = 1


def dp_rank_and_size(strategy) -> tuple[int, int]:
    """(rank, size) of this process in the data-parallel group; (0, 1) without torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    group = _get_dp_group(strategy)
    return dist.get_rank(group=group), dist.get_world_size(group=group)


def dump_part(strategy) -> tuple[bool, int | None]:
    """Whether this rank writes its dump rows, and its part number (None: the only writer, no part suffix).

    Ranks of one ring-attention / tensor-parallel group train the same samples: only the first writes.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return True, None
    mesh = getattr(strategy, "ds_device_mesh", None)
    if mesh is None:
        return True, dist.get_rank()
    first = mesh["sp"].get_local_rank() == 0 and mesh["tp"].get_local_rank() == 0
    return first, mesh["dp"].get_local_rank()


ENTROPY_CHUNK_ELEMENTS = 1 << 24
"""Logits entries per entropy chunk: bounds the temporaries to ~64 MiB each, whatever the vocabulary."""


@torch.no_grad()
def logits_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last axis of (N, V) logits, in float32, chunked along N.

    Eager on purpose: upstream's `compute_entropy` is `torch.compile`d, which costs seconds of
    compilation in each process (docs/measurements.md) and again for new shapes.
    """
    chunk = max(1, ENTROPY_CHUNK_ELEMENTS // max(int(logits.shape[-1]), 1))
    parts = []
    for piece in logits.split(chunk):
        logp = torch.log_softmax(piece.float(), dim=-1)
        parts.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(parts) if parts else logits.new_zeros(0, dtype=torch.float32)


def response_entropy(output: Any, sequences_shape: Sequence[int], width: int, rows: Sequence[int]) -> torch.Tensor:
    """(B, width) float32 entropy of the training policy at the response tokens of `rows`; NaN elsewhere.

    Read from the forward's own entropy when it computed one (--actor.entropy_coef), otherwise from its
    logits (already float32 and temperature-scaled by upstream's Actor), row by row without gradient, so
    the dump neither grows the autograd graph nor holds a (B, T, V) softmax. Packed or
    sequence-parallel outputs (no (B, T) layout here) give NaN.
    """
    batch, seq_len = int(sequences_shape[0]), int(sequences_shape[1])
    result = torch.full((batch, width), float("nan"))
    entropy = getattr(output, "entropy", None)
    if entropy is not None and tuple(entropy.shape[:2]) == (batch, seq_len - 1):
        result[list(rows)] = entropy.detach()[list(rows), -width:].float().cpu()
        return result
    logits = getattr(output, "logits", None)
    if logits is None or tuple(logits.shape[:2]) != (batch, seq_len):
        return result
    for row in rows:  # position t's logits predict token t+1: the response tokens are t = T-1-width .. T-2
        result[row] = logits_entropy(logits[row, seq_len - 1 - width: seq_len - 1]).cpu()
    return result


_THIS_FILE = "openrlhf_tis/trainer/token_dumps.py"  # named by the guards' errors: the file to review
_UPSTREAM_CALL = ("sequences", "action_mask")  # upstream's training_step: self.actor(sequences, action_mask, ...)


def _check_actor_forward(actor: torch.nn.Module) -> None:
    """Refuse an upstream whose actor `capture_response_entropy` would wrap wrongly: another openrlhf than the one
    read (0.11.2's `Actor.forward(sequences, action_mask, ..., return_output)`), or a forward of another shape."""
    require_version("openrlhf", "==0.11.2", patch=_THIS_FILE)
    forward = getattr(type(actor), "forward", None)
    params = list(inspect.signature(forward).parameters) if callable(forward) else []
    if tuple(params[1:3]) != _UPSTREAM_CALL or "return_output" not in params:
        raise PatchTargetMissingError(
            f"patch {_THIS_FILE!r}: {type(actor).__module__}.{type(actor).__qualname__}.forward{tuple(params[1:])} "
            f"is not openrlhf 0.11.2's Actor.forward(sequences, action_mask, ..., return_output); review the patch")


@contextmanager
def capture_response_entropy(actor: torch.nn.Module, rows: Sequence[int]) -> Iterator[dict]:
    """Within the block, the first `actor(...)` call also leaves its response entropy in the yielded dict.

    Upstream's `training_step` calls the actor with no seam for extras; an instance-level `forward`
    wraps the class's for the one micro-batch being dumped and is removed afterwards, even on error
    (`upstream_guards.swapped`; a forward of another shape, or another openrlhf, is refused first).
    """
    _check_actor_forward(actor)
    found: dict[str, Any] = {}

    def capturing(sequences, action_mask=None, *args, **kwargs):
        result = forward(sequences, action_mask, *args, **kwargs)
        if "entropy" not in found and isinstance(result, tuple) and action_mask is not None:
            started = time.perf_counter()
            found["entropy"] = response_entropy(result[1], sequences.shape, action_mask.shape[1], rows)
            found["seconds"] = time.perf_counter() - started
        return result

    with swapped(actor, "forward", capturing, patch=_THIS_FILE) as forward:
        yield found


def correction_token_details(config: CorrectionConfig, output: PolicyLossOutput,
                             action_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-token weights and masks of one micro-batch's loss, as the dump stores them ((B, A) tensors).

    Read off the loss's own output, computed with details (`policy_loss(details=True)`): the raw weight, the reasons,
    the final weight and the kept mask are exactly what the loss trained with, compiled or not.

    is_weight is the factor the loss multiplied the token's term by, 0 where masked; 1 under bypass_ppo
    (its IS ratio π_θ/μ sits inside the clip) and when the correction is off (the loss is plain PPO,
    nothing is masked there, so every reason is 'kept').
    """
    out = output.correction
    if out.raw_weights is None:
        raise RuntimeError("token dump: the policy loss ran without details on a dumped micro-batch")
    action = action_mask.bool()
    reasons = {name: mask.bool() & action for name, mask in out.reasons.items()}
    raw = torch.where(reasons["nan"], float("nan"), out.raw_weights.float())
    if not config.enabled:
        return {"is_weight_raw": raw, "is_weight": action.float(), "keep": action, "reasons": {}}
    keep = out.mask.bool() & action
    weight = keep.float() if config.loss == "bypass_ppo" else torch.where(keep, out.weights.float(), 0.0)
    return {"is_weight_raw": raw, "is_weight": weight, "keep": keep, "reasons": reasons}


def scoring_columns(per_position: np.ndarray, width: int) -> np.ndarray:
    """(B, width, ...) of a (B, seq, ...) per-position array: at each action token, the column whose forward scores
    it (column t's logits predict token t + 1: the response tokens are scored at t = T-1-width .. T-2)."""
    seq_len = per_position.shape[1]
    return per_position[:, seq_len - 1 - width: seq_len - 1]


def _per_sample(value: Any, batch: int) -> torch.Tensor:
    """A (B,) float tensor from a per-sample field (tensor, or upstream's list of 0-d tensors); NaN if absent."""
    if value is None:
        return torch.full((batch,), float("nan"))
    if isinstance(value, list):
        value = torch.stack([torch.as_tensor(v).reshape(()) for v in value]) if value else torch.empty(0)
    value = torch.as_tensor(value).detach().float().reshape(-1).cpu()
    return value if value.numel() == batch else torch.full((batch,), float("nan"))


class TokenDumpCollector:
    """The rows of one dumped step on one rank, gathered micro-batch by micro-batch inside `ppo_train`.

    A sample is read at its first training step of the step only (epoch 0: π_θ as that forward saw
    it); later epochs train it again but add nothing. Rows leave the device as numpy right away.
    """

    def __init__(self, plan: TokenDumpPlan, config: CorrectionConfig, global_ids: bool = True):
        self.plan = plan
        self.config = config
        self.global_ids = global_ids  # False: ids are rank-strided stand-ins, prompt ids unknown
        self.wanted = frozenset(int(i) for i in plan.sample_ids)
        self.done: set[int] = set()
        self.parts: list[dict[str, np.ndarray]] = []
        self.seconds = 0.0

    def rows_to_collect(self, experience) -> list[int]:
        """Batch rows of this micro-batch holding planned samples not collected yet."""
        ids = experience.index
        if not ids or len(ids) != len(experience.sequences):
            return []
        return [row for row, sample_id in enumerate(ids) if sample_id in self.wanted and sample_id not in self.done]

    def add(self, experience, rows: list[int], call: LossCall, entropy: torch.Tensor | None,
            routing: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        """Flatten the rows' response tokens into dump columns (see schema.COLUMNS).

        old_logprob is NaN under the bypass losses: π_old is never computed there, and μ, which stands in
        for it, is the rollout_logprob column already. entropy is NaN where the forward's output has no
        (B, T) layout (packed samples without --actor.entropy_coef). `routing` (a routing-replay run:
        `ReplayedBatch.mismatch_by_position`, the engine's routing against the trainer's own choice in this π_θ
        forward, as the moe/* metrics count it): (B, T, layers) differed, (B, T) compared, read at the column
        that scores each token; without it the routing columns say "not compared".
        """
        if call.output is None:
            raise RuntimeError("token dump: the policy loss did not run on a dumped micro-batch")
        captured = call.inputs
        action_mask = captured["action_mask"]
        batch, width = action_mask.shape
        details = correction_token_details(self.config, call.output, action_mask)
        nan = torch.full((batch, width), float("nan"))
        roll = captured["rollout_log_probs"]
        per_token = {
            "token_id": experience.sequences[:, -width:],
            "rollout_logprob": roll if roll is not None else nan,
            "old_logprob": captured["old_log_probs"] if self.config.loss == "decoupled" else nan,
            "train_logprob": captured["log_probs"],
            "is_weight_raw": details["is_weight_raw"],
            "is_weight": details["is_weight"],
            "masked": ~details["keep"],
            "advantage": captured["advantages"],
            "entropy": entropy if entropy is not None else nan,
            **{f"reason_{name}": mask for name, mask in details["reasons"].items()},
        }
        if routing is not None:
            per_token["routing_differed"] = scoring_columns(routing[0], width)
            per_token["routing_compared"] = scoring_columns(routing[1], width)
        ids = torch.tensor([int(i) for i in experience.index])
        prompts = ids // max(self.plan.group_size, 1) if self.global_ids else torch.full_like(ids, -1)
        reward = experience.rewards if experience.rewards is not None else experience.info.get("reward")
        lag = _per_sample(experience.info.get(LAG), batch).nan_to_num(0.0).to(torch.int32)
        per_sample = {"sample_id": ids, "prompt_id": prompts, "reward": _per_sample(reward, batch), "lag": lag}
        texts = getattr(experience, "prompts", None)  # the prompt each response answers, as the engine got it
        if isinstance(texts, (list, tuple)) and len(texts) == batch:
            per_sample["prompt_text"] = np.array([str(t) for t in texts], dtype=object)
        columns = flatten_response_tokens(action_mask, per_token, per_sample, rows=rows)
        reasons = {name[len("reason_"):]: columns.pop(name) for name in list(columns) if name.startswith("reason_")}
        columns["mask_reason"] = mask_reason_codes(len(columns["token_id"]), **reasons)
        if routing is not None:
            columns["routing_mismatch_layers"] = routing_mismatch_layers(columns.pop("routing_differed"),
                                                                         columns.pop("routing_compared"))
        self.parts.append(columns)
        self.done.update(int(experience.index[row]) for row in rows)

    def columns(self) -> dict[str, np.ndarray] | None:
        """All rows, in (sample, position) order (micro-batches arrive shuffled); None when there are none."""
        if not self.parts:
            return None
        columns = {name: np.concatenate([part[name] for part in self.parts]) for name in self.parts[0]}
        order = np.lexsort((columns["position"], columns["sample_id"]))
        return {name: array[order] for name, array in columns.items()}

