"""Routing statistics of a trace: what makes routing non-uniform.

These are the statistics the realistic synthetic routing model is tuned to reproduce
(``docs/concepts/synthetic.md``) and that ``moesim trace info`` prints:

- ``top1_repeat``: probability that a token's top-1 expert at a layer equals the previous
  token's top-1 expert at the same layer (same request). Uniform routing gives 1/N.
- ``set_overlap``: mean fraction of a token's top-k set shared with the previous token's
  set at the same layer. Uniform routing gives k/N.
- ``popularity_skew``: 1 - H(p_l)/log N averaged over layers, where p_l is the share of
  selections each expert receives at layer l (0 for perfectly even use).
- ``layer_mi``: normalised mutual information I(X_l; X_{l+1}) / H(X_{l+1}) between a token's
  top-1 experts at consecutive layers, averaged over layer pairs (0 when independent).
  Plug-in estimates are biased upwards on small samples, so compare traces of similar size.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from moesim.traces.schema import PHASE_CODES
from moesim.traces.trace import Trace


def _entropy(counts: np.ndarray) -> float:
    total = counts.sum()
    if total <= 0:
        return 0.0
    p = counts[counts > 0] / total
    return float(-(p * np.log(p)).sum())


def sequence_stats(seqs: Sequence[np.ndarray], num_experts: int) -> dict[str, float]:
    """Statistics over token sequences, each an int array ``[tokens, layers, k]``.

    Entries equal to -1 mark missing (token, layer) cells and are skipped.
    """
    repeat_hits = repeat_n = 0
    overlap_sum = 0.0
    overlap_n = 0
    num_layers = max((s.shape[1] for s in seqs), default=0)
    pop = np.zeros((num_layers, num_experts), dtype=np.int64)
    joint = np.zeros((max(num_layers - 1, 0), num_experts, num_experts), dtype=np.int64)
    for s in seqs:
        if s.shape[0] == 0:
            continue
        k = s.shape[2]
        valid: np.ndarray = np.asarray((s >= 0).all(axis=2))  # [T, L]
        top1 = s[:, :, 0]
        pair = valid[1:] & valid[:-1]
        repeat_hits += int(((top1[1:] == top1[:-1]) & pair).sum())
        repeat_n += int(pair.sum())
        # set overlap between consecutive tokens, same layer
        eq = (s[1:, :, :, None] == s[:-1, :, None, :]).any(axis=3).sum(axis=2)  # [T-1, L]
        overlap_sum += float((eq[pair] / k).sum())
        overlap_n += int(pair.sum())
        for layer in range(s.shape[1]):
            ids = s[valid[:, layer], layer, :].reshape(-1)
            pop[layer] += np.bincount(ids, minlength=num_experts)
            if layer + 1 < s.shape[1]:
                both = valid[:, layer] & valid[:, layer + 1]
                np.add.at(joint[layer], (top1[both, layer], top1[both, layer + 1]), 1)
    logn = np.log(num_experts)
    skew = [1.0 - _entropy(pop[layer]) / logn for layer in range(num_layers) if pop[layer].sum()]
    mis = []
    for j in joint:
        n = j.sum()
        if n == 0:
            continue
        h_next = _entropy(j.sum(axis=0))
        if h_next <= 0:
            continue
        mi = _entropy(j.sum(axis=1)) + h_next - _entropy(j.reshape(-1))
        mis.append(mi / h_next)
    return {
        "top1_repeat": repeat_hits / repeat_n if repeat_n else float("nan"),
        "set_overlap": overlap_sum / overlap_n if overlap_n else float("nan"),
        "popularity_skew": float(np.mean(skew)) if skew else float("nan"),
        "layer_mi": float(np.mean(mis)) if mis else float("nan"),
    }


def trace_sequences(trace: Trace, phases: tuple[str, ...] = ("decode",)) -> list[np.ndarray]:
    """Per-request ``[tokens, layers, k]`` arrays (ordered by position; -1 = missing cell)."""
    codes = [PHASE_CODES[p] for p in phases]
    mask = np.isin(trace.phase, codes)
    if not mask.any():
        return []
    req = trace.request[mask]
    pos = trace.position[mask]
    lay = trace.layer[mask].astype(np.int64)
    exp = trace.experts[mask]
    num_layers = trace.model.num_layers
    k = trace.model.top_k
    out = []
    order = np.lexsort((lay, pos, req))
    req, pos, lay, exp = req[order], pos[order], lay[order], exp[order]
    bounds = np.flatnonzero(np.diff(req)) + 1
    for lo, hi in zip(np.r_[0, bounds], np.r_[bounds, len(req)], strict=True):
        upos, tok_idx = np.unique(pos[lo:hi], return_inverse=True)
        seq = np.full((len(upos), num_layers, k), -1, dtype=np.int64)
        seq[tok_idx, lay[lo:hi]] = exp[lo:hi]
        out.append(seq)
    return out


def trace_stats(trace: Trace, phases: tuple[str, ...] = ("decode",)) -> dict[str, float]:
    """:func:`sequence_stats` of a trace's rows in ``phases``."""
    return sequence_stats(trace_sequences(trace, phases), trace.model.num_experts)
