"""The token explorer as a person sees it: notebooks/token_explorer.ipynb served by Voilà on 127.0.0.1 (as the
dashboard serves pages: dashboard/voila_server.py), opened in headless Chromium (tests/_browser.py), its tokens'
colours read back from screenshot pixels, and a sample picked through the browser. The test checks from the
browser's network log that the page's scripts and widget code all came from the local server, and nothing else.
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import numpy as np
import papermill
import pytest
from _browser import WAIT_S, chromium, free_port, jupyter_env, requested_urls, served
from PIL import Image
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait

from openrlhf_tis.dashboard.voila_server import voila_args, voila_env
from openrlhf_tis.pipeline.execute import notebook_path
from openrlhf_tis.runs import TokenDumpWriter

NOTEBOOK = notebook_path("token_explorer")
SCREENSHOT_DIR_ENV = "OPENRLHF_TIS_SCREENSHOT_DIR"

# The ends of the explorer's diverging scale (ColorBrewer RdBu): saturated at |log π_θ − log μ| >= clamp, which is
# 0.5 in the notebook, so a log-ratio of ±2 must paint exactly these; 0 paints white.
RED, BLUE, WHITE = (178, 24, 43), (33, 102, 172), (255, 255, 255)
TOLERANCE = 24  # max per-channel distance of a pixel that counts as one of those colours
MIN_SHARE = 0.4  # of a token box's pixels in its background colour (measured 0.64-0.79; the rest is glyphs)
STEP = 5
# sample id -> its response: (token text, log π_θ − log μ). The explorer opens at the first sample, 3.
SAMPLES = {
    3: [("Alpha", 2.0), (" beta", -2.0), (" GAMMA", 2.0), (" delta", -2.0), (" epsilon", 2.0)],
    7: [(" one", -2.0), (" two", 0.0), (" three", -2.0), (" four", 0.0)],
}


def expected_colour(log_ratio: float) -> tuple[int, int, int]:
    return RED if log_ratio > 0 else BLUE if log_ratio < 0 else WHITE


@pytest.fixture()
def explorer_notebook(tmp_path) -> Path:
    """A run store with one dumped step, and the explorer notebook with `run_dir` injected (not executed)."""
    rows = [(sample, position, text, ratio) for sample, tokens in SAMPLES.items()
            for position, (text, ratio) in enumerate(tokens)]
    sample, position, text, ratio = map(list, zip(*rows, strict=True))
    n = len(rows)
    rollout = np.full(n, -3.0)
    TokenDumpWriter(tmp_path / "run").write_step(STEP, {
        "sample_id": np.array(sample), "prompt_id": np.array(sample), "position": np.array(position),
        "token_id": np.arange(n) + 10, "token_text": text, "rollout_logprob": rollout, "old_logprob": rollout,
        "train_logprob": rollout + np.array(ratio), "is_weight_raw": np.ones(n), "is_weight": np.ones(n),
        "mask_reason": np.zeros(n, dtype=int), "advantage": np.zeros(n), "entropy": np.ones(n),
        "reward": np.zeros(n),
    })
    notebook = tmp_path / "token_explorer.ipynb"
    papermill.execute_notebook(NOTEBOOK, notebook, parameters={"run_dir": str(tmp_path / "run")}, prepare_only=True)
    return notebook


@pytest.fixture()
def voila_url(explorer_notebook, tmp_path):
    """(port, log file) of Voilà serving the notebook on a free local port; Jupyter's own dirs kept in tmp_path."""
    port = free_port()
    log = tmp_path / "voila.log"
    argv = [sys.executable, "-m", "voila", *voila_args(explorer_notebook, port)]
    with served(argv, port, log, voila_env(jupyter_env(tmp_path / "jupyter")), tmp_path):
        yield port, log


@pytest.fixture()
def driver(tmp_path):
    with chromium(tmp_path / "chromium-profile") as browser:
        yield browser


def _tokens(browser) -> list[tuple[str, float, float, float, float]]:
    """(text, left, top, right, bottom) of every token span, in viewport CSS pixels, after scrolling them into view."""
    return browser.execute_script("""
        const view = document.querySelector('.mm-view');
        if (!view) return [];
        view.scrollIntoView({block: 'center'});
        return [...view.querySelectorAll('span.tok')].map(s => {
            const r = s.getBoundingClientRect();
            return [s.textContent, r.left, r.top, r.right, r.bottom];
        });""")


