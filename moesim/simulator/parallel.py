"""Expert parallelism (``hardware.gpus`` G > 1; ``docs/concepts/simulation.md``): the
experts of each layer are placed on the G GPUs (``hardware.placement``) and stay resident
there (no host offload, so cache, eviction, miss, prefetch and routing policies do not apply);
attention runs data-parallel with a pass's tokens split across the GPUs, and each layer's
tokens cross the EP link to the GPUs of their experts and back. :class:`ExpertParallel` is the
collaborator the SimPy process (:class:`simulator.engine.Simulation`) is given for it."""

from __future__ import annotations

from functools import cached_property
from typing import Any

import numpy as np

from moesim.simulator.lookup import plan


class ExpertParallel:
    """A replay's layers under expert parallelism. ``sim`` is the replay
    (:class:`simulator.engine.Simulation`): its workload, costs, clock, pass row and
    timeline, read as each layer runs."""

    def __init__(self, sim: Any) -> None:
        self.sim = sim
        self.gpus = sim.scenario.hardware.gpus

    def nonexpert_times(self) -> list[float]:
        """Each pass's non-expert seconds, with the pass's tokens and context split across the
        GPUs (zero in cache-only replay, where no time passes)."""
        sim = self.sim
        wl, g_n = sim.wl, self.gpus
        if not sim.timing:
            return [0.0] * wl.num_passes
        return sim.cost.nonexpert_time(np.ceil(wl.pass_tokens / g_n),
                                       np.ceil(wl.pass_context * sim.costs.attn_scale / g_n)).tolist()

    def step(self, p: int, layer: int, nonexp: float) -> float:
        """One layer, from its start: the budget policy plans it as on one GPU
        (:func:`simulator.lookup.plan`; XShare Algorithm 6 balances the per-GPU load) and the
        pass's row counts it as on one GPU (:meth:`PassRow.count_tokens`); returns its
        non-expert seconds plus :meth:`layer`'s time."""
        sim = self.sim
        sim.clock.layer = layer
        rows = sim.wl.rows(p, layer)
        t_layer = nonexp
        if rows.size:
            orig, chosen = plan(sim, p, layer, rows, None)
            sim.row.count_tokens(sim.wl, rows, orig, [set(c) for c in chosen])
            t_layer += self.layer(p, layer, chosen, nonexp)
        return t_layer

    @cached_property
    def owner(self) -> np.ndarray:
        """The GPU of each (layer, expert)."""
        from moesim.policies.budget.xshare import placement_of

        sim = self.sim
        hw = sim.scenario.hardware
        return placement_of(hw.placement, sim.model.num_layers, sim.model.num_experts, hw.gpus)

    def layer(self, p: int, layer: int, chosen: list[list[int]], nonexp: float) -> float:
        """One layer's time from its routing point: each (token, expert) pair on another GPU
        than the token's sends the token's hidden state over the EP link and back (dispatch
        and combine all-to-all, as long as the busiest GPU's traffic); the layer waits for the
        slowest GPU's experts."""
        sim = self.sim
        hw = sim.scenario.hardware
        g_n = self.gpus
        owner = self.owner
        token_bytes = 2 * sim.model.hidden_size
        tok_gpu = np.arange(len(chosen)) % g_n
        per_gpu_tokens: list[dict[int, int]] = [{} for _ in range(g_n)]
        sent = np.zeros(g_n)
        recv = np.zeros(g_n)
        for t, experts in enumerate(chosen):
            for e in experts:
                gpu = int(owner[layer, e])
                per_gpu_tokens[gpu][e] = per_gpu_tokens[gpu].get(e, 0) + 1
                if gpu != tok_gpu[t]:
                    sent[tok_gpu[t]] += token_bytes
                    recv[gpu] += token_bytes
        sim.row.ep_loads.append(max(len(d) for d in per_gpu_tokens))
        sim.row.ep_bytes += int(2 * sent.sum())  # dispatch, then combine back
        if not sim.timing:
            return 0.0
        per_gpu_time = [float(sim.cost.expert_time(np.asarray(list(d.values()))).sum()) if d else 0.0
                        for d in per_gpu_tokens]
        scale = float(sim.costs.ffn_scale[p])
        expert_t = max(per_gpu_time) * scale
        traffic = float(max(sent.max(), recv.max()))
        a2a = hw.links[hw.ep_link].copy_time(traffic) if traffic > 0 else 0.0
        t_layer = 2 * a2a + expert_t
        log = sim.recorder.ep
        if log is not None and sim.recorder.now():
            t0 = sim.env.now
            t_exp = t0 + nonexp + a2a
            log.extend((sim.clock.pass_index, layer, g, t0, t0 + nonexp, t_exp, t_exp + per_gpu_time[g] * scale,
                        t0 + (nonexp + t_layer)) for g in range(g_n))
        return t_layer
