"""The README's tables are checked against what they describe: the fork's flags against the training CLI's parser
(every flag the fork adds is in the table, every row is a flag, each default is the parser's), the metrics against
metric_names.py, and the study table against the committed results it is copied from (results/study/)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text(encoding="utf-8")


def header_and_rows(text: str, heading: str) -> tuple[list[str], list[list[str]]]:
    """The header and the rows (cells stripped, the rule left out) of the first table under `heading`."""
    section = text[text.index(heading):]
    lines = re.search(r"^\|.*?(?=^[^|]|\Z)", section, re.M | re.S).group(0).splitlines()
    cells = [[c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]] for line in lines]
    return cells[0], cells[2:]


def table_after(text: str, heading: str) -> list[list[str]]:
    """The rows of the first table under `heading`."""
    return header_and_rows(text, heading)[1]


@pytest.fixture(scope="module")
def parsers():
    from openrlhf_tis import patches
    from openrlhf_tis.cli.train_ppo_ray import build_parser
    from openrlhf_tis.patches.upstream_cli import upstream_parser

    patches.apply_platform_patches("cpu")
    return build_parser(), upstream_parser()


def fork_flags(full, upstream) -> dict[str, object]:
    """Flag -> default for every option the fork adds to upstream's parser, or whose choices it extends."""
    theirs = {a.dest: a for a in upstream._actions}
    flags = {}
    for action in full._actions:
        ours = action.dest not in theirs
        if ours or (action.choices and list(action.choices) != list(theirs[action.dest].choices or [])):
            flags[action.option_strings[0]] = action.default
    return flags


def rendered(default: object) -> str | None:
    """How the table writes a parser default; None: words of the table's choosing (the parser says None)."""
    return None if default is None else "off" if default is False else f"`{default}`"


def test_the_flag_table_is_the_parsers(parsers):
    from openrlhf_tis.correction.config import FLAG_PREFIX

    rows = {re.match(r"`(--[\w.]+)", flag).group(1): default for flag, default, _ in
            table_after(README, "## The fork's flags")}
    flags = fork_flags(*parsers)
    assert "--vllm.rollout_precision" in flags and "--ds.param_dtype" in flags and "--actor.pretrain" not in flags
    # one row for the correction: its fields are listed in docs/correction.md (next test)
    wanted = {f for f in flags if not f.startswith(FLAG_PREFIX)} | {FLAG_PREFIX + "preset"}
    assert set(rows) == wanted, (f"README flag table: add {sorted(wanted - set(rows))}; "
                                 f"not flags of the fork: {sorted(set(rows) - wanted)}")
    for flag, cell in rows.items():
        expected = rendered(flags[flag])
        if expected is None:
            assert not re.fullmatch(r"`[^`]*`", cell), f"{flag}: the parser's default is None, the table says {cell}"
        else:
            assert cell == expected, f"{flag}: default {cell} in the README, {expected} in the parser"


def test_every_correction_field_is_in_the_correction_guides_flag_table():
    import dataclasses

    from openrlhf_tis.correction.config import CorrectionConfig

    guide = (REPO / "docs" / "correction.md").read_text(encoding="utf-8")
    listed = {name for row in table_after(guide, "### Flags") for name in re.findall(r"`(\w+)`", row[0])}
    fields = {f.name for f in dataclasses.fields(CorrectionConfig)} | {"preset"}
    assert fields <= listed, f"docs/correction.md flag table: add {sorted(fields - listed)}"


def test_every_metric_to_watch_is_one_the_fork_writes():
    from openrlhf_tis import metric_names as names

    known = {v for v in vars(names).values() if isinstance(v, str)}
    known |= {k for v in vars(names).values() if isinstance(v, tuple) for k in v if isinstance(k, str)}
    metrics = [m for row in table_after(README, "## The metrics to watch") for m in re.findall(r"`([\w/.-]+)`", row[0])
               if "/" in m]
    assert "mismatch/k3_kl" in metrics and len(metrics) >= 8
    # held-out keys are upstream's, named after the eval dataset (`eval/<dataset>_pass1`)
    unknown = {m for m in metrics if m not in known and not m.startswith((names.EVAL_PREFIX, names.EVAL_START_PREFIX))}
    assert not unknown, f"README metrics not in metric_names.py: {sorted(unknown)}"


def test_the_study_table_is_copied_from_the_committed_results():
    """The README's study table fits one screen (at most 8 columns, at most 12 rows) and is a copy of part of the
    full results table its section links to: each column is one of that table's, by name, and each row one of that
    table's settings (its axis where it has one, dose and correction) holding that table's values. Rows are chosen
    by dose, not by result: every reference is there, and each dose shown has its uncorrected and its TIS row."""
    heading = "## What the study has shown so far"
    section = README[README.index(heading):]
    header, rows = header_and_rows(README, heading)
    intro = section[:section.index("\n|")]
    [link] = set(re.findall(r"\]\((results/study/[^)]+\.md)\)", intro))
    keys = len([name for name in header[:3] if name in ("axis", "dose", "correction")])
    assert len(header) <= 8 and header[keys - 2:keys] == ["dose", "correction"], header
    source_header, source_rows = header_and_rows((REPO / link).read_text(encoding="utf-8"), f"| {header[0]}")
    missing = [name for name in header if name not in source_header]
    assert not missing, f"README study columns {missing} are not columns of {link}"
    columns = [source_header.index(name) for name in header]
    results = {tuple(r[:keys]): [r[i] for i in columns] for r in source_rows}
    readme = {tuple(cells[:keys]): cells for cells in rows}
    assert len(readme) == len(rows) <= 12 and set(readme) <= set(results), f"README study rows not of {link}'s settings"
    versus_reference = next(i for i, name in enumerate(header) if name.startswith("gain − reference"))
    references = {key for key, cells in results.items() if cells[versus_reference] == "reference"}
    assert len(references) == 2, references  # one per axis
    doses = {key[:-1] for key in readme}
    chosen = {(*dose, correction) for dose in doses for correction in ("off", "tis")} & set(results)
    assert references <= set(readme) and chosen <= set(readme), sorted((references | chosen) - set(readme))
    for key, cells in readme.items():
        assert cells == results[key], f"README study row {cells} differs from {link}: {results[key]}"


def test_every_console_script_has_one_readme_line():
    """README "## Commands" lists exactly setup.py's console scripts, in its order (test_package checks that each
    one's target imports from the built wheel)."""
    import ast

    tree = ast.parse((REPO / "setup.py").read_text(encoding="utf-8"))
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    entry_points = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "entry_points"))
    scripts = [line.split("=")[0] for line in entry_points["console_scripts"]]
    assert [row[0].strip("`") for row in table_after(README, "## Commands")] == scripts
