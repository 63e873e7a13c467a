"""Flag sets whose resolved namespace tests/data/run_spec_pin.json pins (tests/test_run_spec.py): what upstream's
`train()` received for each, written by the CLI before the run spec existed (its correction then a JSON string at
`algo.correction.resolved`, its device decision at `cluster.device` and `cluster.resources`), so moving the resolution
into one place is checked to change nothing upstream sees. Regenerate only for an intended change of what upstream
receives: `python tests/run_spec_cases.py` (then adapt test_run_spec.py's mapping of the old keys)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from openrlhf_tis.cli.cluster_device import ClusterResources

PIN = Path(__file__).parent / "data" / "run_spec_pin.json"
CPU = ClusterResources("a CPU cluster (pinned)", 0, 8)
CUDA = ClusterResources("a CUDA cluster (pinned)", 8, 64, ("H100",))
BASE = ["--actor.model_name_or_path", "/m", "--reward.remote_url", "/r.py", "--data.prompt_dataset", "/p.jsonl",
        "--logger.run_dir", "/runs/pinned", "--vllm.num_engines", "1"]
CASES: dict[str, tuple[ClusterResources, list[str]]] = {
    "cpu_defaults": (CPU, BASE),
    "cpu_tis_sync_every_dumps": (CPU, [*BASE, "--algo.correction.preset", "tis", "--vllm.sync_every", "4",
                                       "--logger.token_dump_steps", "2", "--logger.token_dump_samples", "3",
                                       "--ds.attn_implementation", "eager"]),
    "cpu_upstream_seq_flags": (CPU, [*BASE, "--algo.advantage.is_correction_level", "seq",
                                     "--algo.advantage.is_correction_threshold", "0.8", "1.25"]),
    "cpu_int8_icepop_overrides": (CPU, [*BASE, "--vllm.rollout_precision", "int8", "--vllm.int8_weight_bits", "6",
                                        "--vllm.int8_scales", "frozen", "--algo.correction.preset", "icepop",
                                        "--algo.correction.upper", "3", "--ds.param_dtype", "fp32"]),
    "cuda_fp8_seq_tis": (CUDA, [*BASE, "--vllm.rollout_precision", "fp8", "--algo.correction.preset", "seq_tis"]),
}


def resolved_namespace(cluster: ClusterResources, argv: list[str]) -> dict:
    """The namespace upstream receives for `argv` on `cluster`, as JSON values (the run store's flattening)."""
    from openrlhf_tis import patches
    from openrlhf_tis.cli.cluster_device import decide_device, requested_device
    from openrlhf_tis.cli.train_ppo_ray import build_parser, parse_flags
    from openrlhf_tis.runs.config import resolve_config

    patches.apply_platform_patches(decide_device(requested_device(argv), cluster))
    args, _ = parse_flags(build_parser(), argv, cluster)
    return resolve_config(args)


def resolve_cases(names: list[str]) -> dict:
    """The named cases, resolved in processes of their own, one per device (a process takes one device's patches)."""
    import subprocess

    found: dict = {}
    for device in (CPU, CUDA):
        mine = [name for name in names if CASES[name][0] is device]
        if mine:
            found.update(json.loads(subprocess.run([sys.executable, __file__, *mine], check=True, capture_output=True,
                                                   text=True).stdout))
    return found


def pin_all() -> dict:
    return resolve_cases(list(CASES))


if __name__ == "__main__":
    if len(sys.argv) > 1:
        print(json.dumps({name: resolved_namespace(*CASES[name]) for name in sys.argv[1:]}))
    else:
        PIN.write_text(json.dumps(pin_all(), indent=1, sort_keys=True) + "\n")
        print(f"wrote {PIN}: {', '.join(CASES)}")
