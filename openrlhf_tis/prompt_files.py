"""Prompt files read before anything starts: readable, not empty, one JSON object per line, keys present.

Upstream loads `--data.prompt_dataset` with Hugging Face `datasets` inside the PPO controller, after
Ray and vLLM have started, so an empty file, a malformed line or a missing `--data.input_key` ends
there as `StopIteration` or `KeyError: 'input'` from an actor. The training CLI and the calibration
command read local JSON-lines, JSON, Parquet and CSV files here instead, and every problem names the
file and, for JSON, the line. A local directory is resolved as upstream's `blending_datasets` resolves it
(a dataset saved with `save_to_disk`, else the data files `datasets` finds in it): one it cannot load is
refused, and the rows of one it can are read the same way. Hub names and dataset scripts are left to upstream.

Each row's prompt must also be something upstream can turn into a non-empty prompt (`prompt_problem`): vLLM
refuses an empty one only at the first step that samples it (`The decoder prompt cannot be empty`), naming no row.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

READ_HERE = (".jsonl", ".json", ".parquet", ".csv")
# What upstream's blending_datasets loads by the extension of a path (a .py is a dataset script); any other
# existing file goes to `load_dataset(path)`, which finds no data file in it ("Couldn't find any data file").
UPSTREAM_LOADS = (".py", ".json", ".jsonl", ".csv", ".parquet", ".arrow")
# The `datasets` builders of a data-file directory whose files are read here (by the same extensions).
READ_FORMATS = {"json": (".json", ".jsonl"), "csv": (".csv",), "parquet": (".parquet",), "text": (".txt",)}
SAVED_FILES = "dataset_info.json and state.json, or dataset_dict.json"

Records = Iterator[tuple[str, dict[str, Any]]]  # (where: "file:line" or "file record N", record)


class PromptFileError(ValueError):
    """A prompt file that training could not use; `key` is set when a record lacks that key."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class PromptFile:
    path: str
    records: int
    first: dict[str, Any]  # the first record, e.g. for a reward script to be tried on
    kept: tuple[tuple[str, Any], ...] = ()  # (where, value of the kept key) of the leading records asked for


def _json_lines(path: str, text: str) -> Iterator[tuple[int, Any]]:
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError as err:
            raise PromptFileError(f"{path}:{number}: not valid JSON ({err.msg} at column {err.colno})") from None


def _json_records(path: str) -> Iterator[tuple[int | None, Any]]:
    """(line number or None, record) of a JSON-lines file, or of a .json file holding one array / column dict.

    Hugging Face's json loader takes all three forms, so a .json file is tried whole first.
    """
    with open(path, encoding="utf-8-sig") as f:  # a leading BOM is read past, as `datasets`' json builder does
        text = f.read()
    if path.lower().endswith(".json") and text.lstrip()[:1] in ("[", "{"):
        try:
            whole = json.loads(text)
        except json.JSONDecodeError:
            whole = None  # JSON lines under a .json name
        if isinstance(whole, list):
            yield from ((None, record) for record in whole)
            return
        if isinstance(whole, dict) and whole and all(isinstance(v, list) for v in whole.values()):
            if len({len(v) for v in whole.values()}) > 1:
                raise PromptFileError(f"{path}: a JSON object of columns whose lists differ in length")
            yield from ((None, dict(zip(whole, row, strict=True))) for row in zip(*whole.values(), strict=True))
            return
    yield from _json_lines(path, text)


def _text_records(path: str) -> Iterator[tuple[int | None, Any]]:
    """One {"text": line} per line, as `datasets`' text builder reads a .txt file in a directory (blank lines kept:
    each is an empty prompt there)."""
    with open(path, encoding="utf-8") as f:  # universal newlines, a BOM kept in line 1: as the builder reads it
        yield from ((number, {"text": line.rstrip("\n")}) for number, line in enumerate(f, 1))


def _table_records(path: str) -> Iterator[tuple[int | None, Any]]:
    if path.lower().endswith(".csv"):
        with open(path, newline="", encoding="utf-8-sig") as f:  # as pandas, `datasets`' csv builder, reads a BOM
            yield from ((None, row) for row in csv.DictReader(f))  # a quoted field may span lines: rows count
        return
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as err:  # pyarrow raises several types for a damaged file
        raise PromptFileError(f"{path}: not a readable Parquet file ({err})") from None
    yield from ((None, record) for record in table.to_pylist())


