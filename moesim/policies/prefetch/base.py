"""The prefetch family's base: propose experts for later layers at a layer's routing point.

The engine calls :meth:`PrefetchPolicy.propose` after layer ``l``'s routing decision; the
proposed cache keys (:meth:`PolicyContext.key`) are queued on the copy engine behind
demand fetches. Policies with ``active = False`` are never called. Each policy is a module of
this package; this one holds what they share."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from moesim.errors import MoesimError
from moesim.jit import inline, jit
from moesim.policies.registry import Policy, PolicyContext, Registry


class PrefetchPolicy(Policy, ABC):
    """Base class of the prefetch family: per-layer proposals (``propose``; ``active = False``
    when there are none) and an admission rule (``pinned``: experts loaded before the replay
    and never evicted)."""

    active: ClassVar[bool] = True
    # what a replay of the policy needs (capability flags): ``piecewise``, its proposals at a
    # (pass, layer) read that pass or the one before it in its batch and nothing later (a trace
    # read in pieces can be replayed a piece at a time); ``reads_previous_pass``, they read the
    # pass before (serving forms each pass anew: there is none); ``counts_whole_trace``, it counts
    # over the whole trace before the replay (a first pass over a file read in pieces);
    # ``reads_predictions``, it needs the trace's ``pred_next`` column
    piecewise: ClassVar[bool] = False
    reads_previous_pass: ClassVar[bool] = False
    counts_whole_trace: ClassVar[bool] = False
    reads_predictions: ClassVar[bool] = False

    @abstractmethod
    def propose(self, pass_index: int, layer: int) -> Sequence[int]:
        """Cache keys to prefetch, most wanted first."""

    @classmethod
    def why_not_compiled(cls) -> str | None:
        """Why the compiled replay kernel cannot run the policy (a line; it runs on the SimPy
        path), or None: its :meth:`proposals` are made by compiled code from the trace alone
        (the kernel reads them as arrays), or it proposes nothing in the replay
        (``active = False``)."""
        return None if not cls.active else "it has no kernel form"

    def pinned(self) -> Sequence[int]:
        """Cache keys admitted before the replay starts (untimed) and never evicted. Default: none."""
        return ()

    def proposals(self, first: int, last: int) -> tuple[np.ndarray, np.ndarray]:
        """The proposals of every (pass, layer) of passes ``first .. last`` as arrays (what
        the compiled replay kernel reads): offsets (``(last - first) * num_layers + 1``; the
        proposals of (pass p, layer l) are ``keys[off[i]:off[i + 1]]`` with
        ``i = (p - first) * num_layers + l``) and int64 cache keys. Default: :meth:`propose`
        for each."""
        lists = [self.propose(p, layer) for p in range(first, last) for layer in range(self.ctx.num_layers)]
        off = np.zeros(len(lists) + 1, dtype=np.int64)
        np.cumsum([len(x) for x in lists], out=off[1:])
        keys = np.fromiter((k for x in lists for k in x), dtype=np.int64, count=int(off[-1]))
        return off, keys

    def piece_proposals(self, workload: Any) -> tuple[np.ndarray, np.ndarray] | None:
        """:meth:`proposals` of all the passes of ``workload`` (a piece of a trace read in
        pieces, not yet the one replayed), for a policy whose proposals read that workload and
        nothing else, no state of the policy's included: made on the thread that reads the next
        piece while the kernel replays this one (:func:`simulator.stream.read_ahead`). Default:
        None, not made ahead (the kernel asks :meth:`proposals` as it replays the piece)."""
        return None


REGISTRY: Registry[PrefetchPolicy] = Registry("prefetch")


def predictors() -> list[str]:
    """The registered prefetchers that read the trace's predicted next-layer scores
    (``reads_predictions``), in registration order."""
    return [name for name, cls in REGISTRY.items() if cls.reads_predictions]


def _keys_of(ctx: PolicyContext, pass_index: int, layer: int, wl: Any = None) -> list[int]:
    """Cache keys the workload (``ctx``'s, or ``wl``) accesses at (pass, layer), in access order."""
    wl = ctx.workload if wl is None else wl
    b = pass_index * ctx.num_layers + layer
    return ctx.cache_keys(wl.acc_layer[wl.off[b]:wl.off[b + 1]].astype(np.int64) * ctx.num_experts
                          + wl.acc_expert[wl.off[b]:wl.off[b + 1]]).tolist()


def _previous_pass(ctx: PolicyContext, pass_index: int) -> int | None:
    """The previous forward pass of the same batch group (the previous token), or None."""
    wl = ctx.workload
    if pass_index == 0 or wl.pass_group[pass_index - 1] != wl.pass_group[pass_index]:
        return None
    return pass_index - 1


def _need_pred_next(ctx: PolicyContext, name: str) -> None:
    if ctx.workload is None or ctx.workload.pred_next is None:
        raise MoesimError(
            f"prefetch policy '{name}' needs the trace's 'pred_next' column (the next layer's "
            "router probabilities predicted from this layer's hidden state), and this trace has "
            "none. Record it with `moesim capture --predict-next`, make a synthetic trace with "
            "workload.trace.synth.pred_next: true, or use prefetch: previous-token, which needs "
            "no hidden state.")


@dataclass(frozen=True)
class TopKParams:
    """Parameters of top-k next-gate prefetch."""

    overfetch: float = field(default=1.0, metadata={
        "help": "prefetch ceil(top_k * overfetch) experts per token (SpecMD §3.1.4)"})

    def __post_init__(self) -> None:
        if not self.overfetch > 0:
            raise ValueError(f"overfetch must be > 0, got {self.overfetch}")


class _ProposedInChunks(PrefetchPolicy):
    """A prefetcher whose proposals read the workload alone, made for many passes at once
    (:meth:`_proposals_of`, compiled): its compiled form. :meth:`propose` (the SimPy path's
    call, unless the policy writes its own) reads them from a chunk of :attr:`CHUNK` passes made
    at once, the kernel asks :meth:`proposals` for its calls, and a trace read in pieces makes
    each piece's on the reading thread (:meth:`piece_proposals`)."""

    CHUNK = 256

    @classmethod
    def why_not_compiled(cls) -> str | None:
        """None unless a subclass changed what it proposes on the SimPy path (``propose``) or
        how the kernel asks for the arrays (``proposals``) apart from the form that makes them
        (``_proposals_of``): a user's change the compiled form cannot know of."""
        def owner(name: str) -> type:
            return next(k for k in cls.__mro__ if name in k.__dict__)

        if owner("proposals") is _ProposedInChunks and issubclass(owner("_proposals_of"), owner("propose")):
            return None
        return "it has no kernel form (it changes propose or proposals apart from its compiled form)"

    def __init__(self, params: Any, ctx: PolicyContext) -> None:
        super().__init__(params, ctx)
        self._lo = self._hi = 0
        self._of: Any = None  # the workload the chunk was made from
        self._num_l = ctx.num_layers
        self._off = np.zeros(1, dtype=np.int64)
        self._keys = np.zeros(0, dtype=np.int64)

    def propose(self, pass_index: int, layer: int) -> Sequence[int]:
        wl = self.ctx.workload
        if wl is not self._of or not self._lo <= pass_index < self._hi:  # a chunk of this workload's
            self._of, self._lo, self._hi = wl, pass_index, min(pass_index + self.CHUNK, wl.num_passes)
            self._off, self._keys = self.proposals(self._lo, self._hi)
        i = (pass_index - self._lo) * self._num_l + layer
        return self._keys[self._off[i]:self._off[i + 1]].tolist()

    def proposals(self, first: int, last: int) -> tuple[np.ndarray, np.ndarray]:
        """Proposals of every (pass, layer) of passes ``first .. last`` at once."""
        return self._proposals_of(self.ctx.workload, first, last)

    def piece_proposals(self, workload: Any) -> tuple[np.ndarray, np.ndarray]:
        return self._proposals_of(workload, 0, workload.num_passes)

    @abstractmethod
    def _proposals_of(self, wl: Any, first: int, last: int) -> tuple[np.ndarray, np.ndarray]:
        """The proposals of passes ``first .. last`` of workload ``wl`` (offsets and cache
        keys, as :meth:`PrefetchPolicy.proposals`): they read ``wl``, the parameters and the
        layout alone (every buffer is the call's own)."""


class _Predicted(_ProposedInChunks):
    """A prefetcher whose proposals read the trace's predicted next-layer scores
    (``pred_next``) of each (pass, layer)'s tokens."""

    reads_predictions = True

    def _proposals_of(self, wl: Any, first: int, last: int) -> tuple[np.ndarray, np.ndarray]:
        num_l = self._num_l
        bounds = np.ascontiguousarray(wl.row_off[first * num_l:last * num_l + 1], dtype=np.int64)
        off, out = self._arrays(wl.pred_next, wl.row_order, bounds, first * num_l)
        return off, self.ctx.cache_keys(out)

    @abstractmethod
    def _arrays(self, pred: np.ndarray, row_order: np.ndarray, bounds: np.ndarray,
                g0: int) -> tuple[np.ndarray, np.ndarray]:
        """The proposals of the (pass, layer) groups ``g0 + g`` whose rows are
        ``row_order[bounds[g]:bounds[g + 1]]``: offsets and next-layer flat expert ids."""


class _Routed(_ProposedInChunks):
    """A prefetcher whose proposals are experts the trace routed: at layer ``l`` of pass ``p``,
    the experts of layers ``l + 1 .. l + ahead`` of pass ``p`` itself, or of the pass before it
    in its batch (the previous token) when the policy ``reads_previous_pass``: nearest layer
    first, each layer's in access order (:meth:`propose`, the reference form; compiled:
    :func:`routed_proposals`)."""

    def _ahead(self) -> int:
        """How many layers ahead it proposes."""
        return 1

    def _source(self, pass_index: int) -> tuple[Any, int] | None:
        """The workload and pass whose routing pass ``pass_index`` proposes, or None: the pass
        itself, or the one before it in its batch; serving gives a pass that reads the pass
        before the tokens its requests processed in their own last passes
        (``Workload.previous``, one pass)."""
        wl = self.ctx.workload
        if not self.reads_previous_pass:
            return wl, pass_index
        if wl.previous is not None:
            return wl.previous, 0
        prev = _previous_pass(self.ctx, pass_index)
        return None if prev is None else (wl, prev)

    def propose(self, pass_index: int, layer: int) -> Sequence[int]:
        src = self._source(pass_index)
        out: list[int] = []
        if src is not None:
            for t in range(layer + 1, min(layer + 1 + self._ahead(), self.ctx.num_layers)):
                out.extend(_keys_of(self.ctx, src[1], t, src[0]))
        return out

    def _proposals_of(self, wl: Any, first: int, last: int) -> tuple[np.ndarray, np.ndarray]:
        previous = self.reads_previous_pass
        if previous and wl.previous is not None:  # serving: a one-pass piece and its requests' last passes
            assert (first, last) == (0, 1), (first, last)
            wl, previous = wl.previous, False
        off, flat = routed_proposals(np.ascontiguousarray(wl.off, np.int64), wl.acc_layer, wl.acc_expert,
                                     wl.pass_group, first, last, self._num_l, self.ctx.num_experts, previous,
                                     self._ahead())
        return off, self.ctx.cache_keys(flat)


def routed_proposals(off: np.ndarray, acc_layer: np.ndarray, acc_expert: np.ndarray, group: np.ndarray,
                     first: int, last: int, num_l: int, num_e: int, previous: bool,
                     ahead: int) -> tuple[np.ndarray, np.ndarray]:
    """:class:`_Routed`'s proposals for passes ``first .. last`` of a workload (its access
    offsets ``off``, one entry per (pass, layer) and the end; each access's layer and expert;
    each pass's batch group): offsets (``off[0]`` = 0) and flat expert ids (``layer * num_e +
    e``). A pass's layers are consecutive in ``off``, so layers ``l + 1 .. l + ahead`` of the
    source pass are one run of accesses (:func:`_routed_runs`), copied in order."""
    groups = (last - first) * num_l
    starts = np.zeros(groups, dtype=np.int64)
    out_off = np.zeros(groups + 1, dtype=np.int64)
    _routed_runs(off, group, first, num_l, previous, ahead, starts, out_off)
    out = np.empty(out_off[-1], dtype=np.int64)
    _routed_copy(acc_layer, acc_expert, num_e, starts, out_off, out)
    return out_off, out


@jit
def _routed_source(p, group, previous):
    """The pass whose routing pass ``p`` proposes: itself, or the one before it in its batch
    (-1: none)."""
    if not previous:
        return p
    return p - 1 if p > 0 and group[p - 1] == group[p] else -1


@jit
def _routed_runs(off, group, first, num_l, previous, ahead, starts, out_off):
    """Where each (pass, layer) group's run of accesses starts (``starts``) and the running
    counts of :func:`routed_proposals` (``out_off[1:]``); the last layer's run is empty (its
    next layer is the next pass's first)."""
    for i in range(starts.shape[0]):
        src = _routed_source(first + i // num_l, group, previous)
        layer = i % num_l
        n = 0
        if src >= 0:
            lo = src * num_l + layer + 1
            starts[i] = off[lo]
            n = off[src * num_l + min(layer + 1 + ahead, num_l)] - off[lo]
        out_off[i + 1] = out_off[i] + n


@jit
def _routed_copy(acc_layer, acc_expert, num_e, starts, out_off, out):
    """Each group's run of accesses as flat expert ids, at its offset."""
    for i in range(starts.shape[0]):
        s = starts[i]
        o = out_off[i]
        for j in range(out_off[i + 1] - o):
            out[o + j] = np.int64(acc_layer[s + j]) * num_e + acc_expert[s + j]


def _proposing(bounds: np.ndarray, g0: int, num_l: int) -> np.ndarray:
    """The groups ``g`` (pass, layer ``(g0 + g) % num_l``) that propose: those with trace
    rows, not at the last layer."""
    rows = np.diff(bounds)
    return np.flatnonzero((rows > 0) & ((g0 + np.arange(len(rows))) % num_l + 1 < num_l))


def _offsets(groups: int, which: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Proposal offsets of ``groups`` groups (``off[0]`` = 0) from the counts of the
    proposing ones, ``which``; the others propose nothing."""
    off = np.zeros(groups + 1, dtype=np.int64)
    off[which + 1] = counts
    return np.cumsum(off, out=off)


@inline
def _row_sums(pred, row_order, r0, r1, sums):
    """The predictions of rows ``row_order[r0:r1]`` (``r0 < r1``) summed per expert into
    ``sums``: each taken as float32 and added in row order in float32."""
    for e in range(sums.shape[0]):
        sums[e] = np.float32(pred[row_order[r0], e])
    for r in range(r0 + 1, r1):
        for e in range(sums.shape[0]):
            sums[e] += np.float32(pred[row_order[r], e])


@inline
def _score_key(score, e):
    """A whole-number key that orders expert ``e`` by its float32 ``score``, highest last,
    then by index, lowest last: the high 32 bits hold the score's bits made
    signed-comparable (a negative float's magnitude bits flipped, after ``+ 0.0`` has made
    ``-0.0`` into ``0.0``, which compare equal as scores), the low 32 bits ``2**32 - 1 - e``, so
    that of two equal scores the lower index has the larger key."""
    bits = np.int64(np.float32(score + np.float32(0.0)).view(np.int32))
    if bits < 0:
        bits ^= 0x7FFFFFFF
    return (bits << 32) | (0xFFFFFFFF - e)


@inline
def _key_expert(key):
    """The expert index of a :func:`_score_key` key."""
    return 0xFFFFFFFF - (key & 0xFFFFFFFF)


@inline
def _key_mean(key, count):
    """The mean score a key of :func:`_percentile_keys` stands for: its float32 sum over
    ``count`` rows, in float64."""
    bits = np.int32(key >> 32)
    if bits < 0:
        bits ^= np.int32(0x7FFFFFFF)
    return np.float64(np.int32(bits).view(np.float32)) / count
