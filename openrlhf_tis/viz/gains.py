"""Held-out gains (after − before) per run, per setting over seeds, and against a baseline setting (the reference;
the uncorrected one at the same dose).

Two sources, never mixed in one statistic: the kept policy (`heldout_kept.json`: the trainer's weights in
the trainer's dtype, what a user deploys; first) and the rollout engine (`eval_start/*` → last `eval/*` in
metrics.jsonl: the possibly quantized rollout policy; second, labelled). A setting's gain is the mean over
its seeds with a t-interval over seeds and, where every run wrote per-question scores, a paired bootstrap
over seeds × questions (viz/stats.py); `shown` applies the study's rule to both. Each comparison between settings
also says what it could have seen (the difference detectable at 80% power from its own spread) and whether its
"shown" survives Holm's adjustment over every comparison the table makes (among 13 independent tests at
α = 0.05 chance alone gives at least one "shown" half the time).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import numpy as np
import pandas as pd

from openrlhf_tis.runs.kept_score import read_kept_heldout
from openrlhf_tis.runs.reader import load_metrics
from openrlhf_tis.viz.compare import held_out_key
from openrlhf_tis.viz.curves import held_out
from openrlhf_tis.viz.stats import (
    LEVEL,
    Interval,
    bootstrap_interval,
    detectable_effect,
    holm,
    shown,
    t_interval,
    t_test_p,
)

KEPT, ENGINE = "kept policy", "rollout engine"
SOURCES = (KEPT, ENGINE)
AGAINST = {"ref": "reference", "off": "uncorrected (same dose)"}  # column suffix -> the baseline a setting is paired to


def run_gains(facts: pd.DataFrame) -> pd.DataFrame:
    """One row per (run, source) that has both a before and an after score: before, after, gain and, for the kept
    policy when written, the per-question gains (`q_gain`, file order). `facts` is viz.compare.run_facts's table."""
    rows = []
    for run, fact in facts.iterrows():
        kept = read_kept_heldout(fact["path"])
        if kept is not None:
            q_gain = None if kept.after.per_question is None else kept.after.per_question - kept.before.per_question
            rows.append({"run": run, "source": KEPT, "before": kept.before.pass1, "after": kept.after.pass1,
                         "q_gain": q_gain})
        metrics = load_metrics(fact["path"])
        key = held_out_key(metrics)
        steps, values = held_out(metrics, key) if key else ([], [])
        if len(values) >= 2 and steps[0] == 0:  # the untrained policy's score is logged: a gain exists
            rows.append({"run": run, "source": ENGINE, "before": float(values[0]), "after": float(values[-1]),
                         "q_gain": None})
    frame = pd.DataFrame(rows, columns=["run", "source", "before", "after", "q_gain"])
    frame["gain"] = frame["after"] - frame["before"]
    return frame.join(facts[["setting", "seed"]], on="run")


def _question_matrix(q_gains: list) -> np.ndarray | None:
    """seeds × questions of per-question gains, when every run has them over as many questions."""
    if not q_gains or not all(isinstance(q, np.ndarray) for q in q_gains) or len({len(q) for q in q_gains}) != 1:
        return None
    return np.stack(q_gains)


def _intervals(values: np.ndarray, questions: np.ndarray | None) -> dict[str, float | bool | int]:
    t = t_interval(values)
    boot = bootstrap_interval(questions) if questions is not None else Interval(t.estimate, np.nan, np.nan, t.n)
    return {"seeds": t.n, "gain": t.estimate, "t_low": t.low, "t_high": t.high, "boot_low": boot.low,
            "boot_high": boot.high, "shown": shown(t, boot)}


def setting_gains(gains: pd.DataFrame, source: str) -> pd.DataFrame:
    """Per setting (in first-seen order): seeds, mean before/after, mean gain with its t-interval over seeds and
    its bootstrap interval over seeds × questions (NaN without per-question scores), and `shown` (every
    interval there is excludes 0)."""
    rows = []
    for setting, group in gains[gains["source"] == source].groupby("setting", sort=False):
        rows.append({"setting": setting, "before": group["before"].mean(), "after": group["after"].mean(),
                     **_intervals(group["gain"].to_numpy(), _question_matrix(list(group["q_gain"])))})
    return pd.DataFrame(rows).set_index("setting") if rows else pd.DataFrame()


