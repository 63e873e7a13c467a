"""Notebook parameters declared once, checked the same way in a notebook, a sweep grid and a console command.

A papermill parameter with a typo is only a warning to papermill and a silently unused variable to the
notebook; a bad value surfaces minutes later inside Ray. Each notebook therefore declares its
parameters as a `ParamSpec` table beside the code it drives (pipeline/train.py's TRAIN_PARAMS,
viz/explorer.py's EXPLORER_PARAMS, ...) and its second cell imports that module and calls
`notebook_params(globals(), module.SPEC, NAME)`, which fails in that cell with the list of accepted names (and
their help) for an unknown name or a bad value. The sweep checks every cell of a grid against the same table
before any cell runs. A bottom-layer module (it imports nothing of the package), so every layer declares its
notebook's table here without reaching up to pipeline/.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import FunctionType, ModuleType
from typing import Any


class ParameterError(ValueError):
    """A notebook or grid parameter that cannot be used; the message names it and lists what is accepted."""


Check = Callable[[Any], str | None]  # returns why the value is wrong, or None


@dataclass(frozen=True)
class Param:
    default: Any
    help: str
    types: tuple[type, ...] = ()
    choices: tuple[Any, ...] | None = None
    check: Check | None = None
    # The command-line flag the parameter becomes (a training parameter's, pipeline/train.py derives the argv);
    # a dict value gives one flag per key, `flag + key`. None: the notebook itself uses the value.
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
            return f"must be one of {list(self.choices)}"
        wrong_type = not isinstance(value, self.types) or isinstance(value, bool) and bool not in self.types
        if self.types and wrong_type:
            return f"must be {' or '.join(t.__name__ for t in self.types)}, got {type(value).__name__}"
        return self.check(value) if self.check else None


ParamSpec = Mapping[str, Param]


def positive(value: Any) -> str | None:
    return None if value > 0 else "must be > 0"


def accepted(spec: ParamSpec) -> str:
    """One line per accepted parameter: name, default, help."""
    return "\n".join(f"  {name} = {p.default!r}  # {p.help}" for name, p in spec.items())


def check_params(values: Mapping[str, Any], spec: ParamSpec, where: str = "parameters") -> dict[str, Any]:
    """Defaults overlaid with `values` (converted where lossless, see Param.converted), every name and value
    checked; raises ParameterError naming all faults."""
    faults = [f"unknown parameter {name!r}" for name in values if name not in spec]
    for name, value in values.items():
        if name in spec and (why := spec[name].problem(value)) is not None:
            faults.append(f"{name} = {value!r}: {why}")
    if faults:
        raise ParameterError(f"{where}: " + "; ".join(faults) + f"\naccepted parameters:\n{accepted(spec)}")
    return {name: p.converted(values[name]) if name in values else p.default for name, p in spec.items()}


def flag_argv(values: Mapping[str, Any], spec: ParamSpec) -> list[str]:
    """`[flag, str(value)]` for every parameter of `spec` that has a flag, in the spec's order; a None value
    leaves its flag out, a dict value gives one `flag + key` per entry."""
    argv: list[str] = []
    for name, param in spec.items():
        value = values[name]
        if param.flag is None or value is None:
            continue
        for key, item in value.items() if isinstance(value, dict) else [("", value)]:
            argv += [param.flag + key, str(item)]
    return argv


_IPYTHON_NAMES = frozenset({"In", "Out", "get_ipython", "exit", "quit", "open"})


_SEEN = "_openrlhf_tis_names_at_check"  # kept in the notebook's globals by the first check


def notebook_params(namespace: dict[str, Any], spec: ParamSpec, notebook: str) -> dict[str, Any]:
    """The parameters notebook `notebook` (declaring `spec`) runs with, read from its globals right after the
    parameters cell.

    Names papermill injected that the spec does not know are refused: every plain value in the kernel's
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
    checked = check_params(values, spec, where=f"{notebook}.ipynb parameters")
    if earlier is None:
        namespace[_SEEN] = frozenset(namespace)
    return checked
