"""Expert parallelism: per-layer time is the slowest GPU's, plus the all-to-all."""

from __future__ import annotations

import numpy as np
import pytest

from moesim.config.hardware import PRESETS
from moesim.simulator.cost import CostModel
from moesim.simulator.engine import simulate
from moesim.traces.synth import synth_from_preset
from tests.helpers import scenario, small_model, trace_from_array


def test_layer_time_is_the_slowest_gpu_plus_all_to_all():
    model = small_model(layers=1, experts=4, top_k=2)
    # one pass of 2 tokens: token 0 -> experts {0, 1} (GPU 0), token 1 -> experts {0, 3}
    ex = np.array([[[[0, 1]], [[0, 3]]]])
    t = trace_from_array(model, ex, prompt_tokens=2)
    sc = scenario(hardware={"preset": "h100-sxm-nvlink-x2"})
    res = simulate(sc, trace=t)
    cost = CostModel(sc.hardware, model, model.expert_bytes["bf16"])
    nonexp = float(cost.nonexpert_time(np.array([1]), np.array([2]))[0])  # 2 tokens, context 1+2, on 2 GPUs
    gpu0 = float(cost.expert_time(np.array([2]))[0] + cost.expert_time(np.array([1]))[0])  # expert 0 (2 tokens), 1
    gpu1 = float(cost.expert_time(np.array([1]))[0])  # expert 3
    # token 0 on GPU 0, token 1 on GPU 1: token 1 -> expert 0 crosses; GPU 1 sends one hidden state
    a2a = sc.hardware.links["nvlink"].copy_time(2 * model.hidden_size)
    assert res.summary["total_time_s"] == pytest.approx(nonexp + 2 * a2a + max(gpu0, gpu1), rel=1e-9)
    assert res.steps["max_experts_per_gpu"].iloc[0] == 2
    # one hidden state (2 H bf16 bytes) crosses to another GPU, and its result comes back
    assert res.summary["bytes_by_link"] == {"pcie.h2d": 0, "nvlink": 2 * 2 * model.hidden_size}


def test_the_expert_parallel_summary_table_shows_its_metrics():
    """The run's table shows the GPUs, the peak experts per GPU and the NVLink bytes, with
    every time in ms."""
    from rich.console import Console

    from moesim.output.results import summary_table

    t = synth_from_preset("olmoe-1b-7b", layers=2, requests=8, tokens=3, seed=2)
    res = simulate(scenario(hardware={"preset": "h100-sxm-nvlink-x8"}, workload={"batch_size": 8}), trace=t)
    con = Console(width=120, record=True)
    con.print(summary_table(res, "ep"))
    text = con.export_text()
    assert "max_experts_per_gpu" in text
    assert "nvlink:" in text
    assert "│ gpus" in text
    for line in text.splitlines():
        if "_s " in line and "tokens_per_s" not in line:
            assert line.rstrip(" │").endswith("ms"), line


