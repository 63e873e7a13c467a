"""`--algo.correction.*` and upstream's `--algo.advantage.is_correction_*` resolved before Ray starts."""

from __future__ import annotations

import pytest
from _support import error_line, refused

from openrlhf_tis.cli import train_ppo_ray
from openrlhf_tis.correction import CorrectionConfig, from_upstream, preset
from openrlhf_tis.run_spec import run_spec


@pytest.fixture()
def argv(valid_argv):
    return valid_argv + ["--vllm.num_engines", "1"]


def _parse(argv):
    """Parse in a run directory of its own (a run directory remembers its configuration)."""
    argv = list(argv)
    i = argv.index("--logger.run_dir") + 1
    _parse.count = getattr(_parse, "count", 0) + 1
    argv[i] = f"{argv[i]}_{_parse.count}"
    return train_ppo_ray.parse(argv, cpu=True)


def _resolved(args) -> CorrectionConfig:
    return run_spec(args).correction


def test_default_is_off_but_rollout_log_probs_are_collected(argv):
    args = _parse(argv)
    assert _resolved(args) == preset("off")
    # Upstream requests vLLM log-probs only for a correction level other than off.
    assert getattr(args, "algo.advantage.is_correction_level") == "token"
    assert getattr(args, "algo.advantage.is_correction_threshold") == [0.0, 1.0e9]


def test_preset_and_overrides(argv):
    args = _parse(argv + ["--algo.correction.preset", "icepop", "--algo.correction.upper", "3",
                                       "--algo.correction.rejection", "k3:mean:0.05", "ratio:mean:0.9:1.1",
                                       "--algo.correction.batch_normalize"])
    cfg = _resolved(args)
    assert cfg == preset("icepop", upper=3.0, batch_normalize=True, rejection=("k3:mean:0.05", "ratio:mean:0.9:1.1"))
    args = _parse(argv + ["--algo.correction.loss", "bypass_reinforce", "--algo.correction.mode",
                                       "truncate"])
    assert _resolved(args).loss == "bypass_reinforce"


def test_upstream_flags_map_onto_the_core(argv):
    args = _parse(argv + ["--algo.advantage.is_correction_level", "seq",
                                       "--algo.advantage.is_correction_threshold", "0.8", "1.25"])
    assert _resolved(args) == from_upstream("seq", "mask", "ratio", [0.8, 1.25])
    assert getattr(args, "algo.advantage.is_correction_level") == "seq"  # left as the user gave it
    args = _parse(argv + ["--algo.advantage.is_correction_level", "token",
                                       "--algo.advantage.is_correction_gating", "tv",
                                       "--algo.advantage.is_correction_threshold", "0.2"])
    assert _resolved(args) == from_upstream("token", "mask", "tv", [0.2])


