"""Which per-step signals warn of a run's fall, how early, and at what false-alarm rate, measured on the studies'
runs: `python -m openrlhf_tis.study.early_warning --out DIR STUDY_FOLDER...` writes DIR/early_warning.md and
DIR/early_warning.png.

A run *fell* when its kept policy's held-out gain is below the collapse study's endpoint (FALL_BELOW, fixed before
that study's first cell). A signal is read the way a person watching the run would read it: its worst value so far
(the running max or min of a per-step metric from metrics.jsonl; reward and response length as the mean of the last
WINDOW steps against the first WINDOW steps), so a warning at step t uses nothing logged after t.

Two questions, fixed here before the analysis was run (the signals are the issue's list: k3, ESS, raw-weight max,
entropy, reward; plus the gradient norm and the response length):
1. *Discrimination*: by step HORIZON (half of a 24-step run), does the worst-so-far separate runs that fell from
   runs that held? AUROC (Mann–Whitney U / n_fell n_held, scipy.stats) in the signal's stated direction, with a
   percentile bootstrap interval (scipy.stats.bootstrap, each group resampled on its own) and a one-sided p,
   Holm-adjusted across the signals.
2. *A rule, measured where it was not tuned*: leave one study out. The threshold is the (1 - FALSE_ALARM_TARGET)
   quantile of the held runs' end-of-run worst values in the other studies; on the left-out study's runs the rule
   warns at the first step the worst-so-far crosses it. Pooled over the folds: recall (falls warned) and false
   alarms (held runs warned) with exact intervals, Fisher's p of warned-among-fell against warned-among-held
   (Holm across signals), and the lead: steps left in the run when it warned.
A rule *holds up* when its Holm-adjusted Fisher p < ALPHA and its median lead is at least MIN_LEAD steps; the
report says so, or says that none does, with the numbers either way.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.stats import bootstrap, mannwhitneyu

from openrlhf_tis.metric_names import ESS_SEQ
from openrlhf_tis.runs.health import FALL_WARNING_ESS
from openrlhf_tis.runs.kept_score import read_kept_heldout
from openrlhf_tis.runs.layout import atomic_write
from openrlhf_tis.runs.reader import find_runs, read_metrics_records
from openrlhf_tis.study.collapse import FALL_BELOW
from openrlhf_tis.viz.stats import fisher_p, holm, rate_interval

WINDOW = 4  # steps in a trailing mean (reward, response length), and in the opening mean it is compared with
HORIZON = 12  # the discrimination question's step: half of the studies' 24-step runs
FALSE_ALARM_TARGET = 0.1  # the share of held runs (in the other studies) a threshold lets through
MIN_LEAD = 4  # steps a warning must leave, at the median, to be worth acting on
ALPHA = 0.05
REPORT_FILE = "early_warning.md"
FIGURE_FILE = "early_warning.png"


@dataclass(frozen=True)
class Signal:
    """A per-step signal: `metric` from metrics.jsonl, read as is or as a trailing mean against the opening one
    (`relative`: "difference" or "ratio"), worse when `worse` ("high" or "low")."""

    name: str
    metric: str
    worse: str
    relative: str | None = None


SIGNALS = (
    Signal("k3", "mismatch/k3_kl", "high"),
    Signal("sequence ESS", ESS_SEQ, "low"),
    Signal("raw weight max", "correction/weight_raw_max", "high"),
    Signal("entropy", "mismatch/entropy_sampled", "high"),
    Signal("gradient norm", "actor_grad_norm", "high"),
    Signal("reward drop", "reward", "low", "difference"),
    Signal("length ratio", "response_length", "low", "ratio"),
)


@dataclass(frozen=True)
class Run:
    """One finished run: its study (folder), directory, kept-policy gain and per-step records in step order."""

    study: str
    path: Path
    gain: float
    records: tuple[dict, ...]

    @property
    def fell(self) -> bool:
        return self.gain < FALL_BELOW

    @property
    def steps(self) -> int:
        return len(self.records)

    @property
    def setting(self) -> str:
        """The study and the cell's parameters without its seed: runs that differ only by seed share it."""
        return f"{self.study}/{_SEED_OR_HASH.sub('', self.path.parent.name)}"


