"""The calibration executor in SpecMD's style (``execution.style: hf-loop``):
a Hugging Face-style per-expert Python loop with blocking fetches, 4-bit experts dequantised
before their matmuls, and the host-to-device link throttled in software.

SpecMD (``specmd-expert-caching-least-stale.txt``) runs its policies inside a transformers
forward pass: "fetch blocks until the expert loads from CPU" (A.2), experts are bitsandbytes
4-bit, and "bandwidth throttling delays expert transfers between CPU and GPU to simulate slower
interconnects" (A.4; 5 GB/s in §5.1). :class:`HfLoopPool` replays the simulator's recorded
decisions (the same ``perform`` as the graph executor, :class:`moesim.calibration.executor.DevicePool`)
with:

- a decoder layer's non-expert part launched eagerly, op by op, as transformers' OLMoE layer
  does (:meth:`HfLoopPool.dense`: RMSNorms written out, q/k/v/o projections, q/k norms, rotary
  embedding, attention, residual adds, the router's linear, softmax and top-k, and the expert
  mask: one-hot, permute, sum, greater, nonzero);
- each routed expert run as transformers 5's ``OlmoeExperts.forward`` loop body: the
  ``expert_idx == num_experts`` test and ``torch.where`` on the expert mask (both make the host
  wait for the GPU), the token gather, the dequantisation of the expert's cached 4-bit weights,
  gate and up, SiLU, the product, down, the routing weights' gather and product, ``index_add_``;
  which tokens an expert gets is the trace's count for it (``top_k_index`` made from the counts
  before the timed passes);
- a demand fetch copied on the compute stream, after which the host blocks until the copy has
  landed *and* the throttled link would have carried it (:class:`Link`); a prefetch (the
  scenario's prefetcher) copied by the copy worker on a side stream through the same link;
- 4-bit experts stored as NF4 (bitsandbytes' 16 code values, an absmax scale per 64 weights),
  dequantised with torch ops (a nibble split, a code lookup and a scale: 7 launches, where
  bitsandbytes launches one kernel; bitsandbytes is not on the device machine). 16-bit experts
  are stored as they are and run without dequantisation.

The link: every copy of ``b`` bytes occupies it for the scenario's modelled copy time of ``b``
(``CostModel.copy_time``: at SpecMD's 5 GB/s with no latency, ``b / 5e9``), one copy after
another in the order they are issued; a copy's real transfer (tens of GB/s on the device) runs
inside that window, and the copy counts as landed at the window's end. The waits use
``time.sleep`` (so the copy worker and the loop share the interpreter); its overshoot is
measured per copy (``late_s``).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from moesim.calibration.executor import DevicePool, repeated

# bitsandbytes' NF4 code values (the normal-float 4-bit data type, QLoRA §3; the table in
# bitsandbytes' functional.py), and its block size for absmax scales
NF4 = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
       0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
       0.7229568362236023, 1.0)
NF4_BLOCK = 64
SPIN_S = 2e-4  # Link.wait spins for its last 200 us


class Link:
    """A host-to-device link throttled in software (SpecMD A.4): copies occupy it one after
    another, each for ``seconds`` of the modelled copy time; :meth:`reserve` returns the
    monotonic time at which a copy issued now has crossed it."""

    def __init__(self) -> None:
        self.free = 0.0
        self.lock = threading.Lock()
        self.late = 0.0  # summed overshoot of the waits (seconds past the window's end)
        self.copies = 0

    def reserve(self, seconds: float) -> float:
        with self.lock:
            self.free = max(time.perf_counter(), self.free) + seconds
            self.copies += 1
            return self.free

    def wait(self, until: float) -> None:
        """Wait until ``until``: asleep (so other threads run) to within ``SPIN_S`` of it, then
        spinning, since a sleep overshoots by tens of microseconds (measured on the H200
        machine: 79 us a copy with sleeps alone)."""
        left = until - time.perf_counter()
        if left > SPIN_S:
            time.sleep(left - SPIN_S)
        while time.perf_counter() < until:
            pass
        over = time.perf_counter() - until
        with self.lock:
            self.late += max(over, 0.0)


def nf4_quantise(torch: Any, w: Any) -> tuple[Any, Any]:
    """``w`` (any shape, a multiple of 64 elements) as NF4: packed codes (two per byte, the
    first in the high nibble) and a float32 absmax per block of 64."""
    flat = w.float().reshape(-1, NF4_BLOCK)
    absmax = flat.abs().amax(dim=1).clamp_min(1e-12)
    table = torch.tensor(NF4, dtype=torch.float32, device=w.device)
    codes = (flat / absmax[:, None]).reshape(-1, 1).sub(table).abs().argmin(dim=1).to(torch.uint8)
    packed = (codes[0::2] << 4) | codes[1::2]
    return packed, absmax


def nf4_dequantise(torch: Any, packed: Any, absmax: Any, table: Any, dtype: Any) -> Any:
    """Packed NF4 codes and their absmax scales back to ``dtype`` (a flat tensor)."""
    codes = torch.stack((packed >> 4, packed & 15), dim=1).reshape(-1).long()
    return (table[codes].reshape(-1, NF4_BLOCK) * absmax[:, None]).reshape(-1).to(dtype)


class HfLoopPool(DevicePool):
    """:class:`DevicePool` run as SpecMD's loop (module docstring). ``host`` holds each
    expert's packed weights (:func:`hf_host_weights`); ``copy_s`` is the modelled copy time of
    one expert; ``quantised`` says the host holds NF4 experts (else bf16 as they are)."""

    def __init__(self, torch: Any, host: Any, slots: int, device: str, p_num: int, tokens: int,
                 num_experts: int, shape: tuple[int, int], copy_s: float, quantised: bool,
                 top_k: int, counts: dict[int, dict[int, int]], pass_tokens: Any, num_layers: int) -> None:
        self.shape, self.copy_s, self.quantised, self.top_k = shape, copy_s, quantised, top_k
        self.counts, self.pass_tokens, self.num_layers = counts, pass_tokens, num_layers
        self.link = Link()
        self.routes: dict[tuple[int, int], tuple[Any, Any, Any]] = {}  # (pass, layer) -> top-k index, weights, mask
        self.routing: tuple[Any, Any, Any] | None = None  # the layer being run's
        self.expert_of: dict[int, int] = {}  # buffer -> the expert's index in its layer
        super().__init__(torch, host, slots, device, p_num, tokens, num_experts, graphs=False,
                         prefetch_from="worker")  # SpecMD's prefetches: a worker, its copies through the link
        h = shape[0]
        dt = self.x.dtype
        gen = torch.Generator(device=device).manual_seed(2)
        heads, self.head_dim = max(1, h // 128), min(128, h)
        self.heads = heads
        self.qkvo = (torch.randn(4, h, h, generator=gen, dtype=torch.float32, device=device) / h ** 0.5).to(dt)
        self.norms = torch.ones(4, h, dtype=dt, device=device)
        self.table = torch.tensor(NF4, dtype=torch.float32, device=device)
        pos = torch.arange(tokens, device=device, dtype=torch.float32)
        freq = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2, device=device, dtype=torch.float32) / self.head_dim))
        ang = torch.cat([torch.outer(pos, freq)] * 2, dim=1)
        self.cos, self.sin = ang.cos().to(dt), ang.sin().to(dt)

    def reset(self) -> None:
        super().reset()
        self.link.free, self.link.late, self.link.copies = 0.0, 0.0, 0

    def _hidden(self, host: Any) -> tuple[int, Any]:
        return self.shape[0], self.torch.float32 if self.device == "cpu" else self.torch.bfloat16

    def top_k_index(self, p: int, layer: int) -> list[list[int]]:
        """Pass ``p``'s layer ``layer`` as transformers' router output: for each of the pass's
        tokens its ``top_k`` experts, expert ``e`` chosen by as many tokens as the trace
        routed to it (its tokens consecutive, so distinct while it has at most one per token),
        unused choices set to ``num_experts`` (the loop skips that index)."""
        n, k, num_e = int(self.pass_tokens[p]), self.top_k, self.router.shape[1]
        chosen = [key // self.p_num % num_e for key, c in sorted(self.counts[p * self.num_layers + layer].items())
                  for _ in range(min(c, n))][: n * k]
        chosen += [num_e] * (n * k - len(chosen))
        return [[chosen[j * n + t] for j in range(k)] for t in range(n)]

    def begin_layer(self, p: int, layer: int) -> None:
        if self.plan:
            return
        route = self.routes.get((p, layer))
        if route is None:  # made before the timed passes (prepare), for every pass the plan saw
            raise KeyError((p, layer))
        self.routing = route

    def perform(self, op: str, key: int, needed: dict[int, int], tokens: dict[int, int]) -> None:
        super().perform(op, key, needed, tokens)
        if op in ("hit", "fetch", "bypass"):
            self.expert_of[needed[key]] = key // self.p_num % self.router.shape[1]

    def _rms(self, x: Any, i: int) -> Any:
        torch = self.torch
        v = x.to(torch.float32)
        v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-5)
        return self.norms[i] * v.to(x.dtype)

    def _rotate(self, q: Any, n: int) -> Any:
        half = q.shape[-1] // 2
        rot = self.torch.cat((-q[..., half:], q[..., :half]), dim=-1)
        return q * self.cos[:n] + rot * self.sin[:n]

    def dense(self, n: int) -> None:
        """One decoder layer outside its experts on ``n`` tokens, eagerly (module docstring)."""
        torch, f = self.torch, self.torch.nn.functional
        x = self.x[:n]
        h = self._rms(x, 0)
        q, k, v = (self._rms(h @ self.qkvo[0], 2), self._rms(h @ self.qkvo[1], 3), h @ self.qkvo[2])
        q, k, v = (t.view(n, self.heads, self.head_dim).transpose(0, 1) for t in (q, k, v))
        q, k = self._rotate(q, n), self._rotate(k, n)
        a = f.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=n > 1)
        y = x + a[0].transpose(0, 1).reshape(n, -1) @ self.qkvo[3]
        h = self._rms(y, 1)
        probs = f.softmax(h @ self.router, dim=-1, dtype=torch.float32)
        w, idx = torch.topk(probs, self.top_k, dim=-1)
        w = w.to(x.dtype)
        mask = f.one_hot(idx, num_classes=self.router.shape[1] + 1).permute(2, 1, 0)
        torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()

    def _launch(self, kernels: tuple[tuple[int, int], ...]) -> None:
        """Eagerly, as transformers does: a layer's non-expert part or an expert's loop body
        (a demand copy has landed before its fetch returned)."""
        for b, n in kernels:
            if b < 0:
                self.dense(n)
            else:
                self._expert(b)

    def _expert(self, b: int) -> None:
        """One iteration of transformers' expert loop over buffer ``b``'s expert (module docstring)."""
        torch, f = self.torch, self.torch.nn.functional
        assert self.routing is not None
        _, weights, mask = self.routing
        e = self.expert_of[b]
        if bool(self.experts[e] == self.router.shape[1]):  # the loop's ``expert_idx == num_experts`` test: a host wait
            return
        top_k_pos, token_idx = torch.where(mask[e])
        cur = self.x[token_idx]
        h, inter = self.shape
        if self.quantised:
            codes, scales = self.buffer(b)[: h * inter * 3 // 2], self.buffer(b)[h * inter * 3 // 2:]
            w = nf4_dequantise(torch, codes, scales.view(torch.float32), self.table, cur.dtype).view(3, h, inter)
        else:
            w = self.buffer(b).view(cur.dtype).view(3, h, inter)
        gate, up = cur @ w[0], cur @ w[1]
        y = (f.silu(gate) * up) @ w[2].T
        y = y * weights[token_idx, top_k_pos, None]
        self.out.index_add_(0, token_idx, y)

    def prepare(self) -> None:
        """After the plan: the spares (:meth:`DevicePool.prepare`, no graphs), and each (pass,
        layer)'s routing on the device (:meth:`top_k_index`, uniform weights, the one-hot mask
        as transformers makes it)."""
        super().prepare()
        torch, f = self.torch, self.torch.nn.functional
        self.out = torch.zeros_like(self.x)
        num_e = self.router.shape[1]
        self.experts = torch.arange(num_e + 1, device=self.device)
        for p in range(len(self.pass_tokens)):
            for layer in range(self.num_layers):
                index = torch.tensor(self.top_k_index(p, layer), device=self.device)
                weights = torch.full(index.shape, 1.0 / self.top_k, dtype=self.x.dtype, device=self.device)
                self.routes[(p, layer)] = (index, weights, f.one_hot(index, num_classes=num_e + 1).permute(2, 1, 0))

    def _copy(self, b: int, key: int, background: bool) -> None:
        """A copy through the throttled link: a demand fetch blocks the host until it has
        landed and its window has passed; a prefetch runs on the copy worker (module docstring)."""
        if self.plan:
            return
        dst, src, torch = self.buffer(b), self.host[key // self.p_num], self.torch
        cuda = self.device == "cuda"
        if not background:
            end = self.link.reserve(self.copy_s)
            dst.copy_(src, non_blocking=cuda)
            if cuda:
                torch.cuda.current_stream().synchronize()
            self.link.wait(end)
            return
        after = torch.cuda.Event() if cuda else None
        if after is not None:
            after.record()
        side, link = self.side, self.link

        def job() -> None:
            end = link.reserve(self.copy_s)
            if side is not None:
                with torch.cuda.stream(side):
                    side.wait_event(after)
                    dst.copy_(src, non_blocking=True)
                side.synchronize()
            else:
                dst.copy_(src)
            link.wait(end)

        self.landing[key] = self.copier.submit(job)


def hf_host_weights(torch: Any, experts: int, h: int, inter: int, device: str, quantised: bool) -> Any:
    """Every expert's weights in host memory (pinned on CUDA) as one row of bytes per expert:
    NF4 codes then float32 absmax scales when ``quantised`` (3 * h * inter / 2 + 3 * h * inter
    / 16 bytes), else bf16 (float32 on the CPU). As :func:`moesim.calibration.executor.host_weights`,
    up to 8 distinct random experts are made and repeated."""
    dt = torch.float32 if device == "cpu" else torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    distinct = []
    for _ in range(min(experts, 8)):
        w = torch.randn(3 * h * inter, generator=gen, dtype=torch.float32, device=device).to(dt)
        if quantised:
            packed, absmax = nf4_quantise(torch, w)
            distinct.append(torch.cat((packed, absmax.view(torch.uint8))))
        else:
            distinct.append(w.view(torch.uint8))
    return repeated(torch, distinct, experts, device)