@pytest.mark.parametrize(
    ("extra", "flag"),
    [
        (["--algo.correction.preset", "tis", "--algo.advantage.is_correction_level", "token"],
         "--algo.correction.preset"),
        (["--algo.correction.mode", "clip", "--algo.correction.lower", "3", "--algo.correction.upper", "2"],
         "--algo.correction.lower"),
        (["--algo.correction.preset", "seq_mis", "--algo.correction.upper", "0.5"], "--algo.correction.upper"),
        (["--algo.correction.rejection", "k3:mean:0.1:0.5"], "--algo.correction.rejection"),
        (["--algo.correction.veto_threshold", "2"], "--algo.correction.veto_threshold"),
        (["--algo.correction.preset", "bypass_ppo", "--algo.correction.mode", "truncate"], "--algo.correction.mode"),
        (["--algo.correction.preset", "tis", "--rollout.top_p", "0.9"], "--rollout.top_p"),
        (["--algo.correction.preset", "tis", "--actor.policy_loss_type", "gspo"], "--algo.correction.preset"),
        (["--actor.policy_loss_type", "gspo", "--algo.correction.mode", "truncate"], "--algo.correction.level"),
        (["--actor.policy_loss_type", "gspo", "--algo.correction.preset", "seq_tis", "--algo.correction.rejection",
          "k3:token:0.1"], "--algo.correction.rejection"),
        (["--algo.advantage.is_correction_level", "seq", "--algo.advantage.is_correction_mode", "clip"],
         "--algo.advantage.is_correction_mode"),
        (["--algo.advantage.is_correction_level", "token", "--algo.advantage.is_correction_threshold", "1.5", "5"],
         "--algo.advantage.is_correction_threshold"),  # upstream accepts it; it rejects all on-policy tokens
        # the adaptive bound: parameters out of range, a fixed bound it would override, where it cannot apply
        (["--algo.correction.preset", "adaptive", "--algo.correction.adaptive_ess_target", "0"],
         "--algo.correction.adaptive_ess_target"),
        (["--algo.correction.preset", "adaptive", "--algo.correction.adaptive_ess_target", "1.5"],
         "--algo.correction.adaptive_ess_target"),
        (["--algo.correction.preset", "adaptive", "--algo.correction.adaptive_min_bound", "0.5"],
         "--algo.correction.adaptive_min_bound"),
        (["--algo.correction.preset", "adaptive", "--algo.correction.adaptive_max_bound", "0.9"],
         "--algo.correction.adaptive_max_bound"),
        (["--algo.correction.preset", "adaptive", "--algo.correction.adaptive_max_bound", "inf"],
         "--algo.correction.adaptive_max_bound"),
        (["--algo.correction.preset", "adaptive", "--algo.correction.upper", "3"], "--algo.correction.upper"),
        (["--algo.correction.preset", "adaptive", "--algo.correction.level", "sequence"], "--algo.correction.level"),
        (["--algo.correction.preset", "adaptive", "--algo.correction.mode", "clip"], "--algo.correction.mode"),
        (["--algo.correction.preset", "seq_mis", "--algo.correction.adaptive_ess_target", "0.9"],
         "--algo.correction.level"),
        (["--algo.correction.preset", "tis", "--algo.correction.adaptive_max_bound", "3"],
         "--algo.correction.adaptive_max_bound"),  # no adaptive bound: nothing reads it
        (["--algo.correction.preset", "adaptive", "--actor.policy_loss_type", "gspo"], "--algo.correction.preset"),
    ],
)
def test_bad_corrections_are_refused_naming_the_flag(argv, extra, flag, capsys):
    err = refused(argv + extra, capsys)
    assert flag in err, err


def test_gspo_measures_the_mismatch_and_takes_sequence_level_corrections(argv, capsys):
    gspo = argv + ["--actor.policy_loss_type", "gspo"]
    args = _parse(gspo)
    assert _resolved(args) == preset("off")
    assert getattr(args, "algo.advantage.is_correction_level") == "token"  # rollout log-probs: mismatch/* metrics
    assert _resolved(_parse(gspo + ["--algo.correction.preset", "seq_tis"])) == preset("seq_tis")
    geometric = _parse(gspo + ["--algo.correction.level", "geometric", "--algo.correction.mode", "truncate"])
    assert _resolved(geometric) == CorrectionConfig(level="geometric", mode="truncate")
    # Upstream's GSPO with its is_correction flags puts μ in π_old's place inside the ratio, and nothing else.
    args = _parse(gspo + ["--algo.advantage.is_correction_level", "token", "--algo.advantage.is_correction_mode",
                          "clip"])
    assert _resolved(args) == CorrectionConfig(mode="none", loss="bypass_ppo")
    err = refused(gspo + ["--algo.correction.preset", "icepop"], capsys)
    assert "icepop sets --algo.correction.level" in err and "GSPO's ratio" in err and "seq_tis" in err
    err = refused(gspo + ["--algo.correction.preset", "adaptive"], capsys)
    assert "adaptive sets --algo.correction.adaptive_ess_target" in err and "GSPO's ratio" in err


@pytest.mark.parametrize(("extra", "flag", "why"), [
    (["--algo.correction.preset", "off", "--algo.correction.upper", "3"], "--algo.correction.upper",
     "it is read by mode truncate, clip or mask only, and the mode is 'none'"),
    (["--algo.correction.preset", "tis", "--algo.correction.veto_sides", "low"], "--algo.correction.veto_sides",
     "it picks the sides of the ratio veto, and no --algo.correction.veto_threshold is set"),
    (["--algo.advantage.is_correction_level", "token", "--algo.correction.lower", "0.2"], "--algo.correction.lower",
     None),  # upstream's mapping is a mask (reads lower): accepted
])
def test_an_option_the_correction_never_reads_is_refused_in_one_line(argv, extra, flag, why, capsys):
    if why is None:
        assert _resolved(_parse(argv + extra)).lower == 0.2
        return
    assert error_line(refused(argv + extra, capsys)) == f"{flag}: has no effect here: {why}"
    # the same option counts once the configuration reads it
    reading = {"--algo.correction.upper": ["--algo.correction.mode", "truncate"],
               "--algo.correction.veto_sides": ["--algo.correction.veto_threshold", "1e-4"]}[flag]
    _parse(argv + extra + reading)


