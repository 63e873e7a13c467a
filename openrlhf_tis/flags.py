"""The one declaration of a fork flag: its name, type, default, help, choices, range check, and where it lands.

A flag the run holds as given is a field of a run-spec plan (run_spec/plans.py) made with `flag`, as CleanRL's Args
and TRL's config dataclasses carry each option's help in its field: the field's default is the flag's default, stated
there once, and the driver copies the parsed value into the field (`plan_from_flags`), so such a flag is its field
and the code that reads it. A flag the run decides on first (`--cluster.device auto`), or reads before any spec
exists, is a module-level `Flag` beside the code that reads it. Everything else is a view of these declarations:
the parser (cli/fork_flags.py), a notebook parameter that becomes the flag (`Flag.param`), the checks before Ray
starts (`Flag.problem`), and the README flag table's test. A bottom-layer module, so every layer declares here.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

from openrlhf_tis.params import Check, param

_FLAG = "flag"  # the field metadata key holding a plan field's Flag
Plan = TypeVar("Plan")


@dataclasses.dataclass(frozen=True)
class Flag:
    """One flag of the fork: a switch when `switch`, else a value of `type` (one of `choices` if given).

    `check`: why a given value is wrong, or None, said before Ray starts (`problem`); the parser checks type and
    choices itself."""

    name: str
    help: str
    default: object = None
    type: Callable[[str], Any] = str
    choices: tuple[Any, ...] | None = None
    switch: bool = False
    check: Check | None = None

    @property
    def dest(self) -> str:
        """The flag's name in upstream's dotted namespace and in a run's config.json: the flag less its `--`."""
        return self.name.removeprefix("--")

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        if self.switch:
            parser.add_argument(self.name, action="store_true", default=bool(self.default), help=self.help)
        else:
            parser.add_argument(self.name, type=self.type, default=self.default, help=self.help,
                                choices=None if self.choices is None else list(self.choices))

    def problem(self, value: Any) -> str | None:
        """Why `value` (parsed) cannot be this flag's, or None; an unset optional flag (None) has no problem."""
        return None if self.check is None or value is None else self.check(value)

    def param(self, help: str, default: Any = None, check: Check | None = None) -> Any:
        """A notebook parameter (params.param) that becomes this flag, of the flag's type and choices, so a notebook
        or sweep value is refused as the CLI refuses it (params.Param.problem), before a command line is built.
        `default`: the notebook's (None: the flag's); `check`: what the CLI checks later, said earlier."""
        return param(self.default if default is None else default, help, (bool,) if self.switch else (self.type,),
                     self.choices, check=check, flag=self.name)


def flag(name: str, default: Any, help: str, *, type: Callable[[str], Any] | None = None,
         choices: tuple[Any, ...] | None = None, switch: bool = False, check: Check | None = None) -> Any:
    """A plan field that a flag sets as given: the field's default is the flag's. `type`: by default the default's
    (give it when the default is None)."""
    kind = type or (str if default is None or switch else default.__class__)
    declared = Flag(name, " ".join(help.split()), default, kind, choices, switch, check)
    return dataclasses.field(default=default, metadata={_FLAG: declared})


def plan_flags(plan: type) -> dict[str, Flag]:
    """The flags of a plan class, by field name, in field order."""
    return {f.name: f.metadata[_FLAG] for f in dataclasses.fields(plan) if _FLAG in f.metadata}


def plan_from_flags(plan: type[Plan], args: Any, **decided: Any) -> Plan:
    """`plan` with every flag field as `args` (a parsed namespace) holds it, and the fields decided from them."""
    given = {name: getattr(args, declared.dest) for name, declared in plan_flags(plan).items()}
    return plan(**given, **decided)
