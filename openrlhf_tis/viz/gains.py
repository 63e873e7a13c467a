"""Held-out gains (after − before) per run, per setting over seeds, and against the reference setting.

Two sources, never mixed in one statistic: the kept policy (`heldout_kept.json`: the trainer's weights in
the trainer's dtype, what a user deploys; first) and the rollout engine (`eval_start/*` → last `eval/*` in
metrics.jsonl: the possibly quantized rollout policy; second, labelled). A setting's gain is the mean over
its seeds with a t-interval over seeds and, where every run wrote per-question scores, a paired bootstrap
over seeds × questions (viz/stats.py); `shown` applies the study's rule to both.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import numpy as np
import pandas as pd

from openrlhf_tis.runs.heldout import read_kept_heldout
from openrlhf_tis.runs.reader import load_metrics
from openrlhf_tis.viz.compare import held_out_key
from openrlhf_tis.viz.curves import held_out
from openrlhf_tis.viz.stats import Interval, bootstrap_interval, shown, t_interval

KEPT, ENGINE = "kept policy", "rollout engine"
SOURCES = (KEPT, ENGINE)


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


def versus_reference(gains: pd.DataFrame, source: str, reference: str) -> pd.DataFrame:
    """Each setting's gain minus the reference setting's, paired by seed (only seeds both ran count): the mean
    difference with its t-interval and paired bootstrap (the same seeds and questions on both sides), and
    `shown` when both exclude 0, i.e. the setting's gain differs from the reference's."""
    mine = gains[(gains["source"] == source) & gains["seed"].notna()]
    ref = mine[mine["setting"] == reference].drop_duplicates("seed").set_index("seed")[["gain", "q_gain"]]
    rows = []
    for setting, group in mine[mine["setting"] != reference].groupby("setting", sort=False):
        paired = group.drop_duplicates("seed").merge(ref, left_on="seed", right_index=True, suffixes=("", "_ref"))
        q_diffs = [a - b if isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and len(a) == len(b) else None
                   for a, b in zip(paired["q_gain"], paired["q_gain_ref"], strict=True)]
        rows.append({"setting": setting,
                     **_intervals((paired["gain"] - paired["gain_ref"]).to_numpy(), _question_matrix(q_diffs))})
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


def dose_response(facts: pd.DataFrame, gains: pd.DataFrame, source: str) -> pd.DataFrame:
    """The headline's points, one per setting: dose, correction, mean k3 KL over its runs (each run's mean over
    its steps) and the gain with its intervals; and the difference from the reference with `shown_vs_ref`."""
    per_setting = facts.groupby("setting", sort=False).agg(
        dose=("dose", "first"), correction=("correction", "first"), k3_mean=("k3_mean", "mean"))
    table = per_setting.join(setting_gains(gains, source), how="inner")
    reference = reference_setting(facts)
    if reference is not None and len(table):
        versus = versus_reference(gains, source, reference)
        if len(versus):
            table = table.join(versus[["difference", "t_low", "t_high", "boot_low", "boot_high", "shown"]]
                               .add_suffix("_vs_ref"), how="left")
    return table


def _fmt(value: float, spec: str = "+.3f") -> str:
    return "n/a" if value is None or not np.isfinite(value) else format(value, spec)


def _ci(row: Mapping, low: str, high: str) -> str:
    return "n/a" if not np.isfinite(row.get(low, np.nan)) else f"[{_fmt(row[low])}, {_fmt(row[high])}]"


def headline_markdown(table: pd.DataFrame, source: str) -> str:
    """The table the README takes: one row per setting, sorted by correction then k3."""
    if table.empty:
        return "(no run with a held-out score before and after training)"
    header = ["dose", "correction", "seeds", "mean k3 KL(μ‖π_old)", f"held-out gain ({source})",
              "95% CI (t, seeds)", "95% CI (bootstrap, seeds × questions)", "shown", "vs reference",
              "95% CI (t)", "shown vs reference"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for _, row in table.sort_values(["correction", "k3_mean"]).iterrows():
        versus = row.get("difference_vs_ref", np.nan)
        lines.append("| " + " | ".join([
            str(row["dose"]), str(row["correction"]), str(int(row["seeds"])), _fmt(row["k3_mean"], ".2g"),
            _fmt(row["gain"]), _ci(row, "t_low", "t_high"), _ci(row, "boot_low", "boot_high"),
            "yes" if row["shown"] else "no", _fmt(versus), _ci(row, "t_low_vs_ref", "t_high_vs_ref"),
            "n/a" if not np.isfinite(versus) else ("yes" if row.get("shown_vs_ref") else "no")]) + " |")
    return "\n".join(lines)
