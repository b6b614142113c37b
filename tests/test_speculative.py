"""Speculative verification workloads built from decode traces."""

from __future__ import annotations

import numpy as np
import pytest

from moesim.simulator.engine import simulate
from moesim.traces.synth import synth_from_preset
from tests.helpers import scenario


def spec_run(t, batch, spec, timing=True, **kw):
    w = {"batch_size": batch}
    if spec is not None:
        w["speculative"] = spec
    return simulate(scenario(timing=timing, cache={"capacity": "inf"}, workload=w, **kw), trace=t)


@pytest.mark.parametrize(("batch", "s"), [(1, 3), (2, 3), (4, 1), (2, 7), (8, 3)])
def test_unique_experts_follow_expected_active_experts_with_drafts(batch, s):
    """xshare §1: with speculation the effective batch is B(s+1): E[N_a] = N(1-(1-k/N)^(B(s+1)))."""
    t = synth_from_preset("olmoe-1b-7b", layers=4, routing="uniform", requests=batch, tokens=3000 // batch, seed=3)
    res = spec_run(t, batch, {"tree_size": s + 1, "accept_prob": 0.5}, timing=False)
    st = res.steps
    full = st[(st.phase == "verify") & (st.tokens == batch * (s + 1))]
    got = full["unique_experts"].sum() / (len(full) * 4)
    expected = 64 * (1 - (1 - 8 / 64) ** (batch * (s + 1)))
    assert got == pytest.approx(expected, rel=0.02)


def test_generated_tokens_are_the_trace_and_acceptance_extremes():
    t = synth_from_preset("olmoe-1b-7b", layers=2, requests=2, prompt_tokens=4, tokens=40, seed=1)
    ar = spec_run(t, 2, None, timing=False)
    all_in = spec_run(t, 2, {"tree_size": 5, "accept_prob": 1.0}, timing=False)
    none_in = spec_run(t, 2, {"tree_size": 5, "accept_prob": 0.0}, timing=False)
    for r in (all_in, none_in):
        assert r.summary["generated_tokens"] == ar.summary["generated_tokens"] == 2 + 2 * 40
    assert (all_in.steps.phase == "verify").sum() == 8  # 40 tokens in windows of 5, all accepted
    assert all_in.summary["mean_accepted_tokens"] == 5
    assert (none_in.steps.phase == "verify").sum() == 40  # one token per pass
    assert none_in.summary["mean_accepted_tokens"] == 1
    assert none_in.summary["unique_experts_per_layer"] > ar.summary["unique_experts_per_layer"]


def test_speedup_against_autoregressive_decoding():
    t = synth_from_preset("mixtral-8x7b", layers=4, tokens=80, seed=2)
    good = spec_run(t, 1, {"tree_size": 4, "accept_prob": 0.9}).summary
    bad = spec_run(t, 1, {"tree_size": 4, "accept_prob": 0.0}).summary
    # memory-bound verification reads each of the pass's experts once, but 4 Mixtral tokens need
    # ~4.9 of 8 experts per layer against 2: 3.8 accepted tokens per pass buy only ~1.1x
    assert 1.0 < good["speedup_vs_autoregressive"] < 2.0
    assert bad["speedup_vs_autoregressive"] < 1.0  # more experts per pass, nothing accepted
    assert good["tpot_s"] < bad["tpot_s"]


def test_a_prebuilt_workload_with_its_trace_gives_the_same_summary():
    """``Simulation(scenario, trace=t, workload=w)`` with ``w`` built from ``t`` (as the
    benchmarks do, to build it once) replays as ``Simulation(scenario, trace=t)``, the
    speed-up against autoregressive decoding included (it replays ``t`` without drafts).
    Found missing by mutation testing of engine.py: the trace passed beside a workload could
    be dropped unnoticed (and the speed-up with it)."""
    from moesim.simulator.engine import Simulation
    from moesim.simulator.workload import build_workload

    t = synth_from_preset("mixtral-8x7b", layers=2, tokens=20, seed=3)
    sc = scenario(cache={"capacity": "inf"}, workload={"speculative": {"tree_size": 4, "accept_prob": 0.7}})
    spec = sc.workload.speculative
    wl = build_workload(t, 1, None, spec, sc.seed)
    alone = Simulation(sc, trace=t).run().summary
    given = Simulation(sc, trace=t, workload=wl).run().summary
    assert given["speedup_vs_autoregressive"] is not None
    assert given == alone


def test_verify_rows_carry_tree_nodes():
    from moesim.simulator.engine import Simulation

    t = synth_from_preset("olmoe-1b-7b", layers=2, requests=1, tokens=20, seed=4)
    sim = Simulation(scenario(workload={"speculative": {"tree_size": 4, "accept_prob": 0.6}}), trace=t)
    tr = sim.wl.trace
    ver = tr.take(tr.phase == 2)
    assert set(np.unique(ver.node).tolist()) <= {0, 1, 2, 3}
    assert (ver.parent[ver.node > 0] == ver.node[ver.node > 0] - 1).all()  # a chain
    assert ver.accepted[ver.node == 0].all()


def test_recorded_verify_steps_count_accepted_tokens():
    from moesim.simulator.workload import build_workload
    from tests.helpers import small_model, trace_from_array

    model = small_model(layers=1, experts=4, top_k=1)
    t = trace_from_array(model, np.array([[[[0]], [[1]], [[2]], [[3]]]]))  # 4 rows, one layer
    t.phase[:] = 2  # verify
    t.step[:] = [1, 1, 2, 2]
    t.position[:] = [5, 5, 6, 6]
    t.node = np.array([1, 2, 1, 2], dtype=np.int16)
    t.parent = np.zeros(4, dtype=np.int16)
    t.accepted = np.array([True, False, False, False])
    wl = build_workload(t)
    assert wl.pass_generated.tolist() == [1, 0]


@pytest.mark.real
def test_real_traces_show_the_budgeting_shapes():
    """MoE-Spec Fig. 2b/2c, XShare Fig. 1 on the real traces: unique experts per layer grow with
    the batch towards N, and the top-B experts of a batch capture most of its routing mass."""
    from moesim.traces.importers import import_trace
    from tests.helpers import mixtral_trace, real_dir

    flame, _ = import_trace("flame-csv", [real_dir() / "flame-moe-290m" / "decode"])
    uniq = []
    for b in (1, 4, 16, 64):
        vals = []
        for step in range(10):
            for layer in range(8):
                sel = (flame.step == step) & (flame.layer == layer)
                vals.append(len(np.unique(flame.experts[sel][:b])))
        uniq.append(np.mean(vals))
    assert uniq == sorted(uniq)
    assert uniq[0] == 6
    assert uniq[-1] > 60  # 64 sequences touch nearly all 64 experts
    sel = (flame.step == 0) & (flame.layer == 7)
    mass = np.zeros(64)
    np.add.at(mass, flame.experts[sel].reshape(-1), flame.weights[sel].reshape(-1))
    share = np.cumsum(np.sort(mass)[::-1]) / mass.sum()
    assert share[31] > 0.6  # half of the experts hold well over half of the mass
    assert (np.diff(share) >= -1e-12).all()
    mx = mixtral_trace("gsm8k")
    p0 = mx.take((mx.request == 0) & (mx.layer == 0))
    unique_by_window = [np.mean([len(np.unique(p0.experts[i:i + b])) for i in range(0, 160 - b, b)])
                        for b in (1, 2, 4, 8)]
    assert unique_by_window == sorted(unique_by_window)
    assert unique_by_window[-1] < 8 * (1 - (1 - 2 / 8) ** 8)  # consecutive tokens share experts


@pytest.mark.parametrize("path", ["kernel", "simpy"])
def test_sparse_verification_factors_thin_attention_and_down_projections(path, monkeypatch):
    """sparse-verification §3 / Table 1: in verification passes the attention reads a share
    (1 - s_a) of the KV cache and experts skip s_f of their down-projection (1/3 of an expert).
    On both replay paths."""
    from moesim.simulator.cost import CostModel
    from moesim.simulator.engine import Simulation

    monkeypatch.setenv("MOESIM_NO_KERNEL", "1" if path == "simpy" else "0")
    t = synth_from_preset("olmoe-1b-7b", layers=2, requests=1, prompt_tokens=200, tokens=40, seed=5)
    base = {"tree_size": 4, "accept_prob": 0.5}
    dense = Simulation(scenario(cache={"capacity": "inf"}, workload={"speculative": base}), trace=t)
    sparse = Simulation(scenario(cache={"capacity": "inf"},
                                 workload={"speculative": {**base, "sparse_attention": 0.6, "sparse_ffn": 0.3}}),
                        trace=t)
    ra, rb = dense.run(), sparse.run()
    assert ra.summary["replay_path"] == rb.summary["replay_path"] == path
    a, b = ra.steps, rb.steps
    wl = dense.wl
    cost = CostModel(dense.scenario.hardware, t.model, t.model.expert_bytes["bf16"])
    ffn = cost.expert_time(wl.acc_tokens)
    checked = 0
    for p in range(wl.num_passes):
        if wl.pass_phase[p] != 2 or a["misses"].iloc[p] or b["misses"].iloc[p]:
            continue
        ctx = np.array([wl.pass_context[p]], float)
        tok = np.array([wl.pass_tokens[p]], float)
        d_attn = (cost.nonexpert_time(tok, ctx) - cost.nonexpert_time(tok, ctx * 0.4))[0] * 2  # 2 layers
        d_ffn = ffn[wl.off[p * 2]:wl.off[p * 2 + 2]].sum() * 0.3 / 3
        assert a["duration_s"].iloc[p] - b["duration_s"].iloc[p] == pytest.approx(d_attn + d_ffn, rel=1e-9)
        checked += 1
    assert checked >= 3
    assert (b["duration_s"] <= a["duration_s"] + 1e-15).all()
