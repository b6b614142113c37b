"""The compiled forms the replay kernel is built with, and which one runs each eviction policy.

The forms shipped with moesim -- each built-in policy's own (``form``, beside it in its module)
and the two that run the policies given as hooks, :class:`moesim.policies.hooks.PriorityHooks`
(the built-ins' ``compiled`` hook classes and a user's
:class:`~moesim.policies.hooks.HookEviction`) and :class:`moesim.policies.list_hooks.ListHooks` (a
user's :class:`~moesim.policies.list_hooks.HookListEviction`) -- fall in two groups
(:data:`GROUPS`): the common forms and the rare ones (``rare = True``). The kernel is compiled
once per group (numba's on-disk cache keeps each: the groups are made from moesim's own sources,
whose digest keys that cache), for the group of the replay's form: each form a kernel dispatches
to lengthens the compile of every function that calls it, so a replay of a common form never
compiles the rare ones. The group reaches the kernel as the type of ``A.hooks[FORM_GROUP]``
(:data:`MARKS`, a one-element array whose record field names the group:
:func:`moesim.simulator.kernel_cache.inline_forms`); within it, the replay's form is picked by its
index (:func:`form_index`, ``IS[C_FORM]``), so that the kernel names no policy. The kernel holds a
group's forms as their seven hooks each (:meth:`~moesim.policies.eviction.base.KernelForm.functions`),
the inlined forms' (``inline = True``, :data:`INLINE_FORMS`) apart from the called ones'
(:data:`CALLED_FORMS`). A group has at most one hook form (its part of ``A.hooks``:
:func:`hooks_of`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from moesim.jit import inline
from moesim.policies.eviction import REGISTRY
from moesim.policies.eviction.base import KernelForm
from moesim.policies.hooks import HookEviction, PriorityHooks, compiled
from moesim.policies.list_hooks import HookListEviction, ListHooks, compiled_lists

# the forms that run policies given as hooks (each in its own group: one ``A.hooks[HOOK_PART]``)
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


@inline
def _no_insert(key: int, demand: int, ai: int, S: Any, IS: np.ndarray, K: Any, DI: np.ndarray, A: Any) -> None:
    pass


@inline
def _no_access(key: int, ai: int, S: Any, IS: np.ndarray, K: Any, DI: np.ndarray, A: Any) -> None:
    pass


@inline
def _no_remove(key: int, evicted: int, S: Any, IS: np.ndarray, K: Any, A: Any) -> None:
    pass


@inline
def _no_victim(for_prefetch: bool, pin_gen: int, adm_layer: int, again: int, S: Any, IS: np.ndarray, K: Any,
               A: Any) -> int:
    return -1


class NoForm(KernelForm):
    """Hooks that do nothing: the one member of a group's inlined or called forms where it has
    none (the kernel's dispatch loops over both); never run (``IS[C_FORM]`` never names it)."""

    insert = staticmethod(_no_insert)
    access = staticmethod(_no_access)
    remove = staticmethod(_no_remove)
    victim = staticmethod(_no_victim)


def _group(forms: list[type[KernelForm]]) -> tuple[tuple[type[KernelForm], ...], tuple[type[KernelForm], ...]]:
    """A group's inlined forms and its called ones, each :class:`NoForm` alone where none is."""
    assert sum(f in HOOK_FORMS for f in forms) <= 1, forms
    inlined = tuple(f for f in forms if f.inline) or (NoForm,)
    called = tuple(f for f in forms if not f.inline) or (NoForm,)
    return inlined, called


_FORMS = _built_in_forms()
# each group's inlined forms and its called ones: the common forms (lru, fifo, least-stale; belady,
# the priority hooks), then the rare ones (SIEVE, S3-FIFO, ARC, the list hooks)
_SPLIT = (_group([f for f in _FORMS if not f.rare]), _group([f for f in _FORMS if f.rare]))
GROUPS: tuple[tuple[type[KernelForm], ...], ...] = tuple(i + c for i, c in _SPLIT)
INLINED: tuple[int, ...] = tuple(len(i) for i, _ in _SPLIT)
INLINE_FORMS: tuple[tuple[tuple[Any, ...], ...], ...] = tuple(tuple(f.functions() for f in i) for i, _ in _SPLIT)
CALLED_FORMS: tuple[tuple[tuple[Any, ...], ...], ...] = tuple(tuple(f.functions() for f in c) for _, c in _SPLIT)
MARK_FIELD = "form_group_"  # a mark's record field: this and the group's number
MARKS: tuple[np.ndarray, ...] = tuple(np.zeros(1, np.dtype([(f"{MARK_FIELD}{g}", np.int8)]))
                                      for g in range(len(GROUPS)))


def group_number(field: str) -> int:
    """The group a mark's record field (:data:`MARKS`) names."""
    assert field.startswith(MARK_FIELD), field
    return int(field[len(MARK_FIELD):])


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


def group_of(form: type[KernelForm]) -> int:
    """The group (:data:`GROUPS`) of compiled form ``form``."""
    return next(g for g, forms in enumerate(GROUPS) if form in forms)


def hooks_of(policy: Any, S: tuple[Any, ...]) -> tuple[Any, ...]:
    """``A.hooks`` for the replay of eviction policy ``policy`` (whose form's state is ``S``): the
    running hook form's state (``HOOK_STATE``), the hooks of its group's hook form (``HOOK_PART``:
    the policy's own where its form runs hooks, hooks never called in the others) and the group's
    mark (``FORM_GROUP``)."""
    form = form_of(type(policy))
    assert form is not None, type(policy)
    return _hooks(group_of(form), form.first_class(policy, S))


def unused_hooks(group: int = 0) -> tuple[Any, ...]:
    """``A.hooks`` whose hooks are never called (a replay of a form of ``group`` that runs
    none)."""
    return _hooks(group, None)


def _hooks(group: int, mine: tuple[Any, ...] | None) -> tuple[Any, ...]:
    from moesim.policies.hooks import unused_state

    if mine is not None:
        return (mine[1], mine[0], MARKS[group])
    hook_form = next((f for f in GROUPS[group] if f in HOOK_FORMS), None)
    part = hook_form.unused() if hook_form is not None else ()  # type: ignore[attr-defined]
    return (unused_state(), part, MARKS[group])


def form_index(cls: type) -> int:
    """The index in its group (:data:`GROUPS`) of the form that runs eviction policy class
    ``cls`` (which has one: :func:`form_of`)."""
    form = form_of(cls)
    assert form is not None, cls
    return GROUPS[group_of(form)].index(form)
