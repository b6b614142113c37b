"""The calibration executor's device side (``moesim calibrate validate``, module
:mod:`moesim.calibration.validate`): the experts' weights in host memory, a device cache pool,
the copies and the kernels, replaying the simulator's recorded decisions one by one.
:mod:`moesim.calibration.hf_loop` runs the same decisions in SpecMD's style."""

from __future__ import annotations

from collections import deque
from typing import Any

from moesim.calibration.torchops import cuda_graph, expert_ffn, warm_up
from moesim.config.execution import (
    PREFETCH_DEPTH,  # copies the main thread keeps issued on the prefetch stream
)


class DevicePool:
    """The executor's memory and kernels: every expert's weights (gate, up, down) in host memory
    (pinned on CUDA), a device pool of ``slots`` experts, spare buffers for uncached fetches
    (each holds its expert until it has run), a prefetch stream (fed by the main thread, or by
    a copy worker thread: ``prefetch_from``), and the layer's kernels on a static input ``x``.

    A buffer is named by an int: ``0 .. slots-1`` the pool's slots, ``slots + j`` spare ``j``.
    :meth:`perform` first runs over a scenario's decisions in ``plan`` mode (no copies, no
    kernels), which finds every launch the replay will make (:meth:`run`: a layer's non-expert
    part, one expert, or a layer's experts together) and how many spares it needs;
    :meth:`prepare` then makes the spares and, on CUDA, captures each launch as a CUDA graph, so
    that the timed replay launches graphs instead of five kernels per expert from Python (on
    the H100 Python's dispatch took 53-91 us per OLMoE FFN, the GPU 19 us)."""

    def __init__(self, torch: Any, host: Any, slots: int, device: str, p_num: int, tokens: int,
                 num_experts: int, spread: int = 1, graphs: bool = True, upload: bool = False,
                 one_stream: bool = False, prefetch_from: str = "main") -> None:
        from concurrent.futures import ThreadPoolExecutor

        # ``spread``: the pool has slots * spread buffers and the cache uses every spread-th, so
        # the copies land in as much device memory as a cache spread times larger while the
        # decisions (and the launches) stay the same; ``graphs``: False launches eagerly
        self.torch, self.device, self.p_num, self.host = torch, device, p_num, host
        # ``upload``: every captured graph replayed once before the timed passes (a graph's
        # first launch uploads it to the device); ``one_stream``: demand copies on the compute stream
        self.spread, self.use_graphs, self.upload, self.one_stream = spread, graphs, upload, one_stream
        # ``prefetch_from``: "main" (default), the main thread queues prefetches and keeps
        # PREFETCH_DEPTH of them issued on the prefetch stream, and a kernel that needs one waits
        # for its event on the GPU, so the host never waits inside a pass (as the simulator's
        # executor styles model it); "worker", the copy worker's thread submits each prefetch and
        # waits for it to land, and the main thread waits for a prefetch still in flight when it
        # needs its buffer (on the H100 the OLMoE per-expert rows with prefetch at 1% and 5% took
        # 1.36-1.52x the prediction that way and 1.07-1.11x with "main": validation/h100/eager/)
        if prefetch_from not in ("worker", "main"):
            raise ValueError(f"prefetch_from must be 'worker' or 'main', got {prefetch_from!r}")
        self.main_prefetch = prefetch_from == "main"
        self.slots = slots * spread
        h, dt = self._hidden(host)
        gen = torch.Generator(device=device).manual_seed(1)
        self.pool = torch.empty(max(self.slots, 1), *host.shape[1:], dtype=host.dtype, device=device)
        self.x = torch.randn(tokens, h, generator=gen, dtype=torch.float32, device=device).to(dt)
        self.attn = (torch.randn(4, h, h, generator=gen, dtype=torch.float32, device=device) / h ** 0.5).to(dt)
        self.router = torch.randn(h, num_experts, generator=gen, dtype=torch.float32, device=device).to(dt)
        self.spares: list[Any] = []
        self.copier = ThreadPoolExecutor(max_workers=1)  # the copy engine: one copy at a time, in order
        self.side: Any = torch.cuda.Stream() if device == "cuda" else None  # prefetch copies
        self.demand: Any = torch.cuda.Stream() if device == "cuda" else None  # demand copies
        self.graphs: dict[tuple[tuple[int, int], ...], Any] = {}  # a launch (see run) -> its graph's replay
        self.launches: set[tuple[tuple[int, int], ...]] = set()  # what the plan found the replay launches
        self.plan = True
        self.most_spares = 0
        self.reset()

    def _hidden(self, host: Any) -> tuple[int, Any]:
        """The hidden size and the activations' dtype for ``host``'s experts (``experts x 3 x
        hidden x intermediate``, the weights' dtype)."""
        return host.shape[2], host.dtype

    def begin_layer(self, p: int, layer: int) -> None:
        """Pass ``p`` starts layer ``layer`` (nothing to do here; the SpecMD-style executor
        takes the layer's routing)."""

    def reset(self) -> None:
        """Empty cache, no copies in flight, tallies at zero (before the plan and the replay)."""
        self.free = list(range(0, self.slots, self.spread))
        self.spare_free: list[int] = []
        self.spare_used = 0
        self.where: dict[int, int] = {}
        self.landing: dict[int, Any] = {}
        self.arrived: dict[int, Any] = {}  # buffer -> CUDA event of its demand copy
        self.queued: deque[tuple[int, int, Any]] = deque()  # main-thread prefetches not yet issued: key, buffer, after
        self.issued: dict[int, Any] = {}  # key -> CUDA event of its issued prefetch (main thread)
        self.flying: deque[Any] = deque()  # those events in issue order, until they have happened
        self.late_withdraws = 0  # prefetches withdrawn after the main thread had issued them
        self.tally = {"hit": 0, "fetch": 0, "bypass": 0, "prefetch": 0}

    def buffer(self, b: int) -> Any:
        return self.pool[b] if b < self.slots else self.spares[b - self.slots]

    def _ffn_eager(self, b: int, n: int) -> None:
        w3 = self.buffer(b)
        expert_ffn(self.x[:n], w3[0], w3[1], w3[2].T)

    def _dense_eager(self, n: int) -> None:
        y = self.x[:n]
        for w in self.attn:
            y = y @ w
        _ = y @ self.router

    def run(self, kernels: tuple[tuple[int, int], ...]) -> None:
        """One launch: for each ``(b, n)`` buffer ``b``'s expert FFN on ``n`` tokens, or (``b``
        = -1) the layer's non-expert projections and router on ``n`` tokens; in the plan, noted;
        in the replay, after the demand copies of its buffers, as one CUDA graph on a GPU (a
        layer's experts in ``layer`` execution: one launch instead of one per expert; at 100%
        capacity OLMoE took twice the GPU's time with a graph per expert, Python's launches
        being the bottleneck)."""
        if not kernels:
            return
        if self.plan:
            self.launches.add(kernels)
            return
        self._launch(kernels)

    def _launch(self, kernels: tuple[tuple[int, int], ...]) -> None:
        """:meth:`run` in the replay: after the buffers' demand copies, the launch's graph (or
        its kernels eagerly)."""
        for b, _ in kernels:
            arrived = self.arrived.pop(b, None)
            if arrived is not None:
                self.torch.cuda.current_stream().wait_event(arrived)
        graph = self.graphs.get(kernels)
        if graph is not None:
            graph()
            return
        for b, n in kernels:
            if b < 0:
                self._dense_eager(n)
            else:
                self._ffn_eager(b, n)

    def size(self, n: int) -> int:
        """Tokens a kernel runs on: at least one, at most the static input's rows."""
        return max(1, min(n, self.x.shape[0]))

    def prepare(self) -> None:
        """After the plan: make the spares it needs and, on CUDA, capture each of its launches
        as a CUDA graph (warmed up on a side stream first, as capture requires)."""
        torch = self.torch
        self.spares = [torch.empty_like(self.pool[0]) for _ in range(self.most_spares)]
        self.plan = False
        if self.device == "cuda" and self.use_graphs:
            kernels = sorted({k for launch in self.launches for k in launch})

            def each_kernel() -> None:
                for k in kernels:
                    self.run((k,))

            warm_up(each_kernel, times=1)
            mempool = torch.cuda.graph_pool_handle()
            for launch in sorted(self.launches):
                self.graphs[launch] = cuda_graph(lambda launch=launch: self.run(launch), mempool)
            if self.upload:
                for replay in self.graphs.values():
                    replay()
            torch.cuda.synchronize()
        self.reset()

    def _copy(self, b: int, key: int, background: bool) -> None:
        """Copy ``key``'s weights into buffer ``b``. On CUDA a copy starts once the compute
        stream has done what was launched before it (the buffer's previous expert may still be
        running; the simulator's copy starts at the decision's time, after that work):
        a demand copy on the demand-copy stream, whose event the expert's kernel waits for, so
        the next expert's copy overlaps this one's compute in per-expert execution (on one
        stream it could not); a prefetch queued for the main thread to issue on the prefetch
        stream (:meth:`_pump`), or handed to the copy worker."""
        if self.plan:
            return
        if background and self.main_prefetch:
            self.queued.append((key, b, self._mark()))
            self._pump()
            return
        dst, src, torch = self.buffer(b), self.host[key // self.p_num], self.torch
        if self.device != "cuda":
            if background:
                self.landing[key] = self.copier.submit(dst.copy_, src)
            else:
                dst.copy_(src)
            return
        after = self._mark()
        if not background and self.one_stream:
            dst.copy_(src, non_blocking=True)
            return
        if not background:
            self.arrived[b] = self._stream_copy(self.demand, after, dst, src)
            return
        side = self.side

        def job() -> None:
            with torch.cuda.stream(side):
                side.wait_event(after)
                dst.copy_(src, non_blocking=True)
            side.synchronize()

        self.landing[key] = self.copier.submit(job)

    def _issue(self) -> None:
        """The main thread issues its oldest queued prefetch on the prefetch stream, after the
        compute stream's work at its decision, with an event that says it has landed."""
        key, b, after = self.queued.popleft()
        dst, src = self.buffer(b), self.host[key // self.p_num]
        if self.device != "cuda":
            dst.copy_(src)
            return
        self.issued[key] = done = self._stream_copy(self.side, after, dst, src)
        self.flying.append(done)

    def _mark(self) -> Any:
        """An event recorded on the compute stream now: its work so far (None off CUDA)."""
        if self.device != "cuda":
            return None
        after = self.torch.cuda.Event()
        after.record()
        return after

    def _stream_copy(self, stream: Any, after: Any, dst: Any, src: Any) -> Any:
        """Copy ``src`` into ``dst`` on ``stream`` once the event ``after`` has happened; the
        event of its landing."""
        torch = self.torch
        with torch.cuda.stream(stream):
            stream.wait_event(after)
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        return done

    def _gpu_wait(self, event: Any) -> None:
        """The compute stream waits for ``event`` (the host goes on)."""
        self.torch.cuda.current_stream().wait_event(event)

    def _pump(self) -> None:
        """Keep :data:`PREFETCH_DEPTH` of the main thread's queued prefetches issued (one stream:
        they land in order, so the first unfinished event bounds the ones behind it)."""
        while self.flying and self.flying[0].query():
            self.flying.popleft()
        while self.queued and len(self.flying) < PREFETCH_DEPTH:
            self._issue()

    def _upto(self, key: int) -> None:
        """Issue the main thread's queued prefetches up to ``key``'s, in order (none if it is not queued)."""
        if all(k != key for k, _, _ in self.queued):
            return
        while self.queued[0][0] != key:
            self._issue()
        self._issue()

    def _landed(self, key: int) -> None:
        """``key``'s buffer is needed (its expert runs) or about to be reused (evicted): a
        prefetch of it must land first."""
        if self.main_prefetch:
            self._upto(key)
            done = self.issued.pop(key, None)
            if done is not None:  # the GPU waits for it, not the host
                self._gpu_wait(done)
            return
        fut = self.landing.pop(key, None)
        if fut is not None:
            fut.result()  # a prefetch still in flight: wait for it

    def _ran(self, b: int) -> None:
        """Buffer ``b``'s expert has run: a spare is free again."""
        if b >= self.slots:
            self.spare_free.append(b)

    def perform(self, op: str, key: int, needed: dict[int, int], tokens: dict[int, int]) -> None:
        """Carry out one recorded decision (``Simulation.decisions``); ``needed`` maps the
        layer's experts to the buffers they will run from."""
        if op in self.tally:
            self.tally[op] += 1
        if self.main_prefetch and not self.plan:
            self._pump()
        if op == "evict":
            self._landed(key)
            self.free.append(self.where.pop(key))
        elif op == "hit":
            self._landed(key)
            needed[key] = self.where[key]
        elif op in ("fetch", "prefetch"):
            slot = self.where[key] = self.free.pop()
            self._copy(slot, key, background=op == "prefetch")
            if op == "fetch":
                needed[key] = slot
        elif op == "bypass":  # an uncached fetch: a spare buffer until the expert has run
            if not self.spare_free:
                self.spare_free.append(self.slots + self.spare_used)
                self.spare_used += 1
                self.most_spares = max(self.most_spares, self.spare_used)
            b = needed[key] = self.spare_free.pop()
            self._copy(b, key, background=False)
        elif op == "withdraw":  # a queued prefetch withdrawn with its room: drop it if not begun
            queued = [q for q in self.queued if q[0] == key]
            if queued:  # the main thread's, not issued yet
                self.queued.remove(queued[0])
            elif key in self.issued:  # the main thread's, issued already: it is copied; the buffer's next copy waits for it
                self.late_withdraws += 1
                self._landed(key)
            fut = self.landing.pop(key, None)  # the copy worker's
            if fut is not None and not fut.cancel():
                fut.result()
            self.free.append(self.where.pop(key))
        elif key == -1:  # run: the layer's experts, all at once
            self.run(tuple((b, self.size(tokens.get(k, 1))) for k, b in needed.items()))
            for b in needed.values():
                self._ran(b)
            needed.clear()
        else:  # run: one expert
            b = needed.pop(key)
            self.run(((b, self.size(tokens.get(key, 1))),))
            self._ran(b)


class RepeatedExperts:
    """Host memory of ``experts`` experts that repeats ``distinct`` (a list of tensors of one
    shape), ``[e]`` giving ``distinct[e % len(distinct)]``: what :func:`host_weights` holds
    when the device is the CPU, whose "host" and "device" memory are one (a copy reads the
    same bytes whichever expert it names, and an OLMoE-shaped model's 13 GB need not be
    allocated to replay its decisions)."""

    def __init__(self, distinct: list[Any], experts: int) -> None:
        self.distinct, self.experts = distinct, experts
        self.shape = (experts, *distinct[0].shape)
        self.dtype = distinct[0].dtype

    def __getitem__(self, e: int) -> Any:
        if not 0 <= e < self.experts:
            raise IndexError(f"expert {e} of {self.experts}")
        return self.distinct[e % len(self.distinct)]


def repeated(torch: Any, distinct: list[Any], experts: int, device: str) -> Any:
    """``experts`` experts' host memory made of ``distinct`` repeated: pinned, one row per
    expert, on CUDA; :class:`RepeatedExperts` on the CPU."""
    if device == "cpu":
        return RepeatedExperts(distinct, experts)
    host = torch.empty(experts, *distinct[0].shape, dtype=distinct[0].dtype, pin_memory=device == "cuda")
    for e in range(experts):
        host[e].copy_(distinct[e % len(distinct)])
    return host


def host_weights(torch: Any, experts: int, h: int, inter: int, device: str) -> Any:
    """Every expert's gate, up and down weights in host memory (pinned on CUDA; bf16 on a GPU,
    float32 on the CPU), made once per validation run and shared by its scenarios. The values
    are random normal (never zeros, which can run faster than real weights); to keep a
    13-GB model's set-up in seconds, up to 8 distinct random experts are drawn on the device
    and repeated (an expert's values do not change what copying or multiplying it costs):
    :func:`repeated`."""
    dt = torch.float32 if device == "cpu" else torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    distinct = [torch.randn(3, h, inter, generator=gen, dtype=torch.float32, device=device).to(dt)
                for _ in range(min(experts, 8))]
    return repeated(torch, distinct, experts, device)
