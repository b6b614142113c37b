"""The miss policies' compiled forms the replay kernel is built with, and which one runs each
policy.

:data:`MISS_FORM_CLASSES` holds every compiled form shipped with moesim (``form``, declared in each
built-in policy's class beside its reference ``decide``), each as the tuple of its hooks
(:meth:`~moesim.policies.miss.base.MissForm.functions`). The kernel is compiled once with all of
them and runs the replay's by its index in the tuple (:func:`form_index`), so that it names no
policy. Last among them, :class:`~moesim.policies.miss.hooked.HookMissForm` runs every policy
written as a hook (:class:`~moesim.policies.miss.hooked.HookMiss`, a user's among them).
"""

from __future__ import annotations

from typing import Any

from moesim.policies.miss import REGISTRY
from moesim.policies.miss.base import MissForm
from moesim.policies.miss.hooked import HookMiss, HookMissForm, compiled_choose


def _shipped(cls: type) -> bool:
    return cls.__module__.startswith("moesim.")


def _built_in_forms() -> tuple[type[MissForm], ...]:
    forms: list[type[MissForm]] = []
    for _, cls in REGISTRY.items():
        form = cls.__dict__.get("form")
        if form is not None and _shipped(cls) and form not in forms:
            forms.append(form)
    return (*forms, HookMissForm)


MISS_FORM_CLASSES: tuple[type[MissForm], ...] = _built_in_forms()
FORM_HOOKS: tuple[tuple[Any, ...], ...] = tuple(f.functions() for f in MISS_FORM_CLASSES)


def form_of(cls: type) -> type[MissForm] | None:
    """The compiled form the kernel runs for miss policy class ``cls``, or None (the SimPy path):
    a built-in's own, declared in the class itself (a subclass elsewhere may change what it
    decides); :class:`HookMissForm` for a policy written as a hook whose hook compiles."""
    if issubclass(cls, HookMiss):
        return HookMissForm if isinstance(compiled_choose(cls), tuple) else None
    if not _shipped(cls):
        return None
    form: type[MissForm] | None = cls.__dict__.get("form")
    return form


def form_index(cls: type) -> int:
    """The index in :data:`MISS_FORM_CLASSES` of the form that runs miss policy class ``cls``
    (which has one: :func:`form_of`)."""
    form = form_of(cls)
    assert form is not None, cls
    return MISS_FORM_CLASSES.index(form)
