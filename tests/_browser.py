"""What the browser tests share: a local server started and awaited, Debian's headless Chromium, and the checks
that a page fetched nothing from outside 127.0.0.1.

The browser is Debian's chromium driven through Debian's /usr/bin/chromedriver (an explicit Service: selenium
never looks for or downloads a driver or a browser build); scripts/setup_env.sh installs both with apt-get, and
the tests skip only where they are absent. Chromium resolves no host but 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
WAIT_S = 60  # bound of every wait: server start, an element appearing, a widget change landing
PAGE_LOAD_S = 3 * WAIT_S  # a page's load (see chromium)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def jupyter_env(directory: Path) -> dict[str, str]:
    """This environment with Jupyter's config, data and runtime dirs inside `directory` (nothing from ~), and
    Python's fault handler on, so that a kernel sent SIGABRT prints every thread's stack into the server's log."""
    return {**os.environ, "JUPYTER_CONFIG_DIR": str(directory / "config"), "JUPYTER_DATA_DIR": str(directory / "data"),
            "JUPYTER_RUNTIME_DIR": str(directory / "runtime"), "JUPYTER_PLATFORM_DIRS": "1",
            "PYTHONFAULTHANDLER": "1"}


@contextlib.contextmanager
def served(argv: Sequence[str], port: int, log: Path, env: dict[str, str], cwd: Path) -> Iterator[subprocess.Popen]:
    """Run server `argv` until it listens on `port` (its output in `log`); SIGTERM it on the way out."""
    with log.open("wb") as out:
        server = subprocess.Popen(list(argv), cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + WAIT_S
        while not listening(port):
            assert server.poll() is None, f"server exited with {server.returncode}:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"server not listening after {WAIT_S} s:\n{log.read_text()[-3000:]}"
            time.sleep(0.2)
        yield server
    finally:
        server.send_signal(signal.SIGTERM)  # voila shuts its kernels down on the way out
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=15)


def descendants(pid: int) -> list[int]:
    """The PIDs of `pid`'s children, their children and so on (Linux /proc), parents first."""
    found, queue = [], [pid]
    while queue:
        parent = queue.pop(0)
        try:
            children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
        except OSError:
            continue
        found += [int(child) for child in children]
        queue += [int(child) for child in children]
    return found


def page_text(url: str, server: subprocess.Popen, log: Path) -> str:
    """The page at `url` read whole within PAGE_LOAD_S. A Voilà page sends nothing while its kernel starts and then
    streams as the kernel executes the notebook, with heartbeats in between, so a stuck kernel never times the socket
    out: past the bound the test fails with `server_state`."""
    reply: list = []

    def read() -> None:
        try:
            with urllib.request.urlopen(url, timeout=PAGE_LOAD_S) as response:
                reply.append(response.read().decode())
        except Exception as error:  # raised in the caller's thread below
            reply.append(error)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(PAGE_LOAD_S)
    if reply:
        if isinstance(reply[0], Exception):
            raise reply[0]
        return reply[0]
    pytest.fail(f"{url} not read whole in {PAGE_LOAD_S} s; {server_state(server, log)}")


def server_state(server: subprocess.Popen, log: Path) -> str:
    """What a test that waited in vain on the server says: the server's processes under `ps`, its asyncio tasks
    each with what it awaits (SIGUSR1, dashboard/waits.py), then the kernels' Python stacks and the server's threads
    (sent SIGABRT, printed by the fault handler that jupyter_env turns on), all from the server's log."""
    below = descendants(server.pid)
    table = subprocess.run(["ps", "-o", "pid,ppid,stat,etime,time,rss,args", "-p", ",".join(map(str, below))],
                           capture_output=True, text=True).stdout if below else "(no process under the server)\n"
    for pid, sig in [(server.pid, signal.SIGUSR1), *((pid, signal.SIGABRT) for pid in [*below, server.pid])]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        time.sleep(1.5)
    return (f"the server's processes:\n{table}server log: its tasks, the kernels' stacks and then the server's threads "
            f"last:\n{log.read_text()[-24000:]}")


@contextlib.contextmanager
def chromium(profile: Path) -> Iterator:
    """Headless Chromium recording its network log; skips the test where Debian's browser or driver is missing."""
    missing = [str(path) for path in (CHROMIUM, CHROMEDRIVER) if not path.exists()]
    if missing:
        pytest.skip(f"Debian's chromium / chromium-driver are not installed ({', '.join(missing)} missing); "
                    f"scripts/setup_env.sh installs them with apt-get where it can")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--no-first-run", "--no-proxy-server",
                f"--user-data-dir={profile}", "--window-size=1280,1000",
                "--force-device-scale-factor=1", "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    browser = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    # A Voilà page is the notebook executed by a fresh kernel before the HTML is sent: on 2 busy cores (the suite's
    # other worker, a real run) that alone took over 60 s once.
    browser.set_page_load_timeout(PAGE_LOAD_S)
    # Selenium's own HTTP client gives chromedriver 120 s per command: a reload that the page-load bound allows
    # outlived it once (CI, 2 busy cores), so the client waits for the browser's bound, not under it.
    browser.command_executor.client_config.timeout = PAGE_LOAD_S + WAIT_S
    try:
        yield browser
    finally:
        browser.quit()


def requested_urls(browser) -> list[str]:
    """Every http(s)/ws(s) URL the browser requested or opened a socket to since the last call."""
    urls = []
    for entry in browser.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
        elif message["method"] == "Network.webSocketCreated":
            urls.append(message["params"]["url"])
    return [url for url in urls if url.split(":", 1)[0] in ("http", "https", "ws", "wss")]


# An asset a page would fetch from elsewhere: a src/href attribute, a CSS url() or a JS import() of an absolute
# http(s) or protocol-relative URL. XML namespaces and links in comments are not fetched and do not match.
_EXTERNAL_ASSET = re.compile(
    r"""(?:\b(?:src|href)\s*=\s*["']?|url\(\s*["']?|import\(\s*["'])((?:https?:)?//[^"')\s>]+)""", re.IGNORECASE)


def external_assets(page: str, port: int) -> list[str]:
    """The URLs `page` would fetch from anywhere but the local server on `port`."""
    local = (f"http://127.0.0.1:{port}/", f"//127.0.0.1:{port}/")
    return sorted({url for url in _EXTERNAL_ASSET.findall(page) if not url.startswith(local)})
