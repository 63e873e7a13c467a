"""IS weights, rejection masks, veto, OPSM and self-normalization: `compute_correction`.

All tensors are (B, T) over response tokens; `action_mask` marks the tokens that are actions.
Notation (docs/correction.md §1): log r_t = log π_old(a_t) − log μ(a_t), over the sequence's valid tokens V.

    token      w_t = r_t                                   TIS (Yao et al. 2025)
    sequence   w_t = Π_{s∈V} r_s = exp Σ_{s∈V} log r_s       sequence IS / MIS (Liu et al. 2025)
    geometric  w_t = exp( (1/|V|) Σ_{s∈V} log r_s )          Geo (Miles)

    truncate   w ← min(w, U)                                TIS
    adaptive   w ← min(w, C_t), C_t from this call's ratios   truncate with a cap by target ESS (adaptive.py)
    clip       w ← clamp(w, L, U)                           CIS (Miles)
    mask       keep iff L ≤ w ≤ U                           IcePop / MIS
    raw        w unchanged (|log w| ≤ 20 before exp)         vanilla IS
    none       w ← 1

    rejection  keep iff L_c ≤ agg_c(stat_c) ≤ U_c for every criterion c   verl rollout_rs (AND-chained)
    veto       drop sequence iff ∃t∈V: r_t < v  or  r_t > 1/v             verl / Miles veto
    OPSM       drop token iff A_t < 0 and (1/|V|) Σ log(μ/π_θ) > δ         DeepSeek-V3.2
    normalize  w ← w / mean_kept(w)          (applied last)                 self-normalized IS

Positions outside `action_mask` and tokens with a non-finite log-prob never influence any other value:
every reduction runs over valid tokens only, and their values are zeroed before a mask multiplies them,
so a NaN cannot leak by 0·NaN.
"""

from __future__ import annotations

import functools
import math
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .adaptive import adaptive_bound
from .config import CorrectionConfig, RejectionCriterion
from .metrics import metric_sums, metric_vector, metrics_from_sums, metrics_to_dict
from .ops import dot, finite, indicator, zero_off

AllReduce = Callable[[torch.Tensor], torch.Tensor]
"""Sums a tensor over the data-parallel ranks and returns the sum (e.g. wraps dist.all_reduce)."""

PROB_EPS = 1e-6  # probability clamp of the binary-KL / TV statistics (OpenRLHF 0.11.2, verl)


@dataclass
class CorrectionOutput:
    """What the loss needs (weights, mask), what is logged (metrics), and why tokens were dropped."""

    weights: torch.Tensor
    """(B, T) float, detached: multiply the per-token policy loss by it; 0 wherever mask is 0."""
    mask: torch.Tensor
    """(B, T) 0/1 in action_mask's dtype: tokens that still count."""
    metrics: dict[str, float]
    """`mismatch/*` (μ vs π_old) and `correction/*` (what the correction did); empty without metrics."""
    raw_weights: torch.Tensor | None = None
    """(B, T) importance weight at the configured level before bounds, 0 off V (only with details=True)."""
    reasons: dict[str, torch.Tensor] = field(default_factory=dict)
    """(B, T) bool per reason an action token was dropped: nan, bounds, rejection, veto, opsm (only with
    details=True; not exclusive, the run store picks one by precedence)."""


