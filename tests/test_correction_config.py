"""CorrectionConfig validation (errors name the flag), rejection specs, presets, upstream mapping."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from openrlhf_tis.correction import (
    PRESETS,
    CorrectionConfig,
    CorrectionConfigError,
    RejectionCriterion,
    from_upstream,
    preset,
)


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"level": "tokens"}, "--algo.correction.level"),
        ({"mode": "cap"}, "--algo.correction.mode"),
        ({"mode": "clip", "lower": 3.0, "upper": 2.0}, "--algo.correction.lower"),
        ({"mode": "mask", "upper": -1.0}, "--algo.correction.upper"),
        ({"mode": "clip", "lower": -0.1}, "--algo.correction.lower"),
        ({"veto_threshold": 0.0}, "--algo.correction.veto_threshold"),
        ({"veto_min_prob": 2.0}, "--algo.correction.veto_min_prob"),
        ({"opsm_delta": -1.0}, "--algo.correction.opsm_delta"),
        ({"loss": "grpo"}, "--algo.correction.loss"),
        ({"denominator": "some"}, "--algo.correction.denominator"),
        ({"upper": math.nan}, "--algo.correction.upper"),
    ],
)
def test_undefined_settings_are_refused_naming_the_flag(kwargs, flag):
    with pytest.raises(CorrectionConfigError) as err:
        CorrectionConfig(**kwargs).validate()
    assert err.value.flag == flag and str(err.value).startswith(flag)


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"mode": "mask", "lower": 1.2, "upper": 2.0}, "--algo.correction.lower"),  # excludes on-policy r = 1
        ({"mode": "truncate", "upper": 0.8}, "--algo.correction.upper"),
        ({"level": "sequence", "mode": "clip", "lower": 0.1, "upper": 0.9}, "--algo.correction.upper"),
        ({"veto_threshold": 1.5}, "--algo.correction.veto_threshold"),
        ({"loss": "bypass_ppo", "mode": "truncate"}, "--algo.correction.mode"),
        ({"rejection": ("ratio:mean:1.1:2",)}, "--algo.correction.rejection"),
        ({"rejection": ("k3:mean:0.1:0.5",)}, "--algo.correction.rejection"),
    ],
)
def test_settings_wrong_for_training_are_refused_at_start_up(kwargs, flag):
    cfg = CorrectionConfig(**kwargs)
    cfg.validate()  # defined: the bare core computes it
    with pytest.raises(CorrectionConfigError) as err:
        cfg.validate(training=True)
    assert err.value.flag == flag


@pytest.mark.parametrize(
    "spec",
    [
        "k3:mean",  # too few fields
        "k4:mean:0.1",  # unknown statistic
        "k3:median:0.1",  # unknown aggregation
        "ratio:max::2",  # one-sided
        "ratio:token:-1:2",  # a negative ratio
        "k1:max::0.5",
        "k2:token::",  # no bound
        "ratio:token:2:1",  # lower > upper
        "k3:mean:abc",
    ],
)
def test_bad_rejection_specs_are_refused(spec):
    with pytest.raises(CorrectionConfigError) as err:
        CorrectionConfig(rejection=(spec,))
    assert err.value.flag == "--algo.correction.rejection"


def test_rejection_spec_roundtrip():
    crit = RejectionCriterion.parse("ratio:mean:0.999:1.001")
    assert (crit.statistic, crit.agg, crit.lower, crit.upper) == ("ratio", "mean", 0.999, 1.001)
    assert RejectionCriterion.parse("k3:max:0.5") == RejectionCriterion("k3", "max", None, 0.5)
    assert RejectionCriterion.parse(crit.spec()) == crit
    assert CorrectionConfig(rejection="k2:token:0.1").rejection == (RejectionCriterion("k2", "token", None, 0.1),)


def test_defaults_and_derived_values():
    cfg = CorrectionConfig()
    assert (cfg.level, cfg.mode, cfg.upper, cfg.lower_bound) == ("token", "truncate", 2.0, 0.5)
    assert cfg.enabled and not CorrectionConfig(mode="none").enabled
    assert CorrectionConfig(mode="none", loss="bypass_ppo").enabled
    assert CorrectionConfig(mode="clip", lower=0.25, upper=4).lower_bound == 0.25


def test_json_roundtrip_of_every_preset():
    """config.json records a run's correction as `to_dict` gives it; `from_dict` reads it back whole."""
    for name in PRESETS:
        cfg = preset(name)
        assert CorrectionConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(CorrectionConfigError, match="--algo.correction.bogus"):
        CorrectionConfig.from_dict({"bogus": 1})


