"""Test helpers: small traces from arrays, scenarios from dicts, the real-trace folder."""

from __future__ import annotations

import contextlib
import json
import os
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from moesim.config.hardware import deep_merge
from moesim.config.scenario import Scenario, scenario_from_dict
from moesim.traces.schema import PHASE_CODES, ModelInfo, expert_bytes_for
from moesim.traces.synth import grid_index
from moesim.traces.trace import Trace

# ../shared beside the checkout; MOESIM_SHARED names it when the tests run from a copy (mutmut)
REAL = Path(os.environ.get("MOESIM_SHARED") or Path(__file__).resolve().parents[2] / "shared") / "traces" / "real"


def real_dir() -> Path:
    """../shared/traces/real, or skip the test with a message saying what is missing."""
    if not REAL.is_dir():
        pytest.skip(f"real traces not found at {REAL} (../shared/traces/real beside the checkout)")
    return REAL


def small_model(layers: int = 2, experts: int = 8, top_k: int = 2, hidden: int = 256,
                inter: int = 512, renorm: bool = True) -> ModelInfo:
    return ModelInfo(name="tiny", num_layers=layers, num_experts=experts, top_k=top_k,
                     hidden_size=hidden, expert_intermediate_size=inter,
                     expert_bytes=expert_bytes_for(hidden, inter), renormalize=renorm)


def trace_from_array(model: ModelInfo, experts: np.ndarray, prompt_tokens: int = 0) -> Trace:
    """Trace from an int array [requests, tokens, layers, k]; the first ``prompt_tokens``
    positions of each request are its prefill (step 0), the rest decode steps."""
    r, t, num_l, k = experts.shape
    flat = experts.reshape(-1, k).astype(np.int16)
    w = np.full(flat.shape, 1.0 / k, dtype=np.float32)
    return Trace(model=model, **grid_index(r, t, num_l, prompt_tokens), experts=flat, weights=w)


BASE: dict[str, Any] = {
    "seed": 0,
    "hardware": {"preset": "a100-80g-pcie4"},
    "workload": {"trace": {"synth": {"preset": "olmoe-1b-7b", "tokens": 50}}, "batch_size": 1},
    "cache": {"capacity": "5%"},
    "policies": {"eviction": "lru", "miss": "fetch", "prefetch": "none"},
}


def experts_cap(cap: int, model: ModelInfo) -> str:
    """A capacity of ``cap`` experts, at most the model's (a larger count is refused as bad
    input, as 120% is): property tests draw counts beyond a small model's to mean that every
    expert fits."""
    return f"{min(cap, model.num_layers * model.num_experts)} experts"


def scenario(**over: Any) -> Scenario:
    """Scenario from BASE with nested overrides (e.g. cache={'capacity': '10 experts'})."""
    return scenario_from_dict(deep_merge(BASE, over), where="<test>")


def mixtral_trace(name: str = "gsm8k") -> Trace:
    """The real Mixtral expert-jsonl trace read directly (problems as requests, decode)."""
    path = real_dir() / "mixtral-8x7b-vllm" / f"routing_data_collected_{name}_2_routing.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows.sort(key=lambda r: (r["problem_id"], r["token_idx"], r["layer"]))
    model = ModelInfo(name="mixtral-8x7b", num_layers=32, num_experts=8, top_k=2, hidden_size=4096,
                      expert_intermediate_size=14336, expert_bytes=expert_bytes_for(4096, 14336),
                      renormalize=True)
    n = len(rows)
    return Trace(
        model=model,
        request=np.array([r["problem_id"] for r in rows], dtype=np.int32),
        step=np.array([r["token_idx"] for r in rows], dtype=np.int32),
        position=np.array([r["token_idx"] for r in rows], dtype=np.int32),
        phase=np.full(n, PHASE_CODES["decode"], dtype=np.int8),
        layer=np.array([r["layer"] for r in rows], dtype=np.int16),
        experts=np.array([r["experts"] for r in rows], dtype=np.int16),
        weights=np.array([r["gating_probs"] for r in rows], dtype=np.float32),
    )


def access_stream(trace: Trace) -> list[int]:
    """(layer, expert) keys of a batch-1 trace ordered by request, step, layer, rank."""
    e = trace.model.num_experts
    order = np.lexsort((trace.layer, trace.step, trace.request))
    out: list[int] = []
    for i in order:
        layer = int(trace.layer[i])
        out.extend(layer * e + int(x) for x in trace.experts[i])
    return out


