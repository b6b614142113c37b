"""Routing statistics of the real traces in ../shared/traces/real (for docs/synthetic.md).

Reads them with the importers (warm-up rows of the layer-0 vLLM logs dropped) and prints the
statistics of :mod:`traces.stats`. Usage: ``python tools/real_stats.py [SHARED_REAL_DIR]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from moesim.traces.importers import import_trace
from moesim.traces.stats import trace_stats


def main(root: str) -> None:
    base = Path(root)
    for name in ("gsm8k", "humaneval"):
        src = base / "mixtral-8x7b-vllm" / f"routing_data_collected_{name}_2_routing.jsonl"
        t, _ = import_trace("expert-jsonl", [src], "mixtral-8x7b")
        print(f"mixtral {name}: tokens={t.num_tokens()}", trace_stats(t))
    for folder, preset in (("olmoe-1b-7b", "olmoe-1b-7b"), ("qwen1.5-moe-a2.7b-chat", "qwen1.5-moe-a2.7b")):
        t, _ = import_trace("vllm-routes-jsonl", [base / "layer0-vllm" / folder / "moe_routes.jsonl"], preset,
                            drop_warmup=True)
        print(f"{folder} layer0: tokens={t.num_tokens()}", trace_stats(t))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "../shared/traces/real")
