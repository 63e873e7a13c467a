"""Mismatch diagnostics (`mismatch/*`: μ vs π_old) and what the correction did (`correction/*`).

All statistics run over valid tokens V (action tokens with finite log-probs); r_t = π_old/μ,
ρ_s = Π_{t∈V_s} r_t the sequence ratio.

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
    correction/adaptive_*  the adaptive cap C_t, ESS(C_t), and whether C_t sat at its max or min (adaptive.py);
                           only with --algo.correction.adaptive_ess_target

r and ρ are clamped to e^±log_ratio_clamp (20) inside χ² and ESS, so one absurd token cannot overflow a
float32 sum; KL estimators and |log r| use the exact log-ratio.

Logging costs one synchronization per micro-batch and few passes over the tokens: `metric_sums` reduces
the core's per-token tensors, on the device, to one short vector of sums, counts and extremes (each
per-token quantity made once and shared, products summed by dot products); `metrics_to_dict` moves it
to the host in one transfer, where `metrics_from_sums` derives every logged value in float64.
"""

from __future__ import annotations

import math

import torch

from openrlhf_tis import metric_names as names

from .config import CorrectionConfig
from .ops import dot, indicator, own, zero_off

_ABOVE_ANY_WEIGHT = 1e30  # added off a mask before a min; weights and ratios are clamped at e^20
Sums = dict[str, list[float]]
"""`metric_sums` on the host: each named group of reductions as floats."""


# ── on the device: reductions only ───────────────────────────────────────────────────────────────────
# Eagerly every operation is a kernel launch and every fresh full-size tensor costs memory (ops.py): each
# per-token quantity is made once, in a tensor that is reused in place or dropped before the next one is
# made, and the reductions land as 0-d tensors in one vector, stacked once.

def _moments(x: torch.Tensor, mask: torch.Tensor, n: torch.Tensor) -> list[torch.Tensor]:
    """[n, Σx, Σx², Σy, Σy², min, max] of weights x ≥ 0, 0 off a 0/1 mask holding n ones, with y = x − 1 on
    the mask (read by `_summary` and `_chi2`); one scratch tensor serves the min and then y."""
    scratch = torch.rsub(mask, 1.0)
    lowest = torch.add(x, scratch, alpha=_ABOVE_ANY_WEIGHT, out=scratch).amin()  # off the mask: above every weight
    y = torch.sub(x, mask, out=scratch)
    return [n, x.sum(), dot(x, x), y.sum(), dot(y, y), lowest, x.amax()]  # x ≥ 0: the zeros off the mask never win


def _bucket_sums(p: torch.Tensor, abs_lr: torch.Tensor, n_valid: torch.Tensor) -> tuple[list, list]:
    """Valid tokens at or above each bucket edge (edge 0: all), exact counts, and Σ|log r| per bucket, for p
    the rollout probability on V and 0 off it (lower edges inclusive). Each bucket's Σ|log r| is summed on
    its own, so a small bucket stays exact in float32, through two 0/1 buffers reused in place (a bucket
    index would cost a slow search or a wide comparison on the CPU; a scatter-add, atomics on six addresses
    on a GPU)."""
    in_bucket, above = torch.ones_like(p), torch.empty_like(p)
    at_or_above, gaps = [n_valid], []
    for edge in names.PROB_BUCKET_EDGES:
        torch.ge(p, edge, out=above)  # off V, p = 0 lies below every edge
        at_or_above.append(above.sum())
        gaps.append(dot(in_bucket.sub_(above), abs_lr))  # the bucket below this edge
        in_bucket, above = above, in_bucket  # the next bucket starts at this edge
    gaps.append(dot(in_bucket, abs_lr))  # the last bucket: at or above the last edge
    return at_or_above, gaps


def _count(flag: torch.Tensor, valid: torch.Tensor, n_seq_tok: torch.Tensor) -> torch.Tensor:
    """Valid tokens flagged by a 0/1 flag: (B, T) per token, or (B, 1) per sequence (all its valid tokens)."""
    return dot(flag, n_seq_tok) if flag.shape[-1] == 1 else dot(flag, valid)


