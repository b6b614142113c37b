"""``moesim capture``: record routing traces from Hugging Face transformers MoE models.

Forward hooks on each MoE layer's router module (no edits to the model's code) record what
the model itself computed: transformers' routers return ``(router_logits, weights,
indices)``, so the trace holds the top-k experts and mixing weights exactly as the model
uses them (renormalised or not, per architecture), in rank order (descending weight), plus
the full router probability vector (softmax of the logits; for DeepSeek-V3's sigmoid
router, the sigmoid scores normalised to sum to 1).

- ``predict_next``: the next MoE layer's router applied to this layer's router input (the
  normalised residual stream), SpecMD's and Eliseev & Mazur's speculative prefetch signal;
- ``quasi_hidden``: ``speculating-experts-prefetch.txt`` §3: default vectors d_{l,e} (the
  mean output of expert e at layer l) from a first pass over the prompts, the layer default
  d_l = sum_e g_e d_{l,e} over the token's experts, and q_l = LN_{l+1}(r_l + d_l) with r_l
  the post-attention residual at layer l and LN_{l+1} the next MoE layer's pre-routing norm;
  the next router applied to q_l goes to the ``pred_quasi`` column.

Prefill then greedy decoding, B prompts at a time (left-padded; padded positions and tokens
after a sequence's end-of-sequence are not recorded). Works offline from a local folder.
Supported families: those of :data:`SUPPORTED` that the installed transformers provides.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from moesim.errors import MoesimError
from moesim.traces.schema import PHASE_CODES, ModelInfo
from moesim.traces.trace import Trace

# model_type -> how its router scores become a probability vector, and renormalisation
SUPPORTED: dict[str, dict[str, Any]] = {
    "olmoe": {"family": "OLMoE", "scores": "softmax"},
    "mixtral": {"family": "Mixtral", "scores": "softmax", "renormalize": True},
    "qwen2_moe": {"family": "Qwen2-MoE", "scores": "softmax"},
    "qwen3_moe": {"family": "Qwen3-MoE", "scores": "softmax"},
    "deepseek_v2": {"family": "DeepSeek-V2", "scores": "softmax", "renormalize": False},
    "deepseek_v3": {"family": "DeepSeek-V3", "scores": "sigmoid"},
    "phimoe": {"family": "Phi-MoE", "scores": "softmax", "renormalize": False},
    "gpt_oss": {"family": "GPT-OSS", "scores": "softmax", "renormalize": True},
}
BYTES_PER_PARAM = {"bf16": 2.0, "int8": 1.0, "int4": 0.5, "int2": 0.25}


def _need_torch() -> Any:
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError:
        raise MoesimError("moesim capture needs PyTorch and transformers: install the 'capture' "
                          "extra (pip install torch==2.13.0 && pip install -e '.[capture]').") from None
    return torch


def _kv(model: Any, cache: Any) -> dict[str, Any]:
    """The keyword that hands ``cache`` to ``model``'s forward: ``cache`` from transformers
    5.24 on (where ``past_key_values`` warns that it is deprecated), ``past_key_values``
    before (the capture extra allows transformers 5.0 and newer)."""
    import inspect

    params = inspect.signature(type(model).forward).parameters
    return {"cache" if "cache" in params else "past_key_values": cache, "use_cache": True}


def supported_families() -> list[str]:
    """Supported model types that the installed transformers provides."""
    import importlib.util

    return [t for t in SUPPORTED if importlib.util.find_spec(f"transformers.models.{t}") is not None]


@dataclass
class MoELayer:
    """One MoE layer of the model: its decoder index and the modules capture uses."""

    ordinal: int
    decoder_index: int
    router: Any
    experts: Any
    post_norm: Any


@dataclass
class CaptureResult:
    """The trace plus, on request, the router inputs aligned with its rows (for tests)."""

    trace: Trace
    hidden: np.ndarray | None = None
    notes: list[str] = field(default_factory=list)


def load_local(path: str, device: str, dtype: str, any_causal_lm: bool = False) -> tuple[Any, Any]:
    """Model and tokenizer (or None) from a local folder; never downloads. ``any_causal_lm``
    accepts any causal LM (a draft model), not only the supported MoE families."""
    torch = _need_torch()
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # moesim shows its own progress; tqdm's lines run past 80 columns
    p = Path(path)
    if not p.is_dir():
        raise MoesimError(f"capture: --model {path} is not a local folder. moesim capture works offline "
                          "from a folder holding config.json and the weights; a hub name would need a "
                          "download, which this machine cannot do: download the model elsewhere and copy it.")
    try:
        config = AutoConfig.from_pretrained(p, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise MoesimError(f"capture: {p} has no readable config.json ({exc}).") from None
    mt = getattr(config, "model_type", None)
    if not any_causal_lm and mt not in supported_families():
        names = ", ".join(SUPPORTED[t]["family"] for t in supported_families())
        raise MoesimError(f"capture: model type '{mt}' is not supported; supported MoE families: {names}.")
    dt = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}.get(dtype)
    if dt is None:
        raise MoesimError(f"capture: --dtype {dtype} is not one of bfloat16, float16, float32.")
    if device == "cuda" and not torch.cuda.is_available():
        raise MoesimError("capture: --device cuda but no CUDA device is available; use --device cpu.")
    model: Any = AutoModelForCausalLM.from_pretrained(p, local_files_only=True, dtype=dt)
    model = model.to(device).eval()
    tok = None
    # only a folder with a vocabulary has a tokenizer: without one, transformers 5.24 builds an
    # empty GPT-NeoX tokenizer that turns every prompt into no tokens
    if any((p / name).is_file() for name in TOKENIZER_FILES):
        try:
            tok = AutoTokenizer.from_pretrained(p, local_files_only=True)
        except (OSError, ValueError, TypeError):
            tok = None
    return model, tok


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def moe_layers(model: Any) -> list[MoELayer]:
    """The model's MoE layers in order (dense layers, e.g. DeepSeek's first ones, skipped)."""
    out: list[MoELayer] = []
    for i, layer in enumerate(model.model.layers):
        mlp = layer.mlp
        router = getattr(mlp, "gate", None) or getattr(mlp, "router", None)
        if router is None or not type(router).__name__.lower().endswith("router"):
            continue
        out.append(MoELayer(len(out), i, router, mlp.experts, layer.post_attention_layernorm))
    if not out:
        raise MoesimError("capture: the model has no MoE router modules.")
    return out


def model_info(model: Any, layers: list[MoELayer]) -> ModelInfo:
    """Model shape and expert sizes read from the model itself."""
    cfg = model.config
    mt = cfg.model_type
    num_e = int(getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
                or cfg.n_routed_experts)
    inter = int(getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size)
    n_params = sum(p.numel() for p in layers[0].experts.parameters())
    per_expert = n_params / num_e
    renorm = SUPPORTED[mt].get("renormalize", bool(getattr(cfg, "norm_topk_prob", False)))
    shared = int(getattr(cfg, "n_shared_experts", 0) or (1 if getattr(cfg, "shared_expert_intermediate_size", 0) else 0))
    shared_inter = int(getattr(cfg, "shared_expert_intermediate_size", 0) or (inter if shared else 0))
    return ModelInfo(
        name=Path(str(getattr(cfg, "_name_or_path", "") or mt)).name or mt,
        num_layers=len(layers), num_experts=num_e, top_k=int(cfg.num_experts_per_tok),
        hidden_size=int(cfg.hidden_size), expert_intermediate_size=inter,
        expert_bytes={k: int(np.ceil(per_expert * b)) for k, b in BYTES_PER_PARAM.items()},
        renormalize=renorm, shared_experts=shared, shared_expert_intermediate_size=shared_inter,
        num_attention_heads=int(cfg.num_attention_heads),
        num_key_value_heads=int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads),
        head_dim=int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads),
        extra={"model_type": mt, "family": SUPPORTED[mt]["family"],
               "decoder_layers": [m.decoder_index for m in layers]})


def router_probs(model_type: str, logits: Any) -> Any:
    """Router probability vector from router logits (see module docstring)."""
    torch = _need_torch()
    logits = logits.float()
    if SUPPORTED[model_type]["scores"] == "sigmoid":
        s = torch.sigmoid(logits)
        return s / s.sum(dim=-1, keepdim=True)
    return torch.softmax(logits, dim=-1)


class _Recorder:
    """Forward hooks on every router (and pre-routing norm) of the MoE layers."""

    def __init__(self, layers: list[MoELayer]) -> None:
        self.layers = layers
        self.on = False
        self.calls: list[dict[int, tuple[Any, Any, Any, Any]]] = []
        self.residual: list[dict[int, Any]] = []
        self.handles = []
        for m in layers:
            self.handles.append(m.router.register_forward_hook(self._router_hook(m.ordinal)))
            self.handles.append(m.post_norm.register_forward_pre_hook(self._norm_hook(m.ordinal)))

    def _router_hook(self, ordinal: int) -> Any:
        def hook(module: Any, args: Any, output: Any) -> None:
            if not self.on:
                return
            h = args[0]
            logits, weights, idx = output[0], output[1], output[2]
            h = h.reshape(-1, h.shape[-1])
            self.calls[-1][ordinal] = (h.detach(), logits.reshape(h.shape[0], -1).detach(),
                                       weights.reshape(h.shape[0], -1).detach(), idx.reshape(h.shape[0], -1).detach())
        return hook

    def _norm_hook(self, ordinal: int) -> Any:
        def hook(module: Any, args: Any) -> None:
            if self.on:
                self.residual[-1][ordinal] = args[0].detach()
        return hook

    def new_call(self) -> None:
        self.calls.append({})
        self.residual.append({})

    def forward(self, model: Any, **kwargs: Any) -> Any:
        """One forward pass of ``model`` with the hooks recording into a fresh ``calls[-1]``
        (earlier calls are dropped)."""
        self.calls.clear()
        self.new_call()
        self.on = True
        try:
            return model(**kwargs)
        finally:
            self.on = False

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _default_vectors(model: Any, layers: list[MoELayer], rec: _Recorder, batches: list[Any]) -> list[Any]:
    """d_{l,e}: mean output of each expert over the first pass (zeros for unused experts)."""
    torch = _need_torch()
    sums: list[Any] = [None] * len(layers)
    counts: list[Any] = [None] * len(layers)
    with torch.no_grad():
        for ids, mask in batches:
            rec.calls.clear()
            rec.residual.clear()
            rec.new_call()
            rec.on = True
            model(input_ids=ids, attention_mask=mask)
            rec.on = False
            valid = mask.reshape(-1).bool()
            for m in layers:
                h, _, _, idx = rec.calls[-1][m.ordinal]
                h, idx = h[valid], idx[valid]
                num_e = int(m.router.num_experts) if hasattr(m.router, "num_experts") else int(idx.max()) + 1
                if sums[m.ordinal] is None:
                    sums[m.ordinal] = torch.zeros(num_e, h.shape[1], dtype=torch.float32, device=h.device)
                    counts[m.ordinal] = torch.zeros(num_e, dtype=torch.float32, device=h.device)
                for e in torch.unique(idx).tolist():
                    rows = (idx == e).any(dim=1)
                    hs = h[rows]
                    one = torch.full((hs.shape[0], 1), e, dtype=idx.dtype, device=h.device)
                    out = m.experts(hs, one, torch.ones((hs.shape[0], 1), dtype=hs.dtype, device=h.device))
                    sums[m.ordinal][e] += out.float().sum(dim=0)
                    counts[m.ordinal][e] += hs.shape[0]
    return [s / torch.clamp(c, min=1)[:, None] for s, c in zip(sums, counts, strict=True)]


def capture(model: Any, tokenizer: Any, prompts: list[str], *, max_new_tokens: int = 16, batch_size: int = 1,
            predict_next: bool = False, quasi_hidden: bool = False, keep_hidden: bool = False,
            progress: Any = None, source: dict[str, Any] | None = None) -> CaptureResult:
    """Run prefill + greedy decoding over ``prompts`` and record routing (module docstring).
    Prompts are text when the model has a tokenizer, else lines of integer token ids."""
    torch = _need_torch()
    layers = moe_layers(model)
    info = model_info(model, layers)
    mt = model.config.model_type
    device = next(model.parameters()).device
    seqs = [_tokenize(tokenizer, p, i) for i, p in enumerate(prompts)]
    pad_id = 0
    if tokenizer is not None and tokenizer.pad_token_id is not None:
        pad_id = int(tokenizer.pad_token_id)
    eos = model.generation_config.eos_token_id if model.generation_config is not None else None
    eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
    batches = []
    for start in range(0, len(seqs), batch_size):
        chunk = seqs[start:start + batch_size]
        width = max(len(s) for s in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for b, s in enumerate(chunk):
            ids[b, width - len(s):] = torch.tensor(s)
            mask[b, width - len(s):] = 1
        batches.append((ids.to(device), mask.to(device)))
    rec = _Recorder(layers)
    defaults = _default_vectors(model, layers, rec, batches) if quasi_hidden else None
    cols: dict[str, list[Any]] = {k: [] for k in ("req", "step", "pos", "phase", "layer", "exp", "w", "probs",
                                                   "pred", "quasi", "hidden")}
    total = sum(len(s) for s in seqs) + len(seqs) * max(max_new_tokens - 1, 0)
    done_tokens = 0
    try:
        with torch.no_grad():
            for bi, (ids, mask) in enumerate(batches):
                rec.calls.clear()
                rec.residual.clear()

                def pre_call(*_a: Any, **_k: Any) -> None:
                    rec.new_call()

                handle = model.register_forward_pre_hook(pre_call)
                rec.on = True
                out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                     do_sample=False, pad_token_id=pad_id, use_cache=True)
                rec.on = False
                handle.remove()
                gen = out[:, ids.shape[1]:].tolist()
                width = ids.shape[1]
                for call_no, call in enumerate(rec.calls):
                    n_rows_per_seq = width if call_no == 0 else 1
                    for b in range(ids.shape[0]):
                        req = bi * batch_size + b
                        plen = int(mask[b].sum())
                        if call_no == 0:
                            ts = list(range(width - plen, width))
                        else:
                            produced = gen[b][:call_no]
                            if any(t in eos_ids for t in produced):
                                continue  # the sequence had ended
                            ts = [0]
                        for t in ts:
                            row = b * n_rows_per_seq + t
                            pos = t - (width - plen) if call_no == 0 else plen + call_no - 1
                            _emit(cols, call, rec.residual[call_no], layers, defaults, mt, row, req,
                                  call_no, pos, predict_next, keep_hidden)
                        done_tokens += len(ts)
                        if progress is not None:
                            progress(done_tokens, total)
    finally:
        rec.close()
    trace = _recorded_trace(info, cols, predict_next, {
        "source": "moesim capture", "model_type": mt, "dtype": str(next(model.parameters()).dtype),
        "device": str(device), "prompts": len(prompts), "batch_size": batch_size,
        "max_new_tokens": max_new_tokens, "predict_next": predict_next, "quasi_hidden": quasi_hidden,
        **(source or {})},
        pred_quasi=np.asarray(cols["quasi"], dtype=np.float32) if quasi_hidden else None)
    order = np.lexsort((trace.layer, trace.position, trace.step, trace.request))
    trace = trace.take(order)
    hidden = np.asarray(cols["hidden"], dtype=np.float32)[order] if keep_hidden else None
    return CaptureResult(trace, hidden)


def _recorded_trace(info: ModelInfo, cols: dict[str, list[Any]], predict_next: bool,
                    capture: dict[str, Any], **extra: Any) -> Trace:
    """The trace of the recorded columns (``_emit``'s), with ``capture`` metadata plus the
    torch/transformers versions and the date; ``extra`` holds optional columns."""
    torch = _need_torch()
    if not cols["req"]:
        raise MoesimError("capture: no tokens were recorded (empty prompts?).")
    stamp = {"torch": torch.__version__, "transformers": __import__("transformers").__version__,
             "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    return Trace(
        model=info, request=np.asarray(cols["req"], dtype=np.int32), step=np.asarray(cols["step"], dtype=np.int32),
        position=np.asarray(cols["pos"], dtype=np.int32), phase=np.asarray(cols["phase"], dtype=np.int8),
        layer=np.asarray(cols["layer"], dtype=np.int16), experts=np.asarray(cols["exp"], dtype=np.int16),
        weights=np.asarray(cols["w"], dtype=np.float32), probs=np.asarray(cols["probs"], dtype=np.float32),
        pred_next=np.asarray(cols["pred"], dtype=np.float32) if predict_next else None,
        capture={**capture, **stamp}, **extra)


def _emit(cols: dict[str, list[Any]], call: dict[int, Any], residual: dict[int, Any], layers: list[MoELayer],
          defaults: list[Any] | None, mt: str, row: int, req: int, step: int, pos: int,
          predict_next: bool, keep_hidden: bool) -> None:
    torch = _need_torch()
    for m in layers:
        h, logits, w, idx = call[m.ordinal]
        order = torch.argsort(w[row].float(), descending=True, stable=True)
        cols["req"].append(req)
        cols["step"].append(step)
        cols["pos"].append(pos)
        cols["phase"].append(PHASE_CODES["prefill"] if step == 0 else PHASE_CODES["decode"])
        cols["layer"].append(m.ordinal)
        cols["exp"].append(idx[row][order].tolist())
        cols["w"].append(w[row][order].float().tolist())
        cols["probs"].append(router_probs(mt, logits[row:row + 1])[0].tolist())
        if keep_hidden:
            cols["hidden"].append(h[row].float().tolist())
        nxt = layers[m.ordinal + 1] if m.ordinal + 1 < len(layers) else None
        num_e = logits.shape[1]
        if predict_next:
            if nxt is None:
                cols["pred"].append([1.0 / num_e] * num_e)
            else:
                cols["pred"].append(router_probs(mt, nxt.router(h[row:row + 1])[0])[0].tolist())
        if defaults is not None:
            if nxt is None:
                cols["quasi"].append([1.0 / num_e] * num_e)
            else:
                r = residual[m.ordinal].reshape(-1, h.shape[-1])[row]
                d = (w[row].float()[:, None] * defaults[m.ordinal][idx[row]]).sum(dim=0)
                q = nxt.post_norm((r.float() + d).to(r.dtype)[None, :])
                cols["quasi"].append(router_probs(mt, nxt.router(q)[0])[0].tolist())


def _tokenize(tokenizer: Any, prompt: str, i: int) -> list[int]:
    if tokenizer is not None:
        ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    else:
        try:
            ids = [int(x) for x in prompt.split()]
        except ValueError:
            raise MoesimError(f"capture: prompt {i + 1} is text but the model folder has no tokenizer; "
                              "give prompts as space-separated token ids, or add tokenizer files.") from None
    if not ids:
        raise MoesimError(f"capture: prompt {i + 1} ({prompt[:40]!r}) gave no tokens: the model folder's "
                          "tokenizer has no vocabulary. Add its tokenizer files, or remove them and give prompts "
                          "as space-separated token ids.")
    return list(ids)


def _record_tree(cols: dict[str, list[Any]], call: dict[int, Any], layers: list[MoELayer], mt: str,
                 flags: tuple[bool, bool], rows: list[int], where: tuple[int, int, int, str], nodes: list[int],
                 accepted: list[bool]) -> None:
    """Append one forward pass's routing for ``rows`` (request, step, position, phase in
    ``where``) with each row's tree node, parent (0, or -1 for none) and acceptance."""
    req, step, pos, phase = where
    for row, node, acc in zip(rows, nodes, accepted, strict=True):
        before = len(cols["req"])
        _emit(cols, call, {}, layers, None, mt, row, req, step, pos, flags[0], flags[1])
        added = len(cols["req"]) - before
        cols["phase"][before:] = [PHASE_CODES[phase]] * added
        cols["node"].extend([node] * added)
        cols["parent"].extend([0 if node > 0 else -1] * added)
        cols["acc"].extend([acc] * added)


