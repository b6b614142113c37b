"""Budget policies, exactly (issue 12): every parameter's range and message; the expert
placement file; Lynx's, dynamic skipping's, MoE-Spec's and XShare's per-request and
GPU-balanced selections on hand-made passes worked out in the docstrings; and ties broken by
expert index (a stable order), on 64 experts where an unstable sort reorders ties."""

from __future__ import annotations

import numpy as np
import pytest

from moesim.errors import MoesimError
from moesim.policies.budget.xshare import placement_of
from moesim.simulator.engine import Simulation
from moesim.traces.schema import PHASE_CODES
from moesim.traces.trace import Trace
from tests.helpers import scenario, small_model
from tests.test_budget_hand import one_pass, select


@pytest.mark.parametrize(("spec", "error"), [
    ({"name": "moe-spec", "budget": 0}, "budget must be >= 1, got 0"),
    ({"name": "moe-spec", "calibration": 0}, "calibration must be in (0, 1], got 0"),
    ({"name": "moe-spec", "calibration": 1.01}, "calibration must be in (0, 1], got 1.01"),
    ({"name": "xshare"}, "give budget (Algorithm 2), threshold (Algorithm 1), per_request [+ budget] "
                         "(Algorithm 4) or per_gpu (Algorithm 6)"),
    ({"name": "xshare", "threshold": 0.5, "per_gpu": 2}, "give budget (Algorithm 2)"),
    ({"name": "xshare", "per_request": -1}, "per_request must be >= 0, got -1"),
    ({"name": "xshare", "per_gpu": 0}, "per_gpu must be >= 1, got 0"),
    ({"name": "xshare", "budget": 4, "gpus": 0}, "gpus must be >= 1, got 0"),
    ({"name": "xshare", "budget": 0}, "budget must be >= 1, got 0"),
    ({"name": "xshare", "per_request": 1, "budget": -1}, "budget must be >= 0, got -1"),
    ({"name": "xshare", "threshold": 0}, "threshold must be in (0, 1], got 0"),
    ({"name": "xshare", "threshold": 1.5}, "threshold must be in (0, 1], got 1.5"),
    ({"name": "xshare", "budget": 4, "k0": -1}, "k0 must be >= 0, got -1"),
    ({"name": "lynx", "drop": -1}, "drop must be >= 0, got -1"),
    ({"name": "dynamic-skip", "beta": -0.1}, "beta must be in [0, 1], got -0.1"),
    ({"name": "dynamic-skip", "beta": 1.1}, "beta must be in [0, 1], got 1.1"),
    ({"name": "skip-threshold", "max_skip": 0}, "max_skip must be >= 1, got 0"),
    ({"name": "skip-threshold", "calibration": 0}, "calibration must be in (0, 1], got 0"),
    ({"name": "skip-threshold", "calibration": 1.5}, "calibration must be in (0, 1], got 1.5"),
])
def test_budget_parameters_out_of_range_are_refused_with_the_range(spec, error):
    with pytest.raises(MoesimError) as exc:
        scenario(policies={"budget": spec})
    assert error in str(exc.value)


@pytest.mark.parametrize("spec", [
    {"name": "moe-spec", "budget": 1, "calibration": 1}, {"name": "moe-spec", "calibration": 0.001},
    {"name": "xshare", "budget": 1, "k0": 0}, {"name": "xshare", "threshold": 1},
    {"name": "xshare", "threshold": 0.001}, {"name": "xshare", "per_request": 0, "budget": 0},
    {"name": "xshare", "per_request": 0}, {"name": "xshare", "per_gpu": 1, "gpus": 1},
    {"name": "lynx", "drop": 0}, {"name": "dynamic-skip", "beta": 0}, {"name": "dynamic-skip", "beta": 1},
    {"name": "skip-threshold", "max_skip": 1, "calibration": 1},
])
def test_budget_parameters_at_the_edges_of_their_range_are_accepted(spec):
    assert scenario(policies={"budget": spec}).policies.budget.name == spec["name"]


# ---------------------------------------------------------------- expert placement files

@pytest.mark.parametrize("text", [
    "0: [0, 0, 1, 1]\n1: [1, 1, 0, 0]\n",          # per layer, integer keys
    "'0': [0, 0, 1, 1]\n'1': [1, 1, 0, 0]\n",      # per layer, string keys (JSON)
])
def test_placement_file_maps_each_layers_experts_to_gpus(tmp_path, text):
    path = tmp_path / "place.yaml"
    path.write_text(text)
    assert placement_of(str(path), 2, 4, 2).tolist() == [[0, 0, 1, 1], [1, 1, 0, 0]]


