"""CorrectionConfig validation (errors name the flag), rejection specs, presets, upstream mapping."""

from __future__ import annotations

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
    for name in PRESETS:
        cfg = preset(name)
        assert CorrectionConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(CorrectionConfigError, match="--algo.correction.bogus"):
        CorrectionConfig.from_dict({"bogus": 1})


# The preset names users type (--algo.correction.preset, notebooks, docs/correction.md), written out by hand.
PRESET_NAMES = {
    "off", "ppo_is", "vanilla_is", "tis", "seq_tis", "icepop", "token_mis", "seq_mis", "geo_rs", "geo_rs_token_tis",
    "k3_rs", "mis_full", "opsm", "bypass_ppo", "bypass_reinforce", "upstream_tis", "upstream_icepop",
    "upstream_seq_mask_tis",
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
