"""An independent float64 reference of the rollout correction, written loop by loop from the formulas.

It shares no code with openrlhf_tis.correction: every quantity is recomputed per sequence with the
`math` module, so an error in the vectorized core cannot hide in both.
"""

from __future__ import annotations

import itertools
import math

EPS = 1e-6


def _bkl(a: float, b: float) -> float:
    return a * math.log(a / b) + (1 - a) * math.log((1 - a) / (1 - b))


def _token_stat(stat: str, old: float, roll: float) -> float:
    lr = old - roll
    if stat in ("ratio", "k1"):
        return lr if stat == "ratio" else -lr
    if stat == "k2":
        return 0.5 * lr * lr
    if stat == "k3":
        return math.exp(lr) - 1 - lr
    p = min(max(math.exp(roll), EPS), 1 - EPS)
    q = min(max(math.exp(old), EPS), 1 - EPS)
    if stat == "tv":
        return abs(p - q)
    if stat == "binary_kl":
        return _bkl(p, q)
    return max(_bkl(p, q), _bkl(q, p))


def _inside(x: float, lo, hi) -> bool:
    return (lo is None or x >= lo) and (hi is None or x <= hi)


def reference(old, roll, am, cfg, log_probs=None, advantages=None):
    """Return (weights, mask) as nested lists for a CorrectionConfig-like `cfg` (float64 arithmetic)."""
    B, T = len(old), len(old[0])
    W = [[0.0] * T for _ in range(B)]
    M = [[0] * T for _ in range(B)]
    seq_weight = [None] * B
    L = (1.0 / cfg.upper) if cfg.lower is None else cfg.lower
    U = cfg.upper
    for b in range(B):
        act = [t for t in range(T) if am[b][t]]
        finite = [t for t in act if math.isfinite(old[b][t]) and math.isfinite(roll[b][t])]
        if cfg.nonfinite == "sequence" and len(finite) < len(act):
            finite = []
        V = finite
        if not V:
            continue
        lrs = {t: old[b][t] - roll[b][t] for t in V}
        total = sum(lrs.values())
        # IS weight per token before bounds
        if cfg.level == "token":
            r = {t: math.exp(lrs[t]) for t in V}
        elif cfg.level == "sequence":
            r = {t: math.exp(total) for t in V}
        else:
            r = {t: math.exp(total / len(V)) for t in V}
        keep = {t: True for t in V}
        w = {}
        for t in V:
            if cfg.mode == "truncate":
                w[t] = min(r[t], U)
            elif cfg.mode == "clip":
                w[t] = min(max(r[t], L), U)
            elif cfg.mode == "mask":
                w[t] = r[t]
                keep[t] = L <= r[t] <= U
            elif cfg.mode == "raw":
                w[t] = math.exp(max(min(math.log(r[t]), cfg.log_ratio_clamp), -cfg.log_ratio_clamp))
            else:
                w[t] = 1.0
        for crit in cfg.rejection:
            stats = {t: _token_stat(crit.statistic, old[b][t], roll[b][t]) for t in V}
            if crit.agg == "token":
                vals = stats
            else:
                s = list(stats.values())
                agg = {"sum": sum(s), "mean": sum(s) / len(s), "max": max(s)}[crit.agg]
                vals = {t: agg for t in V}
            for t in V:
                v = vals[t]
                if crit.statistic == "ratio":
                    v = math.exp(v)
                keep[t] = keep[t] and _inside(v, crit.lower, crit.upper)
        vetoed = False
        if cfg.veto_threshold is not None:
            v = cfg.veto_threshold
            for t in V:
                rt = math.exp(lrs[t])
                if rt < v or (cfg.veto_sides == "both" and rt > 1 / v):
                    vetoed = True
        if cfg.veto_min_prob is not None:
            for t in V:
                if math.exp(roll[b][t]) < cfg.veto_min_prob or math.exp(old[b][t]) < cfg.veto_min_prob:
                    vetoed = True
        if cfg.opsm_delta is not None:
            drift = sum(roll[b][t] - log_probs[b][t] for t in V) / len(V)
            for t in V:
                if advantages[b][t] < 0 and drift > cfg.opsm_delta:
                    keep[t] = False
        for t in V:
            if keep[t] and not vetoed:
                M[b][t] = 1
                W[b][t] = w[t]
                seq_weight[b] = w[t]
    if cfg.batch_normalize:
        if cfg.level == "token":
            kept = [W[b][t] for b in range(B) for t in range(T) if M[b][t]]
        else:
            kept = [seq_weight[b] for b in range(B) if any(M[b])]
        if kept and sum(kept) > 0:
            mean = sum(kept) / len(kept)
            W = [[x / mean for x in row] for row in W]
    return W, M


