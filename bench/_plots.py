"""The benches' pictures, drawn from their JSON alone (never from a live run), so
`python -m bench report` can redraw every one on a fresh clone.

Each drawer takes the results a bench wrote and fills a figure; ``draw`` picks the drawer by
the JSON's ``bench`` key and writes an SVG beside the JSON. Latency is drawn as a CDF on a
logit axis (p50, p90, p99 and p99.9 equally far apart, so the tail a budget is written for is
as visible as the median) against the baseline measured in the same run, dashed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")  # no display: benches run on servers and in CI

import matplotlib.pyplot as plt  # noqa: E402
from _report import CDF_LEVELS  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

# Same JSON, same SVG bytes: fixed ids and no date, so a redraw leaves unchanged pictures
# unchanged in git. Text stays text (smaller files, searchable).
STYLE = {"svg.hashsalt": "engram-bench", "svg.fonttype": "none", "font.size": 9,
         "axes.grid": True, "grid.alpha": 0.3, "axes.spines.top": False,
         "axes.spines.right": False, "legend.fontsize": 8, "legend.frameon": False}
BASELINE = {"linestyle": "--", "color": "0.35"}  # every in-run baseline is drawn like this
PANEL = (4.6, 3.4)  # inches per panel


def draw(path: str | Path) -> Path:
    """Draw the picture for one bench's JSON, beside it (same name, ``.svg``).

    Args:
        path: a JSON file a bench in bench/ wrote.

    Returns:
        The path of the SVG written.

    Raises:
        ValueError: the JSON names no bench this module can draw.
    """
    path = Path(path)
    results = json.loads(path.read_text())
    name = results.get("bench", path.stem)
    if name not in DRAWERS:
        raise ValueError(f"{path}: expected results of one of the benches "
                         f"({', '.join(sorted(DRAWERS))}) in its 'bench' key, found {name!r}; "
                         f"was it written by bench/_report.write_results?")
    with plt.rc_context(STYLE):
        fig = DRAWERS[name](results)
        _plain_log_ticks(fig)
        _footer(fig, results)
        out = path.with_suffix(".svg")
        fig.savefig(out, format="svg", bbox_inches="tight", metadata={"Date": None})
        plt.close(fig)
    return out


def _footer(fig: Figure, results: dict[str, Any]) -> None:
    """When and on what the figures were measured: the load says how far to trust them."""
    m = results.get("machine", {})
    bits = []
    if "at" in m:
        bits.append(m["at"].replace("T", " ").replace("+00:00", " UTC"))
    if "cores" in m or "cores" in results:
        bits.append(f"{m.get('cores', results.get('cores'))} cores")
    if "load_at_start" in m:
        bits.append(f"load average {m['load_at_start'][0]:.1f} at the start, "
                    f"{m['load_at_end'][0]:.1f} at the end (shared machine: compare within a "
                    f"picture, not across)")
    fig.text(0.01, -0.02, "; ".join(bits), fontsize=7, color="0.4", ha="left", va="top")


def _panels(n: int, title: str, rows: int = 1, width: float = PANEL[0]
            ) -> tuple[Figure, list[Axes]]:
    fig, axes = plt.subplots(rows, n, figsize=(width * n, PANEL[1] * rows), squeeze=False,
                             layout="constrained")
    fig.suptitle(title, fontsize=11)
    return fig, list(axes.flat)


QUANTILE_TICKS = {0.01: "p1", 0.1: "p10", 0.5: "p50", 0.9: "p90", 0.99: "p99", 0.999: "p99.9"}


def _cdf(ax: Axes, dist: dict[str, Any], label: str, unit: str, **style: Any) -> None:
    """One latency distribution as a CDF, its p50 and p99 in the legend."""
    shown = "µs" if unit == "us" else unit
    ax.plot(dist["cdf"], CDF_LEVELS[: len(dist["cdf"])],
            label=f"{label}\np50 {_num(dist[f'p50_{unit}'])}, p99 {_num(dist[f'p99_{unit}'])} "
                  f"{shown}, n={dist['n']:,}", **style)
    ax.set_xscale("log")
    ax.set_yscale("logit")
    ax.set_ylim(CDF_LEVELS[0], CDF_LEVELS[-1])
    ax.set_yticks(list(QUANTILE_TICKS), list(QUANTILE_TICKS.values()))
    ax.yaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xlabel(f"latency ({shown}, log scale)")
    ax.set_ylabel("quantile (logit scale)")
    ax.legend(loc="best", fontsize=7)


def _plain_log_ticks(fig: Figure) -> None:
    """Log axes ticked in plain numbers (matplotlib's default, 10^n in mathtext, costs a
    second a picture to typeset): at 1, 2, 5 x 10^n where the axis spans up to two decades,
    at powers of ten on wider ones, where 1-2-5 ticks would run into each other."""
    for ax in fig.axes:
        for axis, scale, limits in ((ax.xaxis, ax.get_xscale(), ax.get_xlim()),
                                    (ax.yaxis, ax.get_yscale(), ax.get_ylim())):
            if scale != "log":
                continue
            axis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: _num(x)))
            axis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            if not isinstance(axis.get_major_locator(), matplotlib.ticker.FixedLocator):
                # a drawer's own ticks (k, store sizes) stay
                subs = (1, 2, 5) if limits[1] / limits[0] <= 100 else (1,)
                axis.set_major_locator(matplotlib.ticker.LogLocator(subs=subs))


MARKERS = "osD^vx"  # modes whose curves coincide stay tellable apart
PHASE_COLORS = ("C0", "C1", "C4", "C5", "C6")  # not green or red: those mean found and lost


def _num(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"  # 1,234 / 56.7 / 0.0123


def _bars(ax: Axes, labels: list[str], values: list[float], unit: str,
          baseline: int | None = None) -> None:
    """Bars with their values written on them; bar ``baseline`` (an index) drawn grey."""
    others = iter(range(len(values)))
    colors = [BASELINE["color"] if i == baseline else f"C{next(others)}"
              for i in range(len(values))]
    bars = ax.bar(labels, values, color=colors)
    ax.bar_label(bars, labels=[_num(v) for v in values], fontsize=8)
    ax.set_ylabel(unit)
    ax.tick_params(axis="x", labelsize=8)
    for label in ax.get_xticklabels():
        label.set_rotation(12)


# -- one drawer per bench ---------------------------------------------------------------------


def ingest(r: dict[str, Any]) -> Figure:
    a = r["args"]
    fig, (buf, dur, bulk) = _panels(3, "Ingest: add_turn latency against in-run baselines, "
                                       "and bulk import")
    _cdf(buf, r["buffered"], "long-term layer on", "us")
    _cdf(buf, r["buffered_without_long_term"], "long-term layer off (baseline)", "us",
         **BASELINE)
    buf.set_title(f"add_turn buffered at {a['rate']:g} turns/s")
    _cdf(dur, r["durable"], f"add_turn durable, {a['writers']} writers", "us")
    _cdf(dur, r["baseline_commit"], "bare LMDB commit + fsync (floor)", "us", **BASELINE)
    dur.set_title(f"add_turn(durable=True) at {a['durable_rate']:g} turns/s in all")
    b = r["bulk"]
    _bars(bulk, ["bare LMDB, same writes", "add_turns"],
          [r["baseline_lmdb_turns_per_s"], b["turns_per_s"]], "turns/s", baseline=0)
    bulk.set_title(f"bulk import of {b['turns']:,} turns: {b['ratio_to_bare_lmdb']:.2f}x of "
                   f"bare LMDB")
    return fig


def _quality_rows(r: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(name, row) for name, row in r.items() if isinstance(row, dict) and "modes" in row]


def _ks(cell: dict[str, Any]) -> list[int]:
    return sorted(int(k[2:]) for k in cell if k.startswith("R@"))


def recall_quality(r: dict[str, Any]) -> Figure:
    rows = _quality_rows(r)
    fig, axes = _panels(3, "Retrieval quality: recall@k per mode and per question category; "
                           "recall latency, full pipeline against turns only", rows=len(rows))
    for i, (name, row) in enumerate(rows):
        modes, per_mode, per_cat, lat = row["modes"], *axes[3 * i : 3 * i + 3]
        for j, (mode, cell) in enumerate(modes.items()):
            ks = _ks(cell["all"])
            per_mode.plot(ks, [cell["all"][f"R@{k}"] for k in ks], marker=MARKERS[j % 6],
                          label=mode, color=f"C{j}", markerfacecolor="none",
                          linewidth=2.2 if mode == "full pipeline" else 1.2)
        full = modes.get("full pipeline") or next(iter(modes.values()))
        groups = [g for g in full if g not in ("all", "query_ms")]
        for j, group in enumerate(groups):
            ks = _ks(full[group])
            per_cat.plot(ks, [full[group][f"R@{k}"] for k in ks], marker="o", color=f"C{j}",
                         label=f"{group} (n={full[group]['n']})")
        if "turns only" in modes:
            turns = modes["turns only"]
            for j, group in enumerate(g for g in groups if g in turns):
                ks = _ks(turns[group])
                per_cat.plot(ks, [turns[group][f"R@{k}"] for k in ks], color=f"C{j}",
                             linestyle=":", linewidth=1)
        title = f"{name}: {row['questions']} questions over {row['turns']:,} turns"
        for ax, what in ((per_mode, "per mode"),
                         (per_cat, "full pipeline per category (dotted: turns only)")):
            ax.set_xscale("log")
            ax.set_xticks(ks, [str(k) for k in ks])
            ax.minorticks_off()
            ax.set_ylim(0, 1)
            ax.set_xlabel("k (turns returned)")
            ax.set_ylabel("recall@k (evidence turns found)")
            ax.set_title(f"{title}\n{what}", fontsize=9)
            ax.legend(loc="lower right")
        if "latency_limit_10" in row:
            ll = row["latency_limit_10"]
            _cdf(lat, ll["full pipeline"], "full pipeline", "ms")
            _cdf(lat, ll["turns only"], "turns only (baseline)", "ms", **BASELINE)
            lat.set_title(f"{name}: recall(limit=10), same store, interleaved\n"
                          f"p50 ratio {ll['p50_ratio']:.2f}", fontsize=9)
        else:
            lat.set_visible(False)
    return fig


def recall_latency(r: dict[str, Any]) -> Figure:
    rows = [(name, row) for name, row in r.items() if isinstance(row, dict)
            and any(isinstance(v, dict) and "cdf" in v for v in row.values())]
    fig, axes = _panels(len(rows), "Recall latency at scale (Engine.recall end to end, query "
                                   "embedding included)")
    labels = {"exact_scan": "exact scan", "graph": "hnswlib graph",
              "after_restart": "graph, after a restart", "cold_users": "each user's first query",
              "warm_users": "users already loaded"}
    for ax, (name, row) in zip(axes, rows, strict=True):
        for j, (key, dist) in enumerate((k, v) for k, v in row.items()
                                        if isinstance(v, dict) and "cdf" in v):
            _cdf(ax, dist, labels.get(key, key), "ms", color=f"C{j}")
        scope, _, n = name.rpartition("_")
        where = {"one_user": "in one user", "across_users": "across users"}.get(scope, scope)
        ax.set_title(f"{int(n):,} memories {where}")
    return fig


def embed(r: dict[str, Any]) -> Figure:
    variants = [k for k, v in r.items() if isinstance(v, dict) and "query_bare" in v]
    fig, (query, batch) = _panels(2, "Embedding: the Embedder actor against bare onnxruntime, "
                                     "same inputs, same process")
    for j, v in enumerate(variants):
        _cdf(query, r[v]["query_actor"], f"{v} through the actor", "ms", color=f"C{j}")
        _cdf(query, r[v]["query_bare"], f"{v} bare (baseline)", "ms", color=f"C{j}",
             linestyle="--")
    query.set_title("one query text at a time")
    labels, values = [], []
    for v in variants:
        labels += [f"{v}\nbare", f"{v}\nactor"]
        values += [r[v]["batch_bare_per_s"], r[v]["batch_actor_per_s"]]
    bars = batch.bar(labels, values, color=[c for j in range(len(variants))
                                            for c in (BASELINE["color"], f"C{j}")])
    batch.bar_label(bars, labels=[_num(v) for v in values], fontsize=8)
    batch.tick_params(axis="x", labelsize=7)
    batch.set_ylabel("sentences/s")
    batch.set_title("batches of 32 turns")
    return fig


def embed_throughput(r: dict[str, Any]) -> Figure:
    lags = r.get("lag", [])
    fig, (lag, behind, rate) = _panels(3, "Background embedding: vector lag while add_turn runs "
                                          "at a fixed rate, and the follower's rate")
    for j, row in enumerate(lags):
        t = [s[0] for s in row["samples"]]
        label = f"{row['rate']:g} turns/s (achieved {row['achieved_rate']:,.0f})"
        lag.plot(t, [s[2] for s in row["samples"]], marker=".", color=f"C{j}", label=label)
        behind.plot(t, [max(s[1], 1) for s in row["samples"]], marker=".", color=f"C{j}",
                    label=label)
        # Where it stood when ingest stopped (the samples are taken each second before it).
        lag.plot([row["seconds"]], [row["lag_at_end_s"]], marker="x", color=f"C{j}")
        behind.plot([row["seconds"]], [max(row["lag_at_end_records"], 1)], marker="x",
                    color=f"C{j}")
        for ax in (lag, behind):
            ax.axvline(row["seconds"], color=f"C{j}", linewidth=0.6, linestyle=":")
    lag.set_ylabel("vector lag (s)")
    behind.set_ylabel("records not yet embedded (log scale)")
    behind.set_yscale("log")
    for ax in (lag, behind):
        ax.set_xlabel("seconds since ingest began (x: when it ended)")
        ax.legend(loc="upper left")
    lag.set_title("vector lag over time, per ingest rate\n(age of the oldest turn not yet "
                  "embedded)", fontsize=9)
    behind.set_title("backlog over time, per ingest rate")
    variants = [k for k, v in r.items() if isinstance(v, dict) and "texts_per_s" in v]
    _bars(rate, ["bare onnxruntime,\nformer batching"] + [f"follower,\n{v}" for v in variants],
          [r["baseline_texts_per_s"]] + [r[v]["texts_per_s"] for v in variants], "texts/s",
          baseline=0)
    rate.set_title(f"embedding a backlog of {r['turns']:,} {r['source']}", fontsize=9)
    return fig


def embed_quality(r: dict[str, Any]) -> Figure:
    variants = [k for k, v in r.items() if isinstance(v, dict) and "recall@10_micro" in v]
    fig, (ax,) = _panels(1, "Vector recall@10 per model variant (LoCoMo dev, turns only)",
                         width=7)
    _bars(ax, [f"{v}\nmicro" for v in variants] + [f"{v}\nper question" for v in variants],
          [r[v]["recall@10_micro"] for v in variants] + [r[v]["recall@10_mean"]
                                                         for v in variants], "recall@10")
    ax.set_ylim(0, 1)
    return fig


def snapshot(r: dict[str, Any]) -> Figure:
    sizes = r["sizes"]
    fig, (times, during) = _panels(2, "Snapshot and restore against store size")
    n = [s["memories"] for s in sizes]
    for key, label in (("snapshot_s", "snapshot (while ingest runs)"),
                       ("restore_s", "restore (verify + install)"),
                       ("first_answer_s", "restore + open + first recall")):
        times.plot(n, [s[key] for s in sizes], marker="o", label=label)
    for s in sizes:
        times.annotate(f"{s['snapshot_bytes'] / 1e6:,.0f} MB", (s["memories"], s["snapshot_s"]),
                       textcoords="offset points", xytext=(0, 6), fontsize=7, ha="center")
    times.set_xscale("log")
    times.set_xticks(n, [f"{x:,}" for x in n])
    times.minorticks_off()
    times.set_xlabel("memories in the store (log scale)")
    times.set_ylabel("seconds")
    times.set_ylim(bottom=0)
    times.legend(loc="upper left")
    times.set_title("time against store size (labels: snapshot bytes)")
    largest = sizes[-1]
    _cdf(during, largest["ingest_during_snapshot"], "during the snapshot", "us")
    _cdf(during, largest["baseline_ingest"], "before it (baseline)", "us", **BASELINE)
    during.set_title(f"add_turn at {r.get('args', {}).get('rate', 2000):g}/s, "
                     f"{largest['memories']:,} memories: p99 ratio {largest['p99_ratio']:.2f}")
    return fig


def crash(r: dict[str, Any]) -> Figure:
    summary, each = r["summary"], r["each"]
    fig, (totals, runs) = _panels(2, f"kill -9 at random moments: {r['runs']} runs, "
                                     f"seed {r['seed']}")
    phases = list(summary)
    found = [summary[p].get("found", 0) for p in phases]
    lost = [summary[p]["lost"] for p in phases]
    totals.bar(phases, found, color="C2", label="acknowledged turns found after the kill")
    bars = totals.bar(phases, lost, bottom=found, color="C3", label="acknowledged turns lost")
    notes = []
    for p in phases:
        s = summary[p]
        note = f"lost {s['lost']}\nopened {s['opened']}/{s['runs']}"
        if s.get("snapshots_restored"):
            ok = s["snapshots_restored"] - s.get("snapshots_missing_turns", 0)
            note += f"\nsnapshots {ok}/{s['snapshots_restored']}"
        notes.append(note)
    totals.bar_label(bars, labels=notes, fontsize=7)
    totals.set_ylim(0, max(1, *(f + l for f, l in zip(found, lost, strict=True))) * 1.35)
    totals.set_ylabel("acknowledged turns, all runs of the phase")
    totals.legend(loc="upper right")
    totals.set_title("per phase")
    for j, phase in enumerate(phases):
        mine = [e for e in each if e["phase"] == phase]
        good = [e for e in mine if e.get("opened") and not e.get("lost")]
        bad = [e for e in mine if e not in good]
        runs.scatter([e["delay_s"] for e in good], [max(e["acknowledged"], 1) for e in good],
                     color=PHASE_COLORS[j % len(PHASE_COLORS)], marker=MARKERS[j % 6],
                     label=phase)
        if bad:
            runs.scatter([e["delay_s"] for e in bad], [max(e["acknowledged"], 1) for e in bad],
                         color="C3", marker="x", s=60, label=f"{phase}: lost or did not open")
    runs.set_yscale("log")
    runs.set_xlabel("kill after the phase was under way (s)")
    runs.set_ylabel("acknowledged turns that must survive (log)")
    runs.legend(loc="lower right")
    runs.set_title("each run (a red x: a turn lost or a store that did not open)")
    return fig


def forget(r: dict[str, Any]) -> Figure:
    fig, (lat, size) = _panels(2, f"forget_session + flush against add_turn + flush, "
                                  f"{r['memories']:,} turns over {r['users']} users")
    _cdf(lat, r["forget_and_flush"], "forget_session + flush", "ms")
    _cdf(lat, r["add_and_flush"], "add_turn + flush (baseline)", "ms", **BASELINE)
    ratio = r["forget_and_flush"]["p50_ms"] / r["add_and_flush"]["p50_ms"]
    lat.set_title(f"{r['turns_per_forgotten_session']} turns a session; p50 ratio {ratio:.1f}x")
    _bars(size, ["before", "after"], [r["data_mdb_bytes_before"] / 1e6,
                                      r["data_mdb_bytes_after"] / 1e6], "data.mdb (MB)",
          baseline=0)
    size.set_title(f"store size around {r['rounds']} forgets")
    return fig


def rebuild(r: dict[str, Any]) -> Figure:
    fig, (ax,) = _panels(1, f"Text index at open, {r['memories']:,} memories "
                            f"({r['index_bytes'] / 1e6:.1f} MB index)", width=8)
    cases = [("intact", "intact"), ("missing", "fulltext/ deleted"),
             ("one_byte_damaged", "one byte flipped")]
    labels = [label for _, label in cases]
    opened = [r[key]["open_s"] for key, _ in cases]
    ready = [r[key]["ready_s"] - r[key]["open_s"] for key, _ in cases]
    ax.barh(labels, opened, height=0.5, color=BASELINE["color"], label="Engine.open")
    bars = ax.barh(labels, ready, left=opened, height=0.5, color="C0",
                   label="then until recall no longer flags bm25")
    ax.bar_label(bars, labels=[f"{r[k]['ready_s']:.2f} s ({r[k]['flagged_recalls']} flagged)"
                               for k, _ in cases], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds from open")
    ax.set_xlim(0, max(r[k]["ready_s"] for k, _ in cases) * 1.4)  # room for the labels
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), ncols=2)
    ax.set_title(f"footer check of every segment: {r['check_index_s'] * 1000:.0f} ms "
                 f"({r['check_mb_per_s']} MB/s)", fontsize=9)
    return fig


def bridges(r: dict[str, Any]) -> Figure:
    facades = [f for f in ("native", "asyncio", "aio-thread", "sync") if f in r]
    calls = [c for c in ("add_turn", "add_turn_nowait", "history", "recall")
             if any(c in r[f] for f in facades)]
    fig, axes = _panels(len(calls), "The asyncio and blocking facades against native trio "
                                    "(dashed), same calls, fresh stores")
    names = {"native": "native trio (baseline)", "asyncio": "engine.aio (guest mode)",
             "aio-thread": "engine.aio (trio on its own thread)", "sync": "engine.sync"}
    for ax, call in zip(axes, calls, strict=True):
        for j, facade in enumerate(facades):
            if call in r[facade]:
                style = BASELINE if facade == "native" else {"color": f"C{j}"}
                _cdf(ax, r[facade][call], names[facade], "us", **style)
        ax.set_title(call)
    return fig


def http(r: dict[str, Any]) -> Figure:
    mixes = r["mixes"]
    fig, (rate, ingest_ax, recall_ax) = _panels(3, "HTTP: concurrent clients against engram-trio "
                                                   "serve and a trivial app on the same stack, "
                                                   "each mix in the same run")
    names = list(mixes)
    width = 0.38
    for i, (side, label) in enumerate((("trivial_app", "trivial FastAPI app"),
                                       ("http", "engram-trio serve"))):
        xs = [j + (i - 0.5) * width for j in range(len(names))]
        bars = rate.bar(xs, [mixes[m][side]["req_per_s"] for m in names], width, label=label,
                        color=BASELINE["color"] if i == 0 else "C0")
        rate.bar_label(bars, labels=[_num(mixes[m][side]["req_per_s"]) for m in names],
                       fontsize=7)
    rate.set_xticks(range(len(names)),
                    [f"{m}\n{mixes[m]['http']['req_per_s'] / mixes[m]['trivial_app']['req_per_s']:.2f}x"
                     for m in names], fontsize=8)
    rate.set_ylabel("requests/s")
    rate.legend(fontsize=7)
    a = r.get("args", {})
    rate.set_title(f"{a.get('clients', '?')} clients, {a.get('seconds', '?')} s a mix",
                   fontsize=9)
    # Each kind's latency from the mix that sends only it, against the trivial app's there.
    for ax, kind in ((ingest_ax, "ingest"), (recall_ax, "recall")):
        _cdf(ax, mixes[kind]["http"][kind], "over HTTP", "ms")
        _cdf(ax, mixes[kind]["trivial_app"][kind], "trivial app (baseline)", "ms", **BASELINE)
        _cdf(ax, r["in_process"][kind], "in-process, native trio", "ms", color="C2")
        ax.set_title(f"{kind} only: latency")
    return fig


def durable(r: dict[str, Any]) -> Figure:
    a = r["args"]
    raw = "burst_raw" in r  # runs before the burst phase waited for the burst's own commit
    fig, (steady, burst) = _panels(2, "Durable add_turn against bare LMDB commits + fsync "
                                      + ("measured before and after it" if raw
                                         else "measured just before it"))
    _cdf(steady, r["steady"], f"add_turn durable, {a['writers']} writers", "us")
    if "ideal" in r:  # runs before the ideal group commit was measured lack it
        _cdf(steady, r["ideal"], "the same arrivals, bare group commit (ideal)", "us")
    if "loaded" in r:  # nor the ideal beside an engine's work
        _cdf(steady, r["loaded"], "the ideal beside an engine taking the same rate", "us")
    _cdf(steady, r["steady_floor"], "bare LMDB commit + fsync (floor)", "us", **BASELINE)
    steady.set_title(f"steady, {a['rate']:g} turns/s in all: p99 {r['steady']['ratio_p99']:.2f}x")
    _cdf(burst, r["burst"], f"{a['burst_writers']} durable after {a['burst_turns']:,} buffered"
                            + (" committed" if raw else ""), "us")
    if raw:
        _cdf(burst, r["burst_raw"], f"{a['burst_writers']} durable the moment add_turns "
                                    "returned", "us")
    _cdf(burst, r["burst_floor"], "bare LMDB commit + fsync (floor)", "us", **BASELINE)
    burst.set_title(f"after bursts ({a['bursts']}): p99 {r['burst']['ratio_p99']:.2f}x")
    return fig


def memory(r: dict[str, Any]) -> Figure:
    rows = r["results"]
    fig, (ax,) = _panels(1, "Resident memory growth of a loaded engine against raw (vectors as "
                            "float32 + texts)", width=8)
    labels = [f"{x['memories']:,} memories\n{x['users']:,} user(s)" for x in rows]
    width, mib = 0.25, 1 << 20
    for i, (key, name) in enumerate((("raw_bytes", "raw"), ("anon_growth", "RSS: anonymous"),
                                     ("file_growth", "RSS: file pages (maps)"))):
        xs = [j + (i - 1) * width for j in range(len(rows))]
        bars = ax.bar(xs, [x[key] / mib for x in rows], width,
                      color=BASELINE["color"] if i == 0 else f"C{i - 1}", label=name)
        ax.bar_label(bars, labels=[_num(x[key] / mib) for x in rows], fontsize=7)
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylabel("MiB")
    ax.legend(fontsize=7)
    return fig


def cluster(r: dict[str, Any]) -> Figure:
    fig, (ack, lag, rate) = _panels(3, f"Cluster mode: writes and reads through a node against "
                                       f"the bare log and the single process (sync_interval "
                                       f"{r['sync']}), same run")
    _cdf(ack, r["bare_puback"], "bare R3 PubAck (baseline)", "ms", **BASELINE)
    _cdf(ack, r["bridge_puback"], "publish from trio via the asyncio thread", "ms", color="C0")
    _cdf(ack, r["durable_add_turn"], "add_turn(durable=True) via a node", "ms", color="C1")
    _cdf(ack, r["single_durable"], "single process, durable (fsynced LMDB)", "ms", color="C2")
    ack.set_title(f"durable ack: p50 {r['durable_over_bare_p50_ms']:+.2f} ms, p99 "
                  f"{r['durable_over_bare_p99_ratio']:.2f}x the bare PubAck", fontsize=9)
    _cdf(lag, r["ryw_single"], "single process: write + recall (baseline)", "ms", **BASELINE)
    _cdf(lag, r["write_to_applied"], f"publish -> applied on the owner, {r['rate']:g}/s", "ms",
         color="C0")
    _cdf(lag, r["ryw_cluster"], "write -> recall after the owner's watermark", "ms",
         color="C1")
    lag.set_title("read-your-writes", fontsize=9)
    _bars(rate, ["R3 publishes in flight", "buffered add_turn via a node", "single process"],
          [r["bare_async_rate"], r["buffered_rate"], r["single_rate"]], "turns/s", baseline=0)
    rate.set_title(f"ingest: buffered {r['buffered_over_bare_async']:.2f}x the in-flight "
                   "publishes", fontsize=9)
    return fig


def cluster_faults(r: dict[str, Any]) -> Figure:
    s, a = r["summary"], r["args"]
    panels = 3 if "ryw" in r else 2
    fig, axes = _panels(panels, f"Cluster faults: {s['runs']} runs of {a['writers']} writers at "
                                f"{a['rate']:g} turns/s for {a['seconds']:g} s, kill -9 of log "
                                f"servers and nodes (lease TTL {a['ttl']:g} s)")
    times, runs = axes[0], axes[1]
    kinds = [("writes_back_s", "leader kill:\nwrites back"),
             ("claimed_s", "owner kill:\nclaimed"), ("caught_up_s", "owner kill:\ncaught up"),
             ("restart_s", "restart\n(within TTL?)")]
    for i, (key, label) in enumerate(kinds):
        values = s.get(key) or []
        times.scatter([i] * len(values), values, color=f"C{i}", alpha=0.7, s=18)
        if values:
            times.annotate(f"max {max(values):.1f}", (i, max(values)), fontsize=7,
                           textcoords="offset points", xytext=(6, 0))
    times.axhline(a["ttl"], **BASELINE, label=f"lease TTL {a['ttl']:g} s")
    times.set_xticks(range(len(kinds)), [label for _, label in kinds], fontsize=7)
    times.set_ylabel("seconds")
    times.legend(fontsize=7)
    times.set_title("failover times, one dot per run", fontsize=9)
    each = r["each"]
    xs = [e["run"] for e in each]
    runs.bar(xs, [e["acked_turns"] for e in each],
             color=["C0" if e["kind"] == "leader" else "C1" for e in each])
    runs.set_xticks(xs, [str(x) for x in xs])
    runs.set_xlabel("run (blue: leader server killed, orange: owner node killed)")
    runs.set_ylabel("acknowledged turns")
    runs.set_title(f"{s['acked_turns']:,} acknowledged: {s['lost']} lost, {s['duplicated']} "
                   f"duplicated, {s['users_unlike_log']} users unlike the log", fontsize=9)
    if "ryw" in r:
        w = r["ryw"]
        _cdf(axes[2], w["read_plain"], "read without min_seq (baseline)", "ms", **BASELINE)
        _cdf(axes[2], w["read_min_seq"], "read with min_seq = the write's log_seq", "ms",
             color="C0")
        axes[2].set_title(f"read-your-writes: {w['found']:,} of {w['pairs']:,} found, "
                          f"{w['retried']} reads repeated", fontsize=9)
    return fig


DRAWERS: dict[str, Callable[[dict[str, Any]], Figure]] = {
    "ingest": ingest, "recall-quality": recall_quality, "recall-latency": recall_latency,
    "embed": embed, "embed-throughput": embed_throughput, "embed-quality": embed_quality,
    "snapshot": snapshot, "crash": crash, "forget": forget, "rebuild": rebuild,
    "bridges": bridges, "http": http, "durable": durable, "memory": memory,
    "cluster": cluster, "cluster-faults": cluster_faults,
}
