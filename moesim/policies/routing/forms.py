"""The routing policies' compiled forms the replay kernel is built with, and which one runs
each policy.

:data:`ROUTING_FORM_CLASSES` holds every compiled form shipped with moesim (``form``, declared in
each built-in policy's class beside its reference ``route``), each as the tuple of its functions
(:meth:`~moesim.policies.routing.base.RoutingForm.functions`). The kernel is compiled with all
of them and runs the replay's by its index in the tuple (:func:`form_index`), so that it names
no policy. Last among them, :class:`~moesim.policies.routing.hooked.HookRoutingForm` runs every
policy written as a hook (:class:`~moesim.policies.routing.hooked.HookRouting`, a user's among
them).
"""

from __future__ import annotations

from typing import Any

from moesim.policies.routing import REGISTRY
from moesim.policies.routing.base import RoutingForm
from moesim.policies.routing.hooked import HookRouting, HookRoutingForm, compiled_choose


def _shipped(cls: type) -> bool:
    return cls.__module__.startswith("moesim.")


def _built_in_forms() -> tuple[type[RoutingForm], ...]:
    forms: list[type[RoutingForm]] = []
    for _, cls in REGISTRY.items():
        form = cls.__dict__.get("form")
        if form is not None and _shipped(cls) and form not in forms:
            forms.append(form)
    return (*forms, HookRoutingForm)


ROUTING_FORM_CLASSES: tuple[type[RoutingForm], ...] = _built_in_forms()
ROUTE_HOOKS: tuple[tuple[Any, ...], ...] = tuple(f.functions() for f in ROUTING_FORM_CLASSES)


def form_of(cls: type) -> type[RoutingForm] | None:
    """The compiled form the kernel runs for routing policy class ``cls``, or None (the SimPy
    path): a built-in's own, declared in the class itself (a subclass elsewhere may change what
    it routes); :class:`HookRoutingForm` for a policy written as a hook whose hook compiles."""
    if issubclass(cls, HookRouting):
        return HookRoutingForm if isinstance(compiled_choose(cls), tuple) else None
    if not _shipped(cls):
        return None
    form: type[RoutingForm] | None = cls.__dict__.get("form")
    return form


def form_index(cls: type) -> int:
    """The index in :data:`ROUTING_FORM_CLASSES` of the form that runs routing policy class
    ``cls`` (which has one: :func:`form_of`)."""
    form = form_of(cls)
    assert form is not None, cls
    return ROUTING_FORM_CLASSES.index(form)
