"""An independent cache-only replay written from the contract in ``docs/design.md``
("Simulation semantics", steps 5-8) and issue 11, for the differential tests. It imports
nothing from moesim: the access stream is a plain list of passes, each a list of layer cells
(the distinct experts of that (pass, layer) in router order, or ``None`` when the log lacks
the cell), and the policies are written here again, as plain lists.

Contract, as replayed here (every expert has the same size; capacity in experts):

- ``layer`` execution: at a layer's routing point every expert of the layer is pinned; the
  experts are looked up in router order (resident: hit; absent: miss, which evicts an
  unpinned victim chosen by the policy, or is not cached when none can be evicted); then the
  prefetcher's proposals are handled; after the layer's experts have run, its pins are
  released and the waiting proposals are admitted again.
- ``per-expert`` execution: the proposals are handled at the routing point, before the first
  expert runs, with none of the layer's experts pinned. ``pipelined`` fetch: expert j+1 is
  looked up when expert j starts to run (pinned: expert j, the running one); when expert j
  has run, expert j+1 starts (in a cache-only replay it has always arrived), so j+2's
  lookup comes first (pinned: j+1), then the admission round with j+1 and j+2 pinned: a
  freed slot goes to demand first. ``blocking`` fetch: expert j+1 is looked up when j has
  run (nothing pinned), then the admission round with j+1 pinned.
- proposals (SpecMD A.3's asynchronous queue): a proposal already resident is *selected* (the
  policy is told: least-stale marks it current; LRU, FIFO, FLD do not change); an absent one
  waits in the queue in order; at every admission round the queue is admitted from its head
  while room can be made, each admission evicting an unpinned victim (the policy may decline:
  least-stale evicts for a prefetch only a stale expert or a current one left of the
  execution point, never a current-layer expert still to run nor a current expert of a
  later layer) and entering as the newest entry; admissions for the same target layer stay
  pinned against later admissions; at the target layer's routing point the proposals still
  waiting are withdrawn.
- a collision miss is a miss on an expert evicted earlier in the same pass.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

Cell = list[int] | None
Pass = list[Cell]
Key = tuple[int, int]  # (layer, expert)


class RefPolicy:
    """Eviction order over the cached keys; the replay passes what is pinned."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.layer = 0  # the execution point: the layer being executed ...
        self.pending: set[Key] = set()  # ... and its routed experts that have not run yet
        self.pass_index = 0

    def insert(self, key: Key, demand: bool) -> None:
        raise NotImplementedError

    def use(self, key: Key) -> None:
        raise NotImplementedError

    def select(self, key: Key) -> None:
        """A resident expert selected by the prefetcher (not a use)."""

    def remove(self, key: Key) -> None:
        raise NotImplementedError

    def order(self, for_prefetch: bool) -> list[Key]:
        """Cached keys, most evictable first (for a prefetch: only those it may evict)."""
        raise NotImplementedError

    def new_pass(self, p: int) -> None:
        self.pass_index = p


class RefLRU(RefPolicy):
    def __init__(self, num_layers: int) -> None:
        super().__init__(num_layers)
        self.keys: list[Key] = []

    def insert(self, key: Key, demand: bool) -> None:
        self.keys.append(key)

    def use(self, key: Key) -> None:
        self.keys.remove(key)
        self.keys.append(key)

    def remove(self, key: Key) -> None:
        self.keys.remove(key)

    def order(self, for_prefetch: bool) -> list[Key]:
        return list(self.keys)


class RefFIFO(RefLRU):
    def use(self, key: Key) -> None:
        pass


class RefFLD(RefLRU):
    """Farthest |layer - current layer| first, ties by least recent use."""

    def order(self, for_prefetch: bool) -> list[Key]:
        rank = {k: i for i, k in enumerate(self.keys)}
        return sorted(self.keys, key=lambda k: (-abs(k[0] - self.layer), rank[k]))


