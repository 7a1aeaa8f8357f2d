"""Combining per-rank metrics and writing them out.

A worker's meta dict carries ``num_samples``, ``metrics`` (means over its own samples),
``sums`` (totals, e.g. token counts) and ``ratios`` (``name -> [numerator, denominator]``, e.g. a
mean over response tokens as its sum and its count). Means combine weighted by samples; sums
add; a ratio is its numerators' total over its denominators' (0 when those add to 0). So no
rank needs a collective for a metric. A metric ``X/mean`` with a companion ``X/sq_mean`` also
yields ``X/std`` over the whole batch.
"""

from __future__ import annotations

import json
import math
from pathlib import Path


def reduce_metas(metas: list[dict]) -> dict[str, float]:
    out: dict[str, float] = {}
    names = {name for m in metas for name in m.get("metrics", {})}
    for name in sorted(names):
        weighted = [(m["metrics"][name], m["num_samples"]) for m in metas if name in m.get("metrics", {})]
        weight = sum(w for _, w in weighted) or 1
        out[name] = sum(v * w for v, w in weighted) / weight
    for name in sorted({name for m in metas for name in m.get("sums", {})}):
        out[name] = float(sum(m.get("sums", {}).get(name, 0.0) for m in metas))
    for name in sorted({name for m in metas for name in m.get("ratios", {})}):
        parts = [m["ratios"][name] for m in metas if name in m.get("ratios", {})]
        denominator = sum(den for _, den in parts)
        out[name] = sum(num for num, _ in parts) / denominator if denominator else 0.0
    for name in [n for n in out if n.endswith("/sq_mean")]:
        base = name[: -len("/sq_mean")]
        if f"{base}/mean" in out:
            out[f"{base}/std"] = math.sqrt(max(out.pop(name) - out[f"{base}/mean"] ** 2, 0.0))
    return out


class JsonlLogger:
    """Appends one JSON object per iteration to ``metrics.jsonl``."""

    def __init__(self, path: Path):
        self.path = path
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
