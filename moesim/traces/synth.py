"""Synthetic routing traces whose statistics follow real ones.

Realistic routing model (one Plackett-Luce draw per token and layer). For request r, token t
and layer l the router logits are::

    z[e] = skew * u[l, e]                          per-layer expert popularity
         + reuse * 1[e in S(t-1, l)]               reuse of the previous token's experts
         + corr * A[l, top1(t, l-1), e]            correlation with the previous layer
         + g[e]                                    Gumbel(0, 1) noise

``u`` and ``A`` are fixed standard-normal tables drawn from the seed. The top-k of ``z`` are
the token's experts in rank order (sampling k experts without replacement with probabilities
proportional to exp of the deterministic part); the mixing weights are ``softmax(z)`` at
those experts, renormalised over the top-k when the model does so. ``uniform`` routing sets
skew = reuse = corr = 0, so every k-subset is equally likely and tokens are independent.

The defaults per preset were tuned so that the statistics of :mod:`traces.stats` match the
real traces in ``../shared/traces/real``; ``docs/concepts/synthetic.md`` gives the figures and the
procedure (``tools/synth_tuning.py tune``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from moesim.errors import MoesimError, did_you_mean
from moesim.traces.schema import PHASE_CODES, ModelInfo, expert_bytes_for
from moesim.traces.trace import Trace


@dataclass(frozen=True)
class RoutingParams:
    """Parameters of the realistic routing model (logit units)."""

    skew: float = 0.5
    """Scale of the per-layer expert popularity logits (0 = every expert equally popular)."""
    reuse: float = 1.0
    """Logit bonus for the experts the previous token chose at the same layer."""
    corr: float = 0.6
    """Scale of the previous-layer top-1 -> this-layer affinity logits."""


@dataclass(frozen=True)
class SynthPreset:
    """A model shape from a paper plus routing defaults tuned on a real trace."""

    model: ModelInfo
    routing: RoutingParams
    tuned_on: str


def _model(name: str, layers: int, experts: int, k: int, hidden: int, inter: int, renorm: bool,
           heads: int, kv_heads: int, head_dim: int, shared: int = 0, shared_inter: int = 0) -> ModelInfo:
    return ModelInfo(name=name, num_layers=layers, num_experts=experts, top_k=k,
                     hidden_size=hidden, expert_intermediate_size=inter,
                     expert_bytes=expert_bytes_for(hidden, inter), renormalize=renorm,
                     shared_experts=shared, shared_expert_intermediate_size=shared_inter,
                     num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim)


# Shapes from the models' public configs; routing defaults from tools/synth_tuning.py.
PRESETS: dict[str, SynthPreset] = {
    "olmoe-1b-7b": SynthPreset(
        _model("olmoe-1b-7b", 16, 64, 8, 2048, 1024, False, 16, 16, 128),
        RoutingParams(skew=0.5, reuse=1.0, corr=0.6), "OLMoE-1B-7B layer-0 vLLM log"),
    "mixtral-8x7b": SynthPreset(
        _model("mixtral-8x7b", 32, 8, 2, 4096, 14336, True, 32, 8, 128),
        RoutingParams(skew=0.05, reuse=0.6, corr=0.9), "Mixtral-8x7B GSM8K vLLM trace"),
    "qwen1.5-moe-a2.7b": SynthPreset(
        _model("qwen1.5-moe-a2.7b", 24, 60, 4, 2048, 1408, False, 16, 16, 128, 4, 1408),
        RoutingParams(skew=0.2, reuse=0.6, corr=0.6), "Qwen1.5-MoE-A2.7B layer-0 vLLM log"),
    "qwen3-30b-a3b": SynthPreset(
        _model("qwen3-30b-a3b", 48, 128, 8, 2048, 768, True, 32, 4, 128),
        RoutingParams(skew=0.5, reuse=1.0, corr=0.6), "no real trace: OLMoE (top-8) defaults"),
    "phi-3.5-moe": SynthPreset(
        _model("phi-3.5-moe", 32, 16, 2, 4096, 6400, True, 32, 8, 128),
        RoutingParams(skew=0.05, reuse=0.6, corr=0.9), "no real trace: Mixtral (top-2) defaults"),
}


def get_preset(name: str) -> SynthPreset:
    """Look up a preset by name; unknown names list the valid ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise MoesimError(
            f"unknown synthetic preset '{name}'{did_you_mean(name, list(PRESETS))}; valid presets: "
            f"{', '.join(PRESETS)}.") from None