# The preset names users type (--algo.correction.preset, notebooks, docs/correction.md), written out by hand.
PRESET_NAMES = {
    "off", "ppo_is", "vanilla_is", "tis", "seq_tis", "icepop", "token_mis", "seq_mis", "geo_rs", "geo_rs_token_tis",
    "k3_rs", "mis_full", "opsm", "bypass_ppo", "bypass_reinforce", "upstream_tis", "upstream_icepop",
    "upstream_seq_mask_tis", "adaptive",
}


def test_presets_are_valid_documented_and_overridable():
    assert set(PRESETS) == PRESET_NAMES
    for name, p in PRESETS.items():
        p.config.validate(training=True)
        assert p.source, name
    assert preset("tis", upper=3.0).upper == 3.0
    with pytest.raises(CorrectionConfigError, match="--algo.correction.preset"):
        preset("nope")
    assert preset("ppo_is").loss == "bypass_ppo" and not preset("off").enabled
    # An alias is its target's config under another name; no other two presets share a config.
    assert PRESETS["ppo_is"].alias_of == "bypass_ppo" and PRESETS["ppo_is"].config is PRESETS["bypass_ppo"].config
    assert preset("icepop") == CorrectionConfig(level="token", mode="mask", lower=0.5, upper=5.0)
    assert PRESETS["icepop"].alias_of == "upstream_icepop"
    canonical = [p.config for p in PRESETS.values() if p.alias_of is None]
    assert len(set(canonical)) == len(canonical)
    assert preset("vanilla_is").mode == "raw"


@pytest.mark.parametrize(
    ("name", "expected"),
    [  # the published recipe each preset reproduces: (level, mode, lower, upper, rejection criteria, loss)
        ("tis", ("token", "truncate", None, 2.0, (), "decoupled")),
        ("seq_tis", ("sequence", "truncate", None, 2.0, (), "decoupled")),
        ("icepop", ("token", "mask", 0.5, 5.0, (), "decoupled")),
        ("token_mis", ("token", "mask", 0.5, 2.0, (), "decoupled")),
        ("seq_mis", ("sequence", "mask", 0.0, 2.0, (), "decoupled")),
        ("geo_rs", ("token", "none", None, 2.0, (("ratio", "mean", 0.999, 1.001),), "decoupled")),
        ("k3_rs", ("token", "none", None, 2.0, (("k3", "mean", None, 0.01),), "decoupled")),
        ("mis_full",
         ("token", "mask", 0.5, 2.0, (("ratio", "mean", 0.99, 1.01), ("k3", "max", None, 1.0)), "decoupled")),
        ("bypass_reinforce", ("token", "truncate", None, 2.0, (), "bypass_reinforce")),
        ("upstream_tis", ("token", "clip", 0.5, 5.0, (), "decoupled")),
        ("upstream_icepop", ("token", "mask", 0.5, 5.0, (), "decoupled")),
        ("upstream_seq_mask_tis", ("token", "raw", None, 2.0, (("ratio", "mean", 0.5, 5.0),), "decoupled")),
    ],
)
def test_preset_contents(name, expected):
    cfg = preset(name)
    specs = tuple(RejectionCriterion(*criterion) for criterion in expected[4])
    assert (cfg.level, cfg.mode, cfg.lower, cfg.upper, cfg.rejection, cfg.loss) == (*expected[:4], specs, expected[5])


def test_from_upstream_mapping():
    assert not from_upstream("off").enabled
    assert from_upstream("token", "clip", "ratio", [0.5, 5.0]) == CorrectionConfig(mode="clip", lower=0.5, upper=5.0)
    assert from_upstream("token", "mask", "ratio", [0.5, 5.0]) == CorrectionConfig(mode="mask", lower=0.5, upper=5.0)
    seq = from_upstream("seq", "mask", "ratio", [0.5, 5.0])
    assert seq.mode == "raw" and seq.rejection == (RejectionCriterion("ratio", "mean", 0.5, 5.0),)
    kl = from_upstream("seq", "mask", "binary_kl", [0.02])  # a single HIGH, as upstream accepts
    assert kl.rejection == (RejectionCriterion("binary_kl", "mean", None, 0.02),)
    tv = from_upstream("token", "mask", "tv", [0.0, 0.3])
    assert tv.rejection == (RejectionCriterion("tv", "token", None, 0.3),)
    assert from_upstream("token", "mask", "ratio", [0.5, 5.0]) == preset("upstream_icepop")
    assert from_upstream("token", "clip", "ratio", [0.5, 5.0]) == preset("upstream_tis")
    assert from_upstream("seq", "mask", "ratio", [0.5, 5.0]) == preset("upstream_seq_mask_tis")
    for args, flag in [
        (("seq", "clip", "ratio", [0.5, 5.0]), "mode"),
        (("token", "mask", "binary_kl", [0.1, 0.5]), "threshold"),
        (("tok", "mask", "ratio", [0.5, 5.0]), "level"),
        (("token", "mask", "ratio", [0.5, 1.0, 5.0]), "threshold"),
    ]:
        with pytest.raises(CorrectionConfigError) as err:
            from_upstream(*args)
        assert err.value.flag == "--algo.advantage.is_correction_" + flag