def paired_differences(gains: pd.DataFrame, source: str, baseline_of: Mapping[str, str]) -> pd.DataFrame:
    """Each setting's gain minus its baseline setting's (`baseline_of[setting]`; settings without one are left out),
    paired by seed (only seeds both ran count): the mean difference with its t-interval and paired bootstrap (the
    same seeds and questions on both sides), `shown` when both exclude 0, i.e. the two gains differ, the paired
    t-test's p-value `p` and the `detectable` difference at 80% power from the pairs' own spread (NaN for both with
    fewer than 2 pairs)."""
    mine = gains[(gains["source"] == source) & gains["seed"].notna()]
    by_setting = {setting: group.drop_duplicates("seed") for setting, group in mine.groupby("setting", sort=False)}
    rows = []
    for setting, group in by_setting.items():
        if baseline_of.get(setting) not in by_setting:
            continue
        base = by_setting[baseline_of[setting]].set_index("seed")[["gain", "q_gain"]]
        paired = group.merge(base, left_on="seed", right_index=True, suffixes=("", "_base"))
        q_diffs = [a - b if isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and len(a) == len(b) else None
                   for a, b in zip(paired["q_gain"], paired["q_gain_base"], strict=True)]
        differences = (paired["gain"] - paired["gain_base"]).to_numpy()
        spread = float(np.std(differences, ddof=1)) if len(differences) >= 2 else float("nan")
        rows.append({"setting": setting, **_intervals(differences, _question_matrix(q_diffs)),
                     "p": t_test_p(differences), "detectable": detectable_effect(spread, len(differences))})
    table = pd.DataFrame(rows)
    return table.rename(columns={"gain": "difference"}).set_index("setting") if rows else table


def headline_source(gains: pd.DataFrame) -> str:
    """The kept policy when every run that has a score has a kept-policy one; else the engine (labelled)."""
    runs = set(gains["run"])
    kept = set(gains.loc[gains["source"] == KEPT, "run"])
    if kept and kept == runs:
        return KEPT
    if kept:
        warnings.warn(f"only {len(kept)} of {len(runs)} runs wrote heldout_kept.json: the headline uses the rollout "
                      "engine's held-out score for all of them", stacklevel=2)
    return ENGINE


def reference_setting(facts: pd.DataFrame) -> str | None:
    """The uncorrected setting whose rollouts ran in the trainer's dtype (dose `none`, correction `off`)."""
    match = facts[(facts["dose"] == "none") & (facts["correction"] == "off")]
    return str(match["setting"].iloc[0]) if len(match) else None


def uncorrected_of(facts: pd.DataFrame) -> dict[str, str]:
    """Each corrected setting's baseline: the uncorrected setting at its dose (the comparison that says whether the
    correction pays there, free of the dose's own effect)."""
    settings = facts.drop_duplicates("setting")
    off = {row.dose: row.setting for row in settings.itertuples() if row.correction == "off"}
    return {row.setting: off[row.dose] for row in settings.itertuples() if row.correction != "off" and row.dose in off}


def dose_response(facts: pd.DataFrame, gains: pd.DataFrame, source: str) -> pd.DataFrame:
    """The headline's points, one per setting: dose, correction, mean k3 KL over its runs (each run's mean over
    its steps) and the gain with its intervals; the difference from the reference (`*_vs_ref`) and, for a
    corrected setting, from the uncorrected one at its dose (`*_vs_off`), each with its pairs, p-value, detectable
    difference and, over the family of every such comparison with a p-value, the Holm-adjusted p (`p_holm_*`) and
    whether a shown difference survives it (`shown_holm_*`)."""
    per_setting = facts.groupby("setting", sort=False).agg(
        dose=("dose", "first"), correction=("correction", "first"), k3_mean=("k3_mean", "mean"))
    table = per_setting.join(setting_gains(gains, source), how="inner")
    reference = reference_setting(facts)
    baselines = {"ref": {s: reference for s in per_setting.index if s != reference} if reference else {},
                 "off": uncorrected_of(facts)}
    for suffix, baseline_of in baselines.items():
        versus = paired_differences(gains, source, baseline_of) if len(table) else pd.DataFrame()
        if len(versus):
            table = table.join(versus[["difference", "t_low", "t_high", "boot_low", "boot_high", "shown", "seeds", "p",
                                       "detectable"]].rename(columns={"seeds": "pairs"}).add_suffix(f"_vs_{suffix}"),
                               how="left")
    return holm_family(table)


def holm_family(table: pd.DataFrame) -> pd.DataFrame:
    """Adds `p_holm_vs_*` (Holm-adjusted over one family: every comparison in the table with a p-value, against
    either baseline) and `shown_holm_vs_*` (shown, and its adjusted p below 1 − LEVEL) to a dose_response table."""
    family = [suffix for suffix in AGAINST if f"p_vs_{suffix}" in table]
    if not family:
        return table
    p = table[[f"p_vs_{suffix}" for suffix in family]].to_numpy(dtype=np.float64)
    adjusted = holm(p.ravel()).reshape(p.shape)
    for column, suffix in enumerate(family):
        table[f"p_holm_vs_{suffix}"] = adjusted[:, column]
        table[f"shown_holm_vs_{suffix}"] = table[f"shown_vs_{suffix}"].eq(True) & (adjusted[:, column] < 1 - LEVEL)
    return table


def _fmt(value: float, spec: str = "+.3f") -> str:
    return "n/a" if value is None or not np.isfinite(value) else format(value, spec)


def _ci(row: Mapping, low: str, high: str) -> str:
    return "n/a" if not np.isfinite(row.get(low, np.nan)) else f"[{_fmt(row[low])}, {_fmt(row[high])}]"