def reshape_model(model: ModelInfo, layers: int | None = None, experts: int | None = None,
                  top_k: int | None = None) -> ModelInfo:
    """The preset's model with overridden layer / expert / top-k counts."""
    k = top_k or model.top_k
    n = experts or model.num_experts
    if k > n:
        raise MoesimError(f"synthetic trace: top-k {k} exceeds {n} experts per layer (--top-k / "
                          "--experts, or workload.trace.synth.top_k / experts); top-k must be at "
                          "most the number of experts.")
    try:
        return replace(model, num_layers=layers or model.num_layers, num_experts=n, top_k=k)
    except ValueError as exc:
        raise MoesimError(f"synthetic trace: {exc}.") from None


def _check_sizes(requests: int, prompt_tokens: int, tokens: int, routing: str) -> None:
    for label, value, low in (("requests", requests, 1), ("prompt tokens", prompt_tokens, 0),
                              ("tokens", tokens, 0)):
        if value < low:
            raise MoesimError(f"synthetic trace: {label} must be >= {low}, got {value}.")
    if prompt_tokens + tokens == 0:
        raise MoesimError("synthetic trace: prompt tokens and decode tokens are both 0; ask for "
                          "at least one token.")
    if routing not in ("realistic", "uniform"):
        raise MoesimError(f"unknown routing model '{routing}'; valid: realistic, uniform.")


