"""Mismatch diagnostics (`mismatch/*`: μ vs π_old) and what the correction did (`correction/*`).

All statistics run over valid tokens V (action tokens with finite log-probs); r_t = π_old/μ,
ρ_s = Π_{t∈V_s} r_t the sequence ratio. Every scalar is computed as a tensor and the lot is moved to
the host in one transfer, so logging costs one synchronization per micro-batch.

    mismatch/k1_kl        (1/N) Σ log(μ/π_old)                  KL(μ‖π_old), k1 (Schulman 2020)
    mismatch/k2_kl        (1/N) Σ ½ (log r)²                     k2
    mismatch/k3_kl        (1/N) Σ (r − 1 − log r)                k3, unbiased and ≥ 0
    mismatch/chi2_token   (1/N) Σ r² − 1                         χ²(π_old‖μ) per token (verl)
    mismatch/chi2_seq     (1/S) Σ_s ρ_s² − 1                     χ² per sequence (verl)
    mismatch/rollout_ppl  (1/S) Σ_s exp(−mean_t log μ)           perplexity under μ (verl)
    mismatch/training_ppl (1/S) Σ_s exp(−mean_t log π_old)
    mismatch/ppl_ratio    (1/S) Σ_s training_ppl_s / rollout_ppl_s
    mismatch/ess_token    (Σ r)² / (N Σ r²)                      normalized ESS of raw token weights (Kong 1992)
    mismatch/ess_seq      (Σ ρ)² / (S Σ ρ²)                      same for sequence weights
    mismatch/abs_dp_*     |π_old(a_t) − μ(a_t)|, max and mean
    mismatch/pearson_p    corr(π_old(a_t), μ(a_t))
    mismatch/abs_dlogp_pA-B, frac_pA-B   mean |log r| and token share per bucket of μ(a_t)
    mismatch/entropy      (1/N) Σ H(π_θ(·|s_t)) when the exact entropy is given
    mismatch/entropy_sampled (1/N) Σ −log π_θ(a_t): sampled estimate (tokens drawn from μ ≈ π_θ)

r and ρ are clamped to e^±log_ratio_clamp (20) inside χ² and ESS, so one absurd token cannot overflow a
float32 sum; KL estimators and |log r| use the exact log-ratio.
"""

from __future__ import annotations

import math

import torch

from .config import CorrectionConfig

PROB_BUCKET_EDGES = (1e-3, 1e-2, 0.1, 0.5, 0.9)
"""Edges of the rollout-probability buckets; docs/measurements.md: the gap is 4–5× larger below 0.01."""


def _fmt(x: float) -> str:
    return f"{x:g}"


def bucket_names(edges: tuple[float, ...] = PROB_BUCKET_EDGES) -> list[str]:
    bounds = (0.0, *edges, 1.0)
    return [f"p{_fmt(lo)}-{_fmt(hi)}" for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]


def _ess(w: torch.Tensor, keep_f: torch.Tensor) -> torch.Tensor:
    """Normalized effective sample size (Σw)²/(n Σw²) of finite weights w (clamped at e^±20 upstream)."""
    n = keep_f.sum()
    wk = w * keep_f
    value = wk.sum() ** 2 / (n * (wk * w).sum()).clamp(min=1e-30)
    return torch.where(n > 0, value, torch.ones_like(value))


def _stats(x: torch.Tensor, keep_f: torch.Tensor) -> list[torch.Tensor]:
    """mean, std (population), min, max of x >= 0 over keep; zeros when keep is empty. One pass."""
    n = keep_f.sum()
    xk = x * keep_f
    mean = xk.sum() / n.clamp(min=1)
    var = ((xk * x).sum() / n.clamp(min=1) - mean * mean).clamp(min=0)
    mx = xk.amax()  # x >= 0, so the zeros off keep never win
    mn = (xk + (1 - keep_f) * 1e30).amin()
    return [mean, var.sqrt(), torch.where(n > 0, mn, torch.zeros_like(mn)), mx]