# --- options that a configuration never reads -----------------------------------------------------------------
# Two values of each field that is read only in some configurations: a change between them must alter nothing where
# `without_effect` names the field, and must be visible somewhere else (so the rule is neither vacuous nor too broad).
CONDITIONAL = {"lower": (0.3, 0.4), "upper": (3.0, 4.0), "veto_sides": ("both", "low"),
               "batch_normalize": (False, True), "normalize_scope": ("global", "local"), "denominator": ("all", "kept"),
               "adaptive_min_bound": (1.0, 1.5), "adaptive_max_bound": (5.0, 1.5)}


def _batch():
    """Log-probs with ordinary and extreme ratios (a token at r = e^12 and one at e^-12: the veto's two sides), both
    advantage signs and padding."""
    import torch

    gen = torch.Generator().manual_seed(0)
    roll = -torch.rand(6, 8, generator=gen, dtype=torch.float64) * 3
    old = roll + torch.randn(6, 8, generator=gen, dtype=torch.float64)
    old[0, 2], old[1, 3] = roll[0, 2] + 12, roll[1, 3] - 12
    log_probs = old + 0.1 * torch.randn(6, 8, generator=gen, dtype=torch.float64)
    advantages = torch.randn(6, 8, generator=gen, dtype=torch.float64)
    action_mask = torch.ones(6, 8)
    action_mask[:, 6:] = 0
    return log_probs, old, advantages, action_mask, roll


def _outcome(cfg: CorrectionConfig):
    """Everything a configuration computes on _batch: the loss, weights, mask and every metric, with another
    data-parallel rank in the sums (so the normalization scope can matter)."""
    import torch

    from openrlhf_tis.correction import policy_loss

    out = policy_loss(*_batch(), cfg, allreduce=lambda t: t + torch.ones_like(t))
    corr = out.correction
    return (out.loss.item(), corr.weights.tolist(), corr.mask.tolist(), sorted(corr.metrics.items()))


def _configs():
    """Every preset, and each with a ratio veto, with self-normalization and with a loose adaptive ESS target (where
    the adaptive cap leaves its floor), where that is a valid training config."""
    variants = []
    for name, p in PRESETS.items():
        for label, cfg in ((name, p.config), (f"{name}+veto", p.config.replace(veto_threshold=1e-4)),
                           (f"{name}+normalize", p.config.replace(batch_normalize=True)),
                           (f"{name}+ess0.3", p.config.replace(adaptive_ess_target=0.3))):
            try:
                variants.append((label, cfg.validate(training=True)))
            except CorrectionConfigError:
                pass
    return variants


def _changed(cfg: CorrectionConfig, name: str) -> CorrectionConfig | None:
    a, b = CONDITIONAL[name]
    try:
        return cfg.replace(**{name: b if getattr(cfg, name) == a else a}).validate(training=True)
    except CorrectionConfigError:
        return None


def test_every_field_read_only_sometimes_is_listed():
    conditional = {f.name for f in dataclasses.fields(CorrectionConfig) if f.metadata["read_when"] is not None}
    assert conditional == set(CONDITIONAL)


def test_a_field_named_without_effect_changes_nothing_and_is_read_elsewhere():
    unread_checked, read_seen = set(), set()
    for label, cfg in _configs():
        unread = cfg.without_effect(CONDITIONAL)
        for name in CONDITIONAL:
            changed = _changed(cfg, name)
            if changed is None:
                continue
            same = _outcome(cfg) == _outcome(changed)
            if name in unread:
                assert same, f"{label}: {name} is named without effect, yet changing it changes the outcome"
                unread_checked.add(name)
            elif not same:
                read_seen.add(name)
    assert unread_checked == set(CONDITIONAL) and read_seen == set(CONDITIONAL)


@pytest.mark.parametrize(("name", "overrides", "unused"), [
    ("off", {"upper": 3.0}, "upper"),  # no weight, so no cap
    ("tis", {"veto_sides": "low"}, "veto_sides"),  # no veto threshold, so no sides
    ("tis", {"lower": 0.5}, "lower"),
    ("tis", {"normalize_scope": "local"}, "normalize_scope"),
    ("off", {"denominator": "kept"}, "denominator"),
    ("ppo_is", {"batch_normalize": True}, "batch_normalize"),
])
def test_the_issue_cases_are_named_without_effect(name, overrides, unused):
    cfg = preset(name, **overrides)
    assert list(cfg.without_effect(overrides)) == [unused]
    assert not preset(name).replace(mode="mask", veto_threshold=1e-4, batch_normalize=True).without_effect(
        ["upper", "lower", "veto_sides", "normalize_scope", "batch_normalize"])
