"""One code revision per study (study/revision.py): fixed by a new folder's first sitting, refused when it differs,
and checked by every study's command before its first cell runs."""

from __future__ import annotations

import json

import pytest

from openrlhf_tis.params import ParameterError
from openrlhf_tis.pipeline.sweep import STATUS_FILE
from openrlhf_tis.study import dose_response, moe_demo, revision, staleness


def test_a_new_folder_records_its_revision_and_refuses_another(tmp_path):
    revision.check_revision(tmp_path, "abc")
    assert json.loads((tmp_path / revision.REVISION_FILE).read_text()) == {"revision": "abc"}
    revision.check_revision(tmp_path, "abc", cells=3)  # a later sitting on the same revision goes on
    with pytest.raises(ParameterError, match=f"--out {tmp_path}: its cells ran on code revision abc, this is def"):
        revision.check_revision(tmp_path, "def")
    with pytest.raises(ParameterError, match="this is abc\\+dirty"):  # uncommitted changes are no revision
        revision.check_revision(tmp_path, "abc+dirty")


def test_cells_from_before_the_records_are_not_claimed_for_this_revision(tmp_path, capsys):
    revision.check_revision(tmp_path, "abc", cells=2)
    assert not (tmp_path / revision.REVISION_FILE).exists()
    assert "its 2 finished cells predate the study's revision record" in capsys.readouterr().err


def test_this_checkout_has_a_revision():
    assert revision.code_revision().split("+")[0] not in ("", "unknown")


@pytest.mark.parametrize(("study", "extra"), [
    (dose_response, ["--doses", "none", "--corrections", "off", "--seeds", "1"]),
    (staleness, ["--every", "4", "--corrections", "off", "--no_int8", "--seeds", "1"]),
    (moe_demo, ["--seeds", "1"]),
])
def test_a_study_sitting_on_another_revision_stops_before_any_cell(tmp_path, monkeypatch, capsys, study, extra):
    out = tmp_path / "s"
    out.mkdir()
    (out / revision.REVISION_FILE).write_text(json.dumps({"revision": "0" * 40}))
    monkeypatch.setattr(revision, "run_command", lambda *a, **k: pytest.fail("a cell ran"))
    with pytest.raises(SystemExit) as done:
        study.main(["--out", str(out), "--model", "upcycled" if study is moe_demo else "tiny", *extra])
    assert done.value.code == 2
    assert f"its cells ran on code revision {'0' * 40}, this is {revision.code_revision()}" in capsys.readouterr().err
    assert not list(out.glob(f"cells/*/{STATUS_FILE}"))