def _token_statistic(stat: str, lr: torch.Tensor, r_tok: torch.Tensor, old: torch.Tensor,
                     roll: torch.Tensor) -> torch.Tensor:
    """Per-token statistic of a rejection criterion; exactly 0 off V (there lr = old = roll = 0)."""
    if stat in ("ratio", "k1"):
        return lr if stat == "ratio" else -lr  # ratio is compared as exp(·) after aggregation
    if stat == "k2":
        return 0.5 * lr * lr  # ½ (log r)²
    if stat == "k3":
        return (r_tok - 1.0).sub_(lr)  # r − 1 − log r  (Schulman's k3); inf where r overflows, which rejects
    p = torch.exp(roll).clamp(PROB_EPS, 1 - PROB_EPS)  # μ(a_t)
    q = torch.exp(old).clamp(PROB_EPS, 1 - PROB_EPS)  # π_old(a_t)
    if stat == "tv":
        return (p - q).abs()  # |μ − π_old| of the sampled token

    def bkl(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # KL(Bern(a) ‖ Bern(b))
        return a * torch.log(a / b) + (1 - a) * torch.log((1 - a) / (1 - b))

    return bkl(p, q) if stat == "binary_kl" else torch.maximum(bkl(p, q), bkl(q, p))  # KPop: both directions


def _aggregate(s: torch.Tensor, nf: torch.Tensor, agg: str) -> torch.Tensor:
    """token | sum | mean | max over V. s is 0 off V; max is only allowed for statistics >= 0."""
    if agg == "token":
        return s
    if agg == "max":
        return s.amax(-1, keepdim=True)
    total = s.sum(-1, keepdim=True)
    return total if agg == "sum" else total / nf


def _out_of_bounds(x: torch.Tensor, lower: float | None, upper: float | None) -> torch.Tensor:
    """1.0 where x < lower or x > upper (None: unbounded), else 0.0. No statistic is NaN on V (every one is
    finite or ±inf there), so this is exactly "not lower ≤ x ≤ upper"."""
    if lower is None:
        return indicator(torch.gt, x, upper)
    if upper is None:
        return indicator(torch.lt, x, lower)
    return indicator(torch.lt, x, lower).add_(x > upper)  # disjoint: validate() keeps lower <= upper


def _criterion_rejects(crit: RejectionCriterion, lr, lr_sum, r_tok, nf, old, roll) -> torch.Tensor:
    """1.0 for each token (B, T) or sequence (B, 1) the criterion rejects."""
    if crit.statistic in ("ratio", "k1") and crit.agg in ("sum", "mean"):  # from Σ log r, summed once already
        total = lr_sum if crit.statistic == "ratio" else -lr_sum
        value = total if crit.agg == "sum" else total / nf
    else:
        value = _aggregate(_token_statistic(crit.statistic, lr, r_tok, old, roll), nf, crit.agg)
    if crit.statistic == "ratio":
        value = torch.exp(value)  # token r_t, sequence Π r_t, geometric exp(mean log r_t); inf/0 compare fine
    return _out_of_bounds(value, crit.lower, crit.upper)


def _needs_log_probs(cfg: CorrectionConfig) -> bool:
    """Whether anything besides log r reads the two log-probs themselves."""
    return (cfg.veto_min_prob is not None or cfg.opsm_delta is not None
            or any(c.statistic in ("binary_kl", "binary_kl_sym", "tv") for c in cfg.rejection))


def clamped(r: torch.Tensor, cfg: CorrectionConfig) -> torch.Tensor:
    """The raw weight exp(clamp(log r, ±log_ratio_clamp)) as clamp(r, e^∓clamp): a new tensor."""
    return r.clamp(math.exp(-cfg.log_ratio_clamp), math.exp(cfg.log_ratio_clamp))


def _bounded(r: torch.Tensor, cfg: CorrectionConfig,
             cap: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The weight after the mode's bounds (a tensor of its own), and 0/1 flags named for their metrics:
    where the bounds bind (truncate, clip), or `bounds_masked` where mode mask drops the token (the caller
    drops it). `cap`: the adaptive bound (a 0-d tensor), which replaces `upper`."""
    U, L = (cfg.upper if cap is None else cap), cfg.lower_bound
    if cfg.mode == "truncate":
        return r.clamp(max=U), {"truncated": indicator(torch.gt, r, U)}  # TIS: min(r, U)
    if cfg.mode == "clip":
        flags = {"clipped_low": indicator(torch.lt, r, L), "clipped_high": indicator(torch.gt, r, U)}
        return r.clamp(min=L, max=U), flags  # clamp(r, L, U)
    if cfg.mode == "mask":  # IcePop / MIS: keep iff L <= r <= U; r.clamp(max=U) = r wherever kept
        outside = indicator(torch.lt, r, L).add_(r > U)  # disjoint: validate() keeps L <= U
        return r.clamp(max=U), {"bounds_masked": outside}
    return (clamped(r, cfg) if cfg.mode == "raw" else torch.ones_like(r)), {}  # vanilla IS | none


def _veto(r_tok: torch.Tensor, log_p: tuple[torch.Tensor, torch.Tensor] | None, valid: torch.Tensor,
          cfg: CorrectionConfig) -> torch.Tensor:
    """(B, 1) 1.0 for a sequence holding a catastrophic valid token (ratio or probability veto), read off
    each sequence's extremes: off V, r_t = 1 and both log-probs are 0, which no test flags (v < 1, p ≤ 1)."""
    vetoed = []
    if cfg.veto_threshold is not None:
        v = cfg.veto_threshold
        if v < 1:
            lowest, highest = torch.aminmax(r_tok, dim=-1, keepdim=True)
        else:  # only the bare core takes v ≥ 1 (training refuses it), which r_t = 1 off V would trip
            lowest = torch.where(valid > 0, r_tok, math.inf).amin(-1, keepdim=True)
            highest = (r_tok * valid).amax(-1, keepdim=True)
        vetoed.append(lowest < v)
        if cfg.veto_sides == "both":
            vetoed.append(highest > 1.0 / v)
    if cfg.veto_min_prob is not None:  # near-impossible under μ or under π_old
        vetoed.append(torch.minimum(*log_p).amin(-1, keepdim=True) < math.log(cfg.veto_min_prob))
    if len(vetoed) == 1:
        return vetoed[0].to(r_tok.dtype)
    flag = torch.logical_or(*vetoed[:2], out=torch.empty(vetoed[0].shape, dtype=r_tok.dtype, device=r_tok.device))
    for more in vetoed[2:]:
        torch.logical_or(flag, more, out=flag)
    return flag


def _core(old: torch.Tensor, roll: torch.Tensor, action_mask: torch.Tensor, log_probs: torch.Tensor | None,
          advantages: torch.Tensor | None, cfg: CorrectionConfig, details: bool = False) -> dict:
    """Everything elementwise or per-row; no host synchronization, so torch.compile can fuse it.

    Masks are 0/1 floats of the working dtype and the core's own temporaries are updated in place
    (ops.py says why). Off V every value is replaced by 0 before use, so no NaN/inf ever meets a mask
    (`ops.zero_off`). The dict holds what the metrics and the details read, and no more: every other
    full-size temporary is freed as soon as the core is done with it.
    """
    dt = old.dtype
    action = indicator(torch.ne, action_mask, 0, dt)
    lr = old - roll  # finite iff both log-probs are finite (log-probs cannot overflow a difference)
    valid = finite(lr).mul_(action)
    n_act_tok = action.sum(-1, keepdim=True)
    n_nonfinite = n_act_tok - valid.sum(-1, keepdim=True)  # per sequence
    if cfg.nonfinite == "sequence":
        valid.mul_(n_nonfinite == 0)
    action = action if details else None  # only the dumps read it again

    lr = zero_off(lr, valid, scratch=True)  # log r_t, 0 off V
    # the log-probs themselves, 0 off V, only for the statistics that read them (the metrics zero their own)
    log_p = (zero_off(old, valid), zero_off(roll, valid)) if _needs_log_probs(cfg) else None
    n_seq_tok = valid.sum(-1, keepdim=True)
    nf = lr_sum = None  # |V| and Σ log r per sequence, where the weights need them (else the metrics make them)
    if cfg.level != "token" or cfg.opsm_delta is not None or any(c.agg in ("sum", "mean") for c in cfg.rejection):
        nf, lr_sum = n_seq_tok.clamp(min=1.0), lr.sum(-1, keepdim=True)
    r_tok = torch.exp(lr)  # r_t, exact (inf/0 at the extremes, which every comparison handles); 1 off V

    # ── IS weight at the chosen level, then its bounds ──
    if cfg.level == "token":
        r = r_tok
    else:
        r = torch.exp(lr_sum if cfg.level == "sequence" else lr_sum / nf)  # Π r, or exp(mean log r)
    # The adaptive cap reads the valid tokens' ratios only (validate() keeps it to token-level truncation).
    adaptive = None
    if cfg.adaptive_ess_target is not None:
        adaptive = adaptive_bound(r_tok, valid, cfg.adaptive_ess_target, cfg.adaptive_min_bound,
                                  cfg.adaptive_max_bound)
    # Flags are 0/1 per token (B, T) or per sequence (B, 1), named for their metrics; they count on V only.
    w, flags = _bounded(r, cfg, None if adaptive is None else adaptive.bound.to(dt))

    keep = valid  # the survivors; each filter below drops its flagged tokens

    def drop(flag: torch.Tensor) -> None:
        """keep ← keep·(1 − flag): into a new tensor the first time (valid stays as it is), then in place."""
        nonlocal keep
        keep = torch.addcmul(keep, keep, flag, value=-1.0) if keep is valid else keep.addcmul_(keep, flag, value=-1.0)

    if "bounds_masked" in flags:
        drop(flags["bounds_masked"])

    # ── rejection sampling, chained with AND ──
    old0, roll0 = log_p or (None, None)
    for crit in cfg.rejection:
        flags[f"rs_{crit.name}"] = _criterion_rejects(crit, lr, lr_sum, r_tok, nf, old0, roll0)
    if cfg.rejection:
        fails = [flags[f"rs_{crit.name}"] for crit in cfg.rejection]
        flags["rejected"] = functools.reduce(torch.maximum, fails)  # OR of 0/1 floats
        drop(flags["rejected"])

    # ── veto: one catastrophic token drops its whole sequence ──
    if cfg.veto_threshold is not None or cfg.veto_min_prob is not None:
        flags["vetoed"] = _veto(r_tok, log_p, valid, cfg)
        drop(flags["vetoed"])

    # ── OPSM: negative-advantage sequences that drifted too far from μ ──
    if cfg.opsm_delta is not None:
        lp = zero_off(log_probs.detach().to(dt), valid)
        drift = (roll0 - lp).sum(-1, keepdim=True) / nf  # (1/|V|) Σ log(μ/π_θ)
        flags["opsm"] = indicator(torch.lt, advantages.detach(), 0, dt).mul_((drift > cfg.opsm_delta).to(dt))
        drop(flags["opsm"])

    weights = w * keep if cfg.sequence_level else w.mul_(keep)  # w: (B, 1) per sequence, else (B, T)

    # Sums for self-normalization: per kept token, or per kept sequence (one weight per sequence).
    norm = None
    if cfg.batch_normalize and cfg.level == "token":
        norm = torch.stack([weights.sum(), keep.sum()])
    elif cfg.batch_normalize:
        kept_seq = keep.amax(-1, keepdim=True)  # 0/1: whether the sequence kept a token
        norm = torch.stack([dot(w, kept_seq), kept_seq.sum()])

    return {
        "weights": weights, "keep": keep, "valid": valid, "lr": lr, "lr_sum": lr_sum, "nf": nf,
        "n_seq_tok": n_seq_tok, "n_act_tok": n_act_tok, "n_nonfinite": n_nonfinite,
        "old": old, "roll": roll, "r": r, "r_tok": r_tok, "flags": flags, "norm": norm, "adaptive": adaptive,
        "action": action,  # for the dumps only
    }


def _reason(flag: torch.Tensor | None, valid: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: valid tokens a 0/1 flag (per token, or (B, 1) per sequence) dropped; None: none."""
    return torch.zeros(valid.shape, dtype=torch.bool, device=valid.device) if flag is None else flag * valid > 0


def _correct(old: torch.Tensor, roll: torch.Tensor, action_mask: torch.Tensor, log_probs: torch.Tensor | None,
             advantages: torch.Tensor | None, entropy: torch.Tensor | None, *, cfg: CorrectionConfig,
             metrics: bool, details: bool, metric_pass: Callable[..., torch.Tensor] = metric_vector
             ) -> dict[str, torch.Tensor]:
    """Core plus (optionally) metrics and per-token details, returning only what the caller keeps.

    Compiled as one graph, the many intermediates of `_core` never reach memory: only the weights,
    the mask, two normalization sums and the metric vector are written.
    """
    c = _core(old, roll, action_mask, log_probs, advantages, cfg, details=details)
    # The mask leaves in action_mask's dtype: a float mask is written far faster than a bool one.
    out = {"weights": c["weights"], "mask": c["keep"].to(action_mask.dtype), "norm": c["norm"]}
    if details:  # before the metrics, which reuse some of the core's tensors
        flags, valid = c["flags"], c["valid"]
        out.update(raw=clamped(c["r"], cfg) * valid, nan=c.pop("action") > valid,
                   bounds=_reason(flags.get("bounds_masked"), valid), rejection=_reason(flags.get("rejected"), valid),
                   veto=_reason(flags.get("vetoed"), valid), opsm=_reason(flags.get("opsm"), valid))
    if metrics:
        out["metrics"] = metric_pass(c, log_probs, entropy, cfg=cfg)
    return out


def _own_code(fn: Callable) -> Callable:
    """fn with a fresh copy of its code object. Dynamo keeps at most `recompile_limit` (8) graphs per code
    object and silently runs eager beyond it; each compiled configuration gets its own budget this way."""
    fresh = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__)
    fresh.__kwdefaults__ = fn.__kwdefaults__
    return fresh


@functools.lru_cache(maxsize=32)
def _compiled(cfg: CorrectionConfig, metrics: bool, details: bool):
    return torch.compile(functools.partial(_own_code(_correct), cfg=cfg, metrics=metrics, details=details))


def _metric_pass(cfg: CorrectionConfig, device: torch.device) -> Callable[..., torch.Tensor]:
    """The metrics pass of a call: compiled where `compile_metrics` says so (auto: on CUDA), else eager."""
    if cfg.compile_metrics == "on" or (cfg.compile_metrics == "auto" and device.type == "cuda"):
        return _compiled_metrics(cfg)
    return metric_vector


@functools.lru_cache(maxsize=32)
def _compiled_metrics(cfg: CorrectionConfig) -> Callable[..., torch.Tensor]:
    """The metrics pass compiled into a few fused kernels (eagerly it is ~95 launches, the whole cost of
    the metrics on a GPU), or, where compiling fails (no Triton, an unsupported GPU), the eager pass after
    one warning. Shapes are dynamic: every micro-batch has its own length, and must not recompile. The
    compiled pass gets a copy of the core's dict, whole for the eager pass should it fail."""
    compiled = torch.compile(_own_code(metric_vector), dynamic=True)
    failure: list[Exception] = []

    def run(c: dict, log_probs: torch.Tensor | None, entropy: torch.Tensor | None, *,
            cfg: CorrectionConfig) -> torch.Tensor:
        if not failure:
            try:
                return compiled(dict(c), log_probs, entropy, cfg=cfg)
            except Exception as exc:  # any compiler failure: the metrics are still owed, eagerly
                failure.append(exc)
                warnings.warn(f"the correction metrics run eagerly: torch.compile failed ({type(exc).__name__}: "
                              f"{exc}); --algo.correction.compile_metrics off skips the attempt", stacklevel=2)
        return metric_vector(c, log_probs, entropy, cfg=cfg)

    return run


def metric_names(cfg: CorrectionConfig, *, has_entropy: bool = False, has_log_probs: bool = False) -> list[str]:
    """The metric keys `compute_correction` returns for this configuration, in order.

    Read off `metrics.metrics_from_sums` (where each value is built under its name) on a 1×1 dummy batch,
    so names and values cannot drift apart; cached per configuration.
    """
    return list(_metric_layout(cfg, has_entropy, has_log_probs)[1])


@functools.lru_cache(maxsize=64)
def _metric_layout(cfg: CorrectionConfig, has_entropy: bool,
                   has_log_probs: bool) -> tuple[tuple[tuple[str, int], ...], tuple[str, ...]]:
    """(name, size) of each group in the metric vector, and the metric names, from a 1×1 dummy batch."""
    x = torch.zeros(1, 1)
    c = _core(x, x, torch.ones(1, 1), x, x, cfg)
    sums = metric_sums(c, x if has_log_probs else None, x if has_entropy else None, cfg)
    layout = tuple((name, len(values)) for name, values in sums.items())
    names = tuple(metrics_from_sums({name: [v.item() for v in values] for name, values in sums.items()}, cfg))
    return layout, names


def kept_weight_totals(weights: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """[Σ kept weights, number kept] per token (token level) or per sequence (sequence levels).

    Used to self-normalize over a whole data-parallel batch computed in several pieces.
    """
    keep = mask.bool()
    if level == "token":
        return torch.stack([torch.where(keep, weights, 0.0).sum(), keep.sum().to(weights.dtype)])
    kept_seq = keep.any(-1)
    seq_w = torch.where(keep, weights, 0.0).amax(-1)  # constant along a kept sequence
    return torch.stack([torch.where(kept_seq, seq_w, 0.0).sum(), kept_seq.sum().to(weights.dtype)])


def compute_correction(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    action_mask: torch.Tensor,
    config: CorrectionConfig | None = None,
    *,
    log_probs: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    allreduce: AllReduce | None = None,
    normalizer: float | torch.Tensor | None = None,
    with_metrics: bool = True,
    details: bool = False,
) -> CorrectionOutput:
    """Importance weights and masks that correct for sampling from μ (rollout) instead of π_old.

    Args:
        old_log_probs: (B, T) log π_old of the sampled tokens (trainer forward; π_θ in bypass losses).
        rollout_log_probs: (B, T) log μ from the rollout engine; NaN/inf tokens are masked and counted.
        action_mask: (B, T) 1 on action tokens.
        config: what to do; default CorrectionConfig() (token TIS, U = 2).
        log_probs, advantages: π_θ and A, needed by OPSM (log_probs also gives a sampled-entropy metric).
        entropy: (B, T) exact training entropy, logged when given.
        allreduce: sums a tensor across data-parallel ranks; with batch_normalize and scope global the
            normalizing mean is taken over all ranks.
        normalizer: a precomputed mean kept weight (e.g. over the whole replay buffer); overrides the
            batch's own.
        with_metrics: compute `out.metrics` (one host sync); False for the bare weights.
        details: also fill `out.raw_weights` and `out.reasons` (per-token dumps of the run store).
    """
    cfg = (config or CorrectionConfig()).validate()
    if old_log_probs.shape != rollout_log_probs.shape or old_log_probs.shape != action_mask.shape:
        raise ValueError(
            f"shapes differ: old {tuple(old_log_probs.shape)}, rollout {tuple(rollout_log_probs.shape)}, "
            f"action_mask {tuple(action_mask.shape)}"
        )
    if cfg.opsm_delta is not None and (log_probs is None or advantages is None):
        raise ValueError("--algo.correction.opsm_delta needs the current log-probs and the advantages")
    dtype = torch.promote_types(old_log_probs.dtype, torch.float32)
    old = old_log_probs.detach().to(dtype)
    roll = rollout_log_probs.detach().to(dtype)
    fn = (_compiled(cfg, with_metrics, details) if cfg.compile
          else functools.partial(_correct, cfg=cfg, metrics=with_metrics, details=details,
                                 metric_pass=_metric_pass(cfg, old.device)))
    c = fn(old, roll, action_mask, log_probs, advantages, entropy)

    weights = c["weights"]
    factor = None
    if cfg.batch_normalize:
        if normalizer is not None:
            factor = torch.as_tensor(normalizer, dtype=weights.dtype, device=weights.device)
            factor = torch.where(factor > 0, factor, 1.0)
        else:
            norm = c["norm"]
            if allreduce is not None and cfg.normalize_scope == "global":
                norm = allreduce(norm.clone())
            factor = torch.where(norm[0] > 0, norm[0] / norm[1], 1.0)  # Σ kept weights > 0: something kept
        weights = weights.div_(factor)  # the core's own tensor

    metrics: dict[str, float] = {}
    if with_metrics:
        layout = _metric_layout(cfg, entropy is not None, log_probs is not None)[0]
        metrics = metrics_to_dict(c["metrics"], factor, layout, cfg)
    out = CorrectionOutput(weights=weights.detach(), mask=c["mask"], metrics=metrics)
    if details:
        out.raw_weights = c["raw"]
        out.reasons = {k: c[k] for k in ("nan", "bounds", "rejection", "veto", "opsm")}
    return out
