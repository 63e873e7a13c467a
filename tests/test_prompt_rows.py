"""The prompt rows upstream would fail on at the first step, or cut, refused before Ray starts in one line
naming the flag, the file and the row: an empty or unusable prompt, a dataset directory upstream cannot load, a
prompt with no room for a response within --data.max_len."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from _support import error_line, refused, with_value

from openrlhf_tis.cli import train_ppo_ray


def _jsonl(path: Path, *values) -> Path:
    path.write_text("".join(json.dumps({"input": value, "label": "2"}) + "\n" for value in values))
    return path


def _with_prompts(valid_argv: list[str], path: Path) -> list[str]:
    return with_value(valid_argv, "--data.prompt_dataset", str(path))


def _accepted(argv: list[str]) -> None:
    train_ppo_ray.parse(argv + ["--logger.run_dir_overwrite"], cpu=True)


# --- empty and unusable prompts ------------------------------------------------------------------------

@pytest.mark.parametrize(("values", "extra", "row", "expected"), [
    (["1 + 1?", ""], [], 2, "'input' is empty or whitespace only"),  # was vLLM's "decoder prompt cannot be empty"
    ([" \t\n "], [], 1, "'input' is empty or whitespace only"),
    (["1 + 1?", "", "2 + 2?"], ["--data.apply_chat_template"], 2, "'input' is empty or whitespace only"),
    ([[]], ["--data.apply_chat_template"], 1, "is an empty list of chat messages"),
    ([[{"role": "user", "content": " "}]], ["--data.apply_chat_template"], 1, "contents are all empty"),
    ([["1 + 1?"]], ["--data.apply_chat_template"], 1, "message 1 is a str, not a {'role', 'content'} message"),
    ([[{"content": "1 + 1?"}]], ["--data.apply_chat_template"], 1, "message 1 is a dict without a role"),
    ([[{"role": "user", "content": "1 + 1?"}]], [], 1, "holds a list, not a prompt text (a list of chat messages "
                                                        "needs --data.apply_chat_template)"),
    ([7], [], 1, "holds an int, not a prompt text"),
    ([{"q": "1 + 1?"}], ["--data.apply_chat_template"], 1, "holds a dict, not a prompt text or a list of chat"),
])
def test_a_row_without_a_usable_prompt_is_refused_naming_file_and_line(valid_argv, tmp_path, capsys, values, extra,
                                                                      row, expected):
    prompts = _jsonl(tmp_path / "p.jsonl", *values)
    line = error_line(refused(_with_prompts(valid_argv, prompts) + extra, capsys))
    assert line.startswith(f"--data.input_key: {prompts}:{row}: ") and expected in line, line


def test_csv_and_eval_rows_are_named_by_record_and_file(valid_argv, tmp_path, capsys):
    csv_file = tmp_path / "p.csv"
    csv_file.write_text('input,label\n1 + 1?,2\n"",4\n')
    line = error_line(refused(_with_prompts(valid_argv, csv_file), capsys))
    assert line.startswith(f"--data.input_key: {csv_file} record 2: 'input' is empty"), line
    eval_file = _jsonl(tmp_path / "eval.jsonl", "3 + 4?", "   ")
    line = error_line(refused(valid_argv + ["--eval.dataset", str(eval_file)], capsys))
    assert line.startswith(f"--data.input_key: {eval_file}:2: 'input' is empty"), line


def test_what_upstream_formats_is_accepted_and_rows_past_max_samples_are_not_read(valid_argv, tmp_path):
    chat = [{"role": "system", "content": ""}, {"role": "user", "content": "1 + 1?"}]
    _accepted(_with_prompts(valid_argv, _jsonl(tmp_path / "chat.jsonl", chat, "2 + 2?"))
              + ["--data.apply_chat_template"])
    _accepted(_with_prompts(valid_argv, _jsonl(tmp_path / "n.jsonl", 7)) + ["--data.input_template", "{} + 1 ="])
    # upstream takes the first --data.max_samples rows of each dataset: the empty second row is never a prompt
    _accepted(_with_prompts(valid_argv, _jsonl(tmp_path / "p.jsonl", "1 + 1?", "")) + ["--data.max_samples", "1"])


# --- dataset directories -------------------------------------------------------------------------------

class _Strategy:
    """What upstream's blending_datasets reads of its strategy."""
    args = SimpleNamespace(use_ms=False)

    def print(self, *_args) -> None:
        pass

    def is_rank_0(self) -> bool:
        return False