class RefLeastStale(RefPolicy):
    """SpecMD §4.2. Stale (last touched in an earlier pass) before current; within each
    queue ``relative``: left layers (passed in this pass, and the current layer's experts
    other than its routed experts still to run) first, by layer, then upcoming layers
    farthest first; ``absolute``: layer index ascending. FIFO within a layer (order of joining the queue)."""

    def __init__(self, num_layers: int, order: str = "relative", left_order: str = "ascending") -> None:
        super().__init__(num_layers)
        self.mode = order
        self.left_order = left_order
        self.entries: dict[Key, list[int]] = {}  # key -> [pass touched, join counter]
        self.counter = 0

    def _touch(self, key: Key) -> None:
        ent = self.entries.get(key)
        if ent is not None and ent[0] == self.pass_index:
            return  # already current: keeps its place
        self.counter += 1
        self.entries[key] = [self.pass_index, self.counter]

    def insert(self, key: Key, demand: bool) -> None:
        self._touch(key)

    def use(self, key: Key) -> None:
        self._touch(key)

    def select(self, key: Key) -> None:
        self._touch(key)

    def remove(self, key: Key) -> None:
        del self.entries[key]

    def _place(self, key: Key) -> tuple[int, int]:
        layer = key[0]
        if self.mode == "absolute":
            return (0, layer)
        left = layer < self.layer or (layer == self.layer and key not in self.pending)
        if left:
            return (0, layer if self.left_order == "ascending" else -layer)
        return (1, -(layer - self.layer))

    def _upcoming(self, key: Key, stale: bool) -> bool:
        """Still needed in this pass after the execution point: a current-layer expert yet
        to run, or a current expert of a later layer (used, selected or admitted)."""
        layer = key[0]
        return (layer == self.layer and key in self.pending) or (not stale and layer > self.layer)

    def order(self, for_prefetch: bool) -> list[Key]:
        out = []
        for want_stale in (True, False):
            # stale entries: those touched in an earlier pass; among them the pass roll keeps
            # the join order (current entries became stale in their order)
            group = [k for k, (p, _c) in self.entries.items() if (p < self.pass_index) == want_stale
                     and not (for_prefetch and self._upcoming(k, want_stale))]
            group.sort(key=lambda k: (*self._place(k), self._join(k)))
            out.extend(group)
        return out

    def _join(self, key: Key) -> tuple[int, int]:
        p, c = self.entries[key]
        return (p, c)


POLICIES: dict[str, Callable[[int], RefPolicy]] = {
    "lru": RefLRU,
    "fifo": RefFIFO,
    "fld": RefFLD,
    "least-stale": lambda n: RefLeastStale(n, "relative"),
    "least-stale-absolute": lambda n: RefLeastStale(n, "absolute"),
}


class Counts:
    def __init__(self) -> None:
        self.hits = 0
        self.misses = 0
        self.collisions = 0
        self.uncached = 0
        self.prefetches = 0
        self.outcomes: list[bool] = []  # per lookup, in order: True for a hit

    def as_tuple(self) -> tuple[int, int, int]:
        return (self.hits, self.misses, self.collisions)


def replay(passes: list[Pass], capacity: int, policy: RefPolicy, mode: str = "layer",
           proposals: Callable[[int, int], list[Key]] | None = None, fetch: str = "pipelined") -> Counts:
    """Cache-only replay of ``passes`` (see the module docstring)."""
    cache: set[Key] = set()
    c = Counts()
    waiting: list[tuple[Key, int]] = []  # (key, target layer) in order
    admitted: dict[int, set[Key]] = {}  # target layer -> admitted keys
    evicted: set[Key] = set()

    def victim(pinned: set[Key], for_prefetch: bool) -> Key | None:
        for k in policy.order(for_prefetch):
            if k not in pinned:
                return k
        return None

    def evict(k: Key) -> None:
        cache.discard(k)
        policy.remove(k)
        evicted.add(k)
        for keys in admitted.values():
            keys.discard(k)

    def lookup(key: Key, pinned: set[Key]) -> None:
        c.outcomes.append(key in cache)
        if key in cache:
            c.hits += 1
            policy.use(key)
            return
        c.misses += 1
        if key in evicted:
            c.collisions += 1
        if len(cache) >= capacity:
            v = victim(pinned, False)
            if v is None:
                c.uncached += 1
                return
            evict(v)
        cache.add(key)
        policy.insert(key, True)

    def admit_round(pinned: set[Key]) -> None:
        while waiting:
            key, target = waiting[0]
            if key in cache:
                waiting.pop(0)
                continue
            if len(cache) >= capacity:
                v = victim(pinned | admitted.get(target, set()), True)
                if v is None:
                    return
                evict(v)
            waiting.pop(0)
            cache.add(key)
            policy.insert(key, False)
            admitted.setdefault(target, set()).add(key)
            c.prefetches += 1

    def propose(p: int, layer: int) -> None:
        if proposals is None:
            return
        for key in proposals(p, layer):
            if key in cache:
                policy.select(key)
            elif all(key != k for k, _t in waiting):
                waiting.append((key, key[0]))

    for p, cells in enumerate(passes):
        policy.new_pass(p)
        evicted.clear()
        for layer, cell in enumerate(cells):
            if cell is None:
                continue
            policy.layer = layer
            waiting[:] = [(k, t) for k, t in waiting if t > layer]
            for t in [t for t in admitted if t <= layer]:
                del admitted[t]
            keys = [(layer, e) for e in cell]
            policy.pending = set(keys)
            if mode == "layer":
                pinned = set(keys)
                for key in keys:
                    lookup(key, pinned)
                propose(p, layer)
                admit_round(pinned)
                policy.pending = set()
                admit_round(set())
            else:
                propose(p, layer)
                admit_round(set())
                n = len(keys)
                lookup(keys[0], set())
                looked = 1
                for j, key in enumerate(keys):
                    if fetch == "pipelined" and looked == j + 1 and looked < n:
                        lookup(keys[looked], {key})  # when expert j starts
                        looked += 1
                    policy.pending.discard(key)  # expert j has run
                    if fetch == "blocking":
                        held: set[Key] = set()
                        if looked < n:
                            lookup(keys[looked], set())
                            held = {keys[looked]}
                            looked += 1
                        admit_round(held)
                    elif looked == j + 2 and looked < n:  # j+1 starts now: j+2's lookup first
                        lookup(keys[looked], {keys[j + 1]})
                        looked += 1
                        admit_round({keys[j + 1], keys[j + 2]})
                    else:
                        admit_round({keys[j + 1]} if looked == j + 2 else set())
    return c


