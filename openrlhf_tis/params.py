"""Notebook parameters as one typed object, checked the same way in a notebook, a sweep grid and a console command.

A papermill parameter with a typo is only a warning to papermill and a silently unused variable to the notebook; a
bad value surfaces minutes later inside Ray. Each notebook therefore declares its parameters as a frozen dataclass
of `ParamObject` beside the code it drives (pipeline/train_params.py's TrainParams, viz/explorer.py's
ExplorerParams, ...), each field made with `param`: its default, help, accepted types and values, and the command-
line flag it becomes, as correction/config.py's CorrectionConfig fields carry their flags. A parameter that becomes
one of the fork's flags is made from that flag's declaration (openrlhf_tis/flags.py `Flag.param`), so its type and
choices are the CLI's and a bad value is refused in the CLI's words. The notebook's second cell imports the class
and calls `Class.from_notebook(globals(), NAME)`, which fails in that cell with the list of accepted names (and
their help) for an unknown name or a bad value; the sweep checks every cell of a grid with `Class.checked` before
any cell runs. A bottom-layer module (it imports nothing of the package), so every layer declares its notebook's
parameters here without reaching up to pipeline/.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import FunctionType, ModuleType
from typing import Any, Self


class ParameterError(ValueError):
    """A notebook or grid parameter that cannot be used; the message names it and lists what is accepted."""


Check = Callable[[Any], str | None]  # returns why the value is wrong, or None
_PARAM = "param"  # the field metadata key holding its Param


@dataclass(frozen=True)
class Param:
    """What one field of a ParamObject accepts, and the flag it becomes."""

    help: str
    types: tuple[type, ...] = ()
    choices: tuple[Any, ...] | None = None
    check: Check | None = None
    # The command-line flag the parameter becomes (ParamObject.flag_argv); a dict value gives one flag per key,
    # `flag + key`. None: the notebook itself uses the value.
    flag: str | None = None

    def converted(self, value: Any) -> Any:
        """`value` in one of the declared types when it converts there without loss, else unchanged.

        papermill's `-p NAME VALUE` types VALUE by its look (`-p lr 1` gives an int, `-p int8_weight_bits 3` an
        int too), so an int is taken for a float parameter when the float holds it exactly, and for a string
        parameter as its digits (which the parameter's own check then judges like any string)."""
        if not self.types or isinstance(value, self.types) or type(value) is not int:
            return value
        if float in self.types:
            exact = float(value) if abs(value) < 2**53 else None  # beyond 2**53 not every int is a float
            return value if exact is None else exact
        return str(value) if str in self.types else value

    def problem(self, value: Any) -> str | None:
        """Why `value` is not acceptable, or None (judged after `converted`)."""
        value = self.converted(value)
        if self.choices is not None and value not in self.choices:
            if self.flag:  # in the words the command line's own parser uses for the flag
                return f"{self.flag}: invalid choice: {value!r} (choose from {', '.join(map(repr, self.choices))})"
            return f"must be one of {list(self.choices)}"
        wrong_type = not isinstance(value, self.types) or isinstance(value, bool) and bool not in self.types
        if self.types and wrong_type:
            return f"must be {' or '.join(t.__name__ for t in self.types)}, got {type(value).__name__}"
        return self.check(value) if self.check else None


def param(default: Any, help: str, types: tuple[type, ...] = (), choices: tuple[Any, ...] | None = None,
          check: Check | None = None, flag: str | None = None) -> Any:
    """A ParamObject field: its default and what it accepts (see Param). A list or dict default is copied for
    every object, never shared between them."""
    metadata = {_PARAM: Param(help, types, choices, check, flag)}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def positive(value: Any) -> str | None:
    return None if value > 0 else "must be > 0"


_IPYTHON_NAMES = frozenset({"In", "Out", "get_ipython", "exit", "quit", "open"})
_SEEN = "_openrlhf_tis_names_at_check"  # kept in the notebook's globals by the first check


class ParamObject:
    """Base of a notebook's parameters: a frozen dataclass whose fields are made with `param`.

    Constructing one directly takes the values as they are (a recorded cell, a test); `checked` and
    `from_notebook` are the gates for values a user wrote."""

    @classmethod
    def spec(cls) -> dict[str, Param]:
        """Each parameter's Param, in field order (the order of the parameters cell and of `flag_argv`)."""
        return {f.name: f.metadata[_PARAM] for f in dataclasses.fields(cls)}

    @classmethod
    def accepted(cls) -> str:
        """One line per accepted parameter: name, default, help."""
        defaults = cls().values()
        return "\n".join(f"  {name} = {defaults[name]!r}  # {p.help}" for name, p in cls.spec().items())

    @classmethod
    def checked(cls, values: Mapping[str, Any], where: str = "parameters") -> Self:
        """Defaults overlaid with `values` (converted where lossless, see Param.converted), every name and value
        checked; raises ParameterError naming all faults."""
        spec = cls.spec()
        faults = [f"unknown parameter {name!r}" for name in values if name not in spec]
        for name, value in values.items():
            if name in spec and (why := spec[name].problem(value)) is not None:
                faults.append(f"{name} = {value!r}: {why}")
        if faults:
            raise ParameterError(f"{where}: " + "; ".join(faults) + f"\naccepted parameters:\n{cls.accepted()}")
        return cls(**{name: spec[name].converted(value) for name, value in values.items()})

    @classmethod
    def from_notebook(cls, namespace: dict[str, Any], notebook: str) -> Self:
        """The parameters notebook `notebook` runs with, read from its globals right after the parameters cell.

        Names papermill injected that the class does not know are refused: every plain value in the kernel's
        namespace at this point was set by the parameters cell or injected after it (imports, functions,
        classes, private and IPython names are not parameters). The names present at the first check are
        remembered in the namespace, so re-running the cell later ignores what later cells defined.
        """
        earlier = namespace.get(_SEEN)
        values = {
            name: value for name, value in namespace.items()
            if not name.startswith("_") and name not in _IPYTHON_NAMES
            and not isinstance(value, (ModuleType, FunctionType, type)) and not callable(value)
            and (earlier is None or name in earlier)
        }
        checked = cls.checked(values, where=f"{notebook}.ipynb parameters")
        if earlier is None:
            namespace[_SEEN] = frozenset(namespace)
        return checked

    def values(self) -> dict[str, Any]:
        """Every parameter by name: what papermill passes to the notebook."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def flag_argv(self, **as_flags: Any) -> list[str]:
        """`[flag, str(value)]` for every parameter that has a flag, in field order; `as_flags` gives some
        parameters' values as their flags take them (a resolved path, a derived count). A None value leaves its
        flag out, a dict value gives one `flag + key` per entry; True gives the bare flag (a switch) and False
        leaves it out, a list or tuple gives the flag then each item."""
        spec = self.spec()
        unknown = set(as_flags) - set(spec)
        if unknown:
            raise TypeError(f"{type(self).__name__} has no parameters {sorted(unknown)}")
        argv: list[str] = []
        for name, p in spec.items():
            value = as_flags[name] if name in as_flags else getattr(self, name)
            if p.flag is None or value is None:
                continue
            for key, item in value.items() if isinstance(value, dict) else [("", value)]:
                if isinstance(item, bool):
                    argv += [p.flag + key] if item else []
                elif isinstance(item, (list, tuple)):
                    argv += [p.flag + key, *map(str, item)]
                else:
                    argv += [p.flag + key, str(item)]
        return argv
