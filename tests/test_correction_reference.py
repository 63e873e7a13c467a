"""An independent float64 reference of the rollout correction, written loop by loop from the formulas.

It shares no code with openrlhf_tis.correction: every quantity is recomputed per sequence with the
`math` module, so an error in the vectorized core cannot hide in both.
"""

from __future__ import annotations

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
    return {
        "mismatch/k1_kl": k1, "mismatch/k3_kl": k3, "mismatch/chi2_token": chi2, "mismatch/chi2_seq": chi2_seq,
        "mismatch/rollout_ppl": rollout_ppl, "mismatch/training_ppl": training_ppl, "mismatch/ess_token": ess,
        "mismatch/pearson_p": cov / var if var > 0 else 0.0, "mismatch/abs_dp_max": max(dp),
        "mismatch/abs_dp_mean": sum(dp) / n,
    }


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
