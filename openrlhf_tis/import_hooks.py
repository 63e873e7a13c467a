"""Run a patch exactly when its upstream module is imported, in whichever process that happens.

Patches are applied explicitly (`openrlhf_tis.patches.apply_platform_patches(device)`), but their targets must not be
imported eagerly: OpenRLHF keeps deepspeed out of its vLLM processes on purpose
(openrlhf/trainer/ray/__init__.py), and importing the trainer stack there would undo that. So a
patch registers a hook; the hook fires right after the target module executes (or at once when it
was already imported). `around_import` wraps the module's execution instead, for patches that must
act while it runs.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from types import ModuleType

from openrlhf_tis.upstream_guards import PatchTargetMissingError

_after: dict[str, list[Callable[[ModuleType], None]]] = {}
_around: dict[str, list[Callable[[], AbstractContextManager]]] = {}


class _PatchFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the real loader of a hooked module."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _after and fullname not in _around:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):  # no hook would fire: say so
            raise PatchTargetMissingError(f"a patch waits on the import of {fullname}, whose loader "
                                          f"({type(spec.loader).__name__}) cannot be hooked; review patches/")
        real_exec = spec.loader.exec_module

        def exec_module(module, _real=real_exec, _name=fullname):
            with contextlib.ExitStack() as stack:
                for ctx in _around.pop(_name, []):
                    stack.enter_context(ctx())
                _real(module)
            for hook in _after.pop(_name, []):
                hook(module)

        spec.loader.exec_module = exec_module
        return spec


_FINDER = _PatchFinder()


def _install() -> None:
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def after_import(module_name: str, hook: Callable[[ModuleType], None]) -> None:
    """Call hook(module) right after `module_name` is imported, or now if it already is."""
    module = sys.modules.get(module_name)
    if module is not None:
        hook(module)
        return
    _after.setdefault(module_name, []).append(hook)
    _install()


def around_import(module_name: str, ctx: Callable[[], AbstractContextManager]) -> bool:
    """Run the import of `module_name` inside ctx(); False when it was already imported."""
    if module_name in sys.modules:
        return False
    _around.setdefault(module_name, []).append(ctx)
    _install()
    return True


def pending() -> list[str]:
    """Modules whose hooks have not fired yet (for tests and diagnostics)."""
    return sorted(set(_after) | set(_around))


def is_available(module_name: str) -> bool:
    """True when `module_name` can be imported (without importing it)."""
    return importlib.util.find_spec(module_name) is not None
