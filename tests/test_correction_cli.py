"""`--algo.correction.*` and upstream's `--algo.advantage.is_correction_*` resolved before Ray starts."""

from __future__ import annotations

import pytest
from _support import refused

from openrlhf_tis.cli import train_ppo_ray
from openrlhf_tis.correction import CorrectionConfig, from_upstream, preset


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
    return CorrectionConfig.from_json(getattr(args, "algo.correction.resolved"))


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
        (["--algo.correction.preset", "tis", "--actor.policy_loss_type", "gspo"], "--actor.policy_loss_type"),
        (["--algo.advantage.is_correction_level", "seq", "--algo.advantage.is_correction_mode", "clip"],
         "--algo.advantage.is_correction_mode"),
        (["--algo.advantage.is_correction_level", "token", "--algo.advantage.is_correction_threshold", "1.5", "5"],
         "--algo.advantage.is_correction_threshold"),  # upstream accepts it; it rejects all on-policy tokens
    ],
)
def test_bad_corrections_are_refused_naming_the_flag(argv, extra, flag, capsys):
    err = refused(argv + extra, capsys)
    assert flag in err, err


def test_correction_without_vllm_isrefused(argv, capsys):
    no_engines = argv[: argv.index("--vllm.num_engines")]
    err = refused(no_engines + ["--algo.correction.preset", "tis"], capsys)
    assert "--vllm.num_engines" in err
    # Without a correction nothing is refused (and nothing is requested from upstream).
    args = _parse(no_engines)
    assert getattr(args, "algo.advantage.is_correction_level") == "off"


def test_top_p_only_warns_when_the_correction_is_off(argv, capsys):
    _parse(argv + ["--rollout.top_p", "0.9"])
    assert "--rollout.top_p" in capsys.readouterr().err