def reference_metrics(old, roll, am):
    """A few mismatch metrics over finite action tokens (float64)."""
    toks, seqs = [], []
    for b in range(len(old)):
        row = [(old[b][t], roll[b][t]) for t in range(len(old[b])) if am[b][t]]
        if any(not (math.isfinite(o) and math.isfinite(r)) for o, r in row):
            row = []
        if row:
            toks.extend(row)
            seqs.append(row)
    n = len(toks)
    k1 = sum(r - o for o, r in toks) / n
    k3 = sum(math.exp(o - r) - 1 - (o - r) for o, r in toks) / n
    chi2 = sum(math.exp(2 * (o - r)) for o, r in toks) / n - 1
    chi2_seq = sum(math.exp(2 * sum(o - r for o, r in s)) for s in seqs) / len(seqs) - 1
    rollout_ppl = sum(math.exp(-sum(r for _, r in s) / len(s)) for s in seqs) / len(seqs)
    training_ppl = sum(math.exp(-sum(o for o, _ in s) / len(s)) for s in seqs) / len(seqs)
    ws = [math.exp(o - r) for o, r in toks]
    ess = sum(ws) ** 2 / (n * sum(w * w for w in ws))
    po = [math.exp(o) for o, _ in toks]
    pr = [math.exp(r) for _, r in toks]
    mo, mr = sum(po) / n, sum(pr) / n
    cov = sum((a - mo) * (c - mr) for a, c in zip(po, pr, strict=True))
    var = math.sqrt(sum((a - mo) ** 2 for a in po) * sum((c - mr) ** 2 for c in pr))
    dp = [abs(a - c) for a, c in zip(po, pr, strict=True)]
    rho = [math.exp(sum(o - r for o, r in s)) for s in seqs]
    ppl_ratios = [math.exp(sum(r - o for o, r in s) / len(s)) for s in seqs]  # ppl under π_old / under μ
    gaps = [abs(o - r) for o, r in toks]
    out = {
        "mismatch/k1_kl": k1, "mismatch/k3_kl": k3, "mismatch/chi2_token": chi2, "mismatch/chi2_seq": chi2_seq,
        "mismatch/rollout_ppl": rollout_ppl, "mismatch/training_ppl": training_ppl, "mismatch/ess_token": ess,
        "mismatch/pearson_p": cov / var if var > 0 else 0.0, "mismatch/abs_dp_max": max(dp),
        "mismatch/abs_dp_mean": sum(dp) / n,
        "mismatch/k2_kl": sum(0.5 * (o - r) ** 2 for o, r in toks) / n,
        "mismatch/ppl_ratio": sum(ppl_ratios) / len(seqs),
        "mismatch/log_ppl_diff": sum(math.log(x) for x in ppl_ratios) / len(seqs),
        "mismatch/ess_seq": sum(rho) ** 2 / (len(rho) * sum(x * x for x in rho)),
        "mismatch/abs_dlogp_mean": sum(gaps) / n, "mismatch/abs_dlogp_max": max(gaps),
    }
    # μ(a_t) buckets, lower edge inclusive: mean |log r| and share of the valid tokens in each
    names = ("0-0.001", "0.001-0.01", "0.01-0.1", "0.1-0.5", "0.5-0.9", "0.9-1")
    for (lo, hi), name in zip(itertools.pairwise((0.0, 1e-3, 1e-2, 0.1, 0.5, 0.9, math.inf)), names, strict=True):
        inside = [abs(o - r) for o, r in toks if lo <= math.exp(r) < hi]
        out[f"mismatch/abs_dlogp_p{name}"] = sum(inside) / len(inside) if inside else 0.0
        out[f"mismatch/frac_p{name}"] = len(inside) / n
    return out


def _summary(xs):
    """mean, population std, min, max and normalized ESS (Σx)²/(n Σx²); zeros and ESS 1 when empty."""
    if not xs:
        return 0.0, 0.0, 0.0, 0.0, 1.0
    n, mean = len(xs), sum(xs) / len(xs)
    squares = sum(x * x for x in xs)
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / n)
    return mean, std, min(xs), max(xs), (sum(xs) ** 2 / (n * squares) if squares > 0 else 0.0)


