"""`openrlhf-tis-dashboard RUNS_ROOT [--port N]` (or `python -m openrlhf_tis.dashboard.cli`): the runs under
RUNS_ROOT, the token explorer and the run comparison as a local web app on 127.0.0.1, until Ctrl-C.

The page is notebooks/dashboard.ipynb with RUNS_ROOT injected (papermill, as every project notebook gets its
parameters), served by Voilà (voila_server.py: loopback only, nothing from a CDN); each page load runs it in a
fresh kernel, so it always reads the run store as it stands; the page frees its kernel as it goes, and kernels
left idle with no page are culled (voila_server.py). A root that does not exist or holds no runs is a
notice on the page, not an error (a run may be about to start there); a port already in use is refused here, in
one line naming it, before Voilà starts. Only pages asking for localhost or a loopback address are answered
(voila_server.py: no DNS rebinding). One SIGINT (Ctrl-C, or `kill -INT` of a dashboard a script started in the
background) or SIGTERM stops it within seconds, its kernels shut down.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from openrlhf_tis.dashboard.voila_server import HOST, port_in_use, voila_env
from openrlhf_tis.pipeline.execute import notebook_path
from openrlhf_tis.sigint import take_sigint

PROG = "openrlhf-tis-dashboard"
DEFAULT_PORT = 8866  # Voilà's own default


def _port(text: str) -> int:
    port = int(text)
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port (1-65535)")
    return port


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("root", metavar="RUNS_ROOT", help="directory holding run directories (searched 3 deep)")
    parser.add_argument("--port", type=_port, default=DEFAULT_PORT, help=f"port on {HOST} (default {DEFAULT_PORT})")
    return parser


def prepare_notebook(root: str | os.PathLike, directory: str | os.PathLike) -> Path:
    """dashboard.ipynb with `root` injected as its parameter, written into `directory` (not executed)."""
    import papermill

    target = Path(directory) / "dashboard.ipynb"
    papermill.execute_notebook(os.fspath(notebook_path("dashboard")), os.fspath(target), prepare_only=True,
                               parameters={"root": os.path.abspath(root)}, progress_bar=False)
    return target


def serve(root: str, port: int) -> None:
    """Serve the dashboard over `root` on HOST:`port` until SIGINT or SIGTERM."""
    from openrlhf_tis.dashboard.voila_app import serve_local  # Voilà takes seconds to import

    os.environ["JUPYTER_PATH"] = voila_env()["JUPYTER_PATH"]  # read by Voilà's template lookup
    with tempfile.TemporaryDirectory(prefix="openrlhf-tis-dashboard-") as directory:
        notebook = prepare_notebook(root, directory)
        print(f"{PROG}: serving {os.path.abspath(root)} at http://{HOST}:{port}/ (Ctrl-C stops it)", flush=True)
        serve_local(notebook, port)


def main(argv: list[str] | None = None) -> None:
    take_sigint()  # KeyboardInterrupt is what Voilà's event loop takes as "stop" (kernels shut down, then exit)
    args = build_parser().parse_args(argv)
    if port_in_use(args.port):
        print(f"{PROG}: error: port {args.port} on {HOST} is in use (choose another with --port)", file=sys.stderr)
        raise SystemExit(2)
    try:
        serve(args.root, args.port)
    except KeyboardInterrupt:  # before Voilà's loop runs, or a second Ctrl-C while its kernels shut down
        print(f"{PROG}: interrupted", file=sys.stderr)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