def _wait_for_sample(browser, sample: int, log: Path) -> list[tuple[str, float, float, float, float]]:
    texts = [text for text, _ in SAMPLES[sample]]
    try:
        WebDriverWait(browser, WAIT_S, poll_frequency=0.2).until(lambda b: [t[0] for t in _tokens(b)] == texts)
    except TimeoutException:
        shown = [t[0] for t in _tokens(browser)]
        page = browser.execute_script("return document.body ? document.body.innerText : ''")
        pytest.fail(f"sample {sample}'s tokens {texts} not shown after {WAIT_S} s (shown: {shown}); page text:\n"
                    f"{page[-2000:]}\nvoila log:\n{log.read_text()[-2000:]}")
    return _tokens(browser)


def _screenshot(browser, path: Path) -> np.ndarray:
    browser.save_screenshot(str(path))
    if os.environ.get(SCREENSHOT_DIR_ENV):
        target = Path(os.environ[SCREENSHOT_DIR_ENV])
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, target / path.name)
    return np.asarray(Image.open(path).convert("RGB")).astype(int)


def _share(image: np.ndarray, box: tuple[int, int, int, int], colour: tuple[int, int, int]) -> float:
    """Share of the box's pixels within TOLERANCE of `colour`."""
    x0, y0, x1, y1 = box
    region = image[y0:y1, x0:x1]
    assert region.size, f"empty token box {box}"
    return float((np.abs(region - np.array(colour)).max(axis=-1) <= TOLERANCE).mean())


def _assert_token_colours(image: np.ndarray, tokens, sample: int, scale: float) -> None:
    """Each span's background is its log-ratio's colour (a good share of its pixels, the rest is glyphs) and no
    pixel of it is the other end of the scale."""
    for (text, left, top, right, bottom), (_, ratio) in zip(tokens, SAMPLES[sample], strict=True):
        # 1 px inside the box: a span starting or ending at a fractional pixel blends into its neighbour there
        box = (int(left * scale) + 1, int(top * scale) + 1, int(right * scale) - 1, int(bottom * scale) - 1)
        colour = expected_colour(ratio)
        shares = {name: _share(image, box, c) for name, c in (("red", RED), ("blue", BLUE), ("white", WHITE))}
        own = {RED: "red", BLUE: "blue", WHITE: "white"}[colour]
        assert shares[own] > MIN_SHARE, f"sample {sample} token {text!r} (log-ratio {ratio:+}): {shares}"
        assert all(share == 0 for name, share in shares.items() if name not in (own, "white")), (
            f"sample {sample} token {text!r} (log-ratio {ratio:+}) shows another end of the scale: {shares}")


@pytest.mark.browser
@pytest.mark.timeout(240)
def test_explorer_in_headless_chromium(voila_url, driver, tmp_path):
    port, log = voila_url
    driver.get(f"http://127.0.0.1:{port}/")
    tokens = _wait_for_sample(driver, 3, log)
    step_picker = driver.find_element(By.XPATH, "//div[contains(@class, 'widget-dropdown')]"
                                                "[label[normalize-space()='step']]//select")
    assert Select(step_picker).first_selected_option.text == str(STEP)
    shot = _screenshot(driver, tmp_path / "token_explorer_sample3.png")
    scale = shot.shape[1] / driver.execute_script("return window.innerWidth")
    _assert_token_colours(shot, tokens, 3, scale)

    sample_picker = driver.find_element(By.XPATH, "//div[contains(@class, 'widget-dropdown')]"
                                                  "[label[normalize-space()='sample']]//select")
    assert [option.text for option in Select(sample_picker).options] == ["3", "7"]
    Select(sample_picker).select_by_visible_text("7")
    tokens = _wait_for_sample(driver, 7, log)
    shot = _screenshot(driver, tmp_path / "token_explorer_sample7.png")
    _assert_token_colours(shot, tokens, 7, scale)

    # Everything the page ran came from the local server, and nothing came from anywhere else.
    urls = requested_urls(driver)
    local = [u for u in urls if u.startswith((f"http://127.0.0.1:{port}/", f"ws://127.0.0.1:{port}/"))]
    assert any("/voila/labextensions/@jupyter-widgets/" in u for u in local), local  # the widget manager's JS
    assert any(u.startswith("ws://") and "/api/kernels/" in u for u in local), local  # the live kernel
    assert sorted(set(urls) - set(local)) == []
