"""Every metrics.jsonl key the fork writes or reads, in one bottom module that imports nothing (no torch).

It sits at the package root, not in correction/: the keys belong to every layer that writes them (correction/,
trainer/'s sync check, staleness, timing and eval) and the readers (runs/, viz/) need the strings, not the
correction core.

Writers (correction/metrics.py, trainer/*) and readers (viz/*, runs/summary.py, pipeline/live.py) import
the names from here, so a renamed metric cannot leave a reader looking for the old one. torch stays out
because the readers run in notebook kernels, where torch doubles the live heap and with it every full
garbage collection (viz/token_plots.py). tests/test_metric_names.py checks each name against its writer.
"""

from __future__ import annotations

MISMATCH, CORRECTION = "mismatch/", "correction/"

# ── mismatch/*: μ vs π_old (correction/metrics.py has the formulas) ─────────────────────────────────
K1_KL, K2_KL, K3_KL = MISMATCH + "k1_kl", MISMATCH + "k2_kl", MISMATCH + "k3_kl"
CHI2_TOKEN, CHI2_SEQ = MISMATCH + "chi2_token", MISMATCH + "chi2_seq"
ROLLOUT_PPL, TRAINING_PPL = MISMATCH + "rollout_ppl", MISMATCH + "training_ppl"
PPL_RATIO, LOG_PPL_DIFF = MISMATCH + "ppl_ratio", MISMATCH + "log_ppl_diff"
ESS_TOKEN, ESS_SEQ = MISMATCH + "ess_token", MISMATCH + "ess_seq"
ABS_DP_MAX, ABS_DP_MEAN = MISMATCH + "abs_dp_max", MISMATCH + "abs_dp_mean"
ABS_DLOGP_MEAN, ABS_DLOGP_MAX = MISMATCH + "abs_dlogp_mean", MISMATCH + "abs_dlogp_max"
PEARSON_P = MISMATCH + "pearson_p"
ENTROPY, ENTROPY_SAMPLED = MISMATCH + "entropy", MISMATCH + "entropy_sampled"
"""Exact entropy when the trainer computes it, else the sampled estimate; a run logs one or both."""

PROB_BUCKET_EDGES = (1e-3, 1e-2, 0.1, 0.5, 0.9)
"""Edges of the rollout-probability buckets (lower edges inclusive); docs/measurements.md: the gap is 4–5×
larger below 0.01."""
BUCKET_NAMES = tuple(f"p{lo:g}-{hi:g}" for lo, hi in zip((0.0, *PROB_BUCKET_EDGES), (*PROB_BUCKET_EDGES, 1.0),
                                                         strict=True))
"""`p0-0.001`, ..., `p0.9-1`: one per bucket, in order of μ."""
BUCKET_GAP_KEYS = tuple(f"{MISMATCH}abs_dlogp_{b}" for b in BUCKET_NAMES)
"""Mean |log r| over the step's tokens in each bucket."""
BUCKET_FRAC_KEYS = tuple(f"{MISMATCH}frac_{b}" for b in BUCKET_NAMES)
"""Share of the step's tokens in each bucket."""

# ── correction/*: what the correction did ────────────────────────────────────────────────────────────
_STATS = ("mean", "std", "min", "max")
WEIGHT_RAW_MEAN, WEIGHT_RAW_STD, WEIGHT_RAW_MIN, WEIGHT_RAW_MAX = (f"{CORRECTION}weight_raw_{s}" for s in _STATS)
WEIGHT_MEAN, WEIGHT_STD, WEIGHT_MIN, WEIGHT_MAX = (f"{CORRECTION}weight_{s}" for s in _STATS)
WEIGHT_RAW_STATS = (WEIGHT_RAW_MEAN, WEIGHT_RAW_STD, WEIGHT_RAW_MIN, WEIGHT_RAW_MAX)
"""Weights before bounds and masks."""
WEIGHT_STATS = (WEIGHT_MEAN, WEIGHT_STD, WEIGHT_MIN, WEIGHT_MAX)
"""Final weights on kept units (divided by NORM_FACTOR under self-normalization)."""
ESS = CORRECTION + "ess"


def frac_key(action: str) -> str:
    """`correction/<action>_frac`: the share of action tokens an action (truncated, vetoed, ...) touched."""
    return f"{CORRECTION}{action}_frac"


def rejection_frac_key(criterion: str) -> str:
    """The share of action tokens rejected by one rejection criterion (`RejectionCriterion.name`)."""
    return frac_key(f"rs_{criterion}")


TRUNCATED_FRAC, CLIPPED_LOW_FRAC, CLIPPED_HIGH_FRAC = map(frac_key, ("truncated", "clipped_low", "clipped_high"))
BOUNDS_MASKED_FRAC, REJECTED_FRAC, VETOED_FRAC = map(frac_key, ("bounds_masked", "rejected", "vetoed"))
VETOED_SEQ_FRAC, OPSM_FRAC, NONFINITE_FRAC = map(frac_key, ("vetoed_seq", "opsm", "nonfinite"))
MASKED_FRAC, KEPT_FRAC = frac_key("masked"), frac_key("kept")
NONFINITE_COUNT, NORM_FACTOR = CORRECTION + "nonfinite_count", CORRECTION + "norm_factor"
ADAPTIVE_BOUND, ADAPTIVE_ESS = CORRECTION + "adaptive_bound", CORRECTION + "adaptive_ess"
ADAPTIVE_AT_MAX, ADAPTIVE_AT_MIN = frac_key("adaptive_at_max"), frac_key("adaptive_at_min")
ADAPTIVE_KEYS = (ADAPTIVE_BOUND, ADAPTIVE_ESS, ADAPTIVE_AT_MAX, ADAPTIVE_AT_MIN)
"""Only with the adaptive bound (correction/adaptive.py): the cap C_t each micro-batch chose and the ESS of its
weights (token-weighted means over the step's micro-batches, as every correction metric), and the share of
tokens whose micro-batch had its cap at adaptive_max_bound (the ratios met the ESS target untruncated) or at
adaptive_min_bound (even that cap missed it); in between the target set the cap."""