def metric_sums(c: dict, log_probs: torch.Tensor | None, entropy: torch.Tensor | None,
                cfg: CorrectionConfig) -> dict[str, list[torch.Tensor]]:
    """Every reduction the metrics need, as named groups of 0-d tensors, from the core's intermediates
    (weights before self-normalization); `metrics_from_sums` reads the names. Takes the core's flags, ratios
    and log-ratios out of `c` (overwriting them in place), so their memory goes as soon as they are used."""
    valid, lr = c["valid"], c["lr"]
    clamp = cfg.log_ratio_clamp
    lr_sum = c["lr_sum"] if c["lr_sum"] is not None else lr.sum(-1, keepdim=True)  # log ρ_s
    nf = c["nf"] if c["nf"] is not None else c["n_seq_tok"].clamp(min=1.0)  # |V_s|, at least 1
    seq_valid = indicator(torch.gt, c["n_seq_tok"].squeeze(-1), 0)
    n_kept_tok = c["keep"].sum(-1, keepdim=True)
    per_seq = torch.stack([c["n_act_tok"], c["n_seq_tok"], n_kept_tok, c["n_nonfinite"], lr_sum])
    lr_sum = lr_sum.squeeze(-1)
    n_act, n_valid, n_kept, n_nonfinite, sum_lr = per_seq.sum((1, 2)).unbind()
    n_seq = seq_valid.sum()
    sums = {"kl": [sum_lr, dot(lr, lr)], "tokens": [n_act, n_valid, n_kept, n_nonfinite]}
    flags = c.pop("flags")
    sums.update({name: [_count(flag, valid, c["n_seq_tok"])] for name, flag in flags.items()})
    if "vetoed" in flags:
        sums["vetoed_seqs"] = [flags["vetoed"].sum(), (c["n_act_tok"] > 0).sum().to(valid.dtype)]
    del flags

    # weights: the token ratio exp(clamp(log r)) on V, 0 off V (at token level the raw weight) ...
    level_r = c.pop("r")  # the weight at the configured level: r_tok itself at token level
    r = own(c.pop("r_tok")).clamp_(math.exp(-clamp), math.exp(clamp)).mul_(valid)
    sums["ratio_token"] = _moments(r, valid, n_valid)
    del r
    sums["ratio_seq"] = _moments(torch.exp(lr_sum.clamp(-clamp, clamp)).mul_(seq_valid), seq_valid, n_seq)
    if cfg.level == "token":  # the raw weight is r itself: its moments are ratio_token's
        sums["weight"] = _moments(c["weights"], c["keep"], n_kept)  # weights are 0 off keep
    else:  # one weight per sequence, constant on its kept tokens
        raw = level_r.squeeze(-1).clamp(math.exp(-clamp), math.exp(clamp))
        sums["raw"] = _moments(raw.mul_(seq_valid), seq_valid, n_seq)
        kept_seq = indicator(torch.gt, n_kept_tok.squeeze(-1), 0)
        sums["weight"] = _moments(c["weights"].amax(-1), kept_seq, kept_seq.sum())
    del level_r
    if c["adaptive"] is not None:  # what the adaptive rule chose: its cap, the ESS there, which case held
        sums["adaptive"] = [value.to(valid.dtype) for value in c["adaptive"]]
    if entropy is not None:
        sums["entropy"] = [dot(torch.nan_to_num(entropy.detach().to(valid.dtype)), valid)]
    if log_probs is not None:
        sums["entropy_sampled"] = [dot(torch.nan_to_num(log_probs.detach().to(valid.dtype)), valid)]

    # ... log π_old and log μ, 0 off V: per sequence their means (perplexities), per token their probabilities
    log_p = zero_off(torch.stack([c["old"], c["roll"]]), valid, scratch=True)
    means = log_p.sum(-1).div_(nf.squeeze(-1))  # (2, B)
    ppl = torch.exp(-means)  # training, rollout perplexity
    log_ratio = means[1] - means[0]  # mean log μ − mean log π_old = log(ppl_train / ppl_rollout)
    sums["ppl"] = list((torch.stack([ppl[1], ppl[0], log_ratio.exp(), log_ratio]) @ seq_valid).unbind())
    p = log_p.exp_().mul_(valid)  # π_old(a_t), μ(a_t) on V, 0 off V
    abs_dp = torch.sub(p[0], p[1]).abs_()
    dp_sums = [abs_dp.sum(), abs_dp.amax()]
    del abs_dp
    abs_lr = own(c.pop("lr")).abs_()  # 0 off V; the last use of log r
    sums["gaps"] = [*dp_sums, abs_lr.sum(), abs_lr.amax()]
    sums["bucket_at_or_above"], sums["bucket_gaps"] = _bucket_sums(p[1], abs_lr, n_valid)
    del abs_lr
    # Moments about the batch means (on the device, no sync): raw E[x²] − E[x]² cancels catastrophically when
    # the probabilities barely vary, and a correlation must stay within [−1, 1].
    d = p.sub_((p.sum((1, 2)) / n_valid.clamp_min(1)).view(2, 1, 1)).mul_(valid)
    sums["pearson"] = [*d.sum((1, 2)).unbind(), dot(d[0], d[0]), dot(d[1], d[1]), dot(d[0], d[1])]
    del p, d, log_p

    return sums


