"""Shared pieces of the benchmark scripts: percentiles, the JSON they leave behind, and the
picture drawn beside it."""

from __future__ import annotations

import json
import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

# The distribution is kept as its quantiles at these levels, so `python -m bench report` can
# draw a CDF without the raw samples: every percent, then the tail a budget is written for.
CDF_LEVELS = tuple(i / 100 for i in range(1, 100)) + (0.995, 0.999)
LOAD_AT_START = os.getloadavg()  # taken when a bench imports this module, i.e. as it starts


def percentiles(values: list[float], scale: float, unit: str) -> dict[str, Any]:
    """n, p50, p99, p99.9 and max of ``values`` multiplied by ``scale``, keys suffixed ``unit``,
    and ``cdf``: the values at ``CDF_LEVELS`` (4 significant digits), for the pictures."""
    a = np.asarray(values, dtype=np.float64) * scale
    return {"n": int(a.size), f"p50_{unit}": float(np.percentile(a, 50)),
            f"p99_{unit}": float(np.percentile(a, 99)),
            f"p999_{unit}": float(np.percentile(a, 99.9)), f"max_{unit}": float(a.max()),
            "cdf": [float(f"{v:.4g}") for v in np.quantile(a, CDF_LEVELS)]}


def machine() -> dict[str, Any]:
    """What the figures were measured on: cores, Python, and the load average (1, 5, 15 min)
    when the bench started and when it wrote its results. The machine is shared, so the load
    says how far absolute figures can be trusted; same-run ratios are the comparable ones."""
    return {"at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "cores": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform(), "load_at_start": list(LOAD_AT_START),
            "load_at_end": list(os.getloadavg())}


def write_results(out: str | Path, results: dict[str, Any], bench: str,
                  picture: bool = True) -> None:
    """Write ``results`` as JSON to ``out`` with the bench's name and the machine's state, then
    its picture beside it (same name, ``.svg``).

    Args:
        out: the JSON file to write (its folder is made if missing).
        results: the bench's figures.
        bench: which bench made them: the key `python -m bench report` draws them by.
        picture: draw it too (False: a partial run whose picture would lack its panels).
    """
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    results = {"bench": bench, **results, "machine": {**results.get("machine", {}),
                                                       **machine()}}
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {path}")
    if not picture:
        return
    try:
        from _plots import draw
    except ImportError as exc:  # the JSON is the result; a missing extra must not lose it
        print(f"no picture: {exc}; install the bench extra (pip install -e '.[bench]') and "
              f"redraw with `python -m bench report {path.parent}`", file=sys.stderr)
        return
    print(f"drew {draw(path)}")


def progress(label: str, done: float, total: float) -> None:
    """A one-line progress bar on stderr; the line ends when done reaches total."""
    share = min(done / total, 1.0) if total else 1.0
    print(f"\r  {label:<28} [{'#' * int(share * 30):<30}] {share:6.1%}",
          end="\n" if share >= 1.0 else "", file=sys.stderr, flush=True)