def _route(z: np.ndarray, k: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Router logits ``z`` [requests, N] -> each token's top-k experts (by logit, descending),
    their softmax weights and the full softmax."""
    requests, num_e = z.shape
    top = np.argpartition(-z, k - 1, axis=1)[:, :k] if k < num_e else np.tile(np.arange(num_e), (requests, 1))
    ztop = z[rows, top]
    order = np.argsort(-ztop, axis=1)
    top = top[rows, order]
    ztop = ztop[rows, order]
    zmax = z.max(axis=1, keepdims=True)
    ez = np.exp(z - zmax)
    denom = ez.sum(axis=1, keepdims=True)
    return top, np.exp(ztop - zmax) / denom, ez / denom


def generate(model: ModelInfo, *, requests: int = 1, prompt_tokens: int = 0, tokens: int = 100,
             seed: int = 0, routing: str = "realistic", params: RoutingParams | None = None,
             capture: dict[str, object] | None = None, probs: bool = False,
             pred_next: bool = False, pred_noise: float = 1.0,
             popularity: np.ndarray | None = None, affinity: np.ndarray | None = None,
             batch_corr: float = 0.0) -> Trace:
    """Generate a trace: each request is a prefill of ``prompt_tokens`` (none when 0) then
    ``tokens`` decode tokens. Requests are generated side by side (vectorised), so the cost
    is ``(prompt_tokens + tokens) * num_layers`` small numpy steps.

    ``probs=True`` records the full router probabilities ``softmax(z)``. ``pred_next=True``
    records a speculative predictor of the next layer's router probabilities,
    ``softmax(z_next + pred_noise * N(0, 1))`` where ``z_next`` are the next layer's true
    logits for the same token: ``pred_noise = 0`` is a perfect predictor, larger values a
    worse one (the last layer, which has no next layer, gets a uniform vector).

    Fitted profiles (:mod:`traces.fit`) replace the random tables: ``popularity`` [L, N]
    is used as is (instead of ``skew * u``), ``affinity`` [L, N, N] (row: the previous
    layer's top-1) is scaled by ``params.corr``; ``batch_corr`` adds a standard-normal logit
    vector shared by every request at the same token index and layer (requests decoded
    together route alike).
    """
    _check_sizes(requests, prompt_tokens, tokens, routing)
    p = params or RoutingParams()
    if routing == "uniform":
        p = RoutingParams(skew=0.0, reuse=0.0, corr=0.0)
    rng = np.random.default_rng(seed)
    num_l, num_e, k = model.num_layers, model.num_experts, model.top_k
    pop = rng.standard_normal((num_l, num_e)) * p.skew
    aff = rng.standard_normal((num_l, num_e, num_e)) * p.corr
    if popularity is not None:
        pop = np.asarray(popularity, dtype=np.float64).reshape(num_l, num_e)
    if affinity is not None:
        aff = np.asarray(affinity, dtype=np.float64).reshape(num_l, num_e, num_e) * p.corr
    shared_rng = np.random.default_rng([seed, 2])
    total = prompt_tokens + tokens
    experts = np.empty((total, num_l, requests, k), dtype=np.int16)
    weights = np.empty((total, num_l, requests, k), dtype=np.float32)
    probs_arr = np.empty((total, num_l, requests, num_e), dtype=np.float32) if probs else None
    pred_arr = (np.full((total, num_l, requests, num_e), 1.0 / num_e, dtype=np.float32)
                if pred_next else None)
    pred_rng = np.random.default_rng([seed, 1])
    prev = np.zeros((num_l, requests, num_e), dtype=bool)
    rows = np.arange(requests)[:, None]
    for t in range(total):
        top1_prev_layer: np.ndarray | None = None
        gumbel = rng.gumbel(size=(num_l, requests, num_e))
        shared = shared_rng.standard_normal((num_l, 1, num_e)) * batch_corr if batch_corr else None
        for layer in range(num_l):
            z = gumbel[layer] + pop[layer]
            if shared is not None:
                z = z + shared[layer]
            if p.reuse and t > 0:
                z = z + p.reuse * prev[layer]
            if (p.corr or affinity is not None) and top1_prev_layer is not None:
                z = z + aff[layer][top1_prev_layer]
            top, w, p_all = _route(z, k, rows)
            if probs_arr is not None:
                probs_arr[t, layer] = p_all
            if pred_arr is not None and layer > 0:
                zp = z + pred_noise * pred_rng.standard_normal(z.shape)
                ep = np.exp(zp - zp.max(axis=1, keepdims=True))
                pred_arr[t, layer - 1] = ep / ep.sum(axis=1, keepdims=True)
            if model.renormalize:
                w = w / w.sum(axis=1, keepdims=True)
            experts[t, layer] = top
            weights[t, layer] = w
            if p.reuse:
                prev[layer] = False
                prev[layer][rows, top] = True
            top1_prev_layer = top[:, 0]
    # rows ordered by request, position, layer
    experts = experts.transpose(2, 0, 1, 3).reshape(-1, k)
    weights = weights.transpose(2, 0, 1, 3).reshape(-1, k)
    probs_rows = probs_arr.transpose(2, 0, 1, 3).reshape(-1, num_e) if probs_arr is not None else None
    pred_rows = pred_arr.transpose(2, 0, 1, 3).reshape(-1, num_e) if pred_arr is not None else None
    cap = {"source": "moesim trace synth", "routing": routing, "seed": seed,
           "requests": requests, "prompt_tokens": prompt_tokens, "tokens": tokens}
    if routing == "realistic":
        cap["params"] = {"skew": p.skew, "reuse": p.reuse, "corr": p.corr}
    if pred_next:
        cap["pred_noise"] = pred_noise
    cap.update(capture or {})
    return Trace(model=model, **grid_index(requests, total, num_l, prompt_tokens),
                 experts=experts, weights=weights, probs=probs_rows, pred_next=pred_rows,
                 capture=cap, source="<synth>")


def grid_index(requests: int, tokens: int, num_layers: int, prompt_tokens: int) -> dict[str, np.ndarray]:
    """Index columns (request, step, position, phase, layer) of ``requests`` requests of
    ``tokens`` positions each, rows ordered by request, position, layer: the first
    ``prompt_tokens`` positions are the request's prefill (step 0), the rest one decode step
    each."""
    pos = np.tile(np.repeat(np.arange(tokens, dtype=np.int32), num_layers), requests)
    is_prefill = pos < prompt_tokens
    return {
        "request": np.repeat(np.arange(requests, dtype=np.int32), tokens * num_layers),
        "step": np.where(is_prefill, 0, pos - prompt_tokens + (1 if prompt_tokens else 0)).astype(np.int32),
        "position": pos,
        "phase": np.where(is_prefill, PHASE_CODES["prefill"], PHASE_CODES["decode"]).astype(np.int8),
        "layer": np.tile(np.arange(num_layers, dtype=np.int16), requests * tokens),
    }


def synth_from_preset(preset: str, *, layers: int | None = None, experts: int | None = None,
                      top_k: int | None = None, routing: str = "realistic",
                      skew: float | None = None, reuse: float | None = None,
                      corr: float | None = None, **kwargs: Any) -> Trace:
    """:func:`generate` with a named preset's shape and routing defaults, plus overrides."""
    sp = get_preset(preset)
    model = reshape_model(sp.model, layers, experts, top_k)
    params = sp.routing
    params = RoutingParams(skew=params.skew if skew is None else skew,
                           reuse=params.reuse if reuse is None else reuse,
                           corr=params.corr if corr is None else corr)
    return generate(model, routing=routing, params=params,
                    capture={"preset": preset}, **kwargs)