def test_placement_file_with_one_list_applies_it_to_every_layer(tmp_path):
    path = tmp_path / "place.yaml"
    path.write_text("[1, 0, 1, 0]\n")
    assert placement_of(str(path), 3, 4, 2).tolist() == [[1, 0, 1, 0]] * 3


def test_contiguous_and_round_robin_placements():
    assert placement_of("contiguous", 2, 8, 4).tolist() == [[0, 0, 1, 1, 2, 2, 3, 3]] * 2
    assert placement_of("round-robin", 2, 8, 3).tolist() == [[0, 1, 2, 0, 1, 2, 0, 1]] * 2


@pytest.mark.parametrize(("text", "layer"), [
    ("0: [0, 0, 1]\n1: [0, 0, 1, 1]\n", 0),        # too few experts
    ("0: [0, 0, 1, 1]\n1: [0, 0, 1, 2]\n", 1),     # GPU id 2 with 2 GPUs
    ("0: [0, -1, 1, 1]\n1: [0, 0, 1, 1]\n", 0),    # negative GPU id
    ("0: [0, 0, 1, 1]\n", 1),                      # layer 1 missing
    ("0: {a: 1}\n1: [0, 0, 1, 1]\n", 0),           # not a list
])
def test_a_bad_placement_file_names_the_file_the_layer_and_the_rule(tmp_path, text, layer):
    path = tmp_path / "place.yaml"
    path.write_text(text)
    with pytest.raises(MoesimError) as exc:
        placement_of(str(path), 2, 4, 2)
    assert str(exc.value) == f"expert placement {path}: layer {layer} needs a list of 4 GPU ids in 0..1."


def test_a_missing_placement_file_says_what_else_to_use(tmp_path):
    with pytest.raises(MoesimError) as exc:
        placement_of(str(tmp_path / "none.yaml"), 2, 4, 2)
    assert str(exc.value) == (f"expert placement {tmp_path / 'none.yaml'}: no such file. "
                              "Use contiguous, round-robin or a placement YAML file.")


# ---------------------------------------------------------------- Lynx and dynamic skipping

def test_lynx_drops_the_least_used_experts_ties_by_lower_weight():
    """Top-2 of 8: t0 (0, 1) weights (0.75, 0.25); t1 (0, 2) (0.5, 0.5); t2 (3, 1) (0.875,
    0.125). Tokens per expert: e0 2, e1 2, e2 1, e3 1; summed weight: e0 1.25, e1 0.375,
    e2 0.5, e3 0.875. Drop order (count, then weight): e2, e3, e1, e0.
    drop 1: e2 -> t1 keeps (0); drop 2: also e3 -> t2 keeps (1); drop 3: also e1."""
    t = one_pass([[0, 1], [0, 2], [3, 1]], [[0.75, 0.25], [0.5, 0.5], [0.875, 0.125]])
    assert select(t, {"name": "lynx", "drop": 0}) == [[0, 1], [0, 2], [3, 1]]
    assert select(t, {"name": "lynx", "drop": 1}) == [[0, 1], [0], [3, 1]]
    assert select(t, {"name": "lynx", "drop": 2}) == [[0, 1], [0], [1]]
    assert select(t, {"name": "lynx", "drop": 3}) == [[0], [0], []]


def test_dynamic_skip_keeps_a_weight_equal_to_beta_times_the_top_weight():
    """beta = 0.5, top-3 (weights exact in binary). t0 (0.5, 0.25, 0.25): 0.25 >= 0.5 * 0.5
    -> all kept; t1 (0.75, 0.25, 0): rank 1 0.25 < 0.375 skipped, rank 2 too; t2 (0.5,
    0.3125, 0.1875): 0.3125 kept, 0.1875 < 0.25 skipped. The top expert always stays."""
    t = one_pass([[0, 1, 2], [3, 4, 5], [6, 7, 0]], [[0.5, 0.25, 0.25], [0.75, 0.25, 0.0], [0.5, 0.3125, 0.1875]])
    assert select(t, {"name": "dynamic-skip", "beta": 0.5}) == [[0, 1, 2], [3], [6, 7]]
    assert select(t, {"name": "dynamic-skip", "beta": 0.0}) == [[0, 1, 2], [3, 4, 5], [6, 7, 0]]
    assert select(t, {"name": "dynamic-skip", "beta": 1.0}) == [[0], [3], [6]]


# ---------------------------------------------------------------- MoE-Spec

