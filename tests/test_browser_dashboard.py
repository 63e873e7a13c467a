"""The dashboard as a person uses it: `python -m openrlhf_tis.dashboard.cli ROOT --port P` serving on 127.0.0.1,
opened in headless Chromium (tests/_browser.py) while the run store under ROOT changes: first missing (a notice),
then holding a run in progress and a run without token dumps, then the first run logging and dumping a new step.
The served HTML names no external asset and the browser fetched nothing from anywhere but the local server.
Served on a root that already holds runs, the first screen is the runs table, its headers over their columns.
Reloading the page ten times leaves one kernel alive, the current page's: each page frees its kernel as it goes.
"""

from __future__ import annotations

import sys
import time
import urllib.error
import urllib.request

import pytest
from _browser import (
    WAIT_S,
    chromium,
    external_assets,
    free_port,
    jupyter_env,
    page_text,
    requested_urls,
    served,
    server_state,
)
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait
from test_dashboard import write_step

from openrlhf_tis.runs import RunWriter


@pytest.fixture()
def server(tmp_path):
    """(url, runs root, log, server process) of the dashboard over a root that does not exist yet."""
    port, root, log = free_port(), tmp_path / "runs", tmp_path / "dashboard.log"
    argv = [sys.executable, "-m", "openrlhf_tis.dashboard.cli", str(root), "--port", str(port)]
    with served(argv, port, log, jupyter_env(tmp_path / "jupyter"), tmp_path) as process:
        yield f"http://127.0.0.1:{port}/", root, log, process


@pytest.fixture()
def driver(tmp_path):
    with chromium(tmp_path / "chromium-profile") as browser:
        yield browser


def _wait(browser, what: str, condition, log) -> None:
    try:
        WebDriverWait(browser, WAIT_S, poll_frequency=0.2).until(condition)
    except TimeoutException:
        page = browser.execute_script("return document.body ? document.body.innerText : ''")
        pytest.fail(f"{what}: not seen after {WAIT_S} s; page text:\n{page[-2000:]}\nserver log:\n"
                    f"{log.read_text()[-2000:]}")


def _load(browser, server, reload: bool = False) -> None:
    """Open (or reload) the dashboard's page; a load past the browser's bound fails with where the server waits."""
    url, _, log, process = server
    try:
        browser.refresh() if reload else browser.get(url)
    except TimeoutException:
        pytest.fail(f"the page did not load within the browser's bound; {server_state(process, log)}")


def _run_rows(browser) -> list[list[str]]:
    return browser.execute_script("""
        return [...document.querySelectorAll('table.mm-runs tbody tr')].map(
            tr => [...tr.querySelectorAll('td')].map(td => td.textContent.trim()));""")


def _first_screen(browser) -> dict | None:
    """What the page shows without a click: the selected tab's title, whether the runs table is displayed, and
    per column the [left, right] of the header's text and of each cell's (None before the table is in the page)."""
    return browser.execute_script("""
        const table = document.querySelector('table.mm-runs');
        if (!table) return null;
        const box = cell => { const range = document.createRange(); range.selectNodeContents(cell);
                              const r = range.getBoundingClientRect(); return [r.left, r.right]; };
        const rows = [...table.querySelectorAll('tr')].map(tr => [...tr.querySelectorAll('th, td')].map(box));
        return {tab: document.querySelector('.lm-TabBar-tab.lm-mod-current')?.textContent.trim() ?? null,
                shown: table.offsetParent !== null && table.getBoundingClientRect().height > 0,
                columns: rows[0].map((_, i) => rows.map(row => row[i]))};""")


def _off_their_columns(columns: list[list[list[float]]]) -> list[int]:
    """The columns whose header and cells share neither their text's left edge nor its right edge (1 px slack)."""
    def lined_up(edges: list[float]) -> bool:
        return max(edges) - min(edges) <= 1

    return [i for i, texts in enumerate(columns)
            if not (lined_up([left for left, _ in texts]) or lined_up([right for _, right in texts]))]


def _visible_tokens(browser) -> list[str]:
    return browser.execute_script(
        "return [...document.querySelectorAll('span.tok')].filter(s => s.offsetParent).map(s => s.textContent);")


def _options(browser, label: str) -> tuple[list[str], str | None]:
    """(option texts, selected text) of the visible dropdown labelled `label`, read in one go (a reload replaces
    the explorer's widgets, so element handles can go stale between two reads)."""
    return tuple(browser.execute_script("""
        const box = [...document.querySelectorAll('div.widget-dropdown')].find(
            d => d.offsetParent && d.querySelector('label')?.textContent.trim() === arguments[0]);
        if (!box) return [[], null];
        const select = box.querySelector('select');
        return [[...select.options].map(o => o.text), select.selectedOptions[0]?.text ?? null];""", label))


def _picker(browser, label: str) -> Select:
    return Select(browser.find_element(By.XPATH, f"//div[contains(@class, 'widget-dropdown')]"
                                                 f"[label[normalize-space()='{label}']]//select"))


def _click(browser, xpath: str) -> None:
    browser.find_element(By.XPATH, xpath).click()


def _tab(browser, title: str) -> None:
    _click(browser, f"//li[contains(@class, 'TabBar-tab')][normalize-space()='{title}']")


