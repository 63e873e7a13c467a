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


def metric_names(cfg: CorrectionConfig, *, has_entropy: bool = False, has_log_probs: bool = False) -> list[str]:
    """The metric keys `metrics_to_dict` returns for this configuration (`compute_correction`'s metrics), in order."""
    names = [
        "mismatch/k1_kl", "mismatch/k2_kl", "mismatch/k3_kl", "mismatch/chi2_token", "mismatch/chi2_seq",
        "mismatch/rollout_ppl", "mismatch/training_ppl", "mismatch/ppl_ratio", "mismatch/log_ppl_diff",
        "mismatch/ess_token", "mismatch/ess_seq", "mismatch/abs_dp_max", "mismatch/abs_dp_mean",
        "mismatch/abs_dlogp_mean", "mismatch/abs_dlogp_max", "mismatch/pearson_p",
    ]
    for b in bucket_names():
        names += [f"mismatch/abs_dlogp_{b}", f"mismatch/frac_{b}"]
    if has_entropy:
        names.append("mismatch/entropy")
    if has_log_probs:
        names.append("mismatch/entropy_sampled")
    names += [
        "correction/weight_raw_mean", "correction/weight_raw_std", "correction/weight_raw_min",
        "correction/weight_raw_max", "correction/weight_mean", "correction/weight_std", "correction/weight_min",
        "correction/weight_max", "correction/ess", "correction/truncated_frac", "correction/clipped_low_frac",
        "correction/clipped_high_frac", "correction/bounds_masked_frac", "correction/rejected_frac",
    ]
    names += [f"correction/rs_{c.name}_frac" for c in cfg.rejection]
    names += [
        "correction/vetoed_frac", "correction/vetoed_seq_frac", "correction/opsm_frac",
        "correction/nonfinite_frac", "correction/nonfinite_count", "correction/masked_frac",
        "correction/kept_frac", "correction/norm_factor",
    ]
    return names


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


