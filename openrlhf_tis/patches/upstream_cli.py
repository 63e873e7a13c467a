"""Reuse upstream's `train_ppo_ray` command line exactly: its parser, its checks, its `train()`.

OpenRLHF 0.11.2 builds the parser, validates the arguments and calls `train(args)` inside the
module's `if __name__ == "__main__":` block, so none of it can be imported. The module is run as
`__main__` twice with `ArgumentParser.parse_args` swapped for the run only: once to capture the parser
(the fork adds its flags to it), once to hand it the fork's parsed namespace and let upstream's own
checks and `train()` run unchanged. Only upstream's first call is intercepted; any later parse (a
library's own parser inside `train()`) is argparse's.
"""

from __future__ import annotations

import argparse
import runpy
from collections.abc import Callable

from openrlhf_tis.upstream_guards import require_version, swapped

NAME = "upstream_cli"
UPSTREAM_CLI = "openrlhf.cli.train_ppo_ray"


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def _run_intercepting_first_parse(handler: Callable[[argparse.ArgumentParser], argparse.Namespace]) -> None:
    """Run upstream's `__main__` block with its first `parse_args` call answered by `handler(parser)`."""
    require_version("openrlhf", "==0.11.2", patch=NAME)
    calls = []

    def parse_args(self, args=None, namespace=None):
        if calls:  # only upstream's own first call is intercepted
            return original(self, args, namespace)
        calls.append(self)
        return handler(self)

    with swapped(argparse.ArgumentParser, "parse_args", parse_args, patch=NAME) as original:
        runpy.run_module(UPSTREAM_CLI, run_name="__main__")


def upstream_parser() -> argparse.ArgumentParser:
    """The exact ArgumentParser upstream's train_ppo_ray builds."""

    def capture(parser):
        raise _Captured(parser)

    try:
        _run_intercepting_first_parse(capture)
    except _Captured as captured:
        return captured.parser
    raise RuntimeError(f"{UPSTREAM_CLI} did not build an argument parser; upstream changed its CLI")


def run_upstream_main(args: argparse.Namespace) -> None:
    """Run upstream's __main__ block (its checks, then train()) on already parsed arguments."""
    _run_intercepting_first_parse(lambda _parser: args)
