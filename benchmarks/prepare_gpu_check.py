"""Prepare benchmarks/gpu_check.py for a GPU machine without network access: one folder of at most 64 MiB.

    python benchmarks/prepare_gpu_check.py             # writes ../gpu_check_bundle, beside the repository
    python benchmarks/prepare_gpu_check.py --out DIR

The GPU machine needs only Python with torch (with CUDA), transformers and triton. The folder holds everything else
the check reads: the fork's package `openrlhf_tis` (with patches/ as `openrlhf_tis.patches`, where setup.py installs
it), the benchmarks folder (gpu_check.py, the bench_correction.py it reuses, upstream_formula.py, its statement of
upstream's PolicyLoss for a machine without OpenRLHF), and in vendor/ a copy of the pure-Python packages it uses
where present that such a machine may lack (rich, which draws the table; without it the table is plain text).
gpu_check puts vendor/ last on sys.path, so the machine's own copy of a package wins. Copy the folder over, then run
one command from the folder that holds it:

    python3 gpu_check_bundle/benchmarks/gpu_check.py

The files are the working tree's (tracked, and untracked ones git does not ignore), so uncommitted changes travel
too; GPU_CHECK_BUNDLE.txt in the folder records the commit and whether the tree differed from it. The script prints
the folder's size and the command, and exits 1 where the folder is over the limit or --out names a folder that
exists and is not a bundle it made.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LIMIT_MIB = 64
"""What a GPU machine of this workplace takes along with the repository (the device tool's working-tree limit)."""
SOURCES = {"openrlhf_tis": "openrlhf_tis", "benchmarks": "benchmarks"}
"""Repository folder -> its place in the bundle (the top-level patches/ is a link into openrlhf_tis/)."""
VENDORED = ("rich",)
"""Distributions gpu_check uses where installed that a machine with only torch, transformers and triton may lack.
rich's own requirements (markdown-it-py, pygments) serve Markdown and syntax highlighting only, not tables."""
VENDOR = "vendor"  # gpu_check.VENDOR
MARKER = "GPU_CHECK_BUNDLE.txt"
SKIPPED_PARTS = {"__pycache__", ".ipynb_checkpoints"}


def _git(*args: str) -> str | None:
    """A read-only git query in the repository; None where git or the repository is unavailable (a tarball)."""
    try:
        proc = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def source_files() -> list[Path]:
    """The working tree's files under SOURCES, relative to the repository: what git tracks or would track (so no
    build output, cache or virtual environment), or every file but caches where git cannot say."""
    listed = _git("ls-files", "--cached", "--others", "--exclude-standard", "-z", "--", *SOURCES)
    if listed is not None:
        candidates = [Path(name) for name in listed.split("\0") if name]
    else:
        candidates = [path.relative_to(REPO) for folder in SOURCES for path in (REPO / folder).rglob("*")]
    return sorted({path for path in candidates
                   if (REPO / path).is_file() and not SKIPPED_PARTS & set(path.parts) and path.suffix != ".pyc"})


def bundle_path(path: Path) -> Path:
    """Where repository file `path` goes in the bundle."""
    top, rest = path.parts[0], path.parts[1:]
    return Path(SOURCES[top], *rest)


def vendored_files(name: str) -> dict[Path, Path] | None:
    """{installed file: its path under vendor/} of distribution `name` (its package and its .dist-info, whose
    METADATA carries the licence), or None where it is not installed here."""
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return None
    files = {}
    for entry in dist.files or []:
        relative = Path(entry)
        if relative.parts[0] == ".." or SKIPPED_PARTS & set(relative.parts) or relative.suffix == ".pyc":
            continue  # console scripts outside site-packages, bytecode
        source = Path(entry.locate())
        if source.is_file():
            files[source] = relative
    return files


def folder_size(folder: Path) -> tuple[int, int]:
    """(files, bytes) under `folder`."""
    sizes = [path.stat().st_size for path in folder.rglob("*") if path.is_file()]
    return len(sizes), sum(sizes)


def _clear(out: Path) -> None:
    """Empty `out` for a new bundle: only a bundle this script made (its marker file) or an empty folder."""
    if not out.exists():
        return
    if (out / MARKER).is_file():
        shutil.rmtree(out)
    elif not out.is_dir() or any(out.iterdir()):
        raise SystemExit(f"{out} exists and is not a gpu_check bundle (no {MARKER}): choose another --out")


def _copy(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)


def prepare(out: Path) -> list[str]:
    """Write the bundle into `out`; returns the lines of its marker file (what it holds and how to run it)."""
    _clear(out)
    sources = source_files()
    for path in sources:
        _copy(REPO / path, out / bundle_path(path))
    vendored = []
    for name in VENDORED:
        files = vendored_files(name)
        if files is None:
            print(f"warning: {name} is not installed here, so not in the bundle (the table is then plain text "
                  "where the GPU machine lacks it too)", file=sys.stderr)
            continue
        for source, relative in files.items():
            _copy(source, out / VENDOR / relative)
        vendored.append(f"{name} {importlib.metadata.version(name)}")
    commit = (_git("rev-parse", "HEAD") or "unknown").strip()
    changed = _git("status", "--porcelain", "--", *SOURCES)
    state = "unknown" if changed is None else ("with uncommitted changes" if changed.strip() else "clean")
    lines = [
        "benchmarks/gpu_check.py prepared by benchmarks/prepare_gpu_check.py for a machine with only torch (CUDA),",
        "transformers and triton, and no network.",
        f"source: {REPO} at commit {commit} ({state}), {len(sources)} files",
        f"vendor/ (used only where the machine lacks them): {', '.join(vendored) or 'nothing'}",
        f"run, from the folder that holds this one: python3 {out.name}/benchmarks/gpu_check.py",
    ]
    (out / MARKER).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO.parent / "gpu_check_bundle",
                    help="the folder to write (default: gpu_check_bundle beside the repository); an earlier bundle "
                         "there is replaced")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out.resolve()
    lines = prepare(out)
    files, size = folder_size(out)
    print("\n".join(lines[2:4]))
    print(f"{out}: {files} files, {size / 2**20:.2f} MiB (limit {LIMIT_MIB} MiB)")
    if size > LIMIT_MIB * 2**20:
        print(f"over the {LIMIT_MIB} MiB limit: the bundle is not usable as it is", file=sys.stderr)
        return 1
    command = f"python3 {out.name}/benchmarks/gpu_check.py"
    print(f"on the GPU machine, from the folder that holds {out.name}/:\n    {command}")
    print(f"or, on this machine: python3 {out / 'benchmarks' / 'gpu_check.py'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