_SEED_OR_HASH = re.compile(r"_?seed=\d+|-[0-9a-f]{8}$")


def signal_series(records: Sequence[dict], signal: Signal) -> np.ndarray:
    """The signal at each step (NaN where the metric is missing or the trailing window is not yet full)."""
    values = np.array([float(r.get(signal.metric, math.nan)) for r in records], dtype=np.float64)
    if signal.relative is None:
        return values
    if len(values) < WINDOW:
        return np.full(len(values), math.nan)
    trailing = np.convolve(values, np.ones(WINDOW) / WINDOW, mode="valid")  # mean of steps t-WINDOW+1..t
    opening = trailing[0]
    relative = trailing - opening if signal.relative == "difference" else trailing / opening
    return np.concatenate([np.full(WINDOW - 1, math.nan), relative])


def worst_so_far(series: np.ndarray, worse: str) -> np.ndarray:
    """The running worst of `series` (NaNs skipped; NaN until the first finite value)."""
    running = np.fmax.accumulate(series) if worse == "high" else np.fmin.accumulate(series)
    return running


def _badness(values: np.ndarray, worse: str) -> np.ndarray:
    """Values oriented so that larger is worse."""
    return values if worse == "high" else -values


def auroc(fell: np.ndarray, held: np.ndarray) -> float:
    """P(a fallen run's badness exceeds a held run's), ties counted half: Mann–Whitney U / (n_fell n_held)."""
    if len(fell) == 0 or len(held) == 0:
        return math.nan
    return float(mannwhitneyu(fell, held, alternative="greater").statistic) / (len(fell) * len(held))


@dataclass(frozen=True)
class Discrimination:
    signal: str
    fell: int
    held: int
    auroc: float
    low: float
    high: float
    p: float  # one-sided Mann–Whitney, before adjustment
    within: float  # the same AUROC over (fell, held) pairs of one setting only: what it adds to knowing the setting
    pairs: int


def discrimination(runs: Sequence[Run], signal: Signal, horizon: int = HORIZON) -> Discrimination:
    """How well the worst-so-far at step `horizon` separates runs that fell from runs that held."""
    scored = []  # (setting, fell, badness)
    for run in runs:
        if run.steps < horizon:
            continue
        value = worst_so_far(signal_series(run.records, signal), signal.worse)[horizon - 1]
        if math.isfinite(value):
            scored.append((run.setting, run.fell, value if signal.worse == "high" else -value))
    fell = np.array([b for _, f, b in scored if f])
    held = np.array([b for _, f, b in scored if not f])
    pairs = [(a, b) for sa, fa, a in scored if fa for sb, fb, b in scored if not fb and sb == sa]
    within = (float(np.mean([1.0 if a > b else 0.5 if a == b else 0.0 for a, b in pairs])) if pairs
              else math.nan)
    if len(fell) < 2 or len(held) < 2:
        return Discrimination(signal.name, len(fell), len(held), auroc(fell, held), math.nan, math.nan, math.nan,
                              within, len(pairs))
    ci = bootstrap((fell, held), auroc, vectorized=False, n_resamples=2000, method="percentile",
                   random_state=np.random.default_rng(0)).confidence_interval
    p = float(mannwhitneyu(fell, held, alternative="greater").pvalue)
    return Discrimination(signal.name, len(fell), len(held), auroc(fell, held), float(ci.low), float(ci.high), p,
                          within, len(pairs))


def threshold(held_runs: Sequence[Run], signal: Signal, false_alarm: float = FALSE_ALARM_TARGET) -> float:
    """The badness that a share `false_alarm` of the held runs' end-of-run worst values exceeds (numpy's linear
    quantile); NaN without held runs that log the signal."""
    ends = [_badness(worst_so_far(signal_series(r.records, signal), signal.worse), signal.worse)[-1]
            for r in held_runs]
    ends = np.array([e for e in ends if math.isfinite(e)])
    return float(np.quantile(ends, 1.0 - false_alarm)) if len(ends) else math.nan