def test_correction_without_vllm_isrefused(argv, capsys):
    no_engines = argv[: argv.index("--vllm.num_engines")]
    err = refused(no_engines + ["--algo.correction.preset", "tis"], capsys)
    assert "--vllm.num_engines" in err
    # Without a correction nothing is refused (and nothing is requested from upstream).
    args = _parse(no_engines)
    assert getattr(args, "algo.advantage.is_correction_level") == "off"


@pytest.mark.parametrize(("extra", "level", "mode", "name"), [
    (["--algo.advantage.is_correction_enable"], "token", "clip", "upstream_tis"),  # 0.11.0's default type: tis
    (["--algo.advantage.is_correction_enable", "--algo.advantage.is_correction_type", "icepop"], "token", "mask",
     "upstream_icepop"),
    (["--algo.advantage.is_correction_type=seq-mask-tis", "--algo.advantage.is_correction_enable"], "seq", "mask",
     "upstream_seq_mask_tis"),
])
def test_openrlhf_0110_flags_are_refused_naming_their_0112_replacement(argv, extra, level, mode, name, capsys):
    """OpenRLHF 0.11.0's --algo.advantage.is_correction_enable/_type are gone from 0.11.2: one line names the flag
    and the 0.11.2 flags that compute the same loss, which the fork accepts and maps onto the named preset."""
    replacement = ["--algo.advantage.is_correction_level", level, "--algo.advantage.is_correction_mode", mode]
    line = error_line(refused(argv + extra + ["--algo.advantage.is_correction_threshold", "0.5", "5"], capsys))
    assert line.startswith(f"{extra[0].partition('=')[0]}: OpenRLHF 0.11.0's flag"), line
    assert " ".join(replacement) in line and f"--algo.correction.preset {name}" in line, line
    assert _resolved(_parse(argv + replacement)) == preset(name)


def test_top_p_only_warns_when_the_correction_is_off(argv, capsys):
    _parse(argv + ["--rollout.top_p", "0.9"])
    assert "--rollout.top_p" in capsys.readouterr().err


