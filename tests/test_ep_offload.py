"""Expert parallelism with offload (``cache.ep_offload``): each GPU keeps ``cache.capacity`` of
its experts in its own cache, fetched on demand over its own host link. Checked against
hand-worked layers and an independent per-GPU LRU replay written from the contract."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest

from moesim.config.confload import ConfigError
from moesim.simulator.cost import CostModel
from moesim.simulator.engine import simulate
from tests.helpers import scenario, small_model, trace_from_array

X2 = {"preset": "h100-sxm-nvlink-x2"}


def _two_passes() -> np.ndarray:
    """One request on 2 GPUs (experts 0, 1 on GPU 0; 2, 3 on GPU 1), one layer, top-2: a
    prefill of 2 tokens (token 0 -> {0, 1}, token 1 -> {0, 3}), then one decode token -> {0, 2}."""
    return np.array([[[[0, 1]], [[0, 3]], [[0, 2]]]])


@pytest.mark.parametrize("mode", ["layer", "per-expert"])
def test_each_gpu_fetches_its_misses_over_its_own_link_by_hand(mode):
    """Prefill: every expert misses. GPU 0 copies experts 0 then 1 (c and 2c after the routing
    point, one link: serialised), GPU 1 copies expert 3 (c, its own link: in parallel). Tokens
    are dispatched after a2a (token 1 -> expert 0 crosses). ``layer``: a GPU starts its experts
    once the last has arrived; ``per-expert``: each once it has, in lookup order (0, 1 on GPU 0).
    The layer ends a2a after the slowest GPU. Decode: expert 0 is a hit on GPU 0, expert 2 a
    miss on GPU 1 (its cache of 2 holds 3 only); the decode token stays on GPU 0's side, so
    expert 2 is remote (a2a of one hidden state each way)."""
    model = small_model(layers=1, experts=4, top_k=2)
    sc = scenario(hardware=X2, cache={"capacity": "2 experts", "ep_offload": True}, expert_compute=mode)
    res = simulate(sc, trace=trace_from_array(model, _two_passes(), prompt_tokens=2))
    cost = CostModel(sc.hardware, model, model.expert_bytes["bf16"])
    c = sc.hardware.h2d.copy_time(model.expert_bytes["bf16"])
    a2a = sc.hardware.links["nvlink"].copy_time(2 * model.hidden_size)

    def e(tokens: int) -> float:
        return float(cost.expert_time(np.array([tokens]))[0])

    assert 2 * c > a2a  # the copies, not the dispatch, hold the experts back
    if mode == "layer":
        gpu0 = max(a2a, 2 * c) + (e(2) + e(1))
    else:
        gpu0 = max(max(a2a, c) + e(2), 2 * c) + e(1)
    gpu1 = max(a2a, c) + e(1)
    prefill = float(cost.nonexpert_time(np.array([1]), np.array([2]))[0]) + a2a + max(gpu0, gpu1)
    decode = float(cost.nonexpert_time(np.array([1]), np.array([2]))[0]) + a2a + max(a2a + e(1), max(a2a, c) + e(1))
    steps = res.steps
    assert steps["duration_s"].tolist() == pytest.approx([prefill, decode], rel=1e-12)
    assert steps["hits"].tolist() == [0, 1]
    assert steps["misses"].tolist() == [3, 1]
    assert steps["bytes_h2d"].tolist() == [3 * model.expert_bytes["bf16"], model.expert_bytes["bf16"]]
    resident = 2 * a2a + (e(2) + e(1))  # the prefill with every expert resident
    assert steps["stall_s"].iloc[0] == pytest.approx(prefill - float(cost.nonexpert_time(
        np.array([1]), np.array([2]))[0]) - resident, rel=1e-12)
    s = res.summary
    assert s["gpu_hit_rate"] == {"gpu0": pytest.approx(1 / 3), "gpu1": 0.0}
    assert s["gpu_load"] == {"gpu0": pytest.approx(4 / 6), "gpu1": pytest.approx(2 / 6)}
    assert s["cache_peak_bytes"] == 2 * model.expert_bytes["bf16"]
    total = steps["duration_s"].sum()
    assert s["gpu_link_utilisation"] == {"gpu0": pytest.approx(2 * c / total), "gpu1": pytest.approx(2 * c / total)}
    assert s["link_utilisation"] == {"pcie.h2d": pytest.approx(2 * c / total)}  # the GPUs' links' mean


def test_on_arrival_runs_the_resident_expert_while_the_missed_one_copies():
    """Six experts (0-2 on GPU 0), a cache of 2 each. Pass 1 (one token -> {0, 3}) leaves 0 on
    GPU 0. Pass 2 (one token -> {1, 0}, both on GPU 0: no all-to-all): GPU 0 looks up 1 (a
    miss, there c later) then 0 (a hit). ``layer`` and ``per-expert`` (lookup order) wait c,
    then run both: c + 2e; ``on-arrival`` runs 0 first, then 1 once it has arrived: c + e."""
    model = small_model(layers=1, experts=6, top_k=2)
    ex = np.array([[[[0, 3]], [[1, 0]]]])
    c = e = 0.0
    got = {}
    for mode in ("layer", "per-expert", "on-arrival"):
        sc = scenario(hardware=X2, cache={"capacity": "2 experts", "ep_offload": True}, expert_compute=mode)
        res = simulate(sc, trace=trace_from_array(model, ex, prompt_tokens=1))
        got[mode] = res.steps["stall_s"].iloc[1]
        c = sc.hardware.h2d.copy_time(model.expert_bytes["bf16"])
        e = float(CostModel(sc.hardware, model, model.expert_bytes["bf16"]).expert_time(np.array([1]))[0])
    assert c > e
    # the stall: the layer less its time with both experts resident (2e)
    assert got == {"layer": pytest.approx(c), "per-expert": pytest.approx(c), "on-arrival": pytest.approx(c - e)}


def test_with_no_room_a_copy_goes_to_a_buffer_not_kept():
    """A cache of 1 expert a GPU; layer 0 routes to GPU 0's experts (0, 1), layer 1 to GPU 1's
    (2, 3). Pass 1 (one token, on GPU 0): each GPU fetches its first expert and keeps it; the
    second finds no room (the first is the layer's) and is copied behind it to a buffer not kept
    (uncached), so the experts start 2c after the routing point. Pass 2 (the experts in the other
    order): the second is a hit, the first misses again and again finds no room: c. Layer 1's
    token crosses the EP link to both experts (a2a each way), which overlaps the copies: its stall is 2c - a2a,
    then c - a2a; the pass's stall adds its layers'. In the timeline each GPU runs its experts
    from then for 2e, and the layer ends a2a (the combine) after."""
    from moesim.simulator.engine import Simulation

    model = small_model(layers=2, experts=4, top_k=2)
    ex = np.array([[[[0, 1], [2, 3]], [[1, 0], [3, 2]]]])
    sc = scenario(hardware=X2, cache={"capacity": "1 experts", "ep_offload": True})
    sim = Simulation(sc, trace=trace_from_array(model, ex, prompt_tokens=1), record_layers=True)
    res = sim.run()
    c = sc.hardware.h2d.copy_time(model.expert_bytes["bf16"])
    e = float(CostModel(sc.hardware, model, model.expert_bytes["bf16"]).expert_time(np.array([1]))[0])
    a2a = sc.hardware.links["nvlink"].copy_time(2 * 2 * model.hidden_size)  # the token to both experts
    assert c > a2a
    steps = res.steps
    assert steps["stall_s"].tolist() == pytest.approx([2 * c + (2 * c - a2a), c + (c - a2a)], rel=1e-12)
    assert steps["uncached_fetches"].tolist() == [2, 2]
    assert (steps["hits"].tolist(), steps["misses"].tolist()) == ([0, 2], [4, 2])
    # (pass, layer, gpu, layer start, routing point, experts start, experts end, layer end)
    work = [r for r in sim.recorder.ep if r[5] != r[6]]
    assert [(r[0], r[1], r[2]) for r in work] == [(0, 0, 0), (0, 1, 1), (1, 0, 0), (1, 1, 1)]
    assert [r[5] - r[4] for r in work] == pytest.approx([2 * c, 2 * c, c, c], rel=1e-9)
    assert [r[6] - r[5] for r in work] == pytest.approx([2 * e] * 4, rel=1e-9)
    assert [r[7] - r[6] for r in work] == pytest.approx([0.0, a2a, 0.0, a2a], rel=1e-9, abs=1e-15)
    assert len(sim.recorder.ep) == 8  # and the other GPU, idle, in each layer


def test_a_cache_aware_router_sees_the_gpus_caches():
    """Cache-aware routing biases tokens toward cached experts: with offload it reads the cache
    of the GPU that owns each expert (a key held by another GPU's cache does not count), and it
    re-routes tokens; with every GPU holding its share nothing is cached apart from the rest, so
    it changes no token."""
    from moesim.simulator.engine import Simulation

    def sc(offload: bool):
        return scenario(hardware=X2, workload={"trace": {"synth": {"preset": "olmoe-1b-7b", "tokens": 40,
                                                                     "layers": 2, "probs": True}}},
                        cache={"capacity": "5%", "ep_offload": offload},
                        policies={"eviction": {"name": "least-stale"}, "miss": "fetch", "prefetch": "none",
                                  "routing": "cache-aware"})

    assert simulate(sc(True)).summary["tokens_altered"] > 0
    assert simulate(sc(False)).summary["tokens_altered"] == 0
    sim = Simulation(sc(True))
    ctx = sim.eviction.ctx
    key = ctx.key(1, 40)  # expert 40 of layer 1: GPU 1's (contiguous: 32-63)
    sim.ep.caches[0].fetch(key, sim.expert_bytes, set(), True, 0.0)
    assert not sim.ep.cached(key)
    sim.ep.caches[1].fetch(key, sim.expert_bytes, set(), True, 0.0)
    assert sim.ep.cached(key)
    assert not sim.ep.cached(ctx.key(0, 40))


def _lru_by_gpu(ex: np.ndarray, prompt: int, gpus: int, cap: int) -> tuple[list[tuple[int, int, int, int]], list]:
    """The per-pass (hits, misses, collision misses, uncached) and per-GPU [hits, misses] of a
    replay of ``ex`` ([requests, tokens, layers, k], one request at a time) on ``gpus`` GPUs with
    contiguous placement and an LRU cache of ``cap`` experts each, written from the contract:
    per layer, each GPU looks up its experts in the order the tokens reach them, the layer's
    own experts never evicted; with no room, the copy is not kept."""
    num_e = 1 + int(ex.max())
    caches = [OrderedDict() for _ in range(gpus)]
    per_gpu = [[0, 0] for _ in range(gpus)]
    rows = []
    for req in ex:
        for toks in [req[:prompt], *[req[t:t + 1] for t in range(prompt, len(req))]]:
            hits = misses = coll = unc = 0
            evicted: list[set] = [set() for _ in range(gpus)]
            for layer in range(ex.shape[2]):
                order: list[list[int]] = [[] for _ in range(gpus)]
                for tok in toks:
                    for exp in tok[layer]:
                        g = int(exp) * gpus // num_e
                        if (layer, int(exp)) not in order[g]:
                            order[g].append((layer, int(exp)))
                for g in range(gpus):
                    cache = caches[g]
                    for key in order[g]:
                        if key in cache:
                            cache.move_to_end(key)
                            hits += 1
                            per_gpu[g][0] += 1
                            continue
                        misses += 1
                        per_gpu[g][1] += 1
                        coll += key in evicted[g]
                        if len(cache) >= cap:
                            victim = next((k for k in cache if k not in order[g]), None)
                            if victim is None:
                                unc += 1
                                continue
                            del cache[victim]
                            evicted[g].add(victim)
                        cache[key] = True
            rows.append((hits, misses, coll, unc))
    return rows, per_gpu


@pytest.mark.parametrize(("gpus", "cap"), [(2, 3), (4, 2), (4, 1)])
def test_per_gpu_lru_counts_equal_an_independent_replay(gpus, cap):
    """Random routing (3 requests of a 6-token prompt and 10 decode tokens, 2 layers of 8
    experts, top-2), cache-only: every per-pass hit, miss, collision miss and uncached fetch,
    and each GPU's hit rate, as the independent replay counts them (capacity 1 on 4 GPUs: a
    layer's second expert on a GPU finds no room)."""
    rng = np.random.default_rng(gpus * 10 + cap)
    ex = np.stack([np.stack([np.stack([rng.choice(8, 2, replace=False) for _ in range(2)]) for _ in range(16)])
                   for _ in range(3)])
    model = small_model(layers=2, experts=8, top_k=2)
    sc = scenario(hardware={"preset": f"h100-sxm-nvlink-x{gpus}"}, timing=False,
                  cache={"capacity": f"{cap} experts", "ep_offload": True})
    res = simulate(sc, trace=trace_from_array(model, ex, prompt_tokens=6))
    rows, per_gpu = _lru_by_gpu(ex, 6, gpus, cap)
    assert (res.steps["end_s"] == 0).all()  # cache-only: no time passes
    got = res.steps[["hits", "misses", "collision_misses", "uncached_fetches"]].itertuples(index=False)
    assert [tuple(int(v) for v in r) for r in got] == rows
    assert res.summary["gpu_hit_rate"] == {f"gpu{g}": pytest.approx(h / (h + m)) for g, (h, m) in enumerate(per_gpu)}
    assert sum(r[2] for r in rows) > 0  # collision misses happen
    if cap == 1:  # a GPU's layer needing two experts finds no room for the second
        assert sum(r[3] for r in rows) > 0


def test_a_cache_as_large_as_a_gpus_share_misses_each_expert_once():
    """Capacity of a GPU's whole share: each GPU misses each of its experts once (cold), then
    only hits; the layers cost what the resident replay's do once every expert has arrived."""
    model = small_model(layers=2, experts=8, top_k=2)
    rng = np.random.default_rng(3)
    ex = np.stack([np.stack([np.stack([rng.choice(8, 2, replace=False) for _ in range(2)]) for _ in range(40)])])
    tr = trace_from_array(model, ex, prompt_tokens=4)
    off = simulate(scenario(hardware=X2, cache={"capacity": "8 experts", "ep_offload": True}), trace=tr)
    on = simulate(scenario(hardware=X2), trace=tr)
    seen = {(layer, int(e)) for tok in ex[0] for layer in range(2) for e in tok[layer]}
    assert off.summary["misses"] == len(seen)
    assert off.summary["hits"] + off.summary["misses"] == on.summary["hits"]
    warm = off.steps["misses"].cumsum() == len(seen)
    first_warm = int(np.argmax(warm.to_numpy())) + 1
    assert first_warm < len(off.steps)
    # (each duration is the difference of the pass's end and start times, which differ)
    assert off.steps["duration_s"].iloc[first_warm:].tolist() == pytest.approx(
        on.steps["duration_s"].iloc[first_warm:].tolist(), rel=1e-12)
    assert (off.steps["stall_s"].iloc[first_warm:] == 0).all()


def test_ep_offload_refuses_what_it_does_not_model():
    with pytest.raises(ConfigError, match=r"hardware\.gpus is 1"):
        scenario(cache={"ep_offload": True})
    with pytest.raises(ConfigError, match=r"policies\.prefetch: none, or remove cache\.ep_offload"):
        scenario(hardware=X2, cache={"ep_offload": True},
                 policies={"eviction": "lru", "miss": "fetch", "prefetch": "oracle"})
    with pytest.raises(ConfigError, match=r"policies\.miss: fetch"):
        scenario(hardware=X2, cache={"ep_offload": True},
                 policies={"eviction": "lru", "miss": "drop", "prefetch": "none"})


def test_compare_under_ep_offload_ranks_eviction_with_on_demand_references(tmp_path):
    """``moesim compare`` with offload: the candidates' eviction policies now matter (each GPU's
    cache runs its own), the bound is Belady on demand (fewest misses of every row) and the
    all-resident reference is the GPUs holding their shares (no host copies); each reference row
    equals its scenario run alone."""
    import yaml

    from moesim.config.scenario import scenario_from_dict
    from moesim.studies.compare import compare

    data = {"seed": 0, "hardware": {"preset": "h100-sxm-nvlink-x2"},
            "workload": {"trace": {"synth": {"preset": "olmoe-1b-7b", "layers": 4, "requests": 2,
                                             "prompt_tokens": 8, "tokens": 30}}, "batch_size": 2},
            "cache": {"capacity": "8%", "ep_offload": True},
            "policies": {"eviction": "lru", "miss": "fetch", "prefetch": "none"}}
    path = tmp_path / "ep.yaml"
    path.write_text(yaml.safe_dump(data))
    table, _ = compare(str(path), tmp_path / "cmp", ["lru", "lfu", "least-stale"], ["none"], workers=1)
    by = table.set_index("label")
    bound = by.loc["Belady, on demand (bound)"]
    assert (by["misses"][by["role"] == "candidate"] >= bound["misses"]).all()
    assert by["misses"][by["role"] == "candidate"].nunique() > 1
    resident = by.loc["each GPU holds its experts (no offload)"]
    assert (resident["misses"], resident["bytes_moved"] > 0) == (0, True)  # the all-to-all's bytes only
    alone = simulate(scenario_from_dict({**data, "cache": {"capacity": "8%"}}, base_dir=str(tmp_path))).summary
    assert resident["tpot_s"] == alone["tpot_s"]
    belady = simulate(scenario_from_dict({**data, "policies": {**data["policies"], "eviction": "belady"}},
                                         base_dir=str(tmp_path))).summary
    assert (bound["misses"], bound["tpot_s"]) == (belady["misses"], belady["tpot_s"])