def group_counts(values: list[int]) -> dict[int, int]:
    counts: dict[int, int] = defaultdict(int)
    for v in values:
        counts[v] += 1
    return counts


def flame_decode_trace() -> Trace:
    """The real FLAME-MoE-290M decode trace (64 sequences x 10 decode positions x MoE layers
    2..9 as 0..7), through the flame-csv importer (tested against the traces' documented facts)."""
    from moesim.traces.importers import import_trace

    return import_trace("flame-csv", [real_dir() / "flame-moe-290m" / "decode"])[0]


def batch_cells(trace: Trace, batch: int) -> list[list[int]]:
    """Independent construction of a batched decode trace's (pass, layer) cells, in replay
    order: requests in groups of ``batch``; per step, per layer, the distinct (layer, expert)
    keys in order of first appearance over requests (ascending) and ranks."""
    e = trace.model.num_experts
    reqs = sorted(set(trace.request.tolist()))
    group_of = {r: i // batch for i, r in enumerate(reqs)}
    cells: dict[tuple[int, int, int], list[tuple[int, list[int]]]] = defaultdict(list)
    for i in range(len(trace)):
        r = int(trace.request[i])
        cells[(group_of[r], int(trace.step[i]), int(trace.layer[i]))].append((r, trace.experts[i].tolist()))
    out: list[list[int]] = []
    for key in sorted(cells):
        keys: list[int] = []
        for _r, experts in sorted(cells[key], key=lambda c: c[0]):
            keys += [key[2] * e + x for x in experts if key[2] * e + x not in keys]
        out.append(keys)
    return out


def batch_access_stream(trace: Trace, batch: int) -> list[int]:
    """The access stream of a batched decode trace: its :func:`batch_cells`, one after another."""
    return [k for keys in batch_cells(trace, batch) for k in keys]


def datasheet_times(model: ModelInfo, wl: Any) -> tuple[np.ndarray, np.ndarray, float]:
    """Per-access expert compute, per-pass non-expert time and one bf16 expert's copy time,
    written from the A100-80G + PCIe 4.0 datasheet figures (HBM 2039 GB/s, 312 TFLOPS bf16,
    launches 5 us per expert and 20 us per layer; PCIe 32 GB/s at 80% efficiency, half of it
    at 64 KiB, 10 us latency) and the roofline of docs/design.md, independently of the cost
    model: an expert reads 6 H I bytes and does 6 H I FLOPs per token; a layer's non-expert
    part (q and kv widths H) reads W = 4 H^2 + H N bf16 weights plus 4 H
    bytes of KV cache per context token and does 2 W FLOPs per token plus 4 H per context
    token."""
    h, i, n = model.hidden_size, model.expert_intermediate_size, model.num_experts
    assert model.heads * model.head_size == h, "q width H is assumed"
    assert model.kv_heads * model.head_size == h, "kv width H is assumed"
    hbm, peak = 2039e9, 312e12
    ffn = np.maximum(6 * h * i / hbm, 6 * h * i * wl.acc_tokens / peak) + 5e-6
    w = 4 * h * h + h * n
    nonexp = np.maximum((2 * w + 4 * h * wl.pass_context) / hbm,
                        (2 * w * wl.pass_tokens + 4 * h * wl.pass_context) / peak) + 20e-6
    copy = 10e-6 + (6 * h * i + 65_536) / (32e9 * 0.8)
    return ffn, nonexp, copy


def register_none_at_layer_1(monkeypatch: Any) -> str:
    """Register (for one test) a user's budget policy that keeps no expert at layer 1 and
    every routed one elsewhere; returns its name."""
    from moesim.policies.budget import REGISTRY, BudgetPolicy

    class NoneAtLayer1(BudgetPolicy):
        def select(self, pass_index, layer, rows, experts):  # type: ignore[no-untyped-def]
            return [[] for _ in rows] if layer == 1 else experts.tolist()

    monkeypatch.setitem(REGISTRY._classes, "none-at-1", NoneAtLayer1)
    return "none-at-1"


def load_tool(name: str, folder: str = "tools") -> Any:
    """A script of ``tools/`` (or ``folder``; not a package) loaded as a module, by its file
    name without ``.py``."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / folder / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def kernel_by_hand(ev: str, num_keys: int, layers: int = 1, nprec: int = 1, params: Any = None,
                   pool: int = 8, capacity: float = float("inf")) -> tuple[Any, ...]:
    """The replay kernel's state for eviction policy ``ev`` (a registered name), to drive its
    functions by hand: ``IS, FS, K, T, DI, A`` with ``layers`` layers of ``num_keys // layers``
    keys (``nprec`` precisions), the policy's compiled form picked (``C_FORM``) and its state in
    ``A``; instant copies, one byte an entry, a cache of ``capacity`` bytes."""
    import moesim.kernel_state as KS
    from moesim.policies.eviction import REGISTRY
    from moesim.policies.eviction.forms import form_index, form_of
    from moesim.policies.registry import PolicyContext
    from moesim.simulator import kernel as K

    cls = REGISTRY.get(ev)
    ctx = PolicyContext(num_layers=layers, num_experts=num_keys // layers // nprec, top_k=1, expert_bytes=1,
                        rng=np.random.default_rng(0), precisions=("bf16", "int4")[:nprec],
                        precision_bytes=(1, 1)[:nprec], capacity_bytes=capacity)
    policy = cls(params if params is not None else cls.Params(), ctx)
    IS, FS, KR, TR, _ = KS._layout(num_keys=num_keys, pool=pool, pend_max=4, maxn=1, nprec=nprec,
                                   per_layer=num_keys // layers)
    form = form_of(cls)
    assert form is not None
    IS[KS.C_L], IS[KS.C_FORM], IS[KS.C_INSTANT], IS[KS.C_NBYTES] = layers, form_index(cls), 1, 1
    IS[KS.C_PENDING], IS[KS.C_KEEPSTATIC], IS[KS.C_PUREVICT] = form.reads_pending, form.keeps_static, form.pure_victim
    FS[KS.CF_CAP] = capacity
    hooks, S = K._form_arrays(policy, num_keys)
    DI = np.zeros(1 << 12, np.int64)  # no accesses at any (pass, layer) a driver reaches (its offsets)
    A = KS.Accesses(*(np.zeros(1, np.int64),) * 5, hooks, S)
    return IS, FS, KR, TR, DI, A


class Callable:
    """A compiled module's functions as Python can call them (:func:`moesim.jit.entry`: the
    kernel's own have no wrapper for it), its constants as they are."""

    def __init__(self, module: Any) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Any:
        from moesim.jit import entry

        value = getattr(self._module, name)
        return entry(value) if callable(value) and hasattr(value, "py_func") else value


def unwrap(text: str) -> str:
    """moesim's prose as written before wrapping at 80 columns: each continuation line (two
    spaces of indent, :func:`moesim.output.console.wrapped`) joined to the line above."""
    import re

    return re.sub(r"\n  (?=\S)", " ", text)


START_LINE = (r"moesim (run \S+: loading the trace and the replay kernel|(sweep|compare) \S+: planning the points "
              r"\(results in \S+\))")


def error_of(output: str) -> str:
    """The one error paragraph a failed command printed, unwrapped: after, at most, the
    command's first line (said before its heavy work), and nothing else."""
    import re

    lines = unwrap(output).strip().split("\n")
    if len(lines) > 1 and re.fullmatch(START_LINE, lines[0]):
        lines = lines[1:]
    assert len(lines) == 1, output
    assert lines[0].startswith("error: "), output
    return lines[0]


def narrow(trace: Any, hidden: int = 256, inter: int = 128) -> Any:
    """``trace`` with its model's expert shapes narrowed (same routing, layers and experts):
    for the calibration executor's tests on the CPU, whose expert pool at 100% capacity would
    otherwise hold an OLMoE-shaped model's gigabytes."""
    import dataclasses

    from moesim.traces.schema import expert_bytes_for

    model = dataclasses.replace(trace.model, hidden_size=hidden, expert_intermediate_size=inter,
                                expert_bytes=expert_bytes_for(hidden, inter))
    return dataclasses.replace(trace, model=model)


@contextlib.contextmanager
def registered(registry: Any, policies: dict[str, type]) -> Iterator[None]:
    """Register ``policies`` (name -> class) in a family's ``registry`` while the ``with``
    block lasts (a module's tests' plugins, in a fixture), then remove them."""
    for name, cls in policies.items():
        registry.register(name)(cls)
    try:
        yield
    finally:
        for name in policies:
            del registry._classes[name]


def too_wide(text: str) -> list[str]:
    """The lines of ``text`` wider than 80 columns, except a line that is one path alone, which
    cannot be wrapped (a test's folder is longer under pytest-xdist)."""
    return [line for line in text.splitlines() if len(line) > 80 and (len(line.split()) > 1 or "/" not in line)]