def first_warning(run: Run, signal: Signal, bound: float) -> int | None:
    """The first step (1-based) whose worst-so-far badness exceeds `bound`, or None."""
    badness = _badness(worst_so_far(signal_series(run.records, signal), signal.worse), signal.worse)
    crossed = np.flatnonzero(np.nan_to_num(badness, nan=-np.inf) > bound)
    return int(crossed[0]) + 1 if len(crossed) else None


@dataclass(frozen=True)
class RuleResult:
    signal: str
    falls: int
    warned_falls: int
    held: int
    warned_held: int
    leads: tuple[int, ...]  # per warned fall: steps left in the run when it warned
    p: float  # two-sided Fisher, before adjustment

    @property
    def median_lead(self) -> float:
        return float(np.median(self.leads)) if self.leads else math.nan


def out_of_study_rule(runs: Sequence[Run], signal: Signal) -> RuleResult:
    """Leave one study out: tune the threshold on the other studies' held runs, warn on the left-out study."""
    falls = warned_falls = held = warned_held = 0
    leads: list[int] = []
    for study in sorted({r.study for r in runs}):
        bound = threshold([r for r in runs if r.study != study and not r.fell], signal)
        if not math.isfinite(bound):
            continue
        for run in (r for r in runs if r.study == study):
            step = first_warning(run, signal, bound)
            if run.fell:
                falls += 1
                if step is not None:
                    warned_falls += 1
                    leads.append(run.steps - step)
            else:
                held += 1
                warned_held += step is not None
    p = fisher_p(warned_falls, falls, warned_held, held) if falls and held else math.nan
    return RuleResult(signal.name, falls, warned_falls, held, warned_held, tuple(leads), p)


def load_runs(folders: Sequence[Path]) -> list[Run]:
    """Every run under the study folders with metrics and a kept-policy score; the study is the folder's name."""
    runs = []
    for folder in folders:
        for path in find_runs(folder, max_depth=4):
            kept = read_kept_heldout(path)
            records = read_metrics_records(path)
            if kept is None or not records:
                continue
            records = sorted(records, key=lambda r: r.get("step", 0))
            runs.append(Run(Path(folder).name, path, kept.after.pass1 - kept.before.pass1, tuple(records)))
    return runs


def _fmt(x: float, digits: int = 2) -> str:
    return "–" if not math.isfinite(x) else f"{x:.{digits}f}"


