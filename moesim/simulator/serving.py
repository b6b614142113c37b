"""Serving under load: request arrivals and continuous batching (``docs/guides/serving.md``).

Without ``workload.arrivals`` a replay runs the trace's requests in fixed batches, back to
back. With it, requests arrive over time (:func:`plan_requests`: a Poisson or gamma process,
or a serving-trace CSV) and a scheduler forms each forward pass from the requests present
when the previous pass ends, in continuous batching (:class:`Scheduler`):

- ``vllm-v1`` (vLLM's V1 engine, the default since vLLM 0.8: ``vllm/v1/core/sched/scheduler.py``,
  ``Scheduler.schedule``): the running requests first, in the order they were admitted, each
  its decode token or the rest of its prompt (at most ``chunked_prefill_tokens``), then
  waiting requests' prompts, first come first served, in one budget of ``max_batched_tokens``
  tokens; no new admission in a pass that preempted.
- ``vllm-v0`` (vLLM's V0 engine without chunked prefill, ``vllm/core/scheduler.py``,
  ``_schedule_default``, as the Vidur simulator models it): whenever waiting requests can be
  admitted (up to ``max_running`` requests, their prompts within ``max_batched_tokens``), the
  pass prefills their whole prompts; otherwise it decodes one token of every running request.
- ``sarathi`` (Sarathi-Serve, Agrawal et al., OSDI 2024, its stall-free batching; vLLM V0 with chunked
  prefill): one decode token of every running request first, then the unfinished prompts of
  running requests, then newly admitted prompts, each in chunks of at most
  ``chunked_prefill_tokens``, until the pass holds ``max_batched_tokens`` tokens.

The KV cache is paged as vLLM pages it: blocks of ``kv_block_tokens`` tokens, a request
holding the blocks of the positions it has processed or is processing in the pass (its first
position's context included). A pass's blocks are allocated when it is formed; when a running
request's are not free, the most recently admitted running request is preempted by
recompute (its blocks freed, its tokens processed again later: prompt and the outputs made so
far, before it makes the next one) and goes back to the head of the queue; the request itself
when it is the last. A new admission must leave ``kv_watermark`` of the blocks free. With
nothing running and nobody waiting the GPU idles until the next arrival (the pass's
*release* time).

Each pass is made into a one-pass :class:`Workload` by the same builder as every replay
(:func:`simulator.workload.build_workload`: the distinct experts of each layer over the pass's
tokens, each expert's compute time from its token count) and replayed by the compiled kernel
with the cache, copy engine, prefetch queue and clocks carried from pass to pass
(:mod:`simulator.stream`'s piece loop, the pass's end time sent back to the scheduler).

A served request takes its routing from a recorded request of the trace (in order, cycling):
its prompt tokens from the recorded prompt, its decode tokens from the recorded decode steps,
each repeated in order when the arrival asks for more tokens than were recorded (the notes say
so), at positions counted from the recorded request's first position.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from moesim.config.scenario import (
    ArrivalsConfig,
    Scenario,
    SchedulerConfig,
    SloConfig,
    parse_capacity,
)
from moesim.errors import MoesimError
from moesim.simulator.workload import DECODE, PREFILL, VERIFY, Workload, build_workload
from moesim.traces.trace import Trace

BF16 = 2  # bytes per KV-cache element

# the common column namings of public LLM serving traces (Azure LLM inference, BurstGPT,
# Splitwise, Mooncake exported to CSV, vLLM benchmark dumps): arrival time, prompt, output
TIME_COLUMNS = ("arrival_time", "arrival_s", "arrival", "timestamp", "TIMESTAMP", "Timestamp", "time",
                "arrived_at", "timestamp_ms", "arrival_time_ms")
PROMPT_COLUMNS = ("input_tokens", "ContextTokens", "context_tokens", "prompt_tokens", "Request tokens",
                  "input_length", "input_len", "prompt_len", "num_prefill_tokens")
OUTPUT_COLUMNS = ("output_tokens", "GeneratedTokens", "generated_tokens", "completion_tokens",
                  "Response tokens", "output_length", "output_len", "num_decode_tokens")


@dataclass
class Plan:
    """The requests to serve, in arrival order: arrival time (s), prompt tokens, output tokens
    (at least 1: the prefill makes the first), and the recorded request (index into
    :class:`Bank`'s requests) whose routing each takes. ``notes`` say what was assumed."""

    arrival: np.ndarray
    prompt: np.ndarray
    output: np.ndarray
    source: np.ndarray
    notes: list[str] = field(default_factory=list)


class Bank:
    """The trace's recorded tokens, by request: each token's rows (one per layer, in layer
    order), its prompt tokens (the prefill's, by position) and decode tokens (by step), and
    each request's first position."""

    def __init__(self, trace: Trace, where: str) -> None:
        if (trace.phase == VERIFY).any():
            raise MoesimError(f"{where}: workload.arrivals serves prefill and decode; the trace {trace.source} has "
                              "speculative verification rows, which serving does not model. Use a trace without "
                              "--speculative, or remove workload.arrivals.")
        self.trace = trace
        req_ids, ridx = np.unique(trace.request, return_inverse=True)
        order = np.lexsort((trace.layer, trace.position, trace.step, ridx))
        key_r, key_s, key_p = ridx[order], trace.step[order], trace.position[order]
        new = np.r_[True, (key_r[1:] != key_r[:-1]) | (key_s[1:] != key_s[:-1]) | (key_p[1:] != key_p[:-1])]
        self.order = order
        self.tok_start = np.flatnonzero(new).astype(np.int64)
        self.tok_len = np.diff(np.r_[self.tok_start, len(order)]).astype(np.int64)
        tok_req = key_r[self.tok_start]
        tok_prefill = trace.phase[order][self.tok_start] == PREFILL
        n = len(req_ids)
        self.request_ids = req_ids
        self.n_prompt = np.bincount(tok_req[tok_prefill], minlength=n).astype(np.int64)
        self.n_decode = np.bincount(tok_req[~tok_prefill], minlength=n).astype(np.int64)
        first = np.searchsorted(tok_req, np.arange(n))  # tokens are by request, prefill (step 0) first
        self.prompt_first = first
        self.decode_first = first + self.n_prompt
        base = np.full(n, np.iinfo(np.int64).max, np.int64)
        np.minimum.at(base, ridx, trace.position.astype(np.int64))
        self.base = base

    @property
    def num_requests(self) -> int:
        return len(self.request_ids)

    def recorded_lengths(self) -> tuple[np.ndarray, np.ndarray]:
        """Per recorded request, its prompt and output lengths: the prefill's tokens, and one
        output token for the prefill plus one per decode step (a decode-only request: one per
        step)."""
        return self.n_prompt, self.n_decode + (self.n_prompt > 0)

    def tokens(self, source: np.ndarray, prompt: np.ndarray, i: np.ndarray) -> np.ndarray:
        """The recorded token that a served request's processed token ``i`` takes (``source``
        its recorded request, ``prompt`` its prompt length; all arrays of one length): token
        ``i < prompt`` from the recorded prompt, the others from the recorded decode steps,
        each cycling; a request without recorded prompt (decode) tokens takes the other kind."""
        npr, nde = self.n_prompt[source], self.n_decode[source]
        in_prompt = i < prompt
        j = np.where(in_prompt, i, i - prompt)
        use_prompt = np.where(in_prompt, npr > 0, nde == 0)
        span = np.where(use_prompt, npr, nde)
        first = np.where(use_prompt, self.prompt_first[source], self.decode_first[source])
        return first + j % span

    def rows(self, tok: np.ndarray) -> np.ndarray:
        """The trace rows of the recorded tokens ``tok``, token after token."""
        lens = self.tok_len[tok]
        starts = np.repeat(self.tok_start[tok] - np.r_[0, np.cumsum(lens)[:-1]], lens)
        return self.order[starts + np.arange(int(lens.sum()))]


def _column(frame: pd.DataFrame, names: tuple[str, ...], what: str, path: Path) -> str:
    for name in names:
        if name in frame.columns:
            return name
    raise MoesimError(f"arrival file {path}: no column for {what}; it has {', '.join(map(str, frame.columns))}. "
                      f"Name one of them {' or '.join(repr(n) for n in names[:4])} (also accepted: "
                      f"{', '.join(names[4:])}).")


def read_arrival_file(path: Path, limit: int | None, skip_zero_output: bool = True
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray, str]:
    """(arrival seconds from the first, prompt tokens, output tokens, which columns were
    read) from a serving-trace CSV; rows in arrival order. Rows with 0 output tokens (failed
    requests, as BurstGPT records them) are skipped and counted when ``skip_zero_output``,
    refused otherwise; ``limit`` takes the first rows kept. Errors name the file, the column
    and the row."""
    if not path.is_file():
        raise MoesimError(f"arrival file {path}: not found. Give workload.arrivals.path as a CSV of arrival time, "
                          "input tokens and output tokens (relative to the scenario file).")
    try:
        frame = pd.read_csv(path)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        raise MoesimError(f"arrival file {path}: not a readable CSV ({str(exc).strip().splitlines()[0]}). Give a "
                          "CSV with a header row naming the arrival time, input and output token columns.") from None
    if len(frame) == 0:
        raise MoesimError(f"arrival file {path}: has no rows; it needs one row per request.")
    tcol = _column(frame, TIME_COLUMNS, "the arrival time", path)
    pcol = _column(frame, PROMPT_COLUMNS, "the input (prompt) tokens", path)
    ocol = _column(frame, OUTPUT_COLUMNS, "the output tokens", path)
    skipped = 0
    if skip_zero_output:
        zero = (pd.to_numeric(frame[ocol], errors="coerce") == 0).to_numpy()
        skipped = int(zero.sum())
        if skipped == len(frame):
            raise MoesimError(f"arrival file {path}: every one of its {skipped} rows has {ocol} = 0 (failed "
                              "requests, skipped); it needs rows of requests that produced output.")
        frame = frame[~zero]
    if limit is not None:
        frame = frame.iloc[:limit]
    line = frame.index.to_numpy() + 2  # the header is line 1
    raw = frame[tcol]
    if pd.api.types.is_numeric_dtype(raw):
        t = raw.to_numpy(np.float64) / (1000.0 if tcol.endswith("_ms") else 1.0)
        unit = "milliseconds" if tcol.endswith("_ms") else "seconds"
    else:
        stamps = pd.to_datetime(raw, errors="coerce", format="mixed")
        t = np.where(stamps.isna(), np.nan, (stamps - stamps.min()).dt.total_seconds().to_numpy(np.float64))
        unit = "date-times"
    for col, values in ((tcol, t), (pcol, frame[pcol]), (ocol, frame[ocol])):
        v = pd.to_numeric(pd.Series(values), errors="coerce").to_numpy(np.float64)
        low = 1 if col == ocol else 0
        bad = np.flatnonzero(~np.isfinite(v) | (v < low) | ((col != tcol) & (v != np.floor(v))))
        if len(bad):
            r = int(bad[0])
            kind = "a time" if col == tcol else (f"a whole number of tokens >= {low}")
            fix = "Fix or remove that row"
            if col == ocol and v[r] == 0:
                fix += (", or remove workload.arrivals.skip_zero_output: false to skip every row of 0 output "
                        "tokens (failed requests)")
            raise MoesimError(f"arrival file {path}: line {line[r]} (data row {line[r] - 1}) has {col} = "
                              f"{frame[col].astype(str).iloc[r]}; it must be {kind}. {fix}.")
    back = np.flatnonzero(np.diff(t) < 0)
    if len(back):
        r = int(back[0]) + 1
        raise MoesimError(f"arrival file {path}: line {line[r]} (data row {line[r] - 1}) arrives at {t[r]:g} s, before "
                          f"the row above it ({t[r - 1]:g} s); the rows must be in arrival order. Sort the file by "
                          f"{tcol}.")
    found = f"arrival file {path.name}: arrival time from '{tcol}' ({unit}), prompt from '{pcol}', output from '{ocol}'"
    if skipped:
        found += (f"; skipped {skipped} row{'s' if skipped != 1 else ''} with 0 output tokens (failed requests; "
                  "workload.arrivals.skip_zero_output: false refuses them)")
    return (t - t[0], frame[pcol].to_numpy(np.int64), frame[ocol].to_numpy(np.int64), found)


def plan_requests(cfg: ArrivalsConfig, bank: Bank, seed: int, base_dir: str) -> Plan:
    """The requests to serve: arrival times, lengths and the recorded request each takes
    its routing from (in order, cycling)."""
    rng = np.random.default_rng([seed if cfg.seed is None else cfg.seed, 35])
    notes: list[str] = []
    prompt = output = None
    if cfg.process == "file":
        assert cfg.path is not None
        path = Path(cfg.path) if Path(cfg.path).is_absolute() else Path(base_dir) / cfg.path
        t, prompt, output, found = read_arrival_file(path, cfg.requests, cfg.skip_zero_output)
        notes.append(found)
        if cfg.rate is not None and len(t) > 1 and t[-1] > 0:
            scale = (len(t) - 1) / cfg.rate / t[-1]
            t = t * scale
            notes.append(f"arrival times scaled by {scale:.4g} to a mean rate of {cfg.rate:g} requests/s")
        n = len(t)
    else:
        assert cfg.rate is not None
        assert cfg.requests is not None
        n = cfg.requests
        if cfg.process == "poisson":
            gaps = rng.exponential(1.0 / cfg.rate, n)
        else:  # gamma gaps of mean 1/rate and coefficient of variation cv
            shape = 1.0 / (cfg.cv * cfg.cv)
            gaps = rng.gamma(shape, 1.0 / (cfg.rate * shape), n)
        t = np.cumsum(gaps)
    source = np.arange(n, dtype=np.int64) % bank.num_requests
    rec_prompt, rec_output = bank.recorded_lengths()
    if cfg.prompt_tokens is not None:
        prompt = np.full(n, cfg.prompt_tokens, np.int64)
    elif prompt is None:
        prompt = rec_prompt[source]
    if cfg.output_tokens is not None:
        output = np.full(n, cfg.output_tokens, np.int64)
    elif output is None:
        output = rec_output[source]
    if n > bank.num_requests:
        notes.append(f"{n} requests take their routing from the trace's {bank.num_requests} recorded requests, "
                     "in order, cycling")
    longer_p = int(((prompt > rec_prompt[source]) & (rec_prompt[source] > 0)).sum())
    longer_o = int((output > rec_output[source]).sum())
    if longer_p:
        notes.append(f"{longer_p} requests ask for a longer prompt than recorded: their prompt routing repeats "
                     "the recorded prompt's tokens in order")
    if longer_o:
        notes.append(f"{longer_o} requests ask for more output tokens than recorded: their decode routing repeats "
                     "the recorded decode steps in order")
    no_prompt = int(((prompt > 0) & (rec_prompt[source] == 0)).sum())
    if no_prompt:
        notes.append(f"{no_prompt} requests have a prompt but their recorded request has no prefill: their prompt "
                     "tokens take the recorded decode tokens' routing")
    no_decode = int(((output > 1) & (bank.n_decode[source] == 0)).sum())
    if no_decode:
        notes.append(f"{no_decode} requests decode but their recorded request has no decode steps: their decode "
                     "tokens take the recorded prompt tokens' routing")
    return Plan(arrival=np.asarray(t, np.float64), prompt=np.asarray(prompt, np.int64),
                output=np.asarray(output, np.int64), source=source, notes=notes)


SYNTH_ROWS_MAX = 20_000_000  # a synthetic trace made longer for the arrivals holds at most this many rows


def synth_lengths(scenario: Scenario, plan: Plan) -> Scenario | None:
    """With a synthetic trace whose requests are shorter than the arrivals ask, the scenario
    whose synthetic trace has the longest prompt and decode lengths asked for (so that every
    request's routing is synthesised for it, not repeated); None when they fit, the trace is
    not synthetic, or the longer trace would hold more than :data:`SYNTH_ROWS_MAX` rows (the
    recorded tokens repeat then, and the notes say so)."""
    from dataclasses import replace

    from moesim.traces.synth import get_preset

    synth = scenario.workload.trace.synth
    if synth is None or synth.preset is None:
        return None
    need_p = int(plan.prompt.max())
    need_d = int(np.where(plan.prompt > 0, plan.output - 1, plan.output).max())
    if need_p <= synth.prompt_tokens and need_d <= synth.tokens:
        return None
    p, d = max(need_p, synth.prompt_tokens), max(need_d, synth.tokens)
    layers = synth.layers or get_preset(synth.preset).model.num_layers
    if synth.requests * (p + d) * layers > SYNTH_ROWS_MAX:
        return None
    longer = replace(synth, prompt_tokens=p, tokens=d)
    return replace(scenario, workload=replace(scenario.workload, trace=replace(scenario.workload.trace, synth=longer)))


def kv_bytes_per_token(model: Any) -> int:
    """Bytes of KV cache per token: keys and values of every layer, bf16."""
    return 2 * model.num_layers * model.kv_heads * model.head_size * BF16


def kv_capacity_tokens(scenario: Scenario, model: Any, capacity: float, dense_bytes: float) -> float:
    """Tokens of KV cache the GPUs hold: ``scheduler.kv_memory`` as given, or ('auto') the
    HBM left after the expert cache and the dense (non-expert) weights; inf with 'none'. Under
    expert parallelism (``hardware.gpus`` G > 1) every GPU holds the dense weights, its share
    of the experts (``capacity``: all experts / G) and the KV of its share of the tokens
    (attention runs data-parallel), ``kv_memory`` is per GPU, and the tokens are G times one
    GPU's."""
    sched = scenario.scheduler or SchedulerConfig()
    where = scenario.source
    per_token = kv_bytes_per_token(model)
    text = sched.kv_memory.strip().lower()
    if text == "none":
        return math.inf
    hbm = scenario.hardware.gpu.memory_gb * 1e9
    gpus = scenario.hardware.gpus
    if text == "auto":
        if not math.isfinite(capacity):
            raise MoesimError(f"{where}: key 'scheduler.kv_memory' is 'auto' (the HBM left after the expert cache), "
                              "but cache.capacity is infinite. Give cache.capacity as a share or size, or "
                              "scheduler.kv_memory as a size ('20GB') or 'none'.")
        left = hbm - capacity - dense_bytes
        if left < per_token:
            held = "the expert cache" if gpus == 1 else f"its share of the experts over {gpus} GPUs"
            raise MoesimError(f"{where}: the GPU's {hbm / 1e9:g} GB of HBM less {held} "
                              f"({capacity / 1e9:.3g} GB) and the dense weights ({dense_bytes / 1e9:.3g} GB) leaves "
                              f"{max(left, 0) / 1e9:.3g} GB, not one token of KV cache ({per_token:,} bytes). Lower "
                              "cache.capacity, or set scheduler.kv_memory to a size ('20GB') or 'none'.")
        return float(left // per_token) * gpus
    try:
        nbytes = parse_capacity(text, 1, 1, where)
    except MoesimError:
        raise MoesimError(f"{where}: key 'scheduler.kv_memory' is {sched.kv_memory!r}; write 'auto', 'none' or a "
                          "size such as '20GB' or '600MiB'.") from None
    if nbytes < per_token or text.endswith(("%", "expert", "experts")):
        raise MoesimError(f"{where}: key 'scheduler.kv_memory' is {sched.kv_memory!r}, "
                          f"{'a share or count' if text.endswith(('%', 'expert', 'experts')) else 'less than one token'}"
                          f"; one token of KV cache takes {per_token:,} bytes. Write a size such as '20GB', or "
                          "'auto' or 'none'.")
    return float(nbytes // per_token) * gpus


class Scheduler:
    """Continuous batching of :class:`Plan`'s requests (module docstring). :meth:`passes` is
    the replay's source of forward passes: it yields a one-pass workload and is sent that
    pass's end time. Afterwards :meth:`frame` is the per-request table."""

    KEEP = False  # tests: keep every pass's workload (``kept``) to replay the schedule again

    def __init__(self, scenario: Scenario, plan: Plan, bank: Bank, kv_tokens: float, previous: bool = False) -> None:
        self.cfg = scenario.scheduler or SchedulerConfig()
        self.previous = previous  # give each pass its requests' own last passes (Workload.previous)
        self.plan = plan
        self.bank = bank
        n = len(plan.arrival)
        self.n = n
        self.first_part = np.maximum(plan.prompt, 1)  # tokens of the pass that makes the first output token
        self.total = self.first_part + plan.output - 1  # tokens processed in all, without preemption
        self.need = self.first_part.copy()  # tokens processed when the next output token is made
        self.redo = np.zeros(n, np.int64)  # a preempted request's tokens to recompute (prefilled again)
        self.context = bank.base[plan.source].astype(np.int64)  # positions before the first served token
        self.kv_tokens = kv_tokens
        self.block = self.cfg.kv_block_tokens
        self.blocks = math.floor(kv_tokens / self.block) if math.isfinite(kv_tokens) else math.inf
        self.watermark = math.floor(self.cfg.watermark * self.blocks) if math.isfinite(self.blocks) else 0
        self.free = self.blocks
        self.held = np.zeros(n, np.int64)  # KV blocks each request holds
        self.preemptions = np.zeros(n, np.int64)
        self.preempted = 0  # preemptions so far, all requests (a pass that preempts admits nobody)
        self.recomputed = np.zeros(n, np.int64)  # tokens processed again after preemption
        self.processed = np.zeros(n, np.int64)
        self.last_start = np.zeros(n, np.int64)  # each request's last pass: its first token there
        self.last_count = np.zeros(n, np.int64)  # and the tokens it processed (0: none since it began)
        self.generated = np.zeros(n, np.int64)
        self.scheduled = np.full(n, np.nan)
        self.first_token = np.full(n, np.nan)
        self.last_token = np.full(n, np.nan)  # when each request's latest output token was made
        self.itl_max = np.full(n, np.nan)  # each request's longest gap between two output tokens
        self._gaps: list[np.ndarray] = []  # every inter-token gap, pass by pass
        self.finish = np.full(n, np.nan)
        self.finished = 0
        self.max_running_seen = 0
        self.kept: list[Workload] | None = [] if self.KEEP else None
        self.where = scenario.source
        self._check(scenario.source)

    def _blocks(self, tokens: np.ndarray | int) -> np.ndarray | int:
        """KV blocks that hold ``tokens`` tokens."""
        return -(-tokens // self.block)

    def _check(self, where: str) -> None:
        """Limits no request can ever meet: one paragraph naming the first such request."""
        cfg = self.cfg
        if cfg.policy == "vllm-v0":
            big = np.flatnonzero(self.first_part > cfg.max_batched_tokens)
            if len(big):
                r = int(big[0])
                raise MoesimError(f"{where}: request {r} (and {len(big) - 1} more) has a {int(self.first_part[r])}-token "
                                  f"prompt, more than scheduler.max_batched_tokens ({cfg.max_batched_tokens}); with "
                                  "policy 'vllm-v0' a prompt is prefilled in one pass, so it could never be "
                                  "scheduled. Raise max_batched_tokens, or set policy: vllm-v1.")
        whole = np.asarray(self._blocks(self.context + self.total))
        big = np.flatnonzero(whole + self.watermark > self.blocks)
        if len(big):
            r = int(big[0])
            raise MoesimError(f"{where}: request {r} (and {len(big) - 1} more) needs {int(whole[r]):,} KV blocks of "
                              f"{self.block} tokens ({int(self.context[r] + self.total[r]):,} tokens) at its last "
                              f"token, more than the {int(self.blocks):,} the GPU holds beside the expert cache"
                              f"{f' less the {self.watermark:,} kept free (kv_watermark)' if self.watermark else ''}; "
                              "it could never be served. Lower cache.capacity, shorten the requests, or set "
                              "scheduler.kv_memory.")

    # -- the passes ------------------------------------------------------------------------
    def passes(self) -> Generator[Workload, float, None]:
        """Forward passes, each formed when the previous one ends (the time sent back)."""
        arrival = self.plan.arrival
        self.waiting: deque[int] = deque()
        self.running: list[int] = []
        nxt = 0
        now = 0.0
        # every pass processes at least one of the tokens left (a preemption adds those it
        # throws away), so there are never more passes than tokens
        self.tokens_left = int(self.total.sum())
        form = {"vllm-v1": self._vllm_v1, "vllm-v0": self._vllm_v0, "sarathi": self._sarathi}[self.cfg.policy]
        while self.finished < self.n:
            if self.tokens_left <= 0:
                raise AssertionError("serving: the scheduler formed more passes than there are tokens to process")
            release = 0.0
            if not self.running and not self.waiting and arrival[nxt] > now:  # idle until the next arrival
                now = release = float(arrival[nxt])
            while nxt < self.n and arrival[nxt] <= now:
                self.waiting.append(nxt)
                nxt += 1
            batch_r, batch_c = form(now)
            self.max_running_seen = max(self.max_running_seen, len(self.running))
            rs = np.asarray(batch_r, np.int64)
            cs = np.asarray(batch_c, np.int64)
            self.tokens_left -= max(int(cs.sum()), 1)
            start = self.processed[rs].copy()
            made = self._made(rs, start, cs)
            end = yield self._workload(rs, start, cs, release, int(made.sum()))
            now = float(end)
            self._account(rs, start, cs, made, now)

    def _left(self, r: int) -> int:
        """Tokens request ``r`` has to process before its next output token (1 when decoding)."""
        return max(int(self.need[r] - self.processed[r]), 1)

    def _grow(self, r: int, tokens: int, keep: int = 0) -> bool:
        """Allocate the KV blocks request ``r`` needs to process ``tokens`` more tokens, leaving
        ``keep`` blocks free; False (nothing allocated) when they are not free."""
        want = int(self._blocks(self.context[r] + self.processed[r] + tokens)) - int(self.held[r])
        if want <= 0:
            return True
        if self.free - want < keep:
            return False
        self.held[r] += want
        self.free -= want
        return True

    def _preempt(self, r: int) -> None:
        """vLLM's preemption by recompute: the running request ``r`` frees its blocks and goes
        back to the head of the queue, to process its prompt and the outputs it made again."""
        self.running.remove(r)
        self.waiting.appendleft(r)
        self.free += int(self.held[r])
        self.held[r] = 0
        self.preemptions[r] += 1
        self.preempted += 1
        self.recomputed[r] += self.processed[r]
        self.tokens_left += int(self.processed[r])
        self.processed[r] = 0
        self.last_count[r] = 0  # its recompute starts anew: no pass before it
        self.need[r] = self.redo[r] = self.first_part[r] + self.generated[r]
        if self.cfg.policy == "vllm-v0" and self.need[r] > self.cfg.max_batched_tokens:
            raise MoesimError(f"{self.where}: request {r} was preempted (its KV blocks were needed) with "
                              f"{int(self.need[r]):,} tokens to recompute, more than scheduler.max_batched_tokens "
                              f"({self.cfg.max_batched_tokens}); policy 'vllm-v0' recomputes them in one pass, as "
                              "vLLM V0 without chunked prefill (which requires max_num_batched_tokens to be at least "
                              "max_model_len). Raise max_batched_tokens, give the KV cache more memory "
                              "(scheduler.kv_memory, a smaller cache.capacity), or set policy: vllm-v1.")

    def _take(self, r: int, tokens: int, batch: dict[int, int]) -> bool:
        """Allocate the running request ``r``'s blocks for ``tokens`` tokens, preempting the most
        recently admitted running requests (dropped from ``batch`` when already in it) until
        they are free; False when ``r`` itself had to go."""
        while not self._grow(r, tokens):
            victim = self.running[-1]
            batch.pop(victim, None)
            self._preempt(victim)
            if victim == r:
                return False
        return True

    def _start(self, r: int, now: float) -> None:
        """The first waiting request starts running (admitted, or readmitted after preemption)."""
        self.waiting.popleft()
        self.running.append(r)
        if np.isnan(self.scheduled[r]):
            self.scheduled[r] = now

    def _admit(self, batch: dict[int, int], budget: int, cap: int, now: float) -> None:
        """Waiting requests, first come first served, while the budget lasts, ``max_running``
        allows and their first chunk's blocks are free beside the watermark."""
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_running:
            r = self.waiting[0]
            n = min(self._left(r), cap, budget)
            if not self._grow(r, n, self.watermark):
                return
            self._start(r, now)
            batch[r] = n
            budget -= n

    def _vllm_v1(self, now: float) -> tuple[list[int], list[int]]:
        """vLLM V1's ``schedule``: each running request in admission order gets its decode
        token or the rest of its prompt (at most ``chunked_prefill_tokens``) while the budget
        lasts, preempting from the back when blocks run out; then, when nothing was preempted,
        waiting requests' prompts in the tokens left."""
        cfg = self.cfg
        cap = cfg.chunked_prefill_tokens or cfg.max_batched_tokens
        budget = cfg.max_batched_tokens
        batch: dict[int, int] = {}
        before = self.preempted
        i = 0
        while i < len(self.running) and budget > 0:
            r = self.running[i]
            n = min(self._left(r), cap, budget)
            if not self._take(r, n, batch):
                break
            batch[r] = n
            budget -= n
            i += 1
        if self.preempted == before:
            self._admit(batch, budget, cap, now)
        return list(batch), list(batch.values())

    def _vllm_v0(self, now: float) -> tuple[list[int], list[int]]:
        """vLLM V0 without chunked prefill: the whole prompts of the requests admitted now, as
        many as fit in ``max_batched_tokens``; with none admitted, one decode token of every
        running one, preempting from the back when a block is not free."""
        batch: dict[int, int] = {}
        budget = self.cfg.max_batched_tokens
        while self.waiting and len(self.running) < self.cfg.max_running:
            r = self.waiting[0]
            n = self._left(r)
            if n > budget or not self._grow(r, n, self.watermark):
                break
            self._start(r, now)
            batch[r] = n
            budget -= n
        if not batch:
            i = 0
            while i < len(self.running):
                r = self.running[i]
                if not self._take(r, 1, batch):
                    break
                batch[r] = 1
                i += 1
        return list(batch), list(batch.values())

    def _sarathi(self, now: float) -> tuple[list[int], list[int]]:
        """Sarathi-Serve: a decode token of every running request that has its first token,
        then chunks of the unfinished prompts, then of newly admitted ones (none in a pass that
        preempted), at most ``chunked_prefill_tokens`` each, until the pass holds
        ``max_batched_tokens``; blocks as vLLM V1 allocates them."""
        cfg = self.cfg
        cap = cfg.chunked_prefill_tokens or cfg.max_batched_tokens
        batch: dict[int, int] = {}
        before = self.preempted
        for r in [r for r in self.running if self.processed[r] >= self.need[r]]:
            if r in self.running and self._take(r, 1, batch):
                batch[r] = 1
        for r in [r for r in self.running if self.processed[r] < self.need[r]]:
            budget = cfg.max_batched_tokens - sum(batch.values())
            if r in self.running and budget > 0:
                n = min(self._left(r), budget, cap)
                if self._take(r, n, batch):
                    batch[r] = n
        if self.preempted == before:
            self._admit(batch, cfg.max_batched_tokens - sum(batch.values()), cap, now)
        return list(batch), list(batch.values())

    def _account(self, rs: np.ndarray, start: np.ndarray, cs: np.ndarray, made: np.ndarray, now: float) -> None:
        """After a pass that ended at ``now``: the tokens processed, first tokens, output
        tokens made, and the requests that finished (leaving, their KV blocks freed)."""
        self.last_start[rs] = self.processed[rs]
        self.last_count[rs] = cs
        self.processed[rs] += cs
        firsts = rs[(start < self.need[rs]) & (self.processed[rs] >= self.need[rs]) & np.isnan(self.first_token[rs])]
        self.first_token[firsts] = now
        self.generated[rs] += made
        out = rs[made > 0]  # each request is in a pass at most once
        prev = self.last_token[out]
        had = np.isfinite(prev)
        if had.any():
            gap = now - prev[had]
            self._gaps.append(gap)
            who = out[had]
            self.itl_max[who] = np.fmax(self.itl_max[who], gap)
        self.last_token[out] = now
        done = rs[self.generated[rs] == self.plan.output[rs]]
        if len(done):
            self.finish[done] = now
            self.finished += len(done)
            gone = set(done.tolist())
            self.running = [r for r in self.running if r not in gone]
            self.free += int(self.held[done].sum())
            self.held[done] = 0

    def _made(self, rs: np.ndarray, start: np.ndarray, cs: np.ndarray) -> np.ndarray:
        """Output tokens each request of a pass makes: one when the pass reaches the tokens its
        next output token needs (its prompt, or after preemption all it had) or decodes; none
        for a chunk that leaves some of them."""
        return (start + cs >= self.need[rs]).astype(np.int64)

    def _workload(self, rs: np.ndarray, start: np.ndarray, cs: np.ndarray, release: float,
                  made: int) -> Workload:
        """The one-pass workload of ``cs`` tokens of each request ``rs`` from its processed
        token ``start`` on (:meth:`_piece`); for a prefetcher that reads the pass before, with
        the one-pass workload of the tokens each of those requests processed in its own last
        pass (``Workload.previous``; vLLM's scheduler keeps no batch from pass to pass, so a
        request's previous token is its own last pass's)."""
        wl = build_workload(self._piece(rs, start, cs), batch_size=len(rs))
        wl.pass_generated = np.array([made], np.int64)
        wl.pass_release = np.array([release])
        if self.previous:
            had = rs[self.last_count[rs] > 0]
            if len(had):
                wl.previous = build_workload(self._piece(had, self.last_start[had], self.last_count[had]),
                                             batch_size=len(had))
        if self.kept is not None:
            self.kept.append(wl)
        return wl

    def _piece(self, rs: np.ndarray, start: np.ndarray, cs: np.ndarray) -> Trace:
        """The recorded tokens' rows of ``cs`` tokens of each request ``rs`` from its processed
        token ``start`` on, renumbered as the served request's tokens (request, position,
        phase) in one step."""
        bank, plan = self.bank, self.plan
        req = np.repeat(rs, cs)
        i = np.repeat(start - np.r_[0, np.cumsum(cs)[:-1]], cs) + np.arange(int(cs.sum()))
        src, prompt = plan.source[req], plan.prompt[req]
        tok = bank.tokens(src, prompt, i)
        lens = bank.tok_len[tok]
        piece = bank.trace.take(bank.rows(tok))
        piece.request = np.repeat(req, lens)
        piece.step = np.zeros(len(piece.request), np.int32)
        piece.position = np.repeat(bank.base[src] + i, lens)
        piece.phase = np.repeat(np.where((i < prompt) | (i < self.redo[req]), PREFILL, DECODE).astype(np.int8), lens)
        return piece

    # -- the results ------------------------------------------------------------------------
    def report(self, requests: pd.DataFrame, slo: SloConfig | None) -> dict[str, Any]:
        """The summary's serving figures for the run's per-request rows ``requests``
        (:func:`summary`), the arrival plan's notes and the scheduler's own figures."""
        out = summary(requests, slo, self.gaps())
        out.update(arrival_notes=self.plan.notes, max_running_seen=self.max_running_seen,
                   kv_capacity_tokens=self.kv_tokens if np.isfinite(self.kv_tokens) else None)
        return out

    def gaps(self) -> np.ndarray:
        """Every inter-token gap of the run (seconds between two consecutive output tokens of a
        request, each the end of the pass that made the later token less the end of the pass
        that made the earlier one), pooled over the requests."""
        return np.concatenate(self._gaps) if self._gaps else np.zeros(0)

    def frame(self) -> pd.DataFrame:
        """One row per request: arrival, when first scheduled, first token and finish (s);
        queueing delay, TTFT, TPOT (after the first token, per token; NaN with one output
        token), its longest inter-token gap (``itl_max_s``; NaN with one output token) and
        end-to-end latency; its lengths and recorded request; how often it was preempted and
        the tokens it processed again."""
        p = self.plan
        out = p.output.astype(np.float64)
        with np.errstate(invalid="ignore"):  # one output token: 0 / 0, masked
            tpot = np.where(p.output > 1, (self.finish - self.first_token) / (out - 1), np.nan)
        return pd.DataFrame({
            "request": np.arange(self.n, dtype=np.int64),
            "source_request": self.bank.request_ids[p.source],
            "arrival_s": p.arrival,
            "scheduled_s": self.scheduled,
            "first_token_s": self.first_token,
            "finish_s": self.finish,
            "queue_s": self.scheduled - p.arrival,
            "ttft_s": self.first_token - p.arrival,
            "tpot_s": tpot,
            "itl_max_s": self.itl_max,
            "e2e_s": self.finish - p.arrival,
            "prompt_tokens": p.prompt,
            "output_tokens": p.output,
            "preemptions": self.preemptions,
            "recomputed_tokens": self.recomputed,
        })


def summary(requests: pd.DataFrame, slo: SloConfig | None, gaps: np.ndarray | None = None) -> dict[str, Any]:
    """The serving figures of the summary (``docs/guides/serving.md``, "Metrics"): TTFT and TPOT
    mean, median and 99th percentile (numpy's linear percentile), the inter-token gaps'
    (``gaps``, pooled over every token of every request) median and 99th percentile, e2e p99,
    output tokens and requests per second over the span from the first arrival to the last
    finish, preemptions and the tokens they made the GPU process again, and with an SLO the share of requests meeting it and those per second (goodput)."""

    def q(col: str, pct: float) -> float | None:
        v = requests[col].to_numpy(np.float64)
        v = v[np.isfinite(v)]
        return float(np.percentile(v, pct)) if len(v) else None

    def mean(col: str) -> float | None:
        v = requests[col].to_numpy(np.float64)
        v = v[np.isfinite(v)]
        return float(v.mean()) if len(v) else None

    span = float(requests["finish_s"].max() - requests["arrival_s"].min())
    n = len(requests)
    out: dict[str, Any] = {
        "ttft_mean_s": mean("ttft_s"), "ttft_p50_s": q("ttft_s", 50), "ttft_p99_s": q("ttft_s", 99),
        "tpot_mean_s": mean("tpot_s"), "tpot_p50_s": q("tpot_s", 50), "tpot_p99_s": q("tpot_s", 99),
        "itl_p50_s": float(np.percentile(gaps, 50)) if gaps is not None and len(gaps) else None,
        "itl_p99_s": float(np.percentile(gaps, 99)) if gaps is not None and len(gaps) else None,
        "e2e_p99_s": q("e2e_s", 99), "queue_mean_s": mean("queue_s"),
        "throughput_tokens_s": float(requests["output_tokens"].sum()) / span if span > 0 else None,
        "requests_per_s": n / span if span > 0 else None,
        "served_requests": n,
        "preemptions": int(requests["preemptions"].sum()),
        "recomputed_tokens": int(requests["recomputed_tokens"].sum()),
        "offered_rate": ((n - 1) / float(requests["arrival_s"].max() - requests["arrival_s"].min())
                         if n > 1 and requests["arrival_s"].max() > requests["arrival_s"].min() else None),
    }
    if slo is not None:
        ok = np.ones(n, dtype=bool)
        if slo.ttft_s is not None:
            ok &= requests["ttft_s"].to_numpy() <= slo.ttft_s
        if slo.tpot_s is not None:
            tp = requests["tpot_s"].to_numpy()
            ok &= np.isnan(tp) | (tp <= slo.tpot_s)  # one output token: no TPOT to miss
        if slo.itl_s is not None:
            gap = requests["itl_max_s"].to_numpy()
            ok &= np.isnan(gap) | (gap <= slo.itl_s)  # every gap within the limit
        out["slo_attainment"] = float(ok.mean())
        out["goodput_requests_s"] = float(ok.sum()) / span if span > 0 else None
    return out
