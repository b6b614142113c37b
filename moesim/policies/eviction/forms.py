"""The compiled forms the replay kernel is built with, and which one runs each eviction policy.

:data:`FORM_CLASSES` holds every compiled form shipped with moesim -- each built-in policy's own
(``form``, beside it in its module) and the two forms that run the policies given as hooks
(:data:`HOOK_FORMS`): :class:`moesim.policies.hooks.PriorityHooks` (the built-ins' ``compiled``
hook classes and a user's :class:`~moesim.policies.hooks.HookEviction`) and
:class:`moesim.policies.list_hooks.ListHooks` (a user's
:class:`~moesim.policies.list_hooks.HookListEviction`) -- each as the tuple of its seven hooks
(:meth:`~moesim.policies.eviction.base.KernelForm.functions`: :data:`INLINE_FORMS`, then
:data:`CALLED_FORMS`). The kernel is compiled once with all of them (numba's on-disk cache keeps
it: the tuple is made from moesim's own sources, whose digest keys that cache) and runs the
replay's form by its index in the tuple (:func:`form_index`), so that it names no policy.
"""

from __future__ import annotations

from typing import Any

from moesim.policies.eviction import REGISTRY
from moesim.policies.eviction.base import KernelForm
from moesim.policies.hooks import HookEviction, PriorityHooks, compiled
from moesim.policies.list_hooks import HookListEviction, ListHooks, compiled_lists

# the forms that run policies given as hooks, each with its part of ``A.hooks`` (in this order:
# PRIORITY_HOOKS, LIST_HOOKS)
HOOK_FORMS: tuple[type[KernelForm], ...] = (PriorityHooks, ListHooks)


def _shipped(cls: type) -> bool:
    return cls.__module__.startswith("moesim.")


def _built_in_forms() -> list[type[KernelForm]]:
    forms: list[type[KernelForm]] = []
    for _, cls in REGISTRY.items():
        form = cls.__dict__.get("form")
        if form is not None and _shipped(cls) and form not in forms:
            forms.append(form)
    return [*forms, *HOOK_FORMS]


# the forms whose hooks are inlined where the kernel calls them come first (``inline = True``: the
# hot lists of lru, fifo and least-stale); the others are called through one compiled function per
# hook, which keeps the kernel's compile short (every form inlined at every call site doubled it)
FORM_CLASSES: tuple[type[KernelForm], ...] = tuple(sorted(_built_in_forms(), key=lambda f: not f.inline))
INLINED = sum(f.inline for f in FORM_CLASSES)
INLINE_FORMS: tuple[tuple[Any, ...], ...] = tuple(f.functions() for f in FORM_CLASSES[:INLINED])
CALLED_FORMS: tuple[tuple[Any, ...], ...] = tuple(f.functions() for f in FORM_CLASSES[INLINED:])


def form_of(cls: type) -> type[KernelForm] | None:
    """The compiled form the kernel runs for eviction policy class ``cls``, or None (the SimPy
    path): a built-in's own form or compiled hooks (declared in the class itself: a subclass
    elsewhere may change what it does), a hook policy whose hooks numba compiles."""
    if _shipped(cls):
        form: type[KernelForm] | None = cls.__dict__.get("form")
        if form is not None:
            return form
        if cls.__dict__.get("compiled") is not None:
            return PriorityHooks
    if issubclass(cls, HookEviction) and isinstance(compiled(cls), tuple):
        return PriorityHooks
    if issubclass(cls, HookListEviction) and isinstance(compiled_lists(cls), tuple):
        return ListHooks
    return None


def hooks_of(policy: Any, S: tuple[Any, ...]) -> tuple[tuple[Any, ...], ...]:
    """``A.hooks`` for the replay of eviction policy ``policy`` (whose form's state is ``S``): its
    form's part (:meth:`~moesim.policies.eviction.base.KernelForm.first_class`) where that form
    runs hooks, hooks never called in the others, then the running form's state
    (``HOOK_STATE``)."""
    form = form_of(type(policy))
    mine = form.first_class(policy, S) if form is not None else None
    if mine is None:
        return unused_hooks()
    parts = tuple(mine[0] if f is form else f.unused() for f in HOOK_FORMS)  # type: ignore[attr-defined]
    return (*parts, mine[1])


def unused_hooks() -> tuple[tuple[Any, ...], ...]:
    """``A.hooks`` whose hooks are never called (a replay of a form that runs none)."""
    from moesim.policies.hooks import unused_state

    return (*(f.unused() for f in HOOK_FORMS), unused_state())  # type: ignore[attr-defined]


def form_index(cls: type) -> int:
    """The index in :data:`FORM_CLASSES` of the form that runs eviction policy class ``cls`` (which has
    one: :func:`form_of`)."""
    form = form_of(cls)
    assert form is not None, cls
    return FORM_CLASSES.index(form)
