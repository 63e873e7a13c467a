"""What the rollout-correction core does, as one frozen dataclass, plus named presets.

Notation used throughout `openrlhf_tis.correction` (docs/correction.md has the derivations):
    μ       behaviour policy: the rollout engine's (vLLM) probability of the sampled token
    π_old   the trainer's probability of the same token before the update (DeepSpeed forward)
    π_θ     the policy being trained
    r_t     = π_old(a_t) / μ(a_t) = exp(old_t − rollout_t), the per-token importance ratio

Every field names the paper or framework it comes from. `validate()` refuses combinations that are
undefined, `validate(training=True)` also those that are wrong for training; both name the flag
(`--algo.correction.<field>`) that sets the offending value, so the CLI can print it unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

LEVELS = ("token", "sequence", "geometric")
MODES = ("truncate", "clip", "mask", "raw", "none")
LOSSES = ("decoupled", "bypass_ppo", "bypass_reinforce")
DENOMINATORS = ("all", "kept")
STATISTICS = ("ratio", "k1", "k2", "k3", "binary_kl", "binary_kl_sym", "tv")
AGGREGATIONS = ("token", "sum", "mean", "max")
FLAG_PREFIX = "--algo.correction."


class CorrectionConfigError(ValueError):
    """A configuration that cannot be right; `flag` is the command-line flag that sets the bad value."""

    def __init__(self, flag: str, message: str):
        super().__init__(f"{flag}: {message}")
        self.flag = flag
        self.message = message


def _flag(name: str) -> str:
    return FLAG_PREFIX + name


@dataclass(frozen=True)
class RejectionCriterion:
    """One rejection-sampling test: keep a unit iff lower <= agg(statistic) <= upper.

    Written on the command line as `STAT:AGG:UPPER` or `STAT:AGG:LOWER:UPPER` (an empty field means
    unbounded), e.g. `k3:mean:0.01`, `ratio:mean:0.999:1.001`, `k1:token:-0.5:0.5`. Several criteria
    are chained with AND (verl `rollout_rs="a,b"`).
    """

    statistic: str
    """ratio r_t (MIS/IcePop) | k1 = −log r_t | k2 = ½(log r_t)² | k3 = r_t − 1 − log r_t (verl rollout_rs
    k1/k2/k3; Schulman's KL-approximation note) | binary_kl, binary_kl_sym, tv on the sampled token's
    probabilities (OpenRLHF 0.11.2 gating; KPop = binary_kl_sym)."""
    agg: str = "token"
    """token (per token) | sum | mean | max over the sequence's valid tokens (verl token_/seq_sum_/seq_mean_/seq_max_).
    For `ratio`, sum and mean are taken on log r, i.e. the sequence product and geometric mean (Geo-RS)."""
    lower: float | None = None
    """Lowest kept value (None: unbounded). k1 bounds are on k1 itself, not on a ratio (see docs)."""
    upper: float | None = None
    """Highest kept value (None: unbounded)."""

    @property
    def name(self) -> str:
        return f"{self.statistic}_{self.agg}"

    @property
    def token_level(self) -> bool:
        return self.agg == "token"

    @classmethod
    def parse(cls, spec: str | RejectionCriterion) -> RejectionCriterion:
        """`STAT:AGG:UPPER` or `STAT:AGG:LOWER:UPPER` -> criterion (validated)."""
        if isinstance(spec, RejectionCriterion):
            return spec
        parts = [p.strip() for p in str(spec).split(":")]
        if len(parts) not in (3, 4):
            raise CorrectionConfigError(
                _flag("rejection"), f"{spec!r} is not STAT:AGG:UPPER or STAT:AGG:LOWER:UPPER (e.g. k3:mean:0.01)"
            )

        def num(text: str) -> float | None:
            if text == "":
                return None
            try:
                return float(text)
            except ValueError:
                raise CorrectionConfigError(_flag("rejection"), f"{text!r} in {spec!r} is not a number") from None

        lower, upper = (None, num(parts[2])) if len(parts) == 3 else (num(parts[2]), num(parts[3]))
        crit = cls(parts[0], parts[1], lower, upper)
        crit.validate()
        return crit

    def spec(self) -> str:
        fmt = lambda v: "" if v is None else repr(float(v))  # noqa: E731
        return f"{self.statistic}:{self.agg}:{fmt(self.lower)}:{fmt(self.upper)}"

    def validate(self, *, training: bool = False) -> None:
        """Refuse undefined criteria; with training=True also those that would reject on-policy data."""
        flag = _flag("rejection")
        if self.statistic not in STATISTICS:
            raise CorrectionConfigError(flag, f"statistic {self.statistic!r} is not one of {STATISTICS}")
        if self.agg not in AGGREGATIONS:
            raise CorrectionConfigError(flag, f"aggregation {self.agg!r} is not one of {AGGREGATIONS}")
        if self.lower is None and self.upper is None:
            raise CorrectionConfigError(flag, f"{self.name} needs at least one bound")
        for v in (self.lower, self.upper):
            if v is not None and math.isnan(v):
                raise CorrectionConfigError(flag, f"{self.name} has a NaN bound")
        if self.lower is not None and self.upper is not None and self.lower > self.upper:
            raise CorrectionConfigError(flag, f"{self.name}: lower {self.lower} > upper {self.upper}")
        if self.statistic in ("ratio", "k1") and self.agg == "max":
            raise CorrectionConfigError(flag, f"{self.statistic}:max tests one side only; use k2:max or k3:max, "
                                        "or veto_threshold for per-token ratios")
        if self.statistic == "ratio" and self.lower is not None and self.lower < 0:
            raise CorrectionConfigError(flag, f"{self.name}: a ratio bound cannot be negative ({self.lower})")
        if not training:
            return
        # A criterion must keep on-policy data: there r = 1, log r = 0 and every divergence is 0.
        if self.statistic == "ratio":
            if (self.lower is not None and self.lower > 1) or (self.upper is not None and self.upper < 1):
                raise CorrectionConfigError(
                    flag, f"{self.name}: bounds [{self.lower}, {self.upper}] exclude ratio 1, i.e. on-policy data"
                )
        elif self.statistic == "k1":
            if (self.lower is not None and self.lower > 0) or (self.upper is not None and self.upper < 0):
                raise CorrectionConfigError(
                    flag, f"{self.name}: bounds [{self.lower}, {self.upper}] exclude k1 = 0, i.e. on-policy data"
                )
        else:  # nonnegative divergences
            if self.lower is not None and self.lower > 0:
                raise CorrectionConfigError(
                    flag, f"{self.name} is 0 on-policy; a lower bound {self.lower} > 0 would reject on-policy data"
                )
            if self.upper is not None and self.upper <= 0:
                raise CorrectionConfigError(flag, f"{self.name} needs an upper bound > 0, got {self.upper}")


BOUNDED_MODES = ("truncate", "clip", "mask")  # the modes that read `upper`
ADAPTIVE_FIELDS = ("adaptive_ess_target", "adaptive_min_bound", "adaptive_max_bound")


@dataclass(frozen=True)
class ReadWhen:
    """When a field is read at all: `holds(config)`; otherwise `why` (formatted with the config's fields, or called
    with the config) says what it would need. A field read only then changes neither the loss nor any metric
    elsewhere."""

    holds: Callable[[CorrectionConfig], bool]
    why: str | Callable[[CorrectionConfig], str]

    def reason(self, config: CorrectionConfig) -> str:
        return self.why(config) if callable(self.why) else self.why.format(**vars(config))


def _option(default: Any, choices: tuple[str, ...] | None, doc: str, read_when: ReadWhen | None = None) -> Any:
    """A CorrectionConfig field and its documentation, which is also the help of its command-line flag.

    `--algo.correction.<name>` is generated from the field (cli/fork_flags.py): the flag's type follows the
    annotation, its choices are `choices` (also what `validate()` accepts), its help is `doc`. `read_when`: the
    configurations that read the field (None: every one), so a value set where it does nothing is refused
    (`CorrectionConfig.without_effect`).
    """
    return field(default=default, metadata={"choices": choices, "help": " ".join(doc.split()), "read_when": read_when})


@dataclass(frozen=True)
class CorrectionConfig:
    """The rollout–training mismatch correction: IS weights, rejection masks, veto, normalization, loss.

    Each field's documentation is its `help` metadata (the `--algo.correction.<field>` help text).
    """

    level: str = _option(
        "token", LEVELS,
        """Granularity of the IS weight: token r_t (TIS, Yao et al. 2025), sequence Π_t r_t (sequence IS/MIS,
        Liu et al. 2025 "When Speed Kills Stability"), geometric exp(mean_t log r_t) (Geo, Miles).""")
    mode: str = _option(
        "truncate", MODES,
        """truncate w = min(r, upper) (TIS) | clip w = clamp(r, lower, upper) (Miles CIS) | mask w = r inside
        [lower, upper], unit dropped outside (IcePop; MIS at sequence level) | raw w = r, unbounded (vanilla IS,
        TIS talk baseline) | none w = 1 (no IS weight; masks still apply).""")
    lower: float | None = _option(
        None, None,
        """Lower bound on the weight for clip and mask; None means 1/upper (Miles, verl). Unused by truncate.""",
        ReadWhen(lambda c: c.mode in ("clip", "mask"),
                 "it is read by mode clip or mask only, and the mode is {mode!r}"))
    upper: float = _option(
        2.0, None, """Upper bound on the weight (TIS cap C = 2, Yao et al. 2025).""",
        ReadWhen(lambda c: c.mode in BOUNDED_MODES and c.adaptive_ess_target is None,
                 lambda c: f"it is read by mode truncate, clip or mask only, and the mode is {c.mode!r}"
                 if c.mode not in BOUNDED_MODES else "the adaptive bound (--algo.correction.adaptive_ess_target "
                 f"{c.adaptive_ess_target}) replaces it; its ceiling is --algo.correction.adaptive_max_bound"))
    adaptive_ess_target: float | None = _option(
        None, None,
        """Adaptive TIS: ρ in (0, 1]; each micro-batch truncates at the loosest cap C in [adaptive_min_bound,
        adaptive_max_bound] whose weights min(r, C) keep a normalized ESS (Σw)²/(nΣw²) >= ρ, so the cap tightens
        as the mismatch spreads the ratios and rises to adaptive_max_bound as it vanishes (token level, mode
        truncate; replaces upper; docs/correction.md). None: a fixed bound.""")
    adaptive_min_bound: float = _option(
        1.0, None, """Adaptive TIS: the tightest cap (>= 1, so the on-policy weight 1 is never cut), taken when even
        it misses the ESS target.""",
        ReadWhen(lambda c: c.adaptive_ess_target is not None,
                 "it is read by the adaptive bound only, and no --algo.correction.adaptive_ess_target is set"))
    adaptive_max_bound: float = _option(
        5.0, None, """Adaptive TIS: the loosest cap, taken when the ratios already meet the ESS target (default 5,
        OpenRLHF's upper ratio threshold).""",
        ReadWhen(lambda c: c.adaptive_ess_target is not None,
                 "it is read by the adaptive bound only, and no --algo.correction.adaptive_ess_target is set"))
    rejection: tuple[RejectionCriterion, ...] = _option(
        (), None,
        f"""Rejection-sampling criteria chained with AND (verl rollout_rs; Geo-RS = ratio:mean), each
        STAT:AGG:UPPER or STAT:AGG:LOWER:UPPER with STAT in {STATISTICS} and AGG in {AGGREGATIONS}, e.g.
        'ratio:mean:0.999:1.001' (Geo-RS), 'k3:mean:0.01' (verl seq_mean_k3).""")
    veto_threshold: float | None = _option(
        None, None,
        """Catastrophic-token veto v in (0, 1): drop a whole sequence holding a token with r_t < v or r_t > 1/v
        (verl rollout_token_veto_threshold, Miles rs_veto_threshold). None: off.""")
    veto_sides: str = _option(
        "both", ("both", "low"), """both: veto r_t < v and r_t > 1/v | low: only r_t < v (Miles, verl).""",
        ReadWhen(lambda c: c.veto_threshold is not None,
                 "it picks the sides of the ratio veto, and no --algo.correction.veto_threshold is set"))
    veto_min_prob: float | None = _option(
        None, None,
        """Probability veto: drop a sequence holding a token whose probability under μ or under π_old is below
        this value (both policies: a token one engine deems near-impossible). None: off.""")
    opsm_delta: float | None = _option(
        None, None,
        """OPSM (DeepSeek-V3.2 off-policy sequence masking): drop the tokens of a sequence whose advantage is
        negative when mean_t log(μ/π_θ) over the sequence exceeds delta. Needs π_θ and advantages. None: off.""")
    batch_normalize: bool = _option(
        False, None,
        """Self-normalize: divide weights by the mean kept weight, so they average 1 (per kept token at token
        level, per kept sequence at sequence/geometric level) (verl rollout_is_batch_normalize, Miles).""",
        ReadWhen(lambda c: c.mode != "none", "it rescales IS weights, and mode 'none' makes every weight 1"))
    normalize_scope: str = _option(
        "global", ("global", "local"),
        """global: the mean is taken over the whole data-parallel batch (all ranks, verl) | local: over this
        process's batch only (Miles).""",
        ReadWhen(lambda c: c.batch_normalize and c.mode != "none", "it is read by --algo.correction.batch_normalize "
                 "with IS weights only, and here batch_normalize is {batch_normalize} with mode {mode!r}"))
    loss: str = _option(
        "decoupled", LOSSES,
        """decoupled: 3-policy PPO, clip on π_θ/π_old times w(π_old/μ) (Hilton et al. 2021; TIS) |
        bypass_ppo: π_old := μ, PPO clip on π_θ/μ, old-log-prob forward skipped (verl bypass; TIS talk
        "PPO-IS") | bypass_reinforce: −w·A·log π_θ with w from π_θ/μ (verl bypass pg_is).""")
    denominator: str = _option(
        "all", DENOMINATORS,
        """Loss denominator: all = every action token (upstream; rejected tokens shrink the gradient) | kept =
        only tokens that survived the masks (verl modified response mask).""",
        ReadWhen(lambda c: c.enabled, "the correction is inactive (mode 'none', no rejection, veto or OPSM, the "
                 "decoupled loss), so the loss keeps upstream's denominator"))
    nonfinite: str = _option(
        "sequence", ("sequence", "token"),
        """A NaN/inf log-prob makes its token invalid; `sequence` also drops the rest of its sequence (its
        sequence weight and statistics are undefined), `token` drops only the token.""")
    log_ratio_clamp: float = _option(
        20.0, None, """|log w| is clamped here before exp for raw weights and metrics (verl/Miles SAFETY_BOUND).""")
    compile: bool = _option(
        False, None, """torch.compile the elementwise core and the metrics into fused kernels (first call compiles).""")
    compile_metrics: str = _option(
        "auto", ("auto", "on", "off"),
        """torch.compile the metrics pass alone into a few fused kernels; the weights and masks stay eager, so
        training is unchanged (metrics may differ in their last bits). auto: on CUDA, where the eager pass is
        ~95 kernel launches, more than upstream's whole policy loss (the first call compiles, seconds to a
        minute; a failed compile falls back to eager with one warning) | on | off.""")

    def __post_init__(self) -> None:
        crits = self.rejection
        if isinstance(crits, str | RejectionCriterion):
            crits = (crits,)
        object.__setattr__(self, "rejection", tuple(RejectionCriterion.parse(c) for c in (crits or ())))

    # ── derived values ──
    @property
    def lower_bound(self) -> float:
        """The lower bound actually applied by clip and mask."""
        return 1.0 / self.upper if self.lower is None else float(self.lower)

    @property
    def sequence_level(self) -> bool:
        return self.level != "token"

    @property
    def bypass(self) -> bool:
        return self.loss.startswith("bypass")

    @property
    def enabled(self) -> bool:
        """Whether the correction changes anything at all compared with plain PPO."""
        return (
            self.mode != "none" or bool(self.rejection) or self.veto_threshold is not None
            or self.veto_min_prob is not None or self.opsm_delta is not None or self.loss != "decoupled"
        )

    def replace(self, **changes: Any) -> CorrectionConfig:
        return dataclasses.replace(self, **changes)

    def without_effect(self, names: Iterable[str]) -> dict[str, str]:
        """Those of the fields `names` this configuration never reads (so their values change neither the loss nor
        any metric), each with why, in field order: a value given for one of them would be silently ignored."""
        wanted = set(names)
        unread = {}
        for f in dataclasses.fields(self):
            read_when = f.metadata["read_when"]
            if f.name in wanted and read_when is not None and not read_when.holds(self):
                unread[f.name] = read_when.reason(self)
        return unread

    # ── validation ──
    def validate(self, *, training: bool = False) -> CorrectionConfig:
        """Raise CorrectionConfigError (naming the flag) for undefined settings; return self.

        With training=True (the CLI and the actor) also refuse what is defined but wrong for training:
        bounds that exclude the on-policy weight 1, a veto at or above 1, and IS weights on top of the
        bypass PPO ratio. The bare core accepts those, so its formulas can be tested on any bounds.
        """
        for f in dataclasses.fields(self):
            allowed = f.metadata["choices"]
            if allowed is not None and getattr(self, f.name) not in allowed:
                raise CorrectionConfigError(_flag(f.name), f"{getattr(self, f.name)!r} is not one of {allowed}")
        for name in ("lower", "upper", "veto_threshold", "veto_min_prob", "opsm_delta", "log_ratio_clamp"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int | float) or math.isnan(v)):
                raise CorrectionConfigError(_flag(name), f"{v!r} is not a number")
        if self.mode in ("truncate", "clip", "mask"):
            if not self.upper > 0:
                raise CorrectionConfigError(_flag("upper"), f"must be > 0, got {self.upper}")
            if self.lower is not None and self.lower < 0:
                raise CorrectionConfigError(_flag("lower"), f"a ratio bound cannot be negative, got {self.lower}")
            if self.mode != "truncate" and self.lower_bound > self.upper:
                default = " (lower defaults to 1/upper)" if self.lower is None else ""
                raise CorrectionConfigError(_flag("lower"), f"lower {self.lower_bound} > upper {self.upper}{default}")
        for crit in self.rejection:
            crit.validate(training=training)
        if self.veto_threshold is not None and not self.veto_threshold > 0:
            raise CorrectionConfigError(_flag("veto_threshold"), f"must be > 0, got {self.veto_threshold}")
        if self.veto_min_prob is not None and not 0 < self.veto_min_prob <= 1:
            raise CorrectionConfigError(_flag("veto_min_prob"), f"must lie in (0, 1], got {self.veto_min_prob}")
        if self.opsm_delta is not None and self.opsm_delta < 0:
            raise CorrectionConfigError(_flag("opsm_delta"), f"must be >= 0, got {self.opsm_delta}")
        if not self.log_ratio_clamp > 0:
            raise CorrectionConfigError(_flag("log_ratio_clamp"), f"must be > 0, got {self.log_ratio_clamp}")
        if self.adaptive_ess_target is not None:
            self._validate_adaptive()
        if training:
            self._validate_for_training()
        return self

    def _validate_adaptive(self) -> None:
        """The adaptive bound's parameters, and the weights it can bound: token-level truncation only."""
        for name in ("adaptive_ess_target", "adaptive_min_bound", "adaptive_max_bound"):
            v = getattr(self, name)
            if not isinstance(v, int | float) or not math.isfinite(v):
                raise CorrectionConfigError(_flag(name), f"{v!r} is not a finite number")
        if not 0 < self.adaptive_ess_target <= 1:
            raise CorrectionConfigError(_flag("adaptive_ess_target"), f"must lie in (0, 1], got "
                                        f"{self.adaptive_ess_target}")
        if self.adaptive_min_bound < 1:
            raise CorrectionConfigError(_flag("adaptive_min_bound"), f"{self.adaptive_min_bound} < 1 would cut the "
                                        "on-policy weight 1")
        if self.adaptive_max_bound < self.adaptive_min_bound:
            raise CorrectionConfigError(_flag("adaptive_max_bound"), f"{self.adaptive_max_bound} < "
                                        f"--algo.correction.adaptive_min_bound {self.adaptive_min_bound}")
        if self.level != "token":
            raise CorrectionConfigError(_flag("level"), f"{self.level}: the adaptive bound "
                                        "(--algo.correction.adaptive_ess_target) caps token weights; use level token")
        if self.mode != "truncate":
            raise CorrectionConfigError(_flag("mode"), f"{self.mode}: the adaptive bound "
                                        "(--algo.correction.adaptive_ess_target) is a truncation cap; use mode "
                                        "truncate")

    def _validate_for_training(self) -> None:
        if self.mode in ("truncate", "clip", "mask"):
            # At every level the on-policy weight is exactly 1; bounds that exclude it would reweight or
            # reject data that needs no correction at all.
            if self.upper < 1:
                raise CorrectionConfigError(
                    _flag("upper"), f"{self.upper} < 1 excludes the on-policy weight 1 at {self.level} level"
                )
            if self.mode != "truncate" and self.lower_bound > 1:
                raise CorrectionConfigError(
                    _flag("lower"), f"{self.lower_bound} > 1 excludes the on-policy weight 1 at {self.level} level"
                )
        if self.veto_threshold is not None and not self.veto_threshold < 1:
            raise CorrectionConfigError(
                _flag("veto_threshold"), f"must lie in (0, 1) (vetoes r < v or r > 1/v), got {self.veto_threshold}"
            )
        if self.veto_min_prob is not None and not self.veto_min_prob < 1:
            raise CorrectionConfigError(_flag("veto_min_prob"), f"must be < 1, got {self.veto_min_prob}")
        # In bypass PPO the clipped ratio π_θ/μ already is the importance weight; multiplying by another
        # weight from π_θ/μ would count the correction twice (verl bypass_mode does not apply them either).
        if self.loss == "bypass_ppo" and self.mode in ("truncate", "clip", "raw"):
            raise CorrectionConfigError(
                _flag("mode"), f"{self.mode!r} weights would double-count the PPO ratio π_θ/μ under "
                "--algo.correction.loss bypass_ppo; use mode none (or mask, which only drops tokens)"
            )

    def validate_for_sequence_ratio(self) -> CorrectionConfig:
        """Refuse what cannot correct a loss whose PPO ratio is one per sequence (GSPO); return self.

        GSPO's ratio is the geometric mean of a sequence's token ratios π_θ/π_old, so every action token's
        log-prob enters it: a per-token IS weight only rescales the sequence's term by an average of its
        tokens' weights, and a token dropped from the loss still moves the gradient through the ratio. A
        correction there decides and weighs per sequence (docs/correction.md §9). The error names the flag
        that set the per-token choice; an inactive correction (metrics only) is always accepted.
        """
        problem = self._sequence_ratio_problem()
        if problem is not None:
            name, reason = problem
            raise CorrectionConfigError(_flag(name), f"{reason}; with --actor.policy_loss_type gspo use a "
                                        f"sequence-level correction (presets {', '.join(sequence_ratio_presets())})")
        return self

    def _sequence_ratio_problem(self) -> tuple[str, str] | None:
        """(field, why) of the first per-token choice `validate_for_sequence_ratio` refuses, or None."""
        if not self.enabled:
            return None
        ratio = "GSPO's ratio, the geometric mean of the sequence's token ratios"
        if self.adaptive_ess_target is not None:
            return "adaptive_ess_target", f"the adaptive bound caps token weights, which cannot correct {ratio}"
        if self.loss == "bypass_reinforce":
            return "loss", "bypass_reinforce is a REINFORCE loss, not GSPO's clipped sequence ratio"
        if self.level == "token" and self.mode != "none":
            return "level", (f"token-level IS weights (mode {self.mode}) cannot correct {ratio}: every token's "
                             "log-prob enters it, so a per-token weight only rescales the sequence's term; use "
                             "level sequence or geometric")
        per_token = [c.name for c in self.rejection if c.token_level]
        if per_token:
            return "rejection", (f"{', '.join(per_token)} rejects single tokens, which still enter {ratio}; "
                                 "aggregate by sum, mean or max")
        if self.nonfinite == "token":
            return "nonfinite", f"token drops single tokens, which still enter {ratio}; use sequence"
        return None

    # ── serialization: config.json records the correction as `to_dict` gives it (runs/config.py). The workers get
    # the object itself, inside the run spec (run_spec/plans.py), not its JSON ──
    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON values. Without an adaptive bound its three fields are left out (`from_dict` restores
        their defaults): a fixed-bound config records what it did before they existed, so its runs resume."""
        d = dataclasses.asdict(self)
        d["rejection"] = [c.spec() for c in self.rejection]
        if self.adaptive_ess_target is None:
            for name in ADAPTIVE_FIELDS:
                del d[name]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CorrectionConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise CorrectionConfigError(FLAG_PREFIX + sorted(unknown)[0], "unknown correction option")
        return cls(**d)


def from_upstream(level: str, mode: str = "mask", gating: str = "ratio",
                  threshold: tuple[float, ...] | list[float] = (0.5, 5.0),
                  policy_loss_type: str = "ppo") -> CorrectionConfig:
    """The config equivalent to OpenRLHF 0.11.2's `--algo.advantage.is_correction_{level,mode,gating,threshold}`.

    Upstream gates a statistic per unit (token, or the per-sequence mean) and either clamps the token
    ratio (clip: token/ratio only) or drops out-of-band units while survivors keep their raw per-token
    ratio (mask). Its binary_kl/tv gates clamp probabilities to [1e-6, 1 − 1e-6], as ours do.
    Under GSPO (`policy_loss_type="gspo"`) upstream checks the same flags but then only puts μ in π_old's
    place inside the sequence ratio, whatever mode, gating and threshold say: bypass PPO, mode none.
    """
    cfg = _from_upstream_ppo(level, mode, gating, threshold)
    if policy_loss_type == "gspo" and level != "off":
        return CorrectionConfig(mode="none", loss="bypass_ppo")
    return cfg


def _from_upstream_ppo(level: str, mode: str, gating: str,
                       threshold: tuple[float, ...] | list[float]) -> CorrectionConfig:
    flag = "--algo.advantage.is_correction_"
    if level == "off":
        return CorrectionConfig(mode="none")
    threshold = list(threshold)
    if len(threshold) == 1:  # upstream: a single value is an upper bound only
        threshold = [0.0, threshold[0]]
    if len(threshold) != 2:
        raise CorrectionConfigError(flag + "threshold", "takes HIGH or LOW HIGH")
    low, high = float(threshold[0]), float(threshold[1])
    if level not in ("token", "seq"):
        raise CorrectionConfigError(flag + "level", f"{level!r} is not off/token/seq")
    if mode not in ("mask", "clip"):
        raise CorrectionConfigError(flag + "mode", f"{mode!r} is not mask/clip")
    if gating not in ("ratio", "binary_kl", "tv"):
        raise CorrectionConfigError(flag + "gating", f"{gating!r} is not ratio/binary_kl/tv")
    if mode == "clip":
        if level != "token" or gating != "ratio":
            raise CorrectionConfigError(flag + "mode", "clip requires level token and gating ratio")
        return CorrectionConfig(level="token", mode="clip", lower=low, upper=high).validate()
    if gating == "ratio":
        if level == "token":
            return CorrectionConfig(level="token", mode="mask", lower=low, upper=high).validate()
        crit = RejectionCriterion("ratio", "mean", low, high)
    else:
        if low > 0:
            raise CorrectionConfigError(flag + "threshold", f"gating {gating} takes an upper bound only")
        crit = RejectionCriterion(gating, "token" if level == "token" else "mean", None, high)
    return CorrectionConfig(level="token", mode="raw", rejection=(crit,)).validate()


# ── presets ──────────────────────────────────────────────────────────────────────────────────────────
# Each preset reproduces one published recipe; overrides on top are allowed (preset(name, upper=3)). Upstream's
# own schemes are what from_upstream maps its flags to, so the table and the flag mapping cannot drift apart.

@dataclass(frozen=True)
class Preset:
    config: CorrectionConfig
    source: str = field(default="")
    alias_of: str | None = None  # the preset this one is, under the name another paper gives it

    @classmethod
    def alias(cls, presets: dict[str, Preset], name: str, source: str) -> Preset:
        """Preset `name` under another name: one config, never two copies that could drift apart."""
        return cls(presets[name].config, source, alias_of=name)


PRESETS: dict[str, Preset] = {
    # TIS talk ablation baselines (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
    # Off-Policy RL Training"), so its comparison can be reproduced.
    "off": Preset(from_upstream("off"), "plain PPO, no correction (TIS talk baseline)"),
    "vanilla_is": Preset(CorrectionConfig(mode="raw"), "untruncated token IS π_old/μ (TIS talk baseline)"),
    "tis": Preset(CorrectionConfig(level="token", mode="truncate", upper=2.0), "token TIS, C = 2 (Yao et al. 2025)"),
    "seq_tis": Preset(CorrectionConfig(level="sequence", mode="truncate", upper=2.0), "sequence TIS (verl seq_is)"),
    "token_mis": Preset(CorrectionConfig(level="token", mode="mask", lower=0.5, upper=2.0),
                        "token masked IS (TRL token_mask, Miles mask)"),
    "seq_mis": Preset(CorrectionConfig(level="sequence", mode="mask", lower=0.0, upper=2.0),
                      "sequence masked IS: drop sequences with Π r > 2 (MIS, Liu et al. 2025)"),
    "geo_rs": Preset(CorrectionConfig(mode="none", rejection=(RejectionCriterion("ratio", "mean", 0.999, 1.001),)),
                     "geometric rejection sampling, keep exp(mean log r) in [0.999, 1.001] (Geo-RS, verl/Miles)"),
    "geo_rs_token_tis": Preset(
        CorrectionConfig(mode="truncate", upper=2.0,
                         rejection=(RejectionCriterion("ratio", "mean", 0.999, 1.001),)),
        "Geo-RS plus token TIS (verl decoupled_geo_rs_token_tis)"),
    "k3_rs": Preset(CorrectionConfig(mode="none", rejection=(RejectionCriterion("k3", "mean", None, 0.01),)),
                    "reject sequences with mean k3 > 0.01 (verl seq_mean_k3 trust region)"),
    "mis_full": Preset(
        CorrectionConfig(level="token", mode="mask", lower=0.5, upper=2.0, veto_threshold=1e-4,
                         rejection=(RejectionCriterion("ratio", "mean", 0.99, 1.01),
                                    RejectionCriterion("k3", "max", None, 1.0)),
                         batch_normalize=True),
        "token MIS + Geo-RS + per-token k3 cap + veto + self-normalization (Miles mis.yaml, extended)"),
    "opsm": Preset(CorrectionConfig(mode="none", opsm_delta=0.1),
                   "off-policy sequence masking (DeepSeek-V3.2; the paper gives no δ, 0.1 is a starting point)"),
    "bypass_ppo": Preset(CorrectionConfig(mode="none", loss="bypass_ppo"), "verl bypass mode, PPO clip on π_θ/μ"),
    "bypass_reinforce": Preset(CorrectionConfig(mode="truncate", upper=2.0, loss="bypass_reinforce"),
                               "verl bypass pg_is: −min(π_θ/μ, 2)·A·log π_θ"),
    "adaptive": Preset(CorrectionConfig(level="token", mode="truncate", adaptive_ess_target=0.9),
                       "token TIS with a per-micro-batch cap in [1, 5] keeping the weights' ESS >= 0.9 (the fork's "
                       "rule; P3O, Fakoor et al. 2026, ties the cap to the ESS)"),
    # OpenRLHF 0.11.2's own schemes (its --algo.advantage.is_correction_* flags, see from_upstream).
    "upstream_tis": Preset(from_upstream("token", "clip"), "OpenRLHF token clip of the ratio into [0.5, 5] (TIS)"),
    "upstream_icepop": Preset(from_upstream("token", "mask"), "OpenRLHF token mask outside [0.5, 5] (ICEPOP)"),
    "upstream_seq_mask_tis": Preset(
        from_upstream("seq", "mask"),
        "OpenRLHF seq-mask-tis: keep sequences with geometric-mean ratio in [0.5, 5], token IS weights"),
}

PRESETS["icepop"] = Preset.alias(PRESETS, "upstream_icepop", "token masking outside [0.5, 5] (IcePop, Ring-1T)")
PRESETS["ppo_is"] = Preset.alias(
    PRESETS, "bypass_ppo", "μ replaces π_old inside the PPO clip (TIS talk baseline 'PPO-IS'; = verl bypass ppo_clip)")


def sequence_ratio_presets() -> list[str]:
    """The presets a loss with one ratio per sequence (GSPO) accepts (`validate_for_sequence_ratio`)."""
    return [name for name, entry in PRESETS.items() if entry.config._sequence_ratio_problem() is None]


def preset(name: str, **overrides: Any) -> CorrectionConfig:
    """The named preset with `overrides` applied, validated."""
    if name not in PRESETS:
        raise CorrectionConfigError(_flag("preset"), f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name].config.replace(**overrides).validate(training=True)