def metric_vector(c: dict, log_probs: torch.Tensor | None, entropy: torch.Tensor | None, *,
                  cfg: CorrectionConfig) -> torch.Tensor:
    """`metric_sums` as one 1-d tensor, group after group (the layout `metrics_to_dict` reads)."""
    return torch.stack([value for group in metric_sums(c, log_probs, entropy, cfg).values() for value in group])


# ── on the host: every logged value from the sums ────────────────────────────────────────────────────

def _summary(moments: list[float]) -> tuple[list[float], float]:
    """(mean, std, min, max) and the normalized ESS (Σx)²/(n Σx²) from `_moments`; zeros and ESS 1 if empty.

    A one-pass variance about c loses ~eps·E[(x − c)²]: taken about 1 when the mean is near the on-policy 1,
    about 0 for small weights (a sequence ratio often is), it stays close to the exact two-pass value.
    """
    n, sx, sxx, sy, syy, lowest, highest = moments
    if n <= 0:
        return [0.0, 0.0, 0.0, 0.0], 1.0
    mean = sx / n
    var = syy / n - (sy / n) ** 2 if mean > 0.5 else sxx / n - mean * mean
    return [mean, math.sqrt(max(var, 0.0)), lowest, highest], (sx * sx / (n * sxx) if sxx > 0 else 0.0)


def _chi2(moments: list[float]) -> float:
    """E[x²] − 1 = E[(x − 1)²] + 2 E[x − 1] from `_moments`, free of cancellation near x = 1; 0 if empty."""
    n, sy, syy = moments[0], moments[3], moments[4]
    return (syy + 2.0 * sy) / max(n, 1.0)