def _upstream_loads(path: Path, tmp_path: Path, monkeypatch) -> int:
    """Rows upstream's own loader reads from `path` (its Hugging Face cache kept under tmp_path)."""
    import datasets
    from openrlhf.datasets.utils import blending_datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    return len(blending_datasets(str(path), None, _Strategy()))


@pytest.mark.parametrize("files", [{}, {"prompts": '{"input": "1 + 1?"}\n'}, {"README.md": "# prompts\n"}])
def test_a_directory_upstream_cannot_load_is_refused_naming_it(valid_argv, tmp_path, capsys, monkeypatch, files):
    folder = tmp_path / "prompts"  # no extension: upstream tries load_from_disk, then load_dataset(folder)
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text)
    line = error_line(refused(_with_prompts(valid_argv, folder), capsys))
    assert line.startswith(f"--data.prompt_dataset: {folder} is a directory upstream cannot load: no dataset saved "
                           "with save_to_disk (dataset_info.json and state.json, or dataset_dict.json) and no data "
                           "files"), line
    with pytest.raises(Exception, match="data files|doesn't contain"):
        _upstream_loads(folder, tmp_path, monkeypatch)


def test_a_file_upstream_cannot_load_by_its_extension_is_refused(valid_argv, tmp_path, capsys, monkeypatch):
    text = tmp_path / "prompts.txt"
    text.write_text("1 + 1?\n")
    line = error_line(refused(_with_prompts(valid_argv, text) + ["--data.input_key", "text"], capsys))
    assert line == (f"--data.prompt_dataset: {text} is a file upstream cannot load: it loads files by their "
                    "extension (.json, .jsonl, .csv, .parquet, .arrow) or a directory")
    with pytest.raises(FileNotFoundError, match="Couldn't find any data file"):
        _upstream_loads(text, tmp_path, monkeypatch)


def test_the_rows_of_a_directory_upstream_loads_are_checked_too(valid_argv, tmp_path, capsys, monkeypatch):
    from datasets import Dataset, DatasetDict

    files = tmp_path / "files"
    (files / "part").mkdir(parents=True)
    _jsonl(files / "part" / "a.jsonl", "1 + 1?", "2 + 2?")
    (files / "b.jsonl").write_text("")  # concatenated by upstream: an empty file among others is no empty dataset
    _accepted(_with_prompts(valid_argv, files))
    assert _upstream_loads(files, tmp_path, monkeypatch) == 2
    _jsonl(files / "b.jsonl", "3 + 4?", "")
    line = error_line(refused(_with_prompts(valid_argv, files), capsys))
    assert line.startswith(f"--data.input_key: {files / 'b.jsonl'}:2: 'input' is empty"), line
    lines = tmp_path / "lines"  # text files: one prompt a line, in the key "text"; a blank line is an empty prompt
    lines.mkdir()
    (lines / "q.txt").write_text("1 + 1?\n\n2 + 2?\n")
    assert _upstream_loads(lines, tmp_path, monkeypatch) == 3
    line = error_line(refused(_with_prompts(valid_argv, lines) + ["--data.input_key", "text"], capsys))
    assert line.startswith(f"--data.input_key: {lines / 'q.txt'}:2: 'text' is empty"), line

    saved = tmp_path / "saved"
    Dataset.from_dict({"input": ["1 + 1?", ""], "label": ["2", "4"]}).save_to_disk(str(saved))
    assert _upstream_loads(saved, tmp_path, monkeypatch) == 2
    line = error_line(refused(_with_prompts(valid_argv, saved), capsys))
    assert line.startswith(f"--data.input_key: {saved} record 2: 'input' is empty"), line
    Dataset.from_dict({"input": ["1 + 1?"]}).save_to_disk(str(saved))
    _accepted(_with_prompts(valid_argv, saved))
    splits = tmp_path / "splits"
    DatasetDict({"test": Dataset.from_dict({"input": ["1 + 1?"]})}).save_to_disk(str(splits))
    line = error_line(refused(_with_prompts(valid_argv, splits), capsys))
    assert line.startswith(f"--data.prompt_dataset: {splits} is a saved DatasetDict without a 'train' split"), line
    _accepted(_with_prompts(valid_argv, splits) + ["--data.prompt_split", "test"])


