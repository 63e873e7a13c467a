"""Prompt files read before anything starts: readable, not empty, one JSON object per line, keys present.

Upstream loads `--data.prompt_dataset` with Hugging Face `datasets` inside the PPO controller, after
Ray and vLLM have started, so an empty file, a malformed line or a missing `--data.input_key` ends
there as `StopIteration` or `KeyError: 'input'` from an actor. The training CLI and the calibration
command read local JSON-lines, JSON, Parquet and CSV files here instead, and every problem names the
file and, for JSON, the line. Hub names, dataset scripts and saved datasets are left to upstream.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

READ_HERE = (".jsonl", ".json", ".parquet", ".csv")


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


def local_files(spec: str) -> list[str]:
    """The files of a comma-separated dataset spec (upstream's `path[@data_dir]` items) that this module reads."""
    paths = [item.split("@")[0].strip() for item in spec.split(",")]
    return [os.path.expanduser(p) for p in paths if os.path.splitext(p)[1].lower() in READ_HERE]


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
    with open(path, encoding="utf-8") as f:
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


def _table_records(path: str) -> Iterator[tuple[int | None, Any]]:
    if path.lower().endswith(".csv"):
        with open(path, newline="", encoding="utf-8") as f:
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
    records = _table_records if path.lower().endswith((".csv", ".parquet")) else _json_records
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
    count, first = 0, None
    for where, record in prompt_records(path):
        count += 1
        for key in keys:
            if record.get(key) is None:
                have = ", ".join(map(repr, list(record)[:8])) or "none"
                what = f"has no key {key!r}" if key not in record else f"has null for key {key!r}"
                raise PromptFileError(f"{where} {what} (its keys: {have})", key=key)
        if first is None:
            first = record
    if first is None:
        raise PromptFileError(f"{path} holds no prompts (empty file)")
    return PromptFile(path, count, first)
