"""The PyTorch pieces that ``calibrate measure`` (:mod:`moesim.calibration.calibrate`) and the
validation executor (:mod:`moesim.calibration.executor`) share: the expert FFN, a CUDA graph's
capture and its warm-up. PyTorch is imported when first used (the capture extra)."""

from __future__ import annotations

from typing import Any

from moesim.errors import MoesimError


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        raise MoesimError("calibrate needs PyTorch: pip install torch==2.13.0 (the capture extra).") from None
    return torch


def expert_ffn(x: Any, gate: Any, up: Any, down: Any) -> Any:
    """One expert FFN on the tokens ``x``: ``(silu(x @ gate) * (x @ up)) @ down`` (gate and up
    ``hidden x intermediate``, down ``intermediate x hidden``). What :func:`measure` times and
    the validation executor runs."""
    torch = _torch()
    return (torch.nn.functional.silu(x @ gate) * (x @ up)) @ down


def warm_up(fn: Any, times: int = 3) -> None:
    """Run ``fn`` ``times`` times on a side stream joined to the current one, as a CUDA graph
    capture of it requires first (cuBLAS picks its kernels and workspace outside the capture)."""
    torch = _torch()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(times):
            fn()
    torch.cuda.current_stream().wait_stream(side)


def cuda_graph(fn: Any, pool: Any = None) -> Any:
    """``fn`` (warmed up: :func:`warm_up`) captured as a CUDA graph, its memory from ``pool``
    when given (graphs replayed one after another may share one); returns its replay."""
    torch = _torch()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        fn()
    return graph.replay
