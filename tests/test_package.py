"""The package as `pip install .` (not editable) ships it: the wheel is built from the working tree, offline,
and its contents are checked; then, unpacked into a directory of its own, its console entry points import and
the notebooks the pipeline executes are found inside it, from an unrelated working directory."""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = ["compare", "dashboard", "sweep", "token_explorer", "train"]
CONSOLE_SCRIPTS = {
    "openrlhf-tis-train": "openrlhf_tis.cli.train_ppo_ray:main",
    "openrlhf-tis-main-job": "openrlhf_tis.pipeline.main_job:main",
    "openrlhf-tis-sweep": "openrlhf_tis.pipeline.sweep:main",
    "openrlhf-tis-study": "openrlhf_tis.study.dose_response:main",
    "openrlhf-tis-runs": "openrlhf_tis.runs.cli:main",
    "openrlhf-tis-dashboard": "openrlhf_tis.dashboard.cli:main",
    "openrlhf-tis-calibrate": "openrlhf_tis.rollout.calibration:main",
}


def _source_tree(dest: Path) -> Path:
    """The files git would commit (tracked plus untracked, not ignored), as a fresh clone has them."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True, timeout=60).stdout.decode().split("\0")
    for name in filter(None, listed):
        src, out = REPO / name, dest / name
        if not src.exists() and not src.is_symlink():  # deleted in the working tree, not yet committed
            continue
        out.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            out.symlink_to(os.readlink(src))
        else:
            shutil.copy2(src, out)
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    if shutil.which("git") is None:
        pytest.skip("needs git to list the source tree")
    work = tmp_path_factory.mktemp("wheel")
    tree = _source_tree(work / "src")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                    "--disable-pip-version-check", "-q", ".", "-w", str(work / "dist")],
                   cwd=tree, check=True, timeout=300)
    (built,) = (work / "dist").glob("openrlhf_tis-*.whl")
    return built


def test_the_wheel_ships_notebooks_patch_notes_and_entry_points(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"openrlhf_tis/notebooks/{name}.ipynb" for name in NOTEBOOKS} <= names
    assert {"openrlhf_tis/patches/README.md", "openrlhf_tis/patches/__init__.py",
            "openrlhf_tis/demo/dense_reward.py", "openrlhf_tis/demo/task_reward.py"} <= names
    assert not [n for n in names if n.startswith(("tests/", "notebooks/", "patches/"))]  # only the package
    (entry_file,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    entries = configparser.ConfigParser()
    entries.read_string(zipfile.ZipFile(wheel).read(entry_file).decode())
    assert {k: v.strip() for k, v in entries["console_scripts"].items()} == CONSOLE_SCRIPTS
    assert entries["vllm.general_plugins"]["openrlhf_tis_patches"].strip() == "openrlhf_tis.patches:vllm_plugin"


def test_the_unpacked_wheel_runs_from_any_directory(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    targets = repr(sorted(CONSOLE_SCRIPTS.values()))
    code = (
        "import importlib, openrlhf_tis\n"
        "from openrlhf_tis.pipeline import execute, main_job, train_params\n"
        f"for target in {targets}:\n"
        "    module, _, name = target.partition(':')\n"
        "    assert callable(getattr(importlib.import_module(module), name)), target\n"
        "print(openrlhf_tis.__file__)\n"
        "print(execute.notebook_path('train'))\n"
        "print(train_params.DEMO_REWARD.is_file(), main_job.TASK_REWARD.is_file())\n"
    )
    # PYTHONPATH comes before site-packages, where the shared venv's editable install points at the repository.
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run([sys.executable, "-c", code], cwd=elsewhere, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    package, notebook, rewards = out.stdout.splitlines()
    assert Path(package).parent == site / "openrlhf_tis"
    assert Path(notebook) == site / "openrlhf_tis" / "notebooks" / "train.ipynb"
    assert rewards == "True True"
    sweep = subprocess.run([sys.executable, "-m", "openrlhf_tis.pipeline.sweep", "--help"], cwd=elsewhere, env=env,
                           capture_output=True, text=True, timeout=120)
    assert sweep.returncode == 0 and "GRID" in sweep.stdout.upper(), sweep.stderr
