"""One response as HTML, each token coloured by how much the trainer disagrees with the rollout engine.

The colour is the log-ratio log π_θ − log μ (train_logprob − rollout_logprob) on a diverging scale:
white at 0, blue where the trainer finds the token less likely than vLLM did, red where more likely,
clamped symmetrically at ±clamp so that one absurd token does not wash out the rest. The scale is a
straight line in sRGB, so the legend can be a CSS gradient that matches the spans exactly.

Every token is `<span class="tok" ...>` (the browser test and the explorer rely on that class; nothing
else in the markup has a class starting with "tok", so counting `class="tok` counts tokens) with a
hover `title` giving μ, π_old and π_θ as probabilities, the raw and final IS weight and the mask
reason, and in a routing-replay run the MoE layers whose engine and trainer top-k sets differed at the token.
Extra classes: `masked` (struck through and outlined), `off` (outside the explorer's filters:
uncoloured, grey), `focus` (the token a worst-token click jumped to), `rdiff` (its MoE routing differed in some
layer: underlined purple). Pure functions of their input.
"""

from __future__ import annotations

import html
import math
from collections.abc import Collection
from typing import Any

import pandas as pd

from openrlhf_tis.runs.schema import MASK_REASONS

DEFAULT_CLAMP = 0.5
"""|log-ratio| at which the colour saturates: a factor e^0.5 ≈ 1.65, beyond TIS's usual bound of 2 only just."""
NEGATIVE_RGB = (33, 102, 172)  # trainer less likely than the rollout (blue)
POSITIVE_RGB = (178, 24, 43)  # trainer more likely than the rollout (red)
NO_RATIO_COLOUR = "#cccccc"  # a non-finite log-prob on either side: no ratio to colour
_DARK_BACKGROUND = 0.6  # beyond this share of the scale the text turns white to stay readable

_STYLE = """<style>
.mm-view {font-family: monospace; white-space: pre-wrap; line-height: 1.7; font-size: 13px}
.mm-view .tok {border-radius: 2px; padding: 0 1px}
.mm-view .tok.masked {text-decoration: line-through; outline: 1px dashed #222; outline-offset: -1px}
.mm-view .tok.off {color: #999}
.mm-view .tok.focus {outline: 2px solid #000; outline-offset: 0}
.mm-view .tok.rdiff {box-shadow: inset 0 -3px 0 #7b3294}
.mm-prompt {font-family: monospace; white-space: pre-wrap; font-size: 13px; color: #333; background: #f4f4f4;
             border-left: 3px solid #999; padding: 2px 6px; margin: 4px 0}
.mm-legend {font-family: sans-serif; font-size: 12px; margin: 4px 0}
.mm-legend .bar {display: inline-block; width: 160px; height: 12px; vertical-align: middle; margin: 0 4px;
                  border: 1px solid #888}
</style>"""


def _scale(log_ratio: float, clamp: float) -> float:
    """log_ratio / clamp clipped to [-1, 1]."""
    return max(-1.0, min(1.0, log_ratio / clamp))


def log_ratio_colour(log_ratio: float, clamp: float = DEFAULT_CLAMP) -> str:
    """Background colour (#rrggbb) of a token: white blended towards blue (< 0) or red (> 0) by |ratio| / clamp."""
    if not math.isfinite(log_ratio):
        return NO_RATIO_COLOUR
    t = _scale(log_ratio, clamp)
    end = POSITIVE_RGB if t > 0 else NEGATIVE_RGB
    rgb = (round(255 + abs(t) * (channel - 255)) for channel in end)
    return "#" + "".join(f"{c:02x}" for c in rgb)


def visible_text(text: Any, token_id: int) -> str:
    """Escaped token text with whitespace made visible: ↵ before a newline, ⇥ for a tab, ␍ for CR.

    Spaces stay spaces (the view keeps them with `white-space: pre-wrap`, and the background shows
    them); an empty token is ∅, a dump without text (no tokenizer) shows the id as ⟨id⟩.
    """
    if text is None or (isinstance(text, float) and math.isnan(text)):
        return f"⟨{int(token_id)}⟩"
    if text == "":
        return "∅"
    return html.escape(str(text)).replace("\r", "␍").replace("\t", "⇥").replace("\n", "↵\n")


def _prob(logprob: float) -> str:
    return f"{math.exp(logprob):.4g}" if math.isfinite(logprob) or logprob == -math.inf else "n/a"


def _reason(value: Any) -> str:
    if isinstance(value, str):
        return value
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "unknown"
    return MASK_REASONS.get(int(value), f"code {int(value)}")


def routing_layers(token: Any) -> list[int] | None:
    """The MoE layers whose engine and trainer top-k sets differed at the token; None where its routing was not
    compared (a dense model, a run without routing replay, an older dump, or rows without the column)."""
    layers = getattr(token, "routing_mismatch_layers", None)
    if layers is None or (isinstance(layers, float) and math.isnan(layers)):
        return None
    return [int(layer) for layer in layers]


