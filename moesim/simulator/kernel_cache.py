"""The replay kernel's cache (:mod:`simulator.cache`'s model): the eviction policy's compiled form
told of the cache's events and asked for victims under the pinning rule, room made for an
entry, insertion.

The form is one of a group of forms (:data:`moesim.policies.eviction.forms.GROUPS`), the group
named by the type of ``A.hooks[FORM_GROUP]`` (so that the kernel is compiled for that group's
forms alone: :func:`inline_forms`), the form picked by its index in the group (``IS[C_FORM]``):
each event goes to that form's hook, with the form's own state arrays (``A.form``). The loops over
a group's forms are unrolled when the kernel compiles: the hooks of the forms declared ``inline``
are inlined where the kernel calls them, the others' are reached through one compiled function
per hook (``_called_*``).
"""

from __future__ import annotations

from typing import Any

from moesim.jit import HAVE_NUMBA, literal_unroll
from moesim.jit import inline as _inline
from moesim.jit import kernel as _jit
from moesim.kernel_state import (
    ABSENT,
    C_FORM,
    C_INSTANT,
    C_KEEPSTATIC,
    C_PUREVICT,
    CF_CAP,
    INFLIGHT,
    R_PFUSED,
    RESIDENT,
    S_MAXUSED,
    S_NRES,
    S_PASS,
    S_USED,
    _nbytes,
    _victims_scratch,
)
from moesim.policies.eviction.base import FORM_GROUP
from moesim.policies.eviction.forms import CALLED_FORMS, INLINE_FORMS, INLINED, group_number
from moesim.simulator.kernel_copy import _complete

# a form's hooks, in the order of KernelForm.functions
_INSERT, _ACCESS, _REMOVE, _SELECT, _NEW_PASS, _MISS, _VICTIM = range(7)


def inline_forms(mark: Any) -> tuple[Any, ...]:
    """The hooks of the inlined forms of the group that ``mark`` (``A.hooks[FORM_GROUP]``)
    names. Compiled, a constant: the group is read from the mark's type, so that each function
    that calls it is compiled once per group, with that group's forms alone."""
    return INLINE_FORMS[group_number(mark.dtype.names[0])]


def called_forms(mark: Any) -> tuple[Any, ...]:
    """The hooks of the called forms of the group that ``mark`` names (as :func:`inline_forms`)."""
    return CALLED_FORMS[group_number(mark.dtype.names[0])]


def inlined(mark: Any) -> int:
    """How many of the group's forms (that ``mark`` names) are inlined: the first called form's
    index."""
    return INLINED[group_number(mark.dtype.names[0])]


if HAVE_NUMBA:
    from numba.extending import overload

    def _group_of_type(mark: Any) -> int:
        return group_number(next(iter(mark.dtype.fields)))

    def _constant_per_group(stub: Any, table: tuple[Any, ...]) -> None:
        """Compiled, ``stub(mark)`` is the constant ``table`` holds for the group the mark's type
        names."""

        @overload(stub, inline="always")
        def typed(mark: Any) -> Any:
            value = table[_group_of_type(mark)]

            def impl(mark: Any) -> Any:
                return value
            return impl

    for _stub, _table in ((inline_forms, INLINE_FORMS), (called_forms, CALLED_FORMS), (inlined, INLINED)):
        _constant_per_group(_stub, _table)


@_inline
def _kept_out(key, IS, K):
    """Whether the form never hears of ``key``: a statically pinned key, for a form that leaves
    them out (``keeps_static = False``; they are never victims, loaded by ``_preload`` and never
    inserted again)."""
    return K[key].static and not IS[C_KEEPSTATIC]


@_inline
def _on_insert(key, demand, ai, IS, K, DI, A):
    """The form's ``insert``: ``key`` entered the cache (``demand``: a use; ``ai`` its access)."""
    f, n = IS[C_FORM], inlined(A.hooks[FORM_GROUP])
    if f >= n:
        _called_insert(f - n, key, demand, ai, IS, K, DI, A)
        return
    i = 0
    for form in literal_unroll(inline_forms(A.hooks[FORM_GROUP])):
        if i == f:
            form[_INSERT](key, demand, ai, A.form, IS, K, DI, A)
        i += 1