def reference_weight_metrics(old, roll, am, cfg):
    """The `correction/*` weight statistics and token fractions (float64) on batches with finite log-probs:
    the raw weight before the bounds (clamped at e^±20 in log space) and the final (self-normalized)
    weight, per valid / kept token or, at the sequence levels, per sequence; and the shares of action
    tokens where the bounds bind or drop, and that are kept."""
    W, M = reference(old, roll, am, cfg)
    U = cfg.upper
    L = (1.0 / U) if cfg.lower is None else cfg.lower
    raw, weights, flagged = [], [], {"truncated": 0, "clipped_low": 0, "clipped_high": 0, "bounds_masked": 0}
    n_act = sum(sum(1 for a in row if a) for row in am)
    for b in range(len(old)):
        V = [t for t in range(len(old[b])) if am[b][t]]
        if not V:
            continue
        lrs = {t: old[b][t] - roll[b][t] for t in V}
        if cfg.level == "token":
            logs = lrs
        else:
            total = sum(lrs.values()) if cfg.level == "sequence" else sum(lrs.values()) / len(V)
            logs = {t: total for t in V}
        units = V if cfg.level == "token" else V[:1]  # a sequence counts once for the statistics
        raw += [math.exp(max(min(logs[t], cfg.log_ratio_clamp), -cfg.log_ratio_clamp)) for t in units]
        kept = [t for t in V if M[b][t]]
        weights += [W[b][t] for t in (kept if cfg.level == "token" else kept[:1])]
        for t in V:  # the bounds' flags count tokens, also at the sequence levels
            r = math.exp(logs[t])
            if cfg.mode == "truncate":
                flagged["truncated"] += r > U
            elif cfg.mode == "clip":
                flagged["clipped_low"] += r < L
                flagged["clipped_high"] += r > U
            elif cfg.mode == "mask":
                flagged["bounds_masked"] += not L <= r <= U
    out = {}
    for prefix, xs in (("weight_raw", raw), ("weight", weights)):
        for stat, value in zip(("mean", "std", "min", "max"), _summary(xs)[:4], strict=True):
            out[f"correction/{prefix}_{stat}"] = value
    out["correction/ess"] = _summary(weights)[4]
    for name, count in flagged.items():
        out[f"correction/{name}_frac"] = count / max(n_act, 1)
    n_kept = sum(sum(row) for row in M)
    out["correction/kept_frac"] = n_kept / max(n_act, 1)
    out["correction/masked_frac"] = (n_act - n_kept) / max(n_act, 1)
    return out


# ── the reference itself, against numbers worked out by hand ──


class _Cfg:
    def __init__(self, **kw):
        self.level, self.mode, self.lower, self.upper = "token", "truncate", None, 2.0
        self.rejection, self.veto_threshold, self.veto_sides, self.veto_min_prob = (), None, "both", None
        self.opsm_delta, self.batch_normalize, self.nonfinite, self.log_ratio_clamp = None, False, "sequence", 20.0
        self.__dict__.update(kw)


def test_reference_hand_computed_token_truncate():
    ln2, ln3 = math.log(2), math.log(3)
    old = [[0.0, 0.0, 0.0]]
    roll = [[0.0, -ln3, ln2]]  # r = exp(old − roll) = 1, 3, 1/2
    W, M = reference(old, roll, [[1, 1, 1]], _Cfg(mode="truncate", upper=2.0))
    assert M == [[1, 1, 1]]
    assert all(abs(a - b) < 1e-12 for a, b in zip(W[0], [1.0, 2.0, 0.5], strict=True))  # min(3, 2) = 2


def test_reference_hand_computed_sequence_and_geometric():
    ln2 = math.log(2)
    old, roll, am = [[ln2, ln2, 5.0]], [[0.0, 0.0, 0.0]], [[1, 1, 0]]  # r = 2, 2, (padding)
    W, _ = reference(old, roll, am, _Cfg(level="sequence", mode="raw"))
    assert abs(W[0][0] - 4.0) < 1e-12 and abs(W[0][1] - 4.0) < 1e-12 and W[0][2] == 0.0
    W, _ = reference(old, roll, am, _Cfg(level="geometric", mode="raw"))
    assert abs(W[0][0] - 2.0) < 1e-12
    _, M = reference(old, roll, am, _Cfg(level="sequence", mode="mask", lower=0.5, upper=3.0))
    assert M == [[0, 0, 0]]  # 4 > 3: the whole sequence goes