# --- prompts longer than --data.max_len ----------------------------------------------------------------

def _tokens(tiny_model_dir: Path, text: str, chat: bool = False) -> int:
    """The prompt's length as an independent reference counts it (the model's tokenizer, no special tokens)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    if chat:
        text = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return len(tok(text, add_special_tokens=False)["input_ids"])


LONG = "what is the number one plus the number two times three minus four equals " * 3


def test_a_prompt_with_no_room_for_a_response_is_refused_naming_row_and_count(valid_argv, tiny_model_dir, tmp_path,
                                                                             capsys):
    prompts = _with_prompts(valid_argv, _jsonl(tmp_path / "p.jsonl", "1 + 1?", LONG))
    count = _tokens(tiny_model_dir, LONG)
    line = error_line(refused(prompts + ["--data.max_len", str(count)], capsys))
    assert line.startswith(f"--data.max_len: {tmp_path / 'p.jsonl'}:2: the prompt is {count} tokens (as formatted), "
                           f"not under --data.max_len {count} (prompt + response): no room for a response; upstream "
                           f"would keep only its last {count - 1} tokens and generate one"), line
    _accepted(prompts + ["--data.max_len", str(count + 1)])  # room for one token: upstream cuts nothing


def test_the_chat_template_counts(valid_argv, tiny_model_dir, tmp_path, capsys):
    prompts = _with_prompts(valid_argv, _jsonl(tmp_path / "p.jsonl", LONG))
    raw, chat = _tokens(tiny_model_dir, LONG), _tokens(tiny_model_dir, LONG, chat=True)
    assert raw < chat
    _accepted(prompts + ["--data.max_len", str(chat)])
    line = error_line(refused(prompts + ["--data.max_len", str(chat), "--data.apply_chat_template"], capsys))
    assert line.startswith(f"--data.max_len: {tmp_path / 'p.jsonl'}:1: the prompt is {chat} tokens (with the chat "
                           "template)"), line


def test_a_prompt_cut_to_leave_max_new_tokens_is_warned_and_one_without_room_refused(valid_argv, tiny_model_dir,
                                                                                   tmp_path, capsys):
    prompts = _with_prompts(valid_argv, _jsonl(tmp_path / "p.jsonl", LONG))
    count = _tokens(tiny_model_dir, LONG)
    _accepted(prompts + ["--data.max_len", str(count + 8), "--rollout.max_new_tokens", "16"])
    err = capsys.readouterr().err
    assert (f"warning: --data.max_len: 1 prompt(s) longer than the {count - 8} tokens --rollout.max_new_tokens 16 "
            f"leaves them (first: {tmp_path / 'p.jsonl'}:1, {count} tokens); upstream cuts their first tokens") in err
    line = error_line(refused(prompts + ["--data.max_len", str(count - 8), "--rollout.max_new_tokens", "16"], capsys))
    assert line.startswith(f"--data.max_len: {tmp_path / 'p.jsonl'}:1: the prompt is {count} tokens"), line
    assert f"upstream would keep only its last {count - 24} tokens and generate 16" in line, line
    # a response budget of all of --data.max_len: upstream keeps the prompt whole (vLLM stops at the context's end)
    _accepted(prompts + ["--data.max_len", "128", "--rollout.max_new_tokens", "128"])
    assert "warning: --data.max_len" not in capsys.readouterr().err
    line = error_line(refused(prompts + ["--data.max_len", "128", "--rollout.max_new_tokens", "200"], capsys))
    assert line == ("--rollout.max_new_tokens: 200 is more than --data.max_len 128, which prompt and response share: "
                    "upstream would drop the first 72 tokens of every prompt (and vLLM refuses one left empty)"), line