def report_markdown(runs: Sequence[Run]) -> str:
    """The report: the runs, the discrimination table, the out-of-study rule table and the verdict."""
    falls = sum(r.fell for r in runs)
    studies = sorted({r.study for r in runs})
    lines = [f"Runs: {len(runs)} from {len(studies)} studies ({', '.join(studies)}); fell (kept gain < "
             f"{FALL_BELOW:g}): {falls}.", ""]
    found = [discrimination(runs, s) for s in SIGNALS]
    adjusted = holm([d.p for d in found])
    lines += [f"**By step {HORIZON}** (worst so far; AUROC 0.5 = no better than chance):", "",
              "| signal | worse when | fell / held | AUROC [95% bootstrap] | p (Holm) | within one setting (pairs) |",
              "|---|---|---|---|---|---|"]
    for signal, d, p in zip(SIGNALS, found, adjusted, strict=True):
        lines.append(f"| {d.signal} | {signal.worse} | {d.fell} / {d.held} | {_fmt(d.auroc)} [{_fmt(d.low)}, "
                     f"{_fmt(d.high)}] | {_fmt(p, 3)} | {_fmt(d.within)} ({d.pairs}) |")
    rules = [out_of_study_rule(runs, s) for s in SIGNALS]
    adjusted = holm([r.p for r in rules])
    lines += ["", f"**A rule tuned on the other studies** (threshold: the held runs' {1 - FALSE_ALARM_TARGET:.0%} "
              "quantile there), on each left-out study:", "",
              "| signal | falls warned [95% exact] | false alarms [95% exact] | median lead (steps) "
              "| Fisher p (Holm) |",
              "|---|---|---|---|---|"]
    held_up = []
    for r, p in zip(rules, adjusted, strict=True):
        recall, alarms = rate_interval(r.warned_falls, r.falls), rate_interval(r.warned_held, r.held)
        lines.append(f"| {r.signal} | {r.warned_falls}/{r.falls} = {_fmt(recall.estimate)} [{_fmt(recall.low)}, "
                     f"{_fmt(recall.high)}] | {r.warned_held}/{r.held} = {_fmt(alarms.estimate)} [{_fmt(alarms.low)}, "
                     f"{_fmt(alarms.high)}] | {_fmt(r.median_lead, 1)} | {_fmt(p, 3)} |")
        if p < ALPHA and r.median_lead >= MIN_LEAD:
            held_up.append(r.signal)
    verdict = (f"Holds up (Holm p < {ALPHA}, median lead ≥ {MIN_LEAD} steps): {', '.join(held_up)}." if held_up else
               f"No rule holds up (none has Holm p < {ALPHA} with a median lead ≥ {MIN_LEAD} steps): nothing may "
               "warn on these signals yet.")
    ess = next(s for s in SIGNALS if s.metric == ESS_SEQ)
    fitted = -threshold([r for r in runs if not r.fell], ess)
    shipped = (f"The trainer warns below a sequence ESS of {FALL_WARNING_ESS:g} (runs/health.py); fitted here on "
               f"every study's held runs: {_fmt(fitted, 3)}.")
    return "\n".join([*lines, "", verdict, "", shipped, ""])


def plot(runs: Sequence[Run], path: Path) -> None:
    """One panel per signal: every run's worst-so-far by step, fallen runs in red over held ones in grey."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 4
    fig, axes = plt.subplots(math.ceil(len(SIGNALS) / cols), cols, figsize=(4 * cols, 6.4), squeeze=False)
    for ax, signal in zip(axes.flat, SIGNALS, strict=False):
        positive = False
        for run in sorted(runs, key=lambda r: r.fell):
            worst = worst_so_far(signal_series(run.records, signal), signal.worse)
            positive |= bool((worst > 0).any())
            ax.plot(np.arange(1, len(worst) + 1), worst, color="tab:red" if run.fell else "0.7",
                    lw=1.2 if run.fell else 0.8, alpha=0.9 if run.fell else 0.6)
        ax.axvline(HORIZON, color="k", ls=":", lw=0.8)
        if signal.metric == ESS_SEQ:
            ax.axhline(FALL_WARNING_ESS, color="tab:blue", lw=0.8, label="the trainer's warning")
            ax.legend(fontsize=7, loc="upper right")
        ax.set_title(f"{signal.name} (worse {signal.worse})", fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        if signal.worse == "high" and signal.relative is None and positive:
            ax.set_yscale("log")
    for ax in list(axes.flat)[len(SIGNALS):]:
        ax.axis("off")
    fig.suptitle(f"worst so far: runs that fell (kept gain < {FALL_BELOW:g}) in red, held in grey", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("studies", nargs="+", type=Path, help="study folders (each holding cells/*/run)")
    parser.add_argument("--out", type=Path, required=True, help="folder for early_warning.md and .png")
    args = parser.parse_args(argv)
    missing = [str(f) for f in args.studies if not f.is_dir()]
    if missing:
        parser.error(f"study folders: not found: {', '.join(missing)}")
    runs = load_runs(args.studies)
    if not runs:
        parser.error("study folders: no run with metrics.jsonl and heldout_kept.json under them")
    args.out.mkdir(parents=True, exist_ok=True)
    text = report_markdown(runs)
    atomic_write(args.out / REPORT_FILE, f"# Early warning\n\n{text}".encode())
    plot(runs, args.out / FIGURE_FILE)
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