# Every --algo.correction.* option as the parser must define it: (dest, action class, type, nargs, choices,
# default). Written out by hand, so generating the flags from CorrectionConfig cannot change any of them.
_STR, _FLOAT, _STORE, _TRUE = str, float, "_StoreAction", "_StoreTrueAction"
EXPECTED_CORRECTION_OPTIONS = {
    "--algo.correction.preset": ("algo.correction.preset", _STORE, _STR, None, sorted(
        ["off", "ppo_is", "vanilla_is", "tis", "seq_tis", "icepop", "token_mis", "seq_mis", "geo_rs",
         "geo_rs_token_tis", "k3_rs", "mis_full", "opsm", "bypass_ppo", "bypass_reinforce", "upstream_tis",
         "upstream_icepop", "upstream_seq_mask_tis", "adaptive"]), None),
    "--algo.correction.level": ("algo.correction.level", _STORE, _STR, None, ["token", "sequence", "geometric"],
                                None),
    "--algo.correction.mode": ("algo.correction.mode", _STORE, _STR, None,
                               ["truncate", "clip", "mask", "raw", "none"], None),
    "--algo.correction.lower": ("algo.correction.lower", _STORE, _FLOAT, None, None, None),
    "--algo.correction.upper": ("algo.correction.upper", _STORE, _FLOAT, None, None, None),
    "--algo.correction.adaptive_ess_target": ("algo.correction.adaptive_ess_target", _STORE, _FLOAT, None, None, None),
    "--algo.correction.adaptive_min_bound": ("algo.correction.adaptive_min_bound", _STORE, _FLOAT, None, None, None),
    "--algo.correction.adaptive_max_bound": ("algo.correction.adaptive_max_bound", _STORE, _FLOAT, None, None, None),
    "--algo.correction.rejection": ("algo.correction.rejection", _STORE, _STR, "+", None, None),
    "--algo.correction.veto_threshold": ("algo.correction.veto_threshold", _STORE, _FLOAT, None, None, None),
    "--algo.correction.veto_sides": ("algo.correction.veto_sides", _STORE, _STR, None, ["both", "low"], None),
    "--algo.correction.veto_min_prob": ("algo.correction.veto_min_prob", _STORE, _FLOAT, None, None, None),
    "--algo.correction.opsm_delta": ("algo.correction.opsm_delta", _STORE, _FLOAT, None, None, None),
    "--algo.correction.batch_normalize": ("algo.correction.batch_normalize", _TRUE, None, 0, None, None),
    "--algo.correction.normalize_scope": ("algo.correction.normalize_scope", _STORE, _STR, None, ["global", "local"],
                                          None),
    "--algo.correction.loss": ("algo.correction.loss", _STORE, _STR, None,
                               ["decoupled", "bypass_ppo", "bypass_reinforce"], None),
    "--algo.correction.denominator": ("algo.correction.denominator", _STORE, _STR, None, ["all", "kept"], None),
    "--algo.correction.nonfinite": ("algo.correction.nonfinite", _STORE, _STR, None, ["sequence", "token"], None),
    "--algo.correction.log_ratio_clamp": ("algo.correction.log_ratio_clamp", _STORE, _FLOAT, None, None, None),
    "--algo.correction.compile": ("algo.correction.compile", _TRUE, None, 0, None, None),
    "--algo.correction.compile_metrics": ("algo.correction.compile_metrics", _STORE, _STR, None, ["auto", "on", "off"],
                                          None),
}


def test_correction_options_are_exactly_the_expected_ones():
    parser = train_ppo_ray.build_parser()
    got = {}
    for action in parser._actions:
        for option in action.option_strings:
            if option.startswith("--algo.correction."):
                choices = list(action.choices) if action.choices is not None else None
                got[option] = (action.dest, type(action).__name__, action.type, action.nargs, choices,
                               action.default)
                assert action.help, option  # every flag explains itself
    assert list(got) == list(EXPECTED_CORRECTION_OPTIONS)  # the same flags, in the same (help) order
    for option, want in EXPECTED_CORRECTION_OPTIONS.items():
        assert got[option] == want, option


def test_every_correction_flag_reaches_the_resolved_config(argv):
    p = "--algo.correction."
    args = _parse(argv + [p + "preset", "off", p + "level", "geometric", p + "mode", "clip", p + "lower", "0.6",
                          p + "upper", "1.5", p + "rejection", "k3:mean:0.05", "ratio:mean:0.9:1.1",
                          p + "veto_threshold", "0.001", p + "veto_sides", "low", p + "veto_min_prob", "1e-6",
                          p + "opsm_delta", "0.2", p + "batch_normalize", p + "normalize_scope", "local",
                          p + "loss", "bypass_reinforce", p + "denominator", "kept", p + "nonfinite", "token",
                          p + "log_ratio_clamp", "10", p + "compile", p + "compile_metrics", "off"])
    assert _resolved(args) == CorrectionConfig(
        level="geometric", mode="clip", lower=0.6, upper=1.5, rejection=("k3:mean:0.05", "ratio:mean:0.9:1.1"),
        veto_threshold=0.001, veto_sides="low", veto_min_prob=1e-6, opsm_delta=0.2, batch_normalize=True,
        normalize_scope="local", loss="bypass_reinforce", denominator="kept", nonfinite="token",
        log_ratio_clamp=10.0, compile=True, compile_metrics="off")
    args = _parse(argv + [p + "preset", "tis", p + "adaptive_ess_target", "0.8", p + "adaptive_min_bound", "1.2",
                          p + "adaptive_max_bound", "4"])
    assert _resolved(args) == CorrectionConfig(adaptive_ess_target=0.8, adaptive_min_bound=1.2, adaptive_max_bound=4.0)
    assert _resolved(_parse(argv + [p + "preset", "adaptive"])) == preset("adaptive")
