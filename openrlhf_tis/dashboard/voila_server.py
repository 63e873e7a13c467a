"""Serving a notebook as a local web page with Voilà: on 127.0.0.1 only, to local Host headers only, and with
nothing fetched from a CDN.

Voilà's lab template links Font Awesome from a CDN and nbconvert's imports mermaid from one; the page must work
with no network (and leak nothing to one), so pages are rendered with the `openrlhf_tis` template shipped in
`jupyter/` beside this module, which drops both (its index.html.j2 says how). Voilà finds templates on the Jupyter
path, hence `voila_env`.

Listening on loopback does not keep other web pages out: a page that rebinds its own DNS name to 127.0.0.1 talks
to the server as its own origin. Voilà turns off jupyter_server's Host check (`allow_remote_access`), so
voila_app.py's `serve_local` turns it back on through Voilà's `tornado_settings` (LOCAL_ONLY): every Jupyter
handler (the page, the kernel API and its websocket) answers 403 to a Host that is neither `localhost` nor a
loopback address. Only the packages' static assets (scripts, styles) are served whatever the Host; they hold no
run data.

Every page load starts a kernel (a few hundred MiB resident). Voilà's page frees it on unload with a POST that echoes
the `_xsrf` cookie, but Voilà's page handler never sets that cookie, so jupyter_server refused every such POST
('_xsrf' argument missing) and each view or reload leaked its kernel. voila_app.py's page handler sets the
cookie with the page, keeping the XSRF check whole: another site's page can neither read the cookie nor guess it.
A kernel whose page went without that POST (a crashed tab, a bare HTTP GET) is culled once idle and unconnected
for CULL_IDLE_S. Pages are rendered at most RENDERS at a time (one kernel executes the notebook per render): twenty
clients at once had each kernel fight nineteen others for the cores, so every page took a minute and a half.

A page's kernel gets KERNEL_START_S to answer, as a notebook's does under papermill (pipeline/execute.py): Voilà's
60 s is passed on a busy 2-core machine, and Voilà renders the page in a task whose failure nobody awaits, so a
kernel that answered late left the page loading forever, a heartbeat every 10 s (measured: the kernel SIGSTOPped
for 65 s; the suite's browser test hung so in CI). voila_app.py ends such a page with the error instead. A cell's
outputs may trail its reply by IOPUB_S, not nbclient's 4 s, past which nbclient stops waiting for them. The page's
executor waits for each reply through pipeline/kernel_client.py's repolling client: with jupyter_client's own, a
reply whose socket wake-up was consumed left a page loading forever beside an idle kernel (the suite's reload test
hung so in CI).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from pathlib import Path

from openrlhf_tis.pipeline.execute import IOPUB_S, KERNEL_START_S
from openrlhf_tis.pipeline.kernel_client import CLIENT_CLASS

HOST = "127.0.0.1"
JUPYTER_DIR = Path(__file__).resolve().parent / "jupyter"
TEMPLATE = "openrlhf_tis"
# The two settings jupyter_server's ServerApp hands its handlers, read by JupyterHandler.check_host: a Host header
# must be a loopback address or one of these names.
LOCAL_ONLY: dict[str, object] = {"allow_remote_access": False, "local_hostnames": ["localhost"]}
CULL_IDLE_S = 300  # a kernel idle this long with no page connected is shut down; checked every CULL_INTERVAL_S
CULL_INTERVAL_S = 60
RENDERS = max(1, len(os.sched_getaffinity(0)))  # pages rendered at once: a render keeps about one core busy


def port_in_use(port: int, host: str = HOST) -> bool:
    """Whether something already listens on (or holds) `host:port`: binding it is what the server would do."""
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def voila_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's environment) with the fork's template directory first on JUPYTER_PATH."""
    env = dict(os.environ if base is None else base)
    env["JUPYTER_PATH"] = os.pathsep.join(p for p in (os.fspath(JUPYTER_DIR), env.get("JUPYTER_PATH")) if p)
    return env


def voila_args(notebook: str | os.PathLike, port: int) -> list[str]:
    """Voilà's command line (after `voila`) serving `notebook` alone on HOST:`port`, failing rather than moving to
    another port; an error in a cell shows its traceback on the page (the page is the only place a user looks)."""
    return [os.fspath(notebook), "--no-browser", f"--Voila.ip={HOST}", f"--port={port}", "--Voila.port_retries=0",
            f"--template={TEMPLATE}", "--VoilaConfiguration.show_tracebacks=True",
            f"--MappingKernelManager.cull_idle_timeout={CULL_IDLE_S}",
            f"--MappingKernelManager.cull_interval={CULL_INTERVAL_S}",
            f"--VoilaExecutor.startup_timeout={KERNEL_START_S}", f"--VoilaExecutor.iopub_timeout={IOPUB_S}",
            f"--AsyncKernelManager.client_class={CLIENT_CLASS}"]
