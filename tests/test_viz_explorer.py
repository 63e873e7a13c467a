"""The token explorer tested as widgets (values changed programmatically, the HTML shown parsed back), its
step figure, and notebooks/token_explorer.ipynb executed by papermill."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from dataclasses import replace
from html import unescape

import ipywidgets as widgets
import nbformat
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from papermill.exceptions import PapermillExecutionError
from test_viz_token_html import Spans, background

from openrlhf_tis.params import ParameterError
from openrlhf_tis.pipeline.execute import WIDGET_VIEW, execute, export_html
from openrlhf_tis.runs import RunWriter, TokenDumpWriter
from openrlhf_tis.runs.layout import token_file
from openrlhf_tis.viz import explorer as explorer_module
from openrlhf_tis.viz.explorer import ExplorerParams, TokenExplorer, open_explorer
from openrlhf_tis.viz.token_html import NO_RATIO_COLOUR
from openrlhf_tis.viz.token_plots import prob_buckets, step_figure, subsample

CODES = {"kept": 0, "bounds": 1, "veto": 3, "nan": 4}
# step -> sample -> tokens (text, log μ, log π_θ, raw weight, final weight, mask reason). Log-probs are
# exact in float32, so the log-ratios (hence colours, clamp 0.5) are exact: +0.125 -> #ecc5ca,
# -0.0625 -> #e3ecf5, +2 -> saturated red #b2182b, -1.5 -> saturated blue #2166ac, 0 -> white.
TOKENS = {
    3: {
        1: [("Hi", -1.0, -0.875, 1.2, 1.2, "kept"),
            (" <x>", -3.0, -3.0625, 3.0, 2.0, "kept"),  # truncated: kept, weight < raw
            ("\n", -7.0, -5.0, 7.4, 0.0, "bounds"),
            ("!", math.nan, -1.0, 1.0, 0.0, "nan")],
        4: [("ok", -0.5, -0.5, 1.0, 1.0, "kept"),
            ("bad", -1.5, -3.0, 0.2, 0.0, "veto"),
            (" end", -0.25, -0.25, 1.0, 0.0, "veto")],
    },
    1: {
        0: [("a", -0.5, -0.5, 1.0, 1.0, "kept"), ("b", -2.0, -2.0, 1.0, 1.0, "kept")],
        1: [("c", -0.5, -0.25, 1.3, 1.3, "kept"), ("d", -0.5, -0.5, 1.0, 1.0, "kept"),
            ("e", -0.5, -0.5, 1.0, 1.0, "kept")],
    },
}


def _write_step(writer: TokenDumpWriter, step: int) -> None:
    rows = [(sample, position, *token) for sample, tokens in TOKENS[step].items()
            for position, token in enumerate(tokens)]
    sample, position, text, rollout, train, raw, weight, reason = map(list, zip(*rows, strict=True))
    n = len(rows)
    # step 3 carries the prompts' text (a writer given it), step 1 does not (an older or text-less writer)
    prompts = {"prompt_text": [f"Q{s}: what is 2 + {s}?\n" for s in sample]} if step == 3 else {}
    if step == 3:  # sample 4 was generated one policy version back (async training); step 1's dump has no lag column
        prompts["lag"] = np.array([1 if s == 4 else 0 for s in sample])
        # an MoE run with routing replay: the layers whose routing differed (None: not compared); step 1 has none
        layers = {1: [[], [0, 2], [], None], 4: [[], [], [1]]}
        prompts["routing_mismatch_layers"] = np.array(
            [None if v is None else np.array(v, np.int16) for s in TOKENS[3] for v in layers[s]], dtype=object)
    writer.write_step(step, {**prompts,
        "sample_id": np.array(sample), "prompt_id": np.array(sample) // 2, "position": np.array(position),
        "token_id": np.arange(n) + 100, "token_text": text, "rollout_logprob": np.array(rollout),
        "old_logprob": np.array(rollout), "train_logprob": np.array(train), "is_weight_raw": np.array(raw),
        "is_weight": np.array(weight), "mask_reason": np.array([CODES[r] for r in reason]),
        "advantage": np.full(n, 0.5), "entropy": np.ones(n), "reward": np.array(sample, dtype=float),
    })


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """runs/a: token dumps at steps 1 and 3; runs/b: metrics only (trained without token dumps)."""
    root = tmp_path_factory.mktemp("runs")
    writer = TokenDumpWriter(root / "a")
    for step in TOKENS:
        _write_step(writer, step)
    RunWriter(root / "b").append_metrics(1, {"rollout/reward_mean": 0.5})
    return root


def shown(ex: TokenExplorer) -> list[dict]:
    return Spans(ex.response.value).spans


def active(ex: TokenExplorer) -> list[int]:
    return [int(s["data-pos"]) for s in shown(ex) if "off" not in s["classes"]]


def test_dom_contract_and_first_view(root):
    ex = TokenExplorer(root / "a")
    assert isinstance(ex.step, widgets.Dropdown) and ex.step.description == "step"
    assert isinstance(ex.sample, widgets.Dropdown) and ex.sample.description == "sample"
    assert ex.step.options == (("1", 1), ("3", 3)) and ex.step.value == 3  # opens at the last dumped step
    assert ex.sample.options == (("1", 1), ("4", 4)) and ex.sample.value == 1
    spans = shown(ex)
    assert [s["text"] for s in spans] == ["Hi", " <x>", "↵\n", "!"]
    assert [background(s) for s in spans] == ["#ecc5ca", "#e3ecf5", "#b2182b", NO_RATIO_COLOUR]
    assert ["masked" in s["classes"] for s in spans] == [False, False, True, True]
    assert "mask: bounds" in spans[2]["title"] and "IS weight raw = 7.4, final = 0" in spans[2]["title"]
    assert "step 3 · sample 1 · 4 tokens" in ex.response.value and "reward 1" in ex.response.value
    prompt = ex.response.value.index('<div class="mm-prompt" title="prompt">Q1: what is 2 + 1?\n</div>')
    assert prompt < ex.response.value.index('class="tok')  # the prompt above the response
    assert ex.response.value.count('class="tok') == 4  # only token spans have a class starting with "tok"
    assert bytes(ex.plots.value).startswith(b"\x89PNG") and ex.notice.value == ""


def test_change_sample_and_step(root):
    ex = TokenExplorer(root / "a")
    ex.sample.value = 4
    assert [(s["text"], background(s)) for s in shown(ex)] == [("ok", "#ffffff"), ("bad", "#2166ac"),
                                                               (" end", "#ffffff")]
    ex.step.value = 1  # step 1 did not dump sample 4: its first sample is shown
    assert ex.sample.options == (("0", 0), ("1", 1)) and ex.sample.value == 0
    assert "this dump does not hold the prompt&#x27;s text" in ex.response.value
    assert [s["text"] for s in shown(ex)] == ["a", "b"]
    ex.select(sample=1)
    ex.step.value = 3  # sample 1 is dumped at both steps: it stays, with step 3's tokens
    assert ex.sample.value == 1 and [s["text"] for s in shown(ex)][0] == "Hi"
    ex.select(step=1, sample=1)
    assert [s["text"] for s in shown(ex)] == ["c", "d", "e"] and ex.step.value == 1


@pytest.mark.parametrize(("show", "sample1", "sample4", "step_rows"), [
    ("all", [0, 1, 2, 3], [0, 1, 2], 7),
    ("masked", [2, 3], [1, 2], 4),
    ("truncated", [1], [], 1),
    ("veto", [], [1, 2], 2),
    ("nan", [3], [], 1),
    ("routing", [1], [2], 2),
])
def test_show_filter(root, show, sample1, sample4, step_rows):
    ex = TokenExplorer(root / "a")
    ex.show.value = show
    assert active(ex) == sample1 and len(ex.step_tokens) == step_rows
    ex.sample.value = 4
    assert active(ex) == sample4
    assert len(shown(ex)) == 3  # filtered-out tokens stay as uncoloured context


def test_routing_marks_titles_and_header(root):
    ex = TokenExplorer(root / "a")
    spans = shown(ex)
    assert ["rdiff" in s["classes"] for s in spans] == [False, True, False, False]
    assert spans[1]["title"].endswith("MoE routing differs in 2 layers: 0, 2")
    assert spans[0]["title"].endswith("MoE routing: engine and trainer agree in every layer")
    assert "MoE routing" not in spans[3]["title"]  # not compared: no routing line
    assert "MoE routing differed on 1 of 3 tokens" in ex.response.value and "underlined purple" in ex.response.value
    ex.select(step=1, sample=1)  # a dump without routing: no mark, no line, no legend entry
    assert not any("rdiff" in s["classes"] or "MoE" in s["title"] for s in shown(ex))
    assert "MoE routing" not in ex.response.value and "underlined purple" not in ex.response.value
    ex.show.value = "routing"
    assert active(ex) == [] and len(ex.step_tokens) == 0


def test_lag_filter(root):
    ex = TokenExplorer(root / "a")
    ex.lag.value = (1, None)  # stale samples only: sample 4's three tokens
    assert active(ex) == [] and len(ex.step_tokens) == 3 and set(ex.step_tokens["sample_id"]) == {4}
    ex.lag.value = (0, 0)
    assert active(ex) == [0, 1, 2, 3] and len(ex.step_tokens) == 4
    ex.select(step=1, sample=0)  # a dump without the column reads lag 0: on-policy
    assert active(ex) == [0, 1]


def test_probability_range(root):
    ex = TokenExplorer(root / "a")
    ex.prob.value = (-2.0, 0.0)  # μ >= 0.01: e^-1 and e^-3 pass, e^-7 and NaN do not
    assert active(ex) == [0, 1]
    ex.prob.value = (-8.0, -2.5)  # μ <= 10^-2.5 (the slider's low end leaves the range open below)
    assert active(ex) == [2]
    ex.show.value = "masked"
    assert active(ex) == [2] and ex.step_tokens["position"].tolist() == [2]
    ex.prob.value = (ex.prob.min, ex.prob.max)  # whole range: no probability filter, NaN μ shown again
    assert active(ex) == [2, 3]


def test_worst_tokens_and_jump(root):
    ex = TokenExplorer(root / "a")
    assert [value for _, value in ex.worst.options] == [(1, 2), (4, 1), (1, 0), (1, 1), (4, 0), (4, 2)]
    assert ex.worst_tokens["log_ratio"].tolist()[:2] == [2.0, -1.5]
    first = ex.worst.options[0][0]
    assert first.lstrip().startswith("+2.000") and "bounds" in first and "'\\n'" in first
    assert " " not in first  # no-break spaces: a <select> would collapse plain ones
    assert ex.worst.value is None  # nothing chosen until the user chooses
    ex.worst.value = (4, 1)
    assert ex.sample.value == 4
    focus = [int(s["data-pos"]) for s in shown(ex) if "focus" in s["classes"]]
    assert focus == [1]
    ex.worst.value = (4, 2)  # same sample: only the outline moves
    assert [int(s["data-pos"]) for s in shown(ex) if "focus" in s["classes"]] == [2]
    ex.sample.value = 1  # a manual change clears the choice and the outline
    assert ex.worst.value is None and not [s for s in shown(ex) if "focus" in s["classes"]]
    ex.show.value = "masked"  # the list follows the filters; the NaN token has no ratio to rank
    assert [value for _, value in ex.worst.options] == [(1, 2), (4, 1), (4, 2)]


def test_every_query_is_one_step(root, monkeypatch):
    calls = []
    real = explorer_module.query_tokens

    def spy(run_dir, **kwargs):
        calls.append(kwargs)
        return real(run_dir, **kwargs)

    monkeypatch.setattr(explorer_module, "query_tokens", spy)
    ex = TokenExplorer(root / "a")
    ex.sample.value = 4
    ex.show.value = "veto"
    ex.step.value = 1
    ex.worst.value = ex.worst.options[0][1] if ex.worst.options else None
    assert calls and all(c["steps"][0] == c["steps"][1] for c in calls)
    assert [c["samples"] for c in calls if "token_text" in c["columns"] and "samples" in c] == [[1], [4], [0]]
    assert any(c.get("reasons") == ["veto"] for c in calls)  # the filter is pushed into the query


def test_runs_without_dumps_show_a_notice(root, tmp_path):
    ex = TokenExplorer(root / "b")
    assert "--logger.token_dump_steps" in ex.notice.value and str(root / "b") in ex.notice.value
    assert ex.body.layout.display == "none" and ex.step.options == ()
    missing = TokenExplorer(tmp_path / "nope")
    assert "does not exist" in missing.notice.value
    with pytest.raises(ParameterError, match="has no token dumps"):
        open_explorer(ExplorerParams(run_dir=str(root / "b"), step=1, clamp=0.5))


def test_run_dropdown_over_a_root(root):
    ex = TokenExplorer(root=root)
    assert [label for label, _ in ex.run.options] == ["a", "b"]
    assert ex.run.value == str(root / "b") and "--logger.token_dump_steps" in ex.notice.value  # newest: b
    ex.run.value = str(root / "a")
    assert ex.notice.value == "" and ex.body.layout.display is None and len(shown(ex)) == 4
    ex.run.value = str(root / "b")
    assert ex.body.layout.display == "none"


def test_version0_dump_opens(tmp_path):
    """A dump by an older writer (no token_text, no old_logprob, no schema metadata) still explores."""
    path = token_file(tmp_path / "old", 2)
    path.parent.mkdir(parents=True)
    pq.write_table(pa.table({
        "sample_id": [0, 0], "prompt_id": [0, 0], "position": [0, 1], "token_id": [42, 43],
        "rollout_logprob": [-1.0, -2.0], "train_logprob": [-1.0, -1.875], "is_weight_raw": [1.0, 1.0],
        "is_weight": [1.0, 1.0], "mask_reason": pa.array([0, 0], pa.int8()), "advantage": [0.0, 0.0],
        "entropy": [0.0, 0.0], "reward": [1.0, 1.0],
    }), path)
    ex = TokenExplorer(tmp_path / "old")
    spans = shown(ex)
    assert [(s["text"], background(s)) for s in spans] == [("⟨42⟩", "#ffffff"), ("⟨43⟩", "#ecc5ca")]
    assert "π_old         p = n/a" in spans[0]["title"]


def test_open_explorer_rejects_steps_and_samples_not_dumped(root):
    params = ExplorerParams(run_dir=str(root / "a"), step=2, clamp=0.5)
    with pytest.raises(ParameterError, match=r"dumped steps: \[1, 3\]"):
        open_explorer(params)
    with pytest.raises(ParameterError, match=r"dumped samples: \[0, 1\]"):
        open_explorer(replace(params, step=1, sample=4))
    assert open_explorer(replace(params, step=1, sample=1)).sample.value == 1


def test_explorer_keeps_torch_out():
    # torch doubles the kernel's heap and so every full garbage collection (token_plots docstring)
    code = "import sys, openrlhf_tis.viz.explorer; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_step_figure_pieces():
    # Buckets of μ at PROB_BUCKET_EDGES (1e-3, 1e-2, 0.1, 0.5, 0.9), lower edge inclusive.
    mu = np.array([5e-4, 1e-3, 0.05, 0.2, 0.5, 0.95])
    assert prob_buckets(np.log(mu) + 1e-12).tolist() == [0, 1, 2, 3, 4, 5]
    picked = subsample(100, 10)
    assert len(set(picked)) == 10 and picked.tolist() == subsample(100, 10).tolist() and picked.max() < 100
    assert subsample(5, 10).tolist() == [0, 1, 2, 3, 4]
    no_ratio = pd.DataFrame({"rollout_logprob": np.float32([np.nan]), "train_logprob": np.float32([-1.0]),
                             "mask_reason": ["nan"]})
    figure = step_figure(no_ratio)
    assert [t.get_text() for ax in figure.axes for t in ax.texts] == ["no token matches"] * 2
    assert "1 tokens (1 without finite log-probs)" in figure.get_suptitle()


def test_notebook_runs_under_papermill(root, tmp_path):
    out = execute("token_explorer", tmp_path / "out.ipynb", {"run_dir": str(root / "a"), "step": 1, "sample": 1})
    nb = nbformat.read(out, as_version=4)
    assert nb.cells[1].metadata.tags == ["parameters"]
    state = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    values = [str(w["state"].get("value", "")) for w in state.values()]
    response = next(v for v in values if 'class="tok' in v)
    assert "step 1 · sample 1 · 3 tokens" in response and len(Spans(response).spans) == 3
    assert any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in nb.cells[-1].outputs)


def test_notebook_refuses_unknown_parameter(root, tmp_path):
    with pytest.raises(PapermillExecutionError) as err:
        execute("token_explorer", tmp_path / "bad.ipynb", {"run_dir": str(root / "a"), "bogus": 1, "clamp": -1})
    assert err.value.ename == "ParameterError" and "ExplorerParams.from_notebook" in err.value.source
    assert "unknown parameter 'bogus'" in err.value.evalue and "clamp = -1: must be > 0" in err.value.evalue
    assert all(f"  {name} = " in err.value.evalue for name in ExplorerParams.spec())


def test_executed_notebook_and_its_html_show_the_sample_without_a_kernel(root, tmp_path):
    """A shared notebook or report shows what the live widget would: the tokens, both figures, the worst tokens."""
    out = execute("token_explorer", tmp_path / "out.ipynb", {"run_dir": str(root / "a"), "step": 3, "sample": 4})
    (output,) = [o for o in nbformat.read(out, as_version=4).cells[-1].outputs if WIDGET_VIEW in o.get("data", {})]
    static = output["data"]["text/html"]
    assert "step 3 · sample 4 · 3 tokens" in static and "Q4: what is 2 + 4?" in static
    assert [s["text"] for s in Spans(static).spans] == ["ok", "bad", " end"]
    html = export_html(out, tmp_path / "out.html").read_text()
    assert f'<script type="{WIDGET_VIEW}"' not in html and "unpkg.com" not in html  # no widget, no widget manager
    spans = Spans(html).spans
    assert [s["text"] for s in spans] == ["ok", "bad", " end"]
    assert html.index("Q4: what is 2 + 4?") < html.index('class="tok')  # the prompt, above the response
    assert [background(s) for s in spans] == ["#ffffff", "#2166ac", "#ffffff"]  # coloured as in the widget
    assert html.count('src="data:image/png;base64,') == 1  # the step figure: scatter and histograms in one image
    table = html.split("Worst tokens of the step", 1)[1].split("</table>", 1)[0]
    rows = [[unescape(cell) for cell in re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", row, re.DOTALL)]
            for row in re.findall(r"<tr[^>]*>(.*?)</tr>", table, re.DOTALL)]
    assert rows[0] == ["log π_θ − log μ", "sample", "position", "μ", "π_θ", "mask", "token"]
    # step 3's worst tokens by |log π_θ − log μ| (TOKENS): +2 ('\n', sample 1 pos 2), -1.5 ('bad', sample 4 pos 1)
    assert rows[1][:3] == ["+2.000", "1", "2"] and rows[1][-2:] == ["bounds", "'\\n'"]
    assert rows[2] == ["-1.500", "4", "1", "0.223", "0.0498", "veto", "'bad'"]


def test_a_run_without_dumps_exports_its_notice(root, tmp_path):
    out = execute("token_explorer", tmp_path / "b.ipynb", {"run_dir": str(root / "b")})
    assert "--logger.token_dump_steps" in export_html(out, tmp_path / "b.html").read_text()


def test_the_export_keeps_a_widget_s_rich_twin_and_drops_the_rest(tmp_path):
    from nbformat.v4 import new_code_cell, new_notebook, new_output

    bar = new_output("display_data", data={WIDGET_VIEW: {"model_id": "1"}, "text/plain": "steps:   0%|   | 0/6"})
    twin = new_output("display_data", data={WIDGET_VIEW: {"model_id": "2"}, "text/plain": "VBox()",
                                            "text/html": "<b>static twin</b>"})
    text = new_output("stream", name="stdout", text="a printed line\n")
    nb = new_notebook(cells=[new_code_cell("x", outputs=[bar, twin, text])],
                      metadata={"widgets": {"application/vnd.jupyter.widget-state+json": {"state": {}}}})
    nbformat.write(nb, tmp_path / "w.ipynb")
    html = export_html(tmp_path / "w.ipynb").read_text()
    assert "<b>static twin</b>" in html and "a printed line" in html
    assert "0/6" not in html and "VBox()" not in html and "widget-state" not in html
