"""Routing statistics of the real traces in ../shared/traces/real (for docs/synthetic.md).

Reads the raw files directly (no importer needed) and prints the statistics of
:mod:`traces.stats`, so that the realistic synthetic routing defaults can be compared with
them. Usage: ``python tools/real_stats.py [SHARED_REAL_DIR]``.
"""

from __future__ import annotations

import glob
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from traces.stats import sequence_stats


def mixtral_sequences(path: Path) -> list[np.ndarray]:
    """[tokens, 32, 2] arrays per problem from an expert-jsonl file (-1 = missing cell)."""
    cells: dict[int, dict[tuple[int, int], list[int]]] = defaultdict(dict)
    for line in path.read_text().splitlines():
        row = json.loads(line)
        cells[row["problem_id"]][(row["token_idx"], row["layer"])] = row["experts"]
    seqs = []
    for cell in cells.values():
        ntok = max(t for t, _ in cell) + 1
        arr = np.full((ntok, 32, 2), -1, dtype=np.int64)
        for (t, layer), ex in cell.items():
            arr[t, layer] = ex
        seqs.append(arr)
    return seqs


def layer0_sequences(path: Path, warmup: tuple[int, ...] | None) -> list[np.ndarray]:
    """[tokens, 1, k] arrays per request from a layer-0 vLLM route log, warm-up rows dropped."""
    by_req: dict[str, list[list[int]]] = defaultdict(list)
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row.get("type") != "route":
            continue
        ids = row["topk_ids"]
        if warmup is None and all(abs(w - row["topk_weights"][0]) < 1e-9 for w in row["topk_weights"]):
            continue  # OLMoE warm-up dummies: all weights equal
        if warmup is not None and tuple(ids) == warmup:
            continue
        by_req[row["req_id"]].append(ids)
    return [np.asarray(v, dtype=np.int64)[:, None, :] for v in by_req.values() if len(v) > 1]


def main(root: str) -> None:
    base = Path(root)
    for name in ("gsm8k", "humaneval"):
        f = next(iter(glob.glob(str(base / f"mixtral-8x7b-vllm/routing_data_collected_{name}_2_routing.jsonl"))))
        seqs = mixtral_sequences(Path(f))
        print(f"mixtral {name}: tokens={sum(len(s) for s in seqs)}", sequence_stats(seqs, 8))
    olmoe = layer0_sequences(base / "layer0-vllm/olmoe-1b-7b/moe_routes.jsonl", None)
    print(f"olmoe layer0: tokens={sum(len(s) for s in olmoe)}", sequence_stats(olmoe, 64))
    qwen = layer0_sequences(base / "layer0-vllm/qwen1.5-moe-a2.7b-chat/moe_routes.jsonl", (43, 5, 7, 58))
    print(f"qwen1.5 layer0: tokens={sum(len(s) for s in qwen)}", sequence_stats(qwen, 60))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "../shared/traces/real")