def test_moe_spec_router_ranking_sums_each_experts_weight_over_the_tokens():
    """Top-2 of 8: t0 (0, 1) (0.75, 0.25); t1 (2, 1) (0.5, 0.5); t2 (0, 3) (0.25, 0.75). Summed
    over the tokens (eq. 5): e0 1.0, e1 0.75, e3 0.75, e2 0.5. Budget 3: shortlist {0, 1, 3}
    (e1 before e3 by index). Truncation (eq. 7): t0 (0, 1), t1 (1), t2 (0, 3)."""
    t = one_pass([[0, 1], [2, 1], [0, 3]], [[0.75, 0.25], [0.5, 0.5], [0.25, 0.75]])
    spec = {"name": "moe-spec", "budget": 3, "coverage": "truncation"}
    assert select(t, spec) == [[0, 1], [1], [0, 3]]
    assert select(t, {**spec, "budget": 1}) == [[0], [], [0]]


def probs_pass() -> Trace:
    """Three tokens of 8 experts with router probabilities (eq. 8 ranks experts outside a
    token's top-k): t0 (0.4, 0.3, 0.2, 0.1, 0...), top-2 (0, 1); t1 (0.1, 0.2, 0.4, 0.3, 0...),
    top-2 (2, 3); t2 (0.3, 0.1, 0.1, 0.5, 0...), top-2 (3, 0)."""
    probs = np.zeros((3, 8), dtype=np.float32)
    probs[0, :4] = [0.4, 0.3, 0.2, 0.1]
    probs[1, :4] = [0.1, 0.2, 0.4, 0.3]
    probs[2, :4] = [0.3, 0.1, 0.1, 0.5]
    t = one_pass([[0, 1], [2, 3], [3, 0]], [[0.4, 0.3], [0.4, 0.3], [0.5, 0.3]])
    t.probs = probs
    return t


def test_moe_spec_substitution_gives_each_token_its_top_k_inside_the_shortlist():
    """Summed probabilities: e0 0.8, e1 0.6, e2 0.7, e3 0.9. Budget 2: {3, 0}. Substitution
    (eq. 8): each token's top-2 within {0, 3} by its own probabilities: t0 (0 0.4, 3 0.1),
    t1 (3 0.3, 0 0.1), t2 (3 0.5, 0 0.3). Truncation keeps only its own: t0 (0), t1 (3),
    t2 (3, 0)."""
    t = probs_pass()
    assert select(t, {"name": "moe-spec", "budget": 2}) == [[0, 3], [3, 0], [3, 0]]
    assert select(t, {"name": "moe-spec", "budget": 2, "coverage": "truncation"}) == [[0], [3], [3, 0]]


def test_moe_spec_substitution_without_probs_names_the_fixes():
    t = one_pass([[0, 1]], [[0.5, 0.5]])
    with pytest.raises(MoesimError) as exc:
        select(t, {"name": "moe-spec", "budget": 2})
    assert ("budget 'moe-spec' with coverage: substitution needs the trace's 'probs' column (router "
            "probabilities over all experts) and this trace has none; use coverage: truncation, or record "
            "probs (`moesim capture`, or synth probs: true).") in str(exc.value)


def decode_passes(routes: list[list[int]], weights: list[list[float]]) -> Trace:
    """One request decoding one token per pass, one layer, top-2 of 8 experts."""
    n = len(routes)
    model = small_model(layers=1, experts=8, top_k=2)
    return Trace(model=model, request=np.zeros(n, dtype=np.int32), step=np.arange(n, dtype=np.int32),
                 position=np.arange(n, dtype=np.int32), phase=np.full(n, PHASE_CODES["decode"], dtype=np.int8),
                 layer=np.zeros(n, dtype=np.int16), experts=np.array(routes, dtype=np.int16),
                 weights=np.array(weights, dtype=np.float32))


def test_moe_spec_static_ranking_counts_only_the_calibration_passes():
    """Eq. 4: counts over the first ceil(4 passes x 0.25) = 1 pass: (0, 1) -> e0 1, e1 1:
    budget 1 keeps e0 (by index). Pass 1 routes (1, 2), so counting 2 passes would rank e1
    first. Pass 3 routes (0, 1): truncation keeps (0). With calibration 0.5 (2 passes):
    e1 2 -> keeps (1)."""
    t = decode_passes([[0, 1], [1, 2], [2, 3], [0, 1]], [[0.5, 0.5]] * 4)
    spec = {"name": "moe-spec", "budget": 1, "ranking": "static", "coverage": "truncation", "calibration": 0.25}

    def at_pass_3(s):
        sim = Simulation(scenario(policies={"budget": s}), trace=t)
        rows = sim.wl.rows(3, 0)
        return sim.budget.select(3, 0, rows, t.experts[rows].astype(np.int64))

    assert at_pass_3(spec) == [[0]]
    assert at_pass_3({**spec, "calibration": 0.5}) == [[1]]
    assert at_pass_3({**spec, "calibration": 1.0}) == [[1]]  # all 4 passes: e1 3, e0 2, e2 2, e3 1