def metric_pairs(c: dict, log_probs: torch.Tensor | None, entropy: torch.Tensor | None,
                 cfg: CorrectionConfig) -> list[tuple[str, torch.Tensor]]:
    """Every metric as (name, 0-d tensor), in logging order, from the core's intermediates (weights
    before self-normalization). Names and values are made together here, so they cannot drift apart:
    `metric_vector` stacks the values (inside the compiled graph) and `weights.metric_names` reads the
    names off a run on a 1×1 dummy batch.
    """
    weights = c["weights"]
    vf, lr, old, roll, nf = c["valid_f"], c["lr"], c["old"], c["roll"], c["nf"]
    dt = lr.dtype
    n_act = torch.count_nonzero(c["action"]).to(dt).clamp(min=1)
    n = vf.sum().clamp(min=1)
    seq_vf = (c["n_seq_tok"].squeeze(-1) > 0).to(dt)
    n_seq = seq_vf.sum().clamp(min=1)
    clamp = cfg.log_ratio_clamp
    out: list[tuple[str, torch.Tensor]] = []

    def put(name: str, value: torch.Tensor) -> None:
        out.append((name, value))

    # ── KL estimators and χ² (lr = 0 off V, so every summand below vanishes there) ──
    r = c["r_tok"].clamp(math.exp(-clamp), math.exp(clamp))  # = exp(clamp(log r))
    put("mismatch/k1_kl", -lr.sum() / n)
    put("mismatch/k2_kl", (0.5 * lr * lr).sum() / n)
    put("mismatch/k3_kl", (r - 1.0 - lr).sum() / n)
    put("mismatch/chi2_token", (r * r - 1.0).sum() / n)
    seq_log = lr.sum(-1)  # log ρ_s
    rho = torch.exp(seq_log.clamp(-clamp, clamp))
    put("mismatch/chi2_seq", ((rho * rho - 1.0) * seq_vf).sum() / n_seq)

    # ── perplexities ──
    mean_roll = roll.sum(-1) / nf.squeeze(-1)
    mean_old = old.sum(-1) / nf.squeeze(-1)
    put("mismatch/rollout_ppl", (torch.exp(-mean_roll) * seq_vf).sum() / n_seq)
    put("mismatch/training_ppl", (torch.exp(-mean_old) * seq_vf).sum() / n_seq)
    put("mismatch/ppl_ratio", (torch.exp(mean_roll - mean_old) * seq_vf).sum() / n_seq)  # ppl_train / ppl_rollout
    put("mismatch/log_ppl_diff", ((mean_roll - mean_old) * seq_vf).sum() / n_seq)  # log ppl_train − log ppl_rollout

    # ── effective sample size of the raw weights ──
    put("mismatch/ess_token", _ess(r, vf))
    put("mismatch/ess_seq", _ess(rho, seq_vf))

    # ── probability gaps and their correlation (off V both probabilities are exp(0) = 1) ──
    p_old, p_roll = torch.exp(old), torch.exp(roll)
    dp = (p_old - p_roll).abs()
    put("mismatch/abs_dp_max", dp.amax() if dp.numel() else torch.zeros((), dtype=dt))
    put("mismatch/abs_dp_mean", dp.sum() / n)
    adl = lr.abs()
    put("mismatch/abs_dlogp_mean", adl.sum() / n)
    put("mismatch/abs_dlogp_max", adl.amax() if adl.numel() else torch.zeros((), dtype=dt))
    po, pr = p_old * vf, p_roll * vf  # one pass: cov = E[xy] − E[x]E[y] (probabilities are O(1))
    mo, mr = po.sum() / n, pr.sum() / n
    cov = (po * p_roll).sum() / n - mo * mr
    vo = ((po * p_old).sum() / n - mo * mo).clamp(min=0)
    vr = ((pr * p_roll).sum() / n - mr * mr).clamp(min=0)
    den = (vo * vr).sqrt()
    put("mismatch/pearson_p", torch.where(den > 0, cov / den.clamp(min=1e-30), torch.zeros_like(den)))

    # ── mismatch by rollout-probability bucket: tokens at or above each edge, then differences ──
    at_or_above = [torch.stack([n, adl.sum()])]  # edge 0: every valid token (adl = 0 off V)
    for edge in PROB_BUCKET_EDGES:
        ge = (p_roll >= edge).to(dt) * vf
        at_or_above.append(torch.stack([ge.sum(), (ge * adl).sum()]))
    at_or_above.append(torch.zeros(2, dtype=dt, device=lr.device))
    cum = torch.stack(at_or_above)  # (E + 2, 2): counts and gap sums at or above each edge
    per_bucket = cum[:-1] - cum[1:]  # (E + 1, 2)
    gap = per_bucket[:, 1] / per_bucket[:, 0].clamp(min=1)
    frac = per_bucket[:, 0] / n
    for b, bucket in enumerate(bucket_names()):
        put(f"mismatch/abs_dlogp_{bucket}", gap[b])
        put(f"mismatch/frac_{bucket}", frac[b])

    if entropy is not None:
        put("mismatch/entropy", (torch.nan_to_num(entropy.detach().to(dt)) * vf).sum() / n)
    if log_probs is not None:
        put("mismatch/entropy_sampled", -(torch.nan_to_num(log_probs.detach().to(dt)) * vf).sum() / n)

    # ── weights before and after bounds, at the configured level ──
    kf = c["keep_f"]
    if cfg.level == "token":
        raw_stats, weight_stats, ess = _stats(c["raw"], vf), _stats(weights, kf), _ess(weights, kf)
    else:
        kept_seq = (kf.sum(-1) > 0).to(dt)
        seq_w = (weights * kf).amax(-1)  # the sequence's weight, constant on its kept tokens
        raw_stats, weight_stats = _stats(c["raw"].squeeze(-1), seq_vf), _stats(seq_w, kept_seq)
        ess = _ess(seq_w, kept_seq)
    for stat, value in zip(("mean", "std", "min", "max"), raw_stats, strict=True):
        put(f"correction/weight_raw_{stat}", value)
    for stat, value in zip(("mean", "std", "min", "max"), weight_stats, strict=True):
        put(f"correction/weight_{stat}", value)
    put("correction/ess", ess)

    # ── what the correction did, as fractions of action tokens ──
    valid, n_seq_tok = c["valid"], c["n_seq_tok"].squeeze(-1)
    zero = torch.zeros((), dtype=dt, device=lr.device)

    def count(m: torch.Tensor) -> torch.Tensor:
        """Valid tokens flagged by m; a (B, 1) sequence-level flag counts its sequence's valid tokens."""
        if m.shape[-1] == 1:
            return (m.squeeze(-1).to(dt) * n_seq_tok).sum()
        return torch.count_nonzero(m & valid).to(dt)

    truncating, clipping = cfg.mode == "truncate", cfg.mode == "clip"
    put("correction/truncated_frac", count(c["over"]) / n_act if truncating else zero)
    put("correction/clipped_low_frac", count(c["under"]) / n_act if clipping else zero)
    put("correction/clipped_high_frac", count(c["over"]) / n_act if clipping else zero)
    put("correction/bounds_masked_frac", count(c["bounds_out"]) / n_act if cfg.mode == "mask" else zero)
    if cfg.rejection:
        rs_any = c["rs_fail"][0]
        for f in c["rs_fail"][1:]:
            rs_any = rs_any | f
        put("correction/rejected_frac", count(rs_any) / n_act)
        for crit, f in zip(cfg.rejection, c["rs_fail"], strict=True):
            put(f"correction/rs_{crit.name}_frac", count(f) / n_act)
    else:
        put("correction/rejected_frac", zero)
    if cfg.veto_threshold is not None or cfg.veto_min_prob is not None:
        veto_seq = c["veto_seq"].squeeze(-1).to(dt)
        put("correction/vetoed_frac", (veto_seq * n_seq_tok).sum() / n_act)
        put("correction/vetoed_seq_frac", veto_seq.sum() / torch.count_nonzero(c["action"].any(-1)).clamp(min=1).to(dt))
    else:
        put("correction/vetoed_frac", zero)
        put("correction/vetoed_seq_frac", zero)
    put("correction/opsm_frac", count(c["opsm"]) / n_act if cfg.opsm_delta is not None else zero)
    n_act_raw = torch.count_nonzero(c["action"]).to(dt)
    n_valid_raw = vf.sum()
    n_kept = kf.sum()
    put("correction/nonfinite_frac", (n_act_raw - n_valid_raw) / n_act)  # lost to non-finite log-probs
    put("correction/nonfinite_count", torch.count_nonzero(c["nonfinite"]).to(dt))
    put("correction/masked_frac", (n_act_raw - n_kept) / n_act)
    put("correction/kept_frac", n_kept / n_act)
    put("correction/norm_factor", torch.ones((), dtype=dt, device=lr.device))  # filled in by metrics_to_dict
    return out


def metric_vector(c: dict, log_probs: torch.Tensor | None, entropy: torch.Tensor | None,
                  cfg: CorrectionConfig) -> torch.Tensor:
    """All metric values as one vector (`metric_pairs` order), moved to the host in one transfer."""
    dt = c["lr"].dtype
    return torch.stack([value.to(dt).reshape(()) for _, value in metric_pairs(c, log_probs, entropy, cfg)])


_SCALED_BY_FACTOR = ("correction/weight_mean", "correction/weight_std", "correction/weight_min",
                     "correction/weight_max")


def metrics_to_dict(vector: torch.Tensor, factor: torch.Tensor | None, names: list[str]) -> dict[str, float]:
    """Name the metric vector (`names`: its `metric_pairs` names; one host transfer) and apply the
    self-normalization factor."""
    if factor is not None:
        vector = torch.cat([vector, factor.to(vector.dtype).reshape(1)])
    values = vector.tolist()
    out = dict(zip(names, values[: len(names)], strict=True))
    if factor is not None:
        f = values[-1]
        out["correction/norm_factor"] = f
        for key in _SCALED_BY_FACTOR:  # w/f scales mean, std, min and max alike
            out[key] /= f
    return out