def _reload(browser) -> None:
    _click(browser, "//button[normalize-space()='reload']")


@pytest.mark.browser
@pytest.mark.timeout(300)
def test_dashboard_in_headless_chromium(server, driver):
    url, root, log, process = server
    page = page_text(url, process, log)
    assert "jupyter-widgets" in page and external_assets(page, int(url.rsplit(":", 1)[1].strip("/"))) == []

    _load(driver, server)
    _wait(driver, "the missing-root notice", lambda b: "does not exist" in b.find_element(By.CLASS_NAME, "mm-notice")
          .text, log)

    for step in (1, 2):
        write_step(root / "live", step)
    RunWriter(root / "nodumps").append_metrics(1, {"reward": 0.25})
    _reload(driver)
    _wait(driver, "the two runs", lambda b: [r[:3] for r in _run_rows(b)] == [["live", "2", "2"],
                                                                               ["nodumps", "1", "1"]], log)
    assert driver.find_element(By.CLASS_NAME, "mm-notice").text == ""

    _tab(driver, "tokens")  # the newest run with dumps at its last step, first sample: tokens t0 t1 t2
    _wait(driver, "sample 0's tokens", lambda b: _visible_tokens(b) == ["t0", "t1", "t2"], log)
    assert _options(driver, "step") == (["1", "2"], "2")

    write_step(root / "live", 3, samples=(1, 2))  # the run goes on
    _reload(driver)
    _wait(driver, "step 3 in the table", lambda b: _run_rows(b)[0][:4] == ["live", "3", "3", "3"], log)
    # the new step is in the step picker and the view stayed where it was
    _wait(driver, "step 3 in the step picker", lambda b: _options(b, "step") == (["1", "2", "3"], "2"), log)

    _picker(driver, "run").select_by_visible_text("nodumps")
    _wait(driver, "the no-dumps notice", lambda b: "No token dumps" in b.find_element(By.TAG_NAME, "body").text, log)

    _tab(driver, "compare")  # curves and bucket figures, then the final table of both runs
    _wait(driver, "the comparison", lambda b: b.execute_script(
        "return [...document.querySelectorAll('img')].filter(i => i.offsetParent && i.naturalWidth > 0).length")
        >= 2 and "nodumps" in b.find_element(By.TAG_NAME, "body").text, log)

    urls = requested_urls(driver)
    local = [u for u in urls if u.startswith((url, url.replace("http://", "ws://")))]
    assert any(u.startswith("ws://") and "/api/kernels/" in u for u in local), local  # the live kernel
    assert sorted(set(urls) - set(local)) == []


@pytest.mark.browser
@pytest.mark.timeout(300)
def test_the_first_screen_is_the_runs_table(server, driver):
    """Regression: the page opened on a tab bar with no tab selected over an empty box, and once the runs tab was
    clicked the table's headers sat right-aligned over left-aligned cells."""
    url, root, log, _ = server
    for step in (1, 2):
        write_step(root / "live", step)
    RunWriter(root / "nodumps").append_metrics(1, {"reward": 0.25})
    _load(driver, server)  # and no click from here on
    _wait(driver, "the runs table on the first screen", lambda b: (_first_screen(b) or {}).get("shown"), log)
    screen = _first_screen(driver)
    assert screen["tab"] == "runs" and [r[0] for r in _run_rows(driver)] == ["live", "nodumps"]
    assert _off_their_columns(screen["columns"]) == [], screen["columns"]
    intro = driver.find_element(By.CSS_SELECTOR, ".jp-MarkdownOutput").text
    assert "folder" in intro and "root" not in intro  # RUNS_ROOT is upper case; `root` was the parameter's name


def _page_kernel(browser) -> str:
    """The id of the kernel the page in `browser` runs on (Voilà's page config)."""
    return browser.execute_script("return JSON.parse(document.getElementById('jupyter-config-data').textContent)"
                                  ".kernelId")


def _alive(url: str, kernel: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}api/kernels/{kernel}", timeout=WAIT_S):
            return True
    except urllib.error.HTTPError as error:
        if error.code == 404:
            return False
        raise


@pytest.mark.browser
@pytest.mark.timeout(600)
def test_reloads_leave_one_kernel(server, driver):
    """Each load or reload used to start a kernel and free none (its shutdown POST was refused for
    a missing `_xsrf`), a few hundred MiB each."""
    url, _, log, _ = server
    kernels = []
    for _ in range(11):  # the first load and ten reloads
        _load(driver, server, reload=bool(kernels))
        # the notice is a widget: the page's widget manager, which frees the kernel on unload, is up
        _wait(driver, "the missing-root notice", lambda b: "does not exist" in b.find_element(
            By.CLASS_NAME, "mm-notice").text, log)
        kernels.append(_page_kernel(driver))
    assert len(set(kernels)) == 11  # a kernel per view
    deadline = time.monotonic() + WAIT_S
    while (alive := [k for k in kernels if _alive(url, k)]) != kernels[-1:] and time.monotonic() < deadline:
        time.sleep(1)
    assert alive == kernels[-1:], f"{len(alive)} of {len(kernels)} kernels alive:\n{log.read_text()[-2000:]}"