def oracle(passes: list[Pass]) -> Callable[[int, int], list[Key]]:
    """Proposals of oracle prefetch: the next layer's true experts in router order."""

    def props(p: int, layer: int) -> list[Key]:
        cells = passes[p]
        if layer + 1 >= len(cells) or cells[layer + 1] is None:
            return []
        return [(layer + 1, e) for e in cells[layer + 1]]

    return props


def mixtral_gsm8k_passes(path: Path, problem: int = 0, layers: int = 32) -> list[Pass]:
    """Problem ``problem`` of the Mixtral GSM8K routing log, read with ``json`` alone: one
    pass per decode token (by ``token_idx``), cells in rank order, ``None`` where missing."""
    by_token: dict[int, dict[int, list[int]]] = {}
    with path.open() as f:
        for line in f:
            rec = json.loads(line)
            if rec["problem_id"] != problem:
                continue
            by_token.setdefault(rec["token_idx"], {})[rec["layer"]] = list(rec["experts"])
    out: list[Pass] = []
    for t in sorted(by_token):
        cells: Pass = []
        for layer in range(layers):
            ex = by_token[t].get(layer)
            cells.append(None if ex is None else list(dict.fromkeys(ex)))
        out.append(cells)
    return out


def flame_prefill_passes(folder: Path, tokens_per_sequence: int = 64) -> list[Pass]:
    """FLAME-MoE prefill CSVs (one per layer, rows = tokens, ``expert_i`` = probability of a
    top-k expert, 0 elsewhere), read with ``csv`` alone: one pass per sequence of
    ``tokens_per_sequence`` rows; a cell lists the experts in order of first appearance, token
    by token, each token's experts by probability (descending, ties by lower index)."""
    import csv
    import re

    files = sorted(folder.glob("*.csv"), key=lambda f: int(re.search(r"layer(\d+)", f.name).group(1)))
    per_layer: list[list[list[int]]] = []
    for f in files:
        with f.open() as fh:
            rows = list(csv.DictReader(fh))
        cols = [c for c in rows[0] if c.startswith("expert_")]
        toks = []
        for row in rows:
            vals = [(float(row[c]), i) for i, c in enumerate(cols)]
            toks.append([i for v, i in sorted(vals, key=lambda x: (-x[0], x[1])) if v > 0])
        per_layer.append(toks)
    n_tok = len(per_layer[0])
    out: list[Pass] = []
    for s in range(n_tok // tokens_per_sequence):
        cells: Pass = []
        for toks in per_layer:
            seen: dict[int, None] = {}
            for t in range(s * tokens_per_sequence, (s + 1) * tokens_per_sequence):
                for e in toks[t]:
                    seen.setdefault(e, None)
            cells.append(list(seen))
        out.append(cells)
    return out


def trace_passes(trace: object) -> list[Pass]:
    """A batch-1 trace's passes from its plain arrays (``request``, ``step``, ``layer``,
    ``experts``; duck-typed, no moesim import): one pass per (request, step), its tokens by
    position, a cell's experts in order of first appearance, ``None`` for a layer without
    rows."""
    t: object = trace
    num_l = t.model.num_layers  # type: ignore[attr-defined]
    passes: dict[tuple[int, int], list[list[int] | None]] = {}
    rows = sorted(range(len(t.request)), key=lambda i: (int(t.request[i]), int(t.step[i]),  # type: ignore[attr-defined]
                                                        int(t.layer[i]), int(t.position[i])))  # type: ignore[attr-defined]
    for i in rows:
        key = (int(t.request[i]), int(t.step[i]))  # type: ignore[attr-defined]
        cells = passes.setdefault(key, [None] * num_l)
        layer = int(t.layer[i])  # type: ignore[attr-defined]
        cell = cells[layer] if cells[layer] is not None else []
        for e in t.experts[i].tolist():  # type: ignore[attr-defined]
            if e not in cell:
                cell.append(int(e))
        cells[layer] = cell
    return [passes[k] for k in sorted(passes)]