# ── written by upstream (openrlhf 0.11.2), read by the fork ──────────────────────────────────────────
REWARD_MEAN, RESPONSE_LENGTH_MEAN = "rollout/reward_mean", "rollout/response_length_mean"
STEP_SECONDS = "timing/step_total"
TIMING_GENERATION, TIMING_MAKE_EXPERIENCE = "timing/generation", "timing/make_experience"
TIMING_PPO_TRAIN, TIMING_BROADCAST = "timing/ppo_train", "timing/broadcast"
"""Parts of STEP_SECONDS: rollout, experience making (π_old forward, rewards), PPO update, weight sync."""
UPSTREAM_REWARD, UPSTREAM_RESPONSE_LENGTH = "reward", "response_length"
"""The actor's per-sample means of the same quantities (older runs may hold only these)."""
UPSTREAM_KL, UPSTREAM_FILTERED = "vllm_kl", "is_filter_ratio"
"""Upstream's own mismatch metrics: aliases of K1_KL and MASKED_FRAC, whose values the fork's policy loss hands
upstream in their place (trainer/ppo_actor.py)."""

# ── written by the fork's trainer ────────────────────────────────────────────────────────────────────
STALENESS_MEAN, STALENESS_MAX = "staleness/mean", "staleness/max"
STALENESS_SPANNING_SYNC, STALENESS_DROPPED = "staleness/spanning_sync", "staleness/dropped_samples"


def staleness_lag_key(lag: int) -> str:
    """The share of a step's samples whose rollout policy is `lag` versions behind π_old."""
    return f"staleness/lag_{lag}"


BY_LAG = "mismatch_by_lag/"
LAG_STALE = "stale"  # every lag above 0 together


def mismatch_lag_key(stat: str, lag: int | str) -> str:
    """μ vs π_old over the tokens of the samples `lag` versions behind π_old (an int, or LAG_STALE for every lag
    above 0): how much of `mismatch/*` is precision (lag 0) and how much staleness (trainer/mismatch_by_lag.py)."""
    return f"{BY_LAG}{stat}_lag_{lag}"


HEALTH_ESS_WORST, HEALTH_FALL_WARNING = "health/ess_seq_worst", "health/fall_warning"
"""The run's lowest sequence ESS so far, and 1 from the step it fell below the fall-warning bound (runs/health.py)."""
REWARD_NONFINITE, REWARD_DROPPED = "reward/nonfinite_samples", "reward/dropped_samples"
QUEUE_WAIT = "timing/queue_wait"
"""Async: seconds the trainer blocked on the rollout queue (not summed into STEP_SECONDS)."""
LOGPROB_COVERAGE = "rollout/logprob_coverage"
INT8_SYNC_PREFIX, FP8_SYNC_PREFIX = "rollout/int8_", "rollout/fp8_"
"""+ a key of what INT8 (or block-FP8) engines return of a sync's re-quantization (saturated_fraction,
max_rel_error, quantize_s)."""
TOKEN_DUMP_SECONDS, TOKEN_DUMP_TOKENS = "run_store/token_dump_s", "run_store/token_dump_tokens"
SYNC_CHECK_SECONDS, SYNC_WEIGHTS_SECONDS = "sync/check_s", "sync/weights_s"
SYNC_BASELINE = "sync/baseline_mean_abs_logprob"
SYNC_GAP_MEAN, SYNC_GAP_MAX = "sync/vllm_vs_trainer_mean_abs_logprob", "sync/vllm_vs_trainer_max_abs_logprob"
SYNC_EXCESS = "sync/vllm_vs_trainer_excess"
SYNC_VLLM_PROBE_CHANGE, SYNC_TRAINER_PROBE_CHANGE = ("sync/vllm_probe_change_mean_abs",
                                                     "sync/trainer_probe_change_mean_abs")
SYNC_VLLM_LOGPROB_CHANGE = "sync/vllm_logprob_change_mean_abs"
MOE = "moe/"
"""Routing mismatch of a mixture-of-experts run with --vllm.routing_replay (moe/routing_metrics.py has the formulas)."""
MOE_AGREEMENT, MOE_TOKENS_DIFFERED = MOE + "routing_agreement", MOE + "tokens_routing_differed"
MOE_K3_DIFFERED, MOE_K3_SAME = MOE + "k3_routing_differed", MOE + "k3_routing_same"


def moe_agreement_layer_key(layer: int) -> str:
    """`moe/routing_agreement_layer_<i>`: the agreement in decoder layer i."""
    return f"{MOE_AGREEMENT}_layer_{layer}"


EVAL_PREFIX, EVAL_START_PREFIX = "eval/", "eval_start/"
"""Held-out scores after an evaluated step, and of the untrained policy (on step 1's line)."""

# ── candidate lists: the first key a run logs (with a finite value) is the one shown ─────────────────
REWARD_KEYS = (REWARD_MEAN, UPSTREAM_REWARD)
RESPONSE_LENGTH_KEYS = (RESPONSE_LENGTH_MEAN, UPSTREAM_RESPONSE_LENGTH)
MISMATCH_KEYS = (K3_KL, K1_KL, UPSTREAM_KL)
"""k3 first (unbiased and ≥ 0); k1 is what upstream logs as vllm_kl."""
MASKED_KEYS = (MASKED_FRAC, UPSTREAM_FILTERED)
ENTROPY_KEYS = (ENTROPY, ENTROPY_SAMPLED)