@_jit
def _called_insert(f, key, demand, ai, IS, K, DI, A):
    i = 0
    for form in literal_unroll(called_forms(A.hooks[FORM_GROUP])):
        if i == f:
            form[_INSERT](key, demand, ai, A.form, IS, K, DI, A)
        i += 1


@_inline
def _on_access(key, ai, IS, K, DI, A):
    """The form's ``access``: a hit or a late prefetch used ``key``."""
    if _kept_out(key, IS, K):
        return
    f, n = IS[C_FORM], inlined(A.hooks[FORM_GROUP])
    if f >= n:
        _called_access(f - n, key, ai, IS, K, DI, A)
        return
    i = 0
    for form in literal_unroll(inline_forms(A.hooks[FORM_GROUP])):
        if i == f:
            form[_ACCESS](key, ai, A.form, IS, K, DI, A)
        i += 1


@_jit
def _called_access(f, key, ai, IS, K, DI, A):
    i = 0
    for form in literal_unroll(called_forms(A.hooks[FORM_GROUP])):
        if i == f:
            form[_ACCESS](key, ai, A.form, IS, K, DI, A)
        i += 1


@_inline
def _on_remove(key, evicted, IS, K, A):
    """The form's ``remove``: ``key`` left the cache, ``evicted`` (1) or withdrawn (0)."""
    f, n = IS[C_FORM], inlined(A.hooks[FORM_GROUP])
    if f >= n:
        _called_remove(f - n, key, evicted, IS, K, A)
        return
    i = 0
    for form in literal_unroll(inline_forms(A.hooks[FORM_GROUP])):
        if i == f:
            form[_REMOVE](key, evicted, A.form, IS, K, A)
        i += 1


@_jit
def _called_remove(f, key, evicted, IS, K, A):
    i = 0
    for form in literal_unroll(called_forms(A.hooks[FORM_GROUP])):
        if i == f:
            form[_REMOVE](key, evicted, A.form, IS, K, A)
        i += 1


@_inline
def _on_select(key, IS, K, A):
    """The form's ``select``: a prefetcher selected the cached ``key`` (``on_prefetch_select``)."""
    if _kept_out(key, IS, K):
        return
    f, n = IS[C_FORM], inlined(A.hooks[FORM_GROUP])
    if f >= n:
        _called_select(f - n, key, IS, K, A)
        return
    i = 0
    for form in literal_unroll(inline_forms(A.hooks[FORM_GROUP])):
        if i == f:
            form[_SELECT](key, A.form, IS, K)
        i += 1


@_jit
def _called_select(f, key, IS, K, A):
    i = 0
    for form in literal_unroll(called_forms(A.hooks[FORM_GROUP])):
        if i == f:
            form[_SELECT](key, A.form, IS, K)
        i += 1


@_jit
def _new_pass(IS, K, A):
    """The form's ``new_pass``: a forward pass begins."""
    f = IS[C_FORM]
    i = 0
    for form in literal_unroll(inline_forms(A.hooks[FORM_GROUP])):
        if i == f:
            form[_NEW_PASS](A.form, IS, K)
        i += 1
    for form in literal_unroll(called_forms(A.hooks[FORM_GROUP])):
        if i == f:
            form[_NEW_PASS](A.form, IS, K)
        i += 1


@_inline
def _on_miss(key, IS, K, A):
    """The form's ``miss``: a demand lookup missed ``key``; room is about to be made for it."""
    f, n = IS[C_FORM], inlined(A.hooks[FORM_GROUP])
    if f >= n:
        _called_miss(f - n, key, IS, K, A)
        return
    i = 0
    for form in literal_unroll(inline_forms(A.hooks[FORM_GROUP])):
        if i == f:
            form[_MISS](key, A.form, IS, K, A)
        i += 1


@_jit
def _called_miss(f, key, IS, K, A):
    i = 0
    for form in literal_unroll(called_forms(A.hooks[FORM_GROUP])):
        if i == f:
            form[_MISS](key, A.form, IS, K, A)
        i += 1


