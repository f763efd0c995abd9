"""Shared pieces of the benchmark scripts: percentiles and the JSON they leave behind."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np


def percentiles(values: list[float], scale: float, unit: str) -> dict[str, float]:
    """n, p50, p99, p99.9 and max of ``values`` multiplied by ``scale``, keys suffixed ``unit``."""
    a = np.asarray(values, dtype=np.float64) * scale
    return {"n": int(a.size), f"p50_{unit}": float(np.percentile(a, 50)),
            f"p99_{unit}": float(np.percentile(a, 99)),
            f"p999_{unit}": float(np.percentile(a, 99.9)), f"max_{unit}": float(a.max())}


def write_results(out: str | Path, results: dict[str, Any]) -> None:
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2))
    print(f"wrote {path}")


def progress(label: str, done: float, total: float) -> None:
    """A one-line progress bar on stderr; the line ends when done reaches total."""
    import sys

    share = min(done / total, 1.0) if total else 1.0
    print(f"\r  {label:<28} [{'#' * int(share * 30):<30}] {share:6.1%}",
          end="\n" if share >= 1.0 else "", file=sys.stderr, flush=True)