def prompt_records(path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, record) for each record of a local prompt file, `where` naming the file and line or record.

    Raises PromptFileError for a file that is missing, unreadable, not UTF-8, not valid JSON, or holds
    something other than objects with named fields.
    """
    if not os.path.exists(path):
        raise PromptFileError(f"{path} does not exist")
    if not os.path.isfile(path):
        raise PromptFileError(f"{path} is not a file")
    lower = path.lower()
    records = (_table_records if lower.endswith((".csv", ".parquet")) else
               _text_records if lower.endswith(".txt") else _json_records)
    try:
        for count, (number, record) in enumerate(records(path), 1):
            where = f"{path}:{number}" if number is not None else f"{path} record {count}"
            if not isinstance(record, dict):
                raise PromptFileError(f"{where}: a JSON {type(record).__name__}, not an object with named fields")
            yield where, record
    except UnicodeDecodeError as err:
        raise PromptFileError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    except OSError as err:
        raise PromptFileError(f"cannot read {path}: {err.strerror or err}") from None


def read_prompt_file(path: str, keys: Sequence[str]) -> PromptFile:
    """Check that `path` holds at least one record and that every record has a non-null value for `keys`.

    Raises PromptFileError naming the file and line (JSON lines) or record; `key` names a missing key.
    """
    return read_records(path, prompt_records(path), keys)


def read_records(name: str, records: Iterable[tuple[str, dict[str, Any]]], keys: Sequence[str],
                 keep_key: str | None = None, keep: int = 0) -> PromptFile:
    """read_prompt_file's checks on the records of any source named `name` (a file, a saved dataset): one pass,
    keeping the prompt values of the rows upstream will use (`keep`: --data.max_samples) for the row checks."""
    count, first, kept = 0, None, []
    for where, record in records:
        count += 1
        for key in keys:
            if record.get(key) is None:
                have = ", ".join(map(repr, list(record)[:8])) or "none"
                what = f"has no key {key!r}" if key not in record else f"has null for key {key!r}"
                raise PromptFileError(f"{where} {what} (its keys: {have})", key=key)
        if first is None:
            first = record
        if keep_key is not None and count <= keep:
            kept.append((where, record[keep_key]))
    if first is None:
        raise PromptFileError(f"{name} holds no prompts ({'empty file' if os.path.isfile(name) else 'no rows'})")
    return PromptFile(name, count, first, tuple(kept))


def item_sources(item: str, split: str, *, modelscope: bool = False) -> list[tuple[str, Records]] | None:
    """(name, records) of each source one dataset spec item (`path[@data_dir]`) loads, as upstream's
    blending_datasets loads it, or None where it is left to upstream (a hub name, a dataset script, an .arrow file,
    files of formats not read here). Records are read lazily: iterating raises PromptFileError.

    Raises PromptFileError at once for a local path upstream cannot load: a file of another extension, or a
    directory that is neither a saved dataset nor holds data files (upstream ends at its controller, after Ray).
    """
    path, _, data_dir = (part.strip() for part in item.partition("@"))
    path = os.path.expanduser(path)
    ext = os.path.splitext(path)[1].lower()
    if ext in READ_HERE:
        return [(path, prompt_records(path))]
    if ext == ".py" or not os.path.exists(path):
        return None
    if os.path.isdir(path):
        return directory_sources(path, data_dir or None, split)
    if ext not in UPSTREAM_LOADS and not modelscope:
        raise PromptFileError(f"{path} is a file upstream cannot load: it loads files by their extension "
                              f"({', '.join(UPSTREAM_LOADS[1:])}) or a directory")
    return None


def directory_sources(path: str, data_dir: str | None, split: str) -> list[tuple[str, Records]] | None:
    """The sources of a local directory, tried in upstream's order: a dataset script named after it (left to
    upstream), a dataset saved with `save_to_disk`, then the data files `datasets` finds in it for `split`."""
    if os.path.isfile(os.path.join(path, os.path.basename(os.path.normpath(path)) + ".py")):
        return None
    saved = _saved_dataset(path, split)
    if saved is not None:
        return [saved]
    return _data_file_sources(path, data_dir, split)


def _saved_dataset(path: str, split: str) -> tuple[str, Records] | None:
    """A `save_to_disk` dataset (upstream tries `load_from_disk` first), with the split upstream selects; None when
    `load_from_disk` fails (upstream then loads the directory's data files)."""
    from datasets import Dataset, load_from_disk

    try:
        data = load_from_disk(path)
    except Exception:  # upstream catches everything here and falls back to load_dataset
        return None
    if not isinstance(data, Dataset):
        if split not in data:
            raise PromptFileError(f"{path} is a saved DatasetDict without a {split!r} split (it has "
                                  f"{', '.join(map(repr, data))}): upstream selects the split named by "
                                  "--data.prompt_split / --eval.split and fails on a whole DatasetDict")
        data = data[split]
    return path, ((f"{path} record {n}", row) for n, row in enumerate(data, 1))


def _data_file_sources(path: str, data_dir: str | None, split: str) -> list[tuple[str, Records]] | None:
    """The `split` files `datasets` would load from a data-file directory (resolved by `datasets` itself, nothing
    read), as one source when their format is read here; PromptFileError when it finds none."""
    from datasets.load import dataset_module_factory

    try:
        module = dataset_module_factory(path, data_dir=data_dir)
    except Exception as err:  # EmptyDatasetError, DataFilesNotFoundError, a bad README config, ...
        raise PromptFileError(f"{path} is a directory upstream cannot load: no dataset saved with save_to_disk "
                              f"({SAVED_FILES}) and no data files Hugging Face datasets reads (.jsonl, .json, "
                              f".csv, .parquet, .arrow, .txt, ...) ({type(err).__name__}: {err})") from None
    configs = module.builder_configs_parameters.builder_configs or []
    if len(configs) != 1 or not configs[0].data_files:
        return None  # several configurations (a README's `configs`): load_dataset's own choice
    files = configs[0].data_files
    if split not in files:
        raise PromptFileError(f"{path} holds data files for the split(s) {', '.join(map(repr, files))}, none for "
                              f"{split!r}: upstream selects the split named by --data.prompt_split / --eval.split "
                              "and fails on the others")
    builder = module.module_path.split(".")[-1]
    paths = list(files[split])
    if not paths or not all(p.lower().endswith(READ_FORMATS.get(builder, ())) for p in paths):
        return None  # compressed files, .arrow, images, ...: left to upstream
    # one source, as upstream concatenates the files: an empty one among others is no empty dataset
    return [(path, chain.from_iterable(prompt_records(p) for p in paths))]


def prompt_problem(value: Any, chat: bool, template: str | None) -> str | None:
    """Why upstream's PromptDataset (`preprocess_data`) would build no usable prompt from a row's --data.input_key
    `value`, or None. `chat`: --data.apply_chat_template (a text or a list of {'role', 'content'} messages);
    otherwise a text, or a number under an --data.input_template (formatted into it)."""
    if isinstance(value, str):
        return None if value.strip() else "is empty or whitespace only: no prompt (vLLM refuses an empty one)"
    if chat and isinstance(value, list):
        return _messages_problem(value)
    if not chat and template and isinstance(value, int | float) and not isinstance(value, bool):
        return None
    hint = " (a list of chat messages needs --data.apply_chat_template)" if isinstance(value, list) else ""
    wanted = "a prompt text or a list of chat messages" if chat else "a prompt text"
    return f"holds {_a(type(value).__name__)}, not {wanted}{hint}"


def _a(noun: str) -> str:
    """`noun` with its indefinite article (an int, a list)."""
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"


def _messages_problem(messages: list[Any]) -> str | None:
    """A chat-message list upstream passes to the chat template: dicts with a role, not all of them empty."""
    if not messages:
        return "is an empty list of chat messages: no prompt"
    for number, message in enumerate(messages, 1):
        if not isinstance(message, dict) or "role" not in message:
            return (f"message {number} is {_a(type(message).__name__)}"
                    f"{' without a role' if isinstance(message, dict) else ''}, not a {{'role', 'content'}} message")
    if all(isinstance(m.get("content"), str | None) and not (m.get("content") or "").strip() for m in messages):
        return "holds chat messages whose contents are all empty: no prompt"
    return None


def token_counts(prompts: Sequence[str], tokenizer: Any, batch: int = 512) -> list[int]:
    """How many tokens each prompt is as upstream's rollout tokenizes it (no special tokens added: a chat template
    already holds its own), in batches so thousands of rows take seconds."""
    counts: list[int] = []
    for start in range(0, len(prompts), batch):
        ids = tokenizer(list(prompts[start:start + batch]), add_special_tokens=False)["input_ids"]
        counts.extend(len(row) for row in ids)
    return counts
