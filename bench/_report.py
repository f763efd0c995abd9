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


_BARS: dict[str, tuple[Any, Any]] = {}  # label -> (rich Progress, its task) while running


def progress(label: str, done: float, total: float) -> None:
    """A progress bar with its ETA on stderr (rich), one per label, ended when ``done``
    reaches ``total``; on a non-terminal (a log file, CI) only the finished bar is written,
    one line, instead of a line of carriage returns."""
    from rich.console import Console
    from rich.progress import (BarColumn, Progress, TaskProgressColumn, TextColumn,
                               TimeRemainingColumn)

    bar = _BARS.get(label)
    if bar is None:
        shown = Progress(TextColumn(f"  {label:<28}"), BarColumn(), TaskProgressColumn(),
                         TimeRemainingColumn(), console=Console(stderr=True))
        shown.start()
        bar = _BARS[label] = (shown, shown.add_task(label, total=total or 1))
    shown, task = bar
    shown.update(task, completed=min(done, total) if total else 1)
    if not total or done >= total:
        shown.stop()
        del _BARS[label]