def capture_speculative(model: Any, tokenizer: Any, prompts: list[str], *, max_new_tokens: int = 16,
                        width: int = 4, draft: Any = None, predict_next: bool = False,
                        keep_hidden: bool = False, progress: Any = None,
                        source: dict[str, Any] | None = None) -> CaptureResult:
    """Prefill, then speculative verification over depth-1 draft trees, one prompt at a time.

    Each verification pass (phase ``verify``) checks ``width`` candidate tokens for the next
    position, all children of the last accepted token: the draft model's top-``width``
    next-token candidates when ``draft`` is given, else the target's own top candidates (so
    the target's greedy token is always among them). The candidates run in one batched
    forward pass over copies of the KV cache — for a depth-1 tree that is exactly what tree
    attention computes — and the hooks record their routing with ``node`` (1..width, rank of
    the candidate), ``parent`` (0: the last accepted token) and ``accepted`` (the candidate
    equal to the target's greedy token). When no candidate is accepted, the target's token
    is fed as a plain decode step. Decoding continues from the accepted candidate.
    """
    torch = _need_torch()
    from transformers import DynamicCache

    layers = moe_layers(model)
    info = model_info(model, layers)
    mt = model.config.model_type
    device = next(model.parameters()).device
    eos = model.generation_config.eos_token_id if model.generation_config is not None else None
    eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
    rec = _Recorder(layers)
    cols: dict[str, list[Any]] = {k: [] for k in ("req", "step", "pos", "phase", "layer", "exp", "w", "probs",
                                                   "pred", "quasi", "hidden", "node", "parent", "acc")}

    def record(call: dict[int, Any], rows: list[int], req: int, step: int, pos: int, phase: str,
               nodes: list[int], accepted: list[bool]) -> None:
        _record_tree(cols, call, layers, mt, (predict_next, keep_hidden), rows, (req, step, pos, phase), nodes,
                     accepted)

    total = sum(len(_tokenize(tokenizer, p, i)) for i, p in enumerate(prompts)) + len(prompts) * max_new_tokens
    done = 0
    try:
        with torch.no_grad():
            for req, prompt in enumerate(prompts):
                ids = torch.tensor([_tokenize(tokenizer, prompt, req)], device=device)
                plen = ids.shape[1]
                cache = DynamicCache(config=model.config)
                out = rec.forward(model, input_ids=ids, **_kv(model, cache))
                record(rec.calls[-1], list(range(plen)), req, 0, 0, "prefill", [0] * plen, [True] * plen)
                for i in range(plen):  # prefill positions are 0..plen-1
                    for j in range(len(layers)):
                        cols["pos"][-(plen - i) * len(layers) + j] = i
                done += plen
                logits = out.logits[0, -1]
                dcache = None
                dlogits = None
                if draft is not None:
                    dcache = DynamicCache(config=draft.config)
                    dlogits = draft(input_ids=ids, **_kv(draft, dcache)).logits[0, -1]
                pos = plen
                step = 1
                produced = 0
                while produced < max_new_tokens - 1:
                    target_tok = int(torch.argmax(logits))
                    source_logits = dlogits if dlogits is not None else logits
                    cands = torch.topk(source_logits.float(), width).indices.tolist()
                    n0 = cache.get_seq_length()
                    cache.batch_repeat_interleave(width)
                    vout = rec.forward(model, input_ids=torch.tensor(cands, device=device)[:, None],
                                       **_kv(model, cache))
                    acc = [c == target_tok for c in cands]
                    record(rec.calls[-1], list(range(width)), req, step, pos, "verify",
                           list(range(1, width + 1)), acc)
                    done += width
                    if any(acc):
                        keep = acc.index(True)
                        cache.batch_select_indices(torch.tensor([keep], device=device))
                        logits = vout.logits[keep, -1]
                        fed = cands[keep]
                    else:
                        cache.batch_select_indices(torch.tensor([0], device=device))
                        cache.crop(n0 - cache.get_seq_length())  # drop the rejected candidate
                        dout = rec.forward(model, input_ids=torch.tensor([[target_tok]], device=device),
                                           **_kv(model, cache))
                        step += 1
                        record(rec.calls[-1], [0], req, step, pos, "decode", [0], [True])
                        done += 1
                        logits = dout.logits[0, -1]
                        fed = target_tok
                    if dcache is not None:
                        dlogits = draft(input_ids=torch.tensor([[fed]], device=device),
                                        **_kv(draft, dcache)).logits[0, -1]
                    pos += 1
                    step += 1
                    produced += 1
                    if progress is not None:
                        progress(done, total)
                    if fed in eos_ids:
                        break
    finally:
        rec.close()
    capture_info = {"source": "moesim capture --speculative", "model_type": mt, "tree": f"depth 1, width {width}",
                    "draft": "target's own top candidates" if draft is None else "draft model",
                    "prompts": len(prompts), "max_new_tokens": max_new_tokens, **(source or {})}
    return _speculative_result(info, cols, predict_next, keep_hidden, capture_info)


def _speculative_result(info: ModelInfo, cols: dict[str, list[Any]], predict_next: bool, keep_hidden: bool,
                        capture_info: dict[str, Any]) -> CaptureResult:
    """The recorded columns of a speculative capture as a trace, rows in (request, step,
    position, node, layer) order."""
    trace = _recorded_trace(info, cols, predict_next, capture_info,
                            node=np.asarray(cols["node"], dtype=np.int16),
                            parent=np.asarray(cols["parent"], dtype=np.int16),
                            accepted=np.asarray(cols["acc"], dtype=bool))
    assert trace.node is not None
    order = np.lexsort((trace.layer, trace.node, trace.position, trace.step, trace.request))
    hidden = np.asarray(cols["hidden"], dtype=np.float32)[order] if keep_hidden else None
    return CaptureResult(trace.take(order), hidden)