def test_skip_threshold_with_max_skip_one_skips_the_lowest_weight_expert():
    """Eqs. (15)-(16), top-3, m = 1, calibration on this one pass. Weights sorted ascending:
    t0 (0.125, 0.25, 0.625): r_1 = 0.375; t1 (0.25, 0.25, 0.5): r_1 = 0.5; t2 (0.0625,
    0.1875, 0.75): r_1 = 0.25. beta_1 = median 0.375. A token skips its lowest expert when
    r_1 < 0.375: t2 only (t0 equals it). Kept experts stay in rank order."""
    t = one_pass([[5, 1, 2], [3, 4, 6], [0, 7, 1]],
                 [[0.625, 0.25, 0.125], [0.5, 0.25, 0.25], [0.75, 0.1875, 0.0625]])
    assert select(t, {"name": "skip-threshold", "max_skip": 1, "calibration": 1.0}) == [[5, 1, 2], [3, 4, 6], [0, 7]]


# ---------------------------------------------------------------- XShare per request and per GPU

def spec_batch() -> Trace:
    """One pass: request 0 verifies two tokens, request 1 one (XShare §4, speculative batch).
    Top-2 of 8: r0 t0 (0, 1) (0.625, 0.375), r0 t1 (2, 3) (0.75, 0.25); r1 t2 (4, 5) (0.5, 0.5)."""
    model = small_model(layers=1, experts=8, top_k=2)
    return Trace(model=model, request=np.array([0, 0, 1], dtype=np.int32), step=np.zeros(3, dtype=np.int32),
                 position=np.array([0, 1, 0], dtype=np.int32), phase=np.full(3, PHASE_CODES["prefill"], dtype=np.int8),
                 layer=np.zeros(3, dtype=np.int16), experts=np.array([[0, 1], [2, 3], [4, 5]], dtype=np.int16),
                 weights=np.array([[0.625, 0.375], [0.75, 0.25], [0.5, 0.5]], dtype=np.float32))


def test_xshare_per_request_uses_each_requests_own_tokens():
    """Algorithm 4, k0 = 1, m_r = 1. Request 0: warm-up {0, 2} (its tokens' top-1); its own
    scores e0 0.625, e1 0.375, e2 0.75, e3 0.25: best other expert e1. Request 1: warm-up {4},
    best other e5. Union {0, 1, 2, 4, 5}; no budget, no top-up. Each token's top-2 within it:
    t0 (0, 1), t1 (2) (e3 is out), t2 (4, 5)."""
    assert select(spec_batch(), {"name": "xshare", "per_request": 1}) == [[0, 1], [2], [4, 5]]


def test_xshare_per_request_with_three_requests_keeps_each_to_its_own_tokens():
    """m_r = 1, k0 = 1, one token per request: r0 (0, 1), r1 (2, 3), r2 (4, 5). Each request
    adds its own second expert: the union is all six and every token keeps both experts
    (pooling the other requests' tokens instead would leave expert 3 out)."""
    t = one_pass([[0, 1], [2, 3], [4, 5]], [[0.625, 0.375], [0.75, 0.25], [0.5, 0.5]])
    assert select(t, {"name": "xshare", "per_request": 1}) == [[0, 1], [2, 3], [4, 5]]


def test_xshare_per_request_adds_only_experts_its_tokens_scored():
    """16 experts, k0 = 1, m_r = 2, budget 8. Request A, one token (8, 9): warm-up {8}, one
    scored extra (9) — not two: a zero-score expert would take a place. Request B, three tokens
    (3, 4) (0.5, 0.5), (5, 2) (0.75, 0.25), (7, 6) (0.875, 0.125): warm-up {3, 5, 7}, extras
    4 (0.5) and 2 (0.25) (6, 0.125, is third). Union {2, 3, 4, 5, 7, 8, 9}: 7 < 8, so the
    batch top-up adds the best remaining, 6. Token (7, 6) keeps both."""
    model = small_model(layers=1, experts=16, top_k=2)
    t = Trace(model=model, request=np.array([0, 1, 1, 1], dtype=np.int32), step=np.zeros(4, dtype=np.int32),
              position=np.array([0, 0, 1, 2], dtype=np.int32), phase=np.full(4, PHASE_CODES["prefill"], dtype=np.int8),
              layer=np.zeros(4, dtype=np.int16), experts=np.array([[8, 9], [3, 4], [5, 2], [7, 6]], dtype=np.int16),
              weights=np.array([[0.625, 0.375], [0.5, 0.5], [0.75, 0.25], [0.875, 0.125]], dtype=np.float32))
    assert select(t, {"name": "xshare", "per_request": 2, "budget": 8}) == [[8, 9], [3, 4], [5, 2], [7, 6]]