def metric_vector(c: dict, log_probs: torch.Tensor | None, entropy: torch.Tensor | None,
                  cfg: CorrectionConfig) -> torch.Tensor:
    """All metrics as one vector, from the core's intermediates (weights before self-normalization)."""
    weights = c["weights"]
    vf, lr, old, roll, nf = c["valid_f"], c["lr"], c["old"], c["roll"], c["nf"]
    dt = lr.dtype
    n_act = torch.count_nonzero(c["action"]).to(dt).clamp(min=1)
    n = vf.sum().clamp(min=1)
    seq_vf = (c["n_seq_tok"].squeeze(-1) > 0).to(dt)
    n_seq = seq_vf.sum().clamp(min=1)
    clamp = cfg.log_ratio_clamp
    out: list[torch.Tensor] = []

    # ── KL estimators and χ² (lr = 0 off V, so every summand below vanishes there) ──
    r = c["r_tok"].clamp(math.exp(-clamp), math.exp(clamp))  # = exp(clamp(log r))
    out.append(-lr.sum() / n)  # k1
    out.append((0.5 * lr * lr).sum() / n)  # k2
    out.append((r - 1.0 - lr).sum() / n)  # k3
    out.append((r * r - 1.0).sum() / n)  # χ² token
    seq_log = lr.sum(-1)  # log ρ_s
    rho = torch.exp(seq_log.clamp(-clamp, clamp))
    out.append(((rho * rho - 1.0) * seq_vf).sum() / n_seq)  # χ² sequence

    # ── perplexities ──
    mean_roll = roll.sum(-1) / nf.squeeze(-1)
    mean_old = old.sum(-1) / nf.squeeze(-1)
    out.append((torch.exp(-mean_roll) * seq_vf).sum() / n_seq)
    out.append((torch.exp(-mean_old) * seq_vf).sum() / n_seq)
    out.append((torch.exp(mean_roll - mean_old) * seq_vf).sum() / n_seq)  # ppl_train / ppl_rollout
    out.append(((mean_roll - mean_old) * seq_vf).sum() / n_seq)  # log ppl_train − log ppl_rollout

    # ── effective sample size of the raw weights ──
    out.append(_ess(r, vf))
    out.append(_ess(rho, seq_vf))

    # ── probability gaps and their correlation (off V both probabilities are exp(0) = 1) ──
    p_old, p_roll = torch.exp(old), torch.exp(roll)
    dp = (p_old - p_roll).abs()
    out.append(dp.amax() if dp.numel() else torch.zeros((), dtype=dt))
    out.append(dp.sum() / n)
    adl = lr.abs()
    out.append(adl.sum() / n)
    out.append(adl.amax() if adl.numel() else torch.zeros((), dtype=dt))
    po, pr = p_old * vf, p_roll * vf  # one pass: cov = E[xy] − E[x]E[y] (probabilities are O(1))
    mo, mr = po.sum() / n, pr.sum() / n
    cov = (po * p_roll).sum() / n - mo * mr
    vo = ((po * p_old).sum() / n - mo * mo).clamp(min=0)
    vr = ((pr * p_roll).sum() / n - mr * mr).clamp(min=0)
    den = (vo * vr).sqrt()
    out.append(torch.where(den > 0, cov / den.clamp(min=1e-30), torch.zeros_like(den)))

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
    out.extend(torch.stack([gap, frac], 1).reshape(-1).unbind())

    if entropy is not None:
        out.append((torch.nan_to_num(entropy.detach().to(dt)) * vf).sum() / n)
    if log_probs is not None:
        out.append(-(torch.nan_to_num(log_probs.detach().to(dt)) * vf).sum() / n)

    # ── weights before and after bounds, at the configured level ──
    kf = c["keep_f"]
    if cfg.level == "token":
        out.extend(_stats(c["raw"], vf))
        out.extend(_stats(weights, kf))
        out.append(_ess(weights, kf))
    else:
        kept_seq = (kf.sum(-1) > 0).to(dt)
        out.extend(_stats(c["raw"].squeeze(-1), seq_vf))
        seq_w = (weights * kf).amax(-1)  # the sequence's weight, constant on its kept tokens
        out.extend(_stats(seq_w, kept_seq))
        out.append(_ess(seq_w, kept_seq))

    # ── what the correction did, as fractions of action tokens ──
    valid, n_seq_tok = c["valid"], c["n_seq_tok"].squeeze(-1)
    zero = torch.zeros((), dtype=dt, device=lr.device)

    def count(m: torch.Tensor) -> torch.Tensor:
        """Valid tokens flagged by m; a (B, 1) sequence-level flag counts its sequence's valid tokens."""
        if m.shape[-1] == 1:
            return (m.squeeze(-1).to(dt) * n_seq_tok).sum()
        return torch.count_nonzero(m & valid).to(dt)

    truncating, clipping = cfg.mode == "truncate", cfg.mode == "clip"
    out.append(count(c["over"]) / n_act if truncating else zero)
    out.append(count(c["under"]) / n_act if clipping else zero)
    out.append(count(c["over"]) / n_act if clipping else zero)
    out.append(count(c["bounds_out"]) / n_act if cfg.mode == "mask" else zero)
    if cfg.rejection:
        rs_any = c["rs_fail"][0]
        for f in c["rs_fail"][1:]:
            rs_any = rs_any | f
        out.append(count(rs_any) / n_act)
        out.extend(count(f) / n_act for f in c["rs_fail"])
    else:
        out.append(zero)
    if cfg.veto_threshold is not None or cfg.veto_min_prob is not None:
        veto_seq = c["veto_seq"].squeeze(-1).to(dt)
        out.append((veto_seq * n_seq_tok).sum() / n_act)
        out.append(veto_seq.sum() / torch.count_nonzero(c["action"].any(-1)).clamp(min=1).to(dt))
    else:
        out.extend([zero, zero])
    out.append(count(c["opsm"]) / n_act if cfg.opsm_delta is not None else zero)
    n_act_raw = torch.count_nonzero(c["action"]).to(dt)
    n_valid_raw = vf.sum()
    n_kept = kf.sum()
    out.append((n_act_raw - n_valid_raw) / n_act)  # lost to non-finite log-probs
    out.append(torch.count_nonzero(c["nonfinite"]).to(dt))
    out.append((n_act_raw - n_kept) / n_act)
    out.append(n_kept / n_act)
    out.append(torch.ones((), dtype=dt, device=lr.device))  # norm_factor, filled in by metrics_to_dict
    return torch.stack([o.to(dt).reshape(()) for o in out])


_SCALED_BY_FACTOR = ("correction/weight_mean", "correction/weight_std", "correction/weight_min",
                     "correction/weight_max")


def metrics_to_dict(vector: torch.Tensor, factor: torch.Tensor | None, cfg: CorrectionConfig, *,
                    has_entropy: bool = False, has_log_probs: bool = False) -> dict[str, float]:
    """Name the metric vector (one host transfer) and apply the self-normalization factor."""
    if factor is not None:
        vector = torch.cat([vector, factor.to(vector.dtype).reshape(1)])
    values = vector.tolist()
    names = metric_names(cfg, has_entropy=has_entropy, has_log_probs=has_log_probs)
    out = dict(zip(names, values[: len(names)], strict=True))
    if factor is not None:
        f = values[-1]
        out["correction/norm_factor"] = f
        for key in _SCALED_BY_FACTOR:  # w/f scales mean, std, min and max alike
            out[key] /= f
    return out