def difference_with_interval(row: Mapping, suffix: str) -> str:
    """'+0.148 [-0.200, +0.500]': a comparison's difference and its t-interval in one cell; n/a without one."""
    difference = row.get(f"difference_vs_{suffix}", np.nan)
    if difference is None or not np.isfinite(difference):
        return "n/a"
    return f"{_fmt(difference)} {_ci(row, f't_low_vs_{suffix}', f't_high_vs_{suffix}')}"


def _versus(row: Mapping, suffix: str) -> list[str]:
    """The difference, its t-interval and whether it is shown; n/a where the setting has no such baseline."""
    difference = row.get(f"difference_vs_{suffix}", np.nan)
    defined = difference is not None and np.isfinite(difference)
    return [_fmt(difference), _ci(row, f"t_low_vs_{suffix}", f"t_high_vs_{suffix}"),
            "n/a" if not defined else ("yes" if row.get(f"shown_vs_{suffix}") else "no")]


def _p(value: float) -> str:
    return "n/a" if not np.isfinite(value) else "<0.001" if value < 0.001 else f"{value:.3f}"


def comparisons_markdown(table: pd.DataFrame) -> str:
    """One row per comparison between settings (against the reference, then against the uncorrected setting at the
    same dose): what it found, what it could have found (the difference detectable at 80% power), its p-value
    raw and Holm-adjusted over the family, and whether a shown difference survives the adjustment. Empty when the
    table makes no comparison."""
    rows, untested = [], 0
    ordered = table.sort_values(["correction", "k3_mean"]) if len(table) else table
    for suffix, against in AGAINST.items():
        for _, row in ordered.iterrows():
            difference = row.get(f"difference_vs_{suffix}", np.nan)
            if difference is None or not np.isfinite(difference):
                continue
            pairs = int(row[f"pairs_vs_{suffix}"])
            tested = np.isfinite(row[f"p_vs_{suffix}"])
            untested += not tested
            why = "" if tested else f" ({pairs} pair)"
            rows.append([str(row["dose"]), str(row["correction"]), against, str(pairs), _fmt(difference),
                         _ci(row, f"t_low_vs_{suffix}", f"t_high_vs_{suffix}"),
                         _ci(row, f"boot_low_vs_{suffix}", f"boot_high_vs_{suffix}"),
                         "yes" if row[f"shown_vs_{suffix}"] else "no",
                         _fmt(row[f"detectable_vs_{suffix}"], ".3f") + why, _p(row[f"p_vs_{suffix}"]) + why,
                         _p(row[f"p_holm_vs_{suffix}"]) + why,
                         "yes" if row[f"shown_holm_vs_{suffix}"] else "no"])
    if not rows:
        return ""
    family = len(rows) - untested
    note = (f"Comparisons, paired by seed: **{family} in the family**; p from the paired t-test (p < 0.05 exactly when "
            f"its 95% t interval excludes 0), Holm-adjusted over the {family}; a shown difference survives when its "
            "adjusted p < 0.05. Detectable: the smallest true difference δ the test finds with 80% power at "
            "two-sided α = 0.05 given the comparison's own spread s over n pairs, exact from the noncentral t "
            "(n−1 df, noncentrality δ√n/s); n/a where the pairs do not spread.")
    if untested:
        note += f" Fewer than 2 pairs in {untested} of them: no test there (n/a), and not in the family."
    header = ["dose", "correction", "against", "pairs", "difference", "95% CI (t)",
              "95% CI (bootstrap, seeds × questions)", "shown", "detectable (80% power)", "p (t)",
              f"p (Holm, {family})", "shown after Holm"]
    lines = [note, "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join([*lines, *("| " + " | ".join(row) + " |" for row in rows)])


def headline_markdown(table: pd.DataFrame, source: str) -> str:
    """The study's tables: the one the README takes, one row per setting sorted by correction then k3, and below it
    the comparisons between settings with what each could detect and what survives Holm."""
    if table.empty:
        return "(no run with a held-out score before and after training)"
    header = ["dose", "correction", "seeds", "mean k3 KL(μ‖π_old)", f"held-out gain ({source})",
              "95% CI (t, seeds)", "95% CI (bootstrap, seeds × questions)", "shown", "vs reference",
              "95% CI (t)", "shown vs reference", "vs uncorrected (same dose)", "95% CI (t) vs uncorrected",
              "shown vs uncorrected"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for _, row in table.sort_values(["correction", "k3_mean"]).iterrows():
        lines.append("| " + " | ".join([
            str(row["dose"]), str(row["correction"]), str(int(row["seeds"])), _fmt(row["k3_mean"], ".2g"),
            _fmt(row["gain"]), _ci(row, "t_low", "t_high"), _ci(row, "boot_low", "boot_high"),
            "yes" if row["shown"] else "no", *_versus(row, "ref"), *_versus(row, "off")]) + " |")
    comparisons = comparisons_markdown(table)
    return "\n".join(lines) + (f"\n\n{comparisons}" if comparisons else "")