def test_xshare_per_gpu_takes_each_gpus_best_expert_first():
    """Algorithm 5, m_g = 1 on 2 GPUs, k0 = 0: batch scores e0 0.75, e1 0.25 (GPU 0), e2 0.375,
    e3 0.625 (GPU 1): the set is {0, 3}; the tokens keep only those."""
    model = small_model(layers=1, experts=4, top_k=2)
    t = Trace(model=model, request=np.array([0, 1], dtype=np.int32), step=np.zeros(2, dtype=np.int32),
              position=np.zeros(2, dtype=np.int32), phase=np.full(2, PHASE_CODES["prefill"], dtype=np.int8),
              layer=np.zeros(2, dtype=np.int16), experts=np.array([[0, 1], [3, 2]], dtype=np.int16),
              weights=np.array([[0.75, 0.25], [0.625, 0.375]], dtype=np.float32))
    assert select(t, {"name": "xshare", "per_gpu": 1, "gpus": 2, "k0": 0}) == [[0], [3]]


def test_xshare_per_request_zero_with_no_warm_up_selects_nothing():
    """k0 = 0, m_r = 0, no budget: the union is empty and Algorithm 4's top-up m is 0."""
    assert select(spec_batch(), {"name": "xshare", "per_request": 0, "k0": 0}) == [[], [], []]


def test_xshare_per_gpu_stops_when_every_gpu_has_run_out():
    """Algorithm 5 with m_g = 3 on 2 GPUs (6 experts wanted) but 4 experts per layer: GPU 0
    owns e0, e1 and GPU 1 e2, e3 (contiguous). Rounds add (e0, e2) then (e1, e3); then no
    GPU has experts left and the selection ends with all four. k0 = 0."""
    model = small_model(layers=1, experts=4, top_k=2)
    t = Trace(model=model, request=np.array([0, 1], dtype=np.int32), step=np.zeros(2, dtype=np.int32),
              position=np.zeros(2, dtype=np.int32), phase=np.full(2, PHASE_CODES["prefill"], dtype=np.int8),
              layer=np.zeros(2, dtype=np.int16), experts=np.array([[0, 2], [1, 3]], dtype=np.int16),
              weights=np.array([[0.75, 0.25], [0.5, 0.5]], dtype=np.float32))
    assert select(t, {"name": "xshare", "per_gpu": 3, "gpus": 2, "k0": 0}) == [[0, 2], [1, 3]]


# ---------------------------------------------------------------- ties: expert index order

def tied_pass() -> Trace:
    """Four tokens, top-8 of 64 experts, all weights 1/8: token t routes experts 32 + 8 t ..
    39 + 8 t. Experts 32..63 tie at batch score 0.125, experts 0..31 at 0."""
    experts = [[32 + 8 * t + j for j in range(8)] for t in range(4)]
    return one_pass(experts, [[0.125] * 8] * 4, num_experts=64)


def test_ties_go_to_the_lower_expert_index():
    """XShare budget 4, no warm-up: the four best of 32 tied experts are 32..35; token 0 keeps
    them (in index order), the others keep none. MoE-Spec budget 4: the same shortlist.
    XShare per GPU (m_g = 2, 2 GPUs, contiguous: e0..31 on GPU 0, e32..63 on GPU 1): GPU 1
    adds 32 then 33, GPU 0 adds 0 then 1 (score 0: no token is routed to them)."""
    t = tied_pass()
    none: list[list[int]] = [[], [], []]
    assert select(t, {"name": "xshare", "budget": 4, "k0": 0}) == [[32, 33, 34, 35], *none]
    assert select(t, {"name": "moe-spec", "budget": 4, "coverage": "truncation"}) == [[32, 33, 34, 35], *none]
    assert select(t, {"name": "xshare", "per_gpu": 2, "gpus": 2, "k0": 0}) == [[32, 33], *none]
    # per request (one token each): token 0's warm-up 32, then its two best tied extras 33, 34
    assert select(t, {"name": "xshare", "per_request": 2, "k0": 1})[0] == [32, 33, 34]