def metrics_from_sums(s: Sums, cfg: CorrectionConfig) -> dict[str, float]:
    """Every metric, in logging order, from `metric_sums` (host floats). The names are made here only, so
    `weights.metric_names` reads them off a run on a 1×1 dummy batch."""
    n_act_tokens, n_valid, n_kept, n_nonfinite = s["tokens"]
    n_act, n = max(n_act_tokens, 1.0), max(n_valid, 1.0)
    n_seq = max(s["ratio_seq"][0], 1.0)
    sum_lr, sum_lr2 = s["kl"]
    out = {
        names.K1_KL: -sum_lr / n,
        names.K2_KL: 0.5 * sum_lr2 / n,
        names.K3_KL: (s["ratio_token"][3] - sum_lr) / n,  # Σ (r − 1) − Σ log r
        names.CHI2_TOKEN: _chi2(s["ratio_token"]),
        names.CHI2_SEQ: _chi2(s["ratio_seq"]),
    }
    per_seq_keys = (names.ROLLOUT_PPL, names.TRAINING_PPL, names.PPL_RATIO, names.LOG_PPL_DIFF)
    for key, total in zip(per_seq_keys, s["ppl"], strict=True):
        out[key] = total / n_seq  # ppl_ratio: ppl_train / ppl_rollout; log_ppl_diff: their logs
    out[names.ESS_TOKEN] = _summary(s["ratio_token"])[1]
    out[names.ESS_SEQ] = _summary(s["ratio_seq"])[1]

    sum_dp, max_dp, sum_dl, max_dl = s["gaps"]
    out.update({names.ABS_DP_MAX: max_dp, names.ABS_DP_MEAN: sum_dp / n, names.ABS_DLOGP_MEAN: sum_dl / n,
                names.ABS_DLOGP_MAX: max_dl})
    so, sr, soo, srr, sor = (v / n for v in s["pearson"])  # about the means: so, sr ≈ 0, no cancellation
    var_o, var_r = max(soo - so * so, 0.0), max(srr - sr * sr, 0.0)
    den = math.sqrt(var_o * var_r)
    out[names.PEARSON_P] = min(1.0, max(-1.0, (sor - so * sr) / den)) if den > 0 else 0.0

    at_or_above = [*s["bucket_at_or_above"], 0.0]
    for b, (gap_key, frac_key, gap) in enumerate(zip(names.BUCKET_GAP_KEYS, names.BUCKET_FRAC_KEYS, s["bucket_gaps"],
                                                     strict=True)):
        count = at_or_above[b] - at_or_above[b + 1]  # differences of exact token counts
        out[gap_key] = gap / max(count, 1.0)
        out[frac_key] = count / n
    if "entropy" in s:
        out[names.ENTROPY] = s["entropy"][0] / n
    if "entropy_sampled" in s:
        out[names.ENTROPY_SAMPLED] = -s["entropy_sampled"][0] / n

    raw_stats, _ = _summary(s["ratio_token"] if cfg.level == "token" else s["raw"])
    weight_stats, ess = _summary(s["weight"])
    out.update(zip(names.WEIGHT_RAW_STATS, raw_stats, strict=True))
    out.update(zip(names.WEIGHT_STATS, weight_stats, strict=True))
    out[names.ESS] = ess
    if "adaptive" in s:
        out.update(zip(names.ADAPTIVE_KEYS, s["adaptive"], strict=True))

    # what the correction did, as fractions of action tokens (0 for what this configuration never does)
    flags = [("truncated", names.TRUNCATED_FRAC), ("clipped_low", names.CLIPPED_LOW_FRAC),
             ("clipped_high", names.CLIPPED_HIGH_FRAC), ("bounds_masked", names.BOUNDS_MASKED_FRAC),
             ("rejected", names.REJECTED_FRAC),
             *((f"rs_{crit.name}", names.rejection_frac_key(crit.name)) for crit in cfg.rejection),
             ("vetoed", names.VETOED_FRAC)]
    for name, key in flags:
        out[key] = s[name][0] / n_act if name in s else 0.0
    vetoed_seqs, action_seqs = s.get("vetoed_seqs", (0.0, 1.0))
    out[names.VETOED_SEQ_FRAC] = vetoed_seqs / max(action_seqs, 1.0)
    out[names.OPSM_FRAC] = s["opsm"][0] / n_act if "opsm" in s else 0.0
    out[names.NONFINITE_FRAC] = (n_act_tokens - n_valid) / n_act  # lost to non-finite log-probs
    out[names.NONFINITE_COUNT] = n_nonfinite
    out[names.MASKED_FRAC] = (n_act_tokens - n_kept) / n_act
    out[names.KEPT_FRAC] = n_kept / n_act
    out[names.NORM_FACTOR] = 1.0  # replaced by metrics_to_dict under self-normalization
    return out


def metrics_to_dict(vector: torch.Tensor, factor: torch.Tensor | None,
                    layout: tuple[tuple[str, int], ...], cfg: CorrectionConfig) -> dict[str, float]:
    """The metrics from `metric_sums` concatenated into `vector` (`layout`: its names and sizes), moved to
    the host in one transfer together with the self-normalization factor, which then scales the weights."""
    if factor is not None:
        vector = torch.cat([vector, factor.to(vector.dtype).reshape(1)])
    values = vector.tolist()
    sums, start = {}, 0
    for name, size in layout:
        sums[name], start = values[start:start + size], start + size
    out = metrics_from_sums(sums, cfg)
    if factor is not None:
        f = values[-1]
        out[names.NORM_FACTOR] = f
        for key in names.WEIGHT_STATS:  # w/f scales mean, std, min and max alike
            out[key] /= f
    return out