@pytest.mark.parametrize("gpus", [2, 4, 8])
def test_gpu_aware_selection_lowers_the_peak_load(gpus):
    assert f"h100-sxm-nvlink-x{gpus}" in PRESETS
    t = synth_from_preset("olmoe-1b-7b", layers=3, experts=128, requests=16, tokens=10, seed=1, probs=True)
    base = {"hardware": {"preset": f"h100-sxm-nvlink-x{gpus}"}, "workload": {"batch_size": 16}}
    plain = simulate(scenario(**base), trace=t).summary
    balanced = simulate(scenario(**base, policies={"budget": {"name": "xshare", "per_gpu": 4, "k0": 0, "gpus": gpus}}),
                        trace=t).summary
    assert balanced["max_experts_per_gpu"] <= -(-4 * gpus // gpus)  # ceil(|S|/G) with |S| = m_g * G
    assert balanced["max_experts_per_gpu"] < plain["max_experts_per_gpu"]
    assert balanced["tpot_s"] < plain["tpot_s"]


def test_gate_mass_and_altered_tokens_mean_the_same_with_and_without_ep():
    """The same budget selects the same experts on one GPU or eight: gate_mass_retained
    (router probabilities when the trace has them) and tokens_altered must agree."""
    t = synth_from_preset("olmoe-1b-7b", layers=3, experts=128, requests=8, tokens=6, seed=4, probs=True)
    budget = {"name": "xshare", "per_gpu": 3, "k0": 1, "gpus": 8}
    one = simulate(scenario(cache={"capacity": "inf"}, workload={"batch_size": 8}, policies={"budget": budget}),
                   trace=t).summary
    ep = simulate(scenario(hardware={"preset": "h100-sxm-nvlink-x8"}, workload={"batch_size": 8},
                           policies={"budget": budget}), trace=t).summary
    assert ep["gate_mass_retained"] == pytest.approx(one["gate_mass_retained"], rel=1e-12)
    assert ep["tokens_altered"] == pytest.approx(one["tokens_altered"], rel=1e-12)
    assert 0 < one["tokens_altered"] <= 1


@pytest.mark.parametrize(("placement", "expected_max"), [("contiguous", 1.75), ("round-robin", 1.25)])
def test_max_experts_per_gpu_and_unique_experts_by_hand(placement, expected_max):
    """2 GPUs, 2 layers, 4 experts, top-2, batch 2 (requests A and B, two decode steps each).
    Routing (A, B): pass 0 layer 0 ({0,1}, {0,3}), layer 1 ({2,3}, {2,3}); pass 1 layer 0
    ({0,1}, {0,1}), layer 1 ({1,2}, {1,2}).
    Contiguous placement (experts 0, 1 on GPU 0; 2, 3 on GPU 1), experts per GPU:
    p0 L0 {0,1} | {3} -> max 2; p0 L1 {} | {2,3} -> 2; p1 L0 {0,1} | {} -> 2; p1 L1 {1} | {2} -> 1.
    max_experts_per_gpu = mean over passes of the per-layer mean = ((2+2)/2 + (2+1)/2) / 2 = 1.75.
    Round-robin (0, 2 on GPU 0; 1, 3 on GPU 1): p0 L0 {0} | {1,3} -> 2; p0 L1 {2} | {3} -> 1;
    p1 L0 {0} | {1} -> 1; p1 L1 {2} | {1} -> 1: ((2+1)/2 + (1+1)/2) / 2 = 1.25.
    unique_experts_per_layer = (3 + 2 + 2 + 2) / (2 passes x 2 layers) = 2.25 either way."""
    model = small_model(layers=2, experts=4, top_k=2)
    ex = np.array([[[[0, 1], [2, 3]], [[0, 1], [1, 2]]],   # A: step 0 (L0, L1), step 1
                   [[[0, 3], [2, 3]], [[0, 1], [1, 2]]]])  # B
    t = trace_from_array(model, ex)
    sc = scenario(hardware={"preset": "h100-sxm-nvlink-x2", "placement": placement}, workload={"batch_size": 2})
    res = simulate(sc, trace=t)
    assert res.summary["max_experts_per_gpu"] == expected_max
    assert res.summary["unique_experts_per_layer"] == 2.25
    assert res.summary["hits"] == 9  # every access is to an expert resident on its GPU


def test_two_layers_by_hand_one_gpu_idle_then_no_traffic():
    """Two GPUs (experts 0, 1 on GPU 0; 2, 3 on GPU 1), one prefill pass of N = 1000 tokens,
    token t on GPU t mod 2, top-2. The tokens are many so that the experts' time grows with
    their tokens (compute-bound, checked; the attention's is bound by its KV-cache read here).
    Found missing by mutation testing of engine.py: the small hand test above is memory-bound
    and has one crossing.

    Layer 0: every token routes to experts 0 and 1, both on GPU 0; GPU 1 computes nothing.
    The 500 tokens of GPU 1 send 2 hidden states each: GPU 1 sends and GPU 0 receives 1000 of
    them, so the all-to-all lasts copy_time(1000 * 2H), once to dispatch and once to combine.
    Layer 1: each token routes to its own GPU's two experts (500 tokens each): no traffic,
    no all-to-all. Each layer first runs the attention on ceil(N / 2) tokens and context
    ceil(N (N + 1) / 2 / 2) per GPU. Bytes over NVLink: 2 x 1000 x 2H, all in layer 0."""
    n = 1000
    model = small_model(layers=2, experts=4, top_k=2)
    ex = np.zeros((1, n, 2, 2), dtype=np.int64)
    ex[0, :, 0] = [0, 1]
    ex[0, 0::2, 1] = [0, 1]
    ex[0, 1::2, 1] = [2, 3]
    sc = scenario(hardware={"preset": "h100-sxm-nvlink-x2"})
    res = simulate(sc, trace=trace_from_array(model, ex, prompt_tokens=n))
    cost = CostModel(sc.hardware, model, model.expert_bytes["bf16"])

    def expert(tokens: int) -> float:
        return float(cost.expert_time(np.array([tokens]))[0])

    assert expert(n) > expert(n - 1) > expert(1)  # compute-bound
    nonexp = float(cost.nonexpert_time(np.array([n // 2]), np.array([np.ceil(n * (n + 1) / 2 / 2)]))[0])
    hb = 2 * model.hidden_size
    a2a = sc.hardware.links["nvlink"].copy_time(n * hb)
    layer0 = nonexp + 2 * a2a + 2 * expert(n)
    layer1 = nonexp + 2 * expert(n // 2)
    assert res.summary["total_time_s"] == pytest.approx(layer0 + layer1, rel=1e-9)
    assert res.summary["bytes_by_link"] == {"pcie.h2d": 0, "nvlink": 2 * n * hb}
    assert res.steps["max_experts_per_gpu"].iloc[0] == 2


def test_the_all_to_all_lasts_as_long_as_the_busiest_receiver():
    """Four GPUs, expert e on GPU e, one prefill pass of 4 tokens (token t on GPU t), all
    routed to expert 0: GPUs 1, 2 and 3 each send one hidden state (2H bytes) and GPU 0
    receives three, so each all-to-all lasts copy_time(3 x 2H), not copy_time(2H). Attention
    on ceil(4 / 4) = 1 token and context ceil((1 + 2 + 3 + 4) / 4) = 3 per GPU."""
    model = small_model(layers=1, experts=4, top_k=1)
    ex = np.zeros((1, 4, 1, 1), dtype=np.int64)
    sc = scenario(hardware={"preset": "h100-sxm-nvlink-x4"})
    res = simulate(sc, trace=trace_from_array(model, ex, prompt_tokens=4))
    cost = CostModel(sc.hardware, model, model.expert_bytes["bf16"])
    hb = 2 * model.hidden_size
    link = sc.hardware.links["nvlink"]
    assert link.copy_time(3 * hb) > link.copy_time(hb)
    nonexp = float(cost.nonexpert_time(np.array([1]), np.array([3]))[0])
    expected = nonexp + 2 * link.copy_time(3 * hb) + float(cost.expert_time(np.array([4]))[0])
    assert res.summary["total_time_s"] == pytest.approx(expected, rel=1e-9)
    assert res.summary["bytes_by_link"] == {"pcie.h2d": 0, "nvlink": 2 * 3 * hb}


def test_a_budget_policy_reads_the_pass_and_layer_it_plans(monkeypatch):
    """A user's budget policy (the plugin registry) that records, each time it plans a layer
    under expert parallelism, the pass and layer it is given and the clock's: two passes of
    a two-layer model give (0, 0), (0, 1), (1, 0), (1, 1) for both, in that order. Found
    missing by mutation testing of engine.py: the expert-parallel step left the clock's
    layer unset and could hand the budget another pass index unnoticed."""
    from moesim.policies.budget import REGISTRY, BudgetPolicy

    seen: list[tuple[int, int, int, int]] = []

    class Recording(BudgetPolicy):
        def select(self, pass_index, layer, rows, experts):
            clock = self.ctx.clock
            seen.append((pass_index, layer, clock.pass_index, clock.layer))
            return experts.tolist()

    monkeypatch.setitem(REGISTRY._classes, "recording", Recording)
    model = small_model(layers=2, experts=4, top_k=2)
    ex = np.array([[[[0, 1], [2, 3]], [[0, 2], [1, 3]]]])  # one request: prompt token, decode token
    res = simulate(scenario(hardware={"preset": "h100-sxm-nvlink-x2"}, policies={"budget": "recording"}),
                   trace=trace_from_array(model, ex, prompt_tokens=1))
    assert res.summary["replay_path"] == "simpy"
    assert seen == [(0, 0, 0, 0), (0, 1, 0, 1), (1, 0, 1, 0), (1, 1, 1, 1)]


def test_sparse_verification_under_expert_parallelism_by_hand():
    """Speculative verification (sparse-verification §3 / Table 1) on two GPUs: in a
    verification pass the attention reads a share 1 - s_a of the KV cache and each expert
    skips s_f of its down-projection (1/3 of an expert), as on one GPU, with the attention's
    tokens and context split over the GPUs. 64 requests decoded as a batch, tree of 4,
    s_a = 0.6, s_f = 0.3; one layer, every token routed to expert 0 (GPU 0), so GPU 1 sends
    its tokens' hidden states (the odd ones: floor(T / 2) x 2H bytes) to GPU 0 and back.
    Per pass of T tokens and context C (the workload's; a factor a = 0.4, f = 0.9 in
    verification passes, 1 in the prefill):
    nonexpert(ceil(T / 2), ceil(a C / 2)) + 2 copy_time(floor(T / 2) 2H) + f expert(T);
    the timeline's GPU 0 experts last f expert(T), GPU 1's nothing. The attention's time
    depends on its tokens and on its context here (checked). Found missing by mutation
    testing of engine.py: the factors under expert parallelism, and the split of the
    attention's tokens, could be inverted unnoticed."""
    from moesim.simulator.engine import Simulation

    model = small_model(layers=1, experts=4, top_k=1, hidden=1024, inter=512)
    requests = 64
    t = trace_from_array(model, np.zeros((requests, 6, 1, 1), dtype=np.int64), prompt_tokens=1)
    spec = {"tree_size": 4, "accept_prob": 0.5, "sparse_attention": 0.6, "sparse_ffn": 0.3}
    sc = scenario(hardware={"preset": "h100-sxm-nvlink-x2"}, workload={"batch_size": requests, "speculative": spec})
    sim = Simulation(sc, trace=t, record_layers=True)
    res = sim.run()
    wl = sim.wl
    cost = CostModel(sc.hardware, model, model.expert_bytes["bf16"])
    link = sc.hardware.links["nvlink"]
    hb = 2 * model.hidden_size
    verify = wl.pass_phase == 2
    assert verify.sum() >= 4
    assert not verify[0]
    ep = {(p, g): row for p, _, g, *row in res.extra["ep_layers"]}
    for p in range(wl.num_passes):
        tok, ctx = int(wl.pass_tokens[p]), float(wl.pass_context[p])
        a, f = (0.4, 0.9) if verify[p] else (1.0, 1.0)
        nonexp = float(cost.nonexpert_time(np.array([np.ceil(tok / 2)]), np.array([np.ceil(a * ctx / 2)]))[0])
        experts = float(cost.expert_time(np.array([tok]))[0]) * f
        a2a = link.copy_time((tok // 2) * hb)
        assert res.steps["duration_s"].iloc[p] == pytest.approx(nonexp + 2 * a2a + experts, rel=1e-12)
        t0, t_dispatch, t_exp, t_gpu_end, t_end = ep[p, 0]
        assert (t_dispatch - t0, t_exp - t_dispatch, t_gpu_end - t_exp, t_end - t_gpu_end) == pytest.approx(
            (nonexp, a2a, experts, a2a), rel=1e-9)
        assert ep[p, 1][3] == ep[p, 1][2]  # GPU 1 computes nothing
    tok, ctx = int(wl.pass_tokens[1]), float(wl.pass_context[1])
    attention = [float(cost.nonexpert_time(np.array([x]), np.array([c]))[0])
                 for x, c in [(np.ceil(tok / 2), np.ceil(0.4 * ctx / 2)), (2 * tok, np.ceil(0.4 * ctx / 2)),
                              (np.ceil(tok / 2), np.ceil(ctx / 0.4 / 2))]]
    assert attention[0] < attention[1]
    assert attention[0] < attention[2]
