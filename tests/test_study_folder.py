"""The study scripts' default folders follow the CPU profile (scripts/study_folder.sh): a machine that emulates bf16
never writes its fp32-trained cells into a folder named for the bf16 studies."""

from __future__ import annotations

import subprocess
from pathlib import Path

from openrlhf_tis.cpu_features import native_bf16

ROOT = Path(__file__).resolve().parents[1]


def test_the_folder_is_named_for_this_machines_profile():
    script = f'ROOT="{ROOT}"; source "{ROOT}/scripts/study_folder.sh"; study_folder moe-demo'
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120, check=True).stdout
    suffix = "avx512" if native_bf16() else "fp32"
    assert out.strip() == f"{ROOT}/results/study/moe-demo-{suffix}"


def test_no_study_script_names_a_profile_itself():
    """Every default results/study folder a script writes is built by study_folder (comments aside)."""
    for script in sorted((ROOT / "scripts").glob("*.sh")):
        code = [line for line in script.read_text().splitlines() if not line.lstrip().startswith("#")]
        named = [line for line in code if "results/study/" in line]
        assert script.name == "study_folder.sh" or not named, f"{script.name}: {named}"