def _routing_line(layers: list[int] | None) -> list[str]:
    if layers is None:
        return []
    if not layers:
        return ["MoE routing: engine and trainer agree in every layer"]
    return [f"MoE routing differs in {len(layers)} layer{'s' if len(layers) > 1 else ''}: "
            + ", ".join(map(str, layers))]


def token_title(token: Any) -> str:
    """Hover text of one token (a row with the schema's columns): probabilities, log-ratio, weights, reason, and the
    layers whose MoE routing differed when the dump compared it."""
    log_ratio = float(token.train_logprob) - float(token.rollout_logprob)
    return "\n".join([
        f"position {int(token.position)} · token id {int(token.token_id)}",
        f"μ (rollout)   p = {_prob(float(token.rollout_logprob))}",
        f"π_old         p = {_prob(float(token.old_logprob))}",
        f"π_θ (train)   p = {_prob(float(token.train_logprob))}",
        f"log π_θ − log μ = {log_ratio:+.4f}" if math.isfinite(log_ratio) else "log π_θ − log μ = n/a",
        f"IS weight raw = {float(token.is_weight_raw):.4g}, final = {float(token.is_weight):.4g}",
        f"mask: {_reason(token.mask_reason)}",
        *_routing_line(routing_layers(token)),
    ])


def token_span(token: Any, clamp: float = DEFAULT_CLAMP, active: bool = True, focus: bool = False) -> str:
    """One `<span class="tok">`; `token` is a row (attribute access) with the schema's columns."""
    reason = _reason(token.mask_reason)
    classes = ["tok"]
    if reason != "kept":
        classes.append("masked")
    if focus:
        classes.append("focus")
    if routing_layers(token):
        classes.append("rdiff")
    style = ""
    if active:
        log_ratio = float(token.train_logprob) - float(token.rollout_logprob)
        colour = log_ratio_colour(log_ratio, clamp)
        dark = math.isfinite(log_ratio) and abs(_scale(log_ratio, clamp)) > _DARK_BACKGROUND
        style = f' style="background:{colour}{";color:#fff" if dark else ""}"'
    else:
        classes.append("off")
    title = html.escape(token_title(token), quote=True)
    return (f'<span class="{" ".join(classes)}" data-pos="{int(token.position)}" title="{title}"{style}>'
            f"{visible_text(token.token_text, token.token_id)}</span>")


def legend_html(clamp: float = DEFAULT_CLAMP, routing: bool = False) -> str:
    """The colour scale and the meaning of the marks, as one line of HTML; `routing`: also the MoE routing mark."""
    stops = ", ".join(log_ratio_colour(x * clamp, clamp) for x in (-1, 0, 1))
    moe = ('<span style="box-shadow: inset 0 -3px 0 #7b3294">underlined purple</span>: the engine and the trainer '
           "routed it to other experts in some MoE layer; " if routing else "")
    return (f'<div class="mm-legend">log π_θ − log μ: −{clamp:g}'
            f'<span class="bar" style="background:linear-gradient(to right, {stops})"></span>+{clamp:g} '
            f"(blue: the trainer finds the token less likely than the rollout, red: more likely; clamped); "
            f'<span style="background:{NO_RATIO_COLOUR}">&nbsp;grey&nbsp;</span>: no finite log-prob; '
            f"<s>struck through</s>: masked; {moe}hover a token for μ, π_old, π_θ, IS weights, mask reason"
            f"{', routing' if routing else ''}</div>")


def render_response(
    tokens: pd.DataFrame,
    clamp: float = DEFAULT_CLAMP,
    active: Collection[int] | None = None,
    focus: int | None = None,
    header: str = "",
    prompt: str | None = None,
) -> str:
    """A response (its token rows in position order) as HTML: style, legend, optional header, the prompt, the spans.

    active: positions that pass the caller's filters (None: all); the others are drawn uncoloured.
    focus: a position to outline. header: plain text shown above the tokens (escaped here). prompt: the text the
    response answers, shown above it (escaped, whitespace kept).
    """
    rows = tokens.sort_values("position", kind="stable") if len(tokens) else tokens
    spans = "".join(
        token_span(t, clamp, active=active is None or int(t.position) in active, focus=int(t.position) == focus)
        for t in rows.itertuples(index=False)
    )
    head = f'<div class="mm-legend"><b>{html.escape(header)}</b></div>' if header else ""
    if prompt is not None:
        head += f'<div class="mm-prompt" title="prompt">{html.escape(prompt)}</div>'
    routing = "routing_mismatch_layers" in rows and bool(rows["routing_mismatch_layers"].notna().any())
    return f'{_STYLE}{legend_html(clamp, routing)}{head}<div class="mm-view">{spans}</div>'
