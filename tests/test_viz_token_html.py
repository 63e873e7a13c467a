"""token_html: colours computed by hand, escaping, hover titles, marks; parsed back with html.parser."""

from __future__ import annotations

import math
from html.parser import HTMLParser

import numpy as np
import pandas as pd
import pytest

from openrlhf_tis.viz.token_html import NO_RATIO_COLOUR, log_ratio_colour, render_response, visible_text


class Spans(HTMLParser):
    """Every <span class="tok ..."> of a rendered response: its classes, attributes and text."""

    def __init__(self, markup: str):
        super().__init__()
        self.spans: list[dict] = []
        self._open: dict | None = None
        self.feed(markup)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "span" and "tok" in attrs.get("class", "").split():
            self._open = {"classes": set(attrs["class"].split()), "text": "", **attrs}

    def handle_data(self, data):
        if self._open is not None:
            self._open["text"] += data

    def handle_endtag(self, tag):
        if tag == "span" and self._open is not None:
            self.spans.append(self._open)
            self._open = None


def background(span: dict) -> str | None:
    style = span.get("style") or ""
    return next((part.split(":", 1)[1] for part in style.split(";") if part.startswith("background:")), None)


# Diverging scale by hand: white (255,255,255) moved a share t = clip(lr / clamp, -1, 1) of the way to
# red (178, 24, 43) for t > 0 or blue (33, 102, 172) for t < 0, each channel rounded.
@pytest.mark.parametrize(("lr", "clamp", "expected"), [
    (0.0, 0.5, "#ffffff"),
    (0.125, 0.5, "#ecc5ca"),  # t = 0.25: 255 - 0.25*77 = 235.75, 255 - 0.25*231 = 197.25, 255 - 0.25*212 = 202
    (-0.0625, 0.5, "#e3ecf5"),  # t = -0.125: 255 - 0.125*222 = 227.25, 235.875, 244.625
    (-0.1, 0.5, "#d3e0ee"),  # t = -0.2: 210.6, 224.4, 238.4
    (3.0, 0.5, "#b2182b"),  # clamped at +1
    (-3.0, 1.0, "#2166ac"),  # clamped at -1
    (0.5, 2.0, "#ecc5ca"),  # the same share of a wider scale
])
def test_colour_of_known_ratios(lr, clamp, expected):
    assert log_ratio_colour(lr, clamp) == expected


def test_non_finite_ratio_is_grey():
    assert log_ratio_colour(math.nan) == log_ratio_colour(math.inf) == NO_RATIO_COLOUR


def _tokens(**overrides) -> pd.DataFrame:
    base = {
        "position": [0, 1, 2], "token_id": [7, 8, 9], "token_text": ["<b>&\"x\"", "a\nb\tc", None],
        "rollout_logprob": np.float32([np.log(0.25), -1.0, np.nan]),
        "old_logprob": np.float32([np.log(0.2), -1.0, -1.0]),
        "train_logprob": np.float32([np.log(0.5), -0.875, -1.0]),
        "is_weight_raw": np.float32([0.8, 1.0, 1.0]), "is_weight": np.float32([0.8, 1.0, 0.0]),
        "mask_reason": ["bounds", "kept", "nan"],
    }
    return pd.DataFrame({**base, **overrides})


def test_spans_text_escaped_and_whitespace_visible():
    markup = render_response(_tokens())
    assert "<b>&" not in markup.split('class="mm-view"')[1]  # the token's markup is text, not tags
    spans = Spans(markup).spans
    assert [s["text"] for s in spans] == ['<b>&"x"', "a↵\nb⇥c", "⟨9⟩"]
    assert visible_text("", 3) == "∅" and visible_text("\r\n", 3) == "␍↵\n"


def test_title_holds_probabilities_weights_and_reason():
    first = Spans(render_response(_tokens())).spans[0]
    lines = first["title"].split("\n")
    assert lines[1].endswith("p = 0.25") and lines[2].endswith("p = 0.2") and lines[3].endswith("p = 0.5")
    assert lines[4] == f"log π_θ − log μ = +{math.log(2):.4f}"
    assert lines[5] == "IS weight raw = 0.8, final = 0.8"
    assert lines[6] == "mask: bounds"
    third = Spans(render_response(_tokens())).spans[2]
    assert "μ (rollout)   p = n/a" in third["title"] and "log π_θ − log μ = n/a" in third["title"]


def test_routing_layers_in_title_and_mark():
    layers = [np.array([3, 17], np.int16), np.array([], np.int16), None]
    spans = Spans(render_response(_tokens(routing_mismatch_layers=layers))).spans
    assert [s["title"].split("\n")[-1] for s in spans] == [
        "MoE routing differs in 2 layers: 3, 17", "MoE routing: engine and trainer agree in every layer",
        "mask: nan"]  # not compared: no routing line
    assert ["rdiff" in s["classes"] for s in spans] == [True, False, False]
    assert "underlined purple" in render_response(_tokens(routing_mismatch_layers=layers))
    assert "underlined purple" not in render_response(_tokens())  # a dense run's legend does not mention it
    assert "underlined purple" not in render_response(_tokens(routing_mismatch_layers=[None] * 3))


def test_marks_colours_filters_and_focus():
    spans = Spans(render_response(_tokens(), clamp=0.5, focus=1)).spans
    assert [background(s) for s in spans] == [log_ratio_colour(math.log(2), 0.5), "#ecc5ca", NO_RATIO_COLOUR]
    assert [("masked" in s["classes"], "focus" in s["classes"]) for s in spans] == [
        (True, False), (False, True), (True, False)]
    assert "#fff" in spans[0]["style"]  # log 2 > 0.6 of the scale: white text on the dark background
    off = Spans(render_response(_tokens(), active={1})).spans
    assert [("off" in s["classes"], background(s)) for s in off] == [(True, None), (False, "#ecc5ca"), (True, None)]
    assert [s["data-pos"] for s in off] == ["0", "1", "2"]


def test_legend_matches_the_scale_and_header_is_escaped():
    markup = render_response(_tokens().iloc[::-1], clamp=0.25, header="step <1>")
    assert "linear-gradient(to right, #2166ac, #ffffff, #b2182b)" in markup and "−0.25" in markup
    assert "step &lt;1&gt;" in markup
    assert [s["data-pos"] for s in Spans(markup).spans] == ["0", "1", "2"]  # drawn in position order