@_jit
def _find_victim(for_prefetch, pin_gen, adm_layer, again, IS, K, A):
    """The form's next victim that the cache may evict (resident, not pinned, not statically
    pinned, not an earlier admission for ``adm_layer``), or -1; ``again``: the walk of the call
    before goes on."""
    f, n = IS[C_FORM], inlined(A.hooks[FORM_GROUP])
    if f >= n:
        return _called_victim(f - n, for_prefetch, pin_gen, adm_layer, again, IS, K, A)
    i = 0
    v = -1
    for form in literal_unroll(inline_forms(A.hooks[FORM_GROUP])):
        if i == f:
            v = form[_VICTIM](for_prefetch, pin_gen, adm_layer, again, A.form, IS, K, A)
        i += 1
    return v


@_jit
def _called_victim(f, for_prefetch, pin_gen, adm_layer, again, IS, K, A):
    i = 0
    v = -1
    for form in literal_unroll(called_forms(A.hooks[FORM_GROUP])):
        if i == f:
            v = form[_VICTIM](for_prefetch, pin_gen, adm_layer, again, A.form, IS, K, A)
        i += 1
    return v


@_inline
def _evict(key, IS, K, A):
    if K[key].state == RESIDENT:  # as every victim is (``evictable``), never statically pinned
        IS[S_NRES] -= 1
    K[key].state = ABSENT
    IS[S_USED] -= _nbytes(key, IS)
    _on_remove(key, 1, IS, K, A)
    K[key].unused = 0
    K[key].evicted = IS[S_PASS]


@_inline
def _evict_for(key, for_prefetch, IS, K, A):
    """Evict a victim; one evicted for a prefetch is no longer an admission."""
    _evict(key, IS, K, A)
    if for_prefetch:
        K[key].adm = 0


@_inline
def _room(nb, for_prefetch, pin_gen, adm_layer, IS, K, FS, A):
    """Make room for an entry of ``nb`` bytes (the victim walk of ``ExpertCache.fetch``):
    evict victims in the policy's order until enough is free. Returns how many were evicted
    (0: it fits), or -1 when the entries that may be evicted cannot free enough (no entry
    changed). With entries of one size one victim is always enough; several are
    :func:`_victims`'s."""
    free = FS[CF_CAP] - IS[S_USED]
    if nb <= free:
        return 0
    if nb > FS[CF_CAP] or (IS[C_PUREVICT] and IS[S_NRES] == 0):
        return -1  # too large, or no key is resident: a walk that changes nothing would find none
    v = _find_victim(for_prefetch, pin_gen, adm_layer, 0, IS, K, A)
    if v == -1:
        return -1
    if nb > free + _nbytes(v, IS):
        return _victims(nb, free, v, for_prefetch, pin_gen, adm_layer, IS, K, A)
    _evict_for(v, for_prefetch, IS, K, A)
    return 1


@_jit
def _victims(nb, free, v, for_prefetch, pin_gen, adm_layer, IS, K, A):
    """:func:`_room` when the first victim ``v`` is not enough: each victim found is pinned
    while the walk goes on to the next (its pin restored after); all are evicted once they
    free enough, none when the walk runs out."""
    vict = _victims_scratch(IS)
    n = 0
    while v != -1:
        vict[2 * n] = v
        vict[2 * n + 1] = K[v].pin
        K[v].pin = pin_gen
        n += 1
        free += _nbytes(v, IS)
        if nb <= free:
            break
        v = _find_victim(for_prefetch, pin_gen, adm_layer, 1, IS, K, A)
    for j in range(n):  # the pins as they were
        K[vict[2 * j]].pin = vict[2 * j + 1]
    if v == -1:
        return -1
    for j in range(n):
        _evict_for(vict[2 * j], for_prefetch, IS, K, A)
    return n


@_inline
def _insert(key, tid, demand, ai, IS, K, T, DI, A):
    """The cache's ``reserve``: an in-flight entry for ``key`` (room was made)."""
    K[key].state = INFLIGHT
    K[key].tid = tid
    IS[S_USED] += _nbytes(key, IS)
    if IS[S_USED] > IS[S_MAXUSED]:
        IS[S_MAXUSED] = IS[S_USED]
    _on_insert(key, demand, ai, IS, K, DI, A)
    if IS[C_INSTANT]:
        _complete(tid, IS, K, T)


@_inline
def _used_prefetch(key, IS, K):
    if K[key].unused:
        K[key].unused = 0
        IS[R_PFUSED] += 1

