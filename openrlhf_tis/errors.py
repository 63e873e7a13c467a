"""The one error type for bad user input, shared by every layer (the CLI turns it into a usage message)."""

from __future__ import annotations


class UsageError(Exception):
    """Bad input; `flag` names the command-line flag (or file) at fault."""

    def __init__(self, flag: str, message: str):
        super().__init__(f"{flag}: {message}")
        self.flag = flag
