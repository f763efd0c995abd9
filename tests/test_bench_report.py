"""`python -m bench report` draws every bench's picture from its JSON alone."""

import importlib
import json
import random
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

pytest.importorskip("matplotlib", reason="the bench extra: pip install -e '.[bench]'")

REPO = Path(__file__).resolve().parents[1]
bench_main = importlib.import_module("bench.__main__")  # puts bench/ on sys.path
plots = importlib.import_module("_plots")
from _report import percentiles  # noqa: E402

SEED = 20261123


def dist(rng: random.Random, median: float, unit: str, n: int = 200) -> dict:
    """A latency distribution as the benches record it, from seeded log-normal samples."""
    return percentiles([rng.lognormvariate(0, 0.6) * median for _ in range(n)], 1.0, unit)


def fixtures() -> dict[str, dict]:
    """The smallest results of each bench that its drawer takes, with the keys it writes."""
    rng = random.Random(SEED)
    print(f"seed {SEED}")
    modes = {mode: {"all": {"R@5": 0.5, "R@10": 0.6, "R@20": 0.7, "R@50": 0.8, "n": 4},
                    "temporal": {"R@5": 0.4, "R@10": 0.5, "R@20": 0.7, "R@50": 0.9, "n": 2},
                    "single-hop": {"R@5": 0.6, "R@10": 0.7, "R@20": 0.7, "R@50": 0.7, "n": 2},
                    "query_ms": 5.0} for mode in ("bm25 only", "turns only", "full pipeline")}
    us = {call: dist(rng, 50, "us") for call in ("add_turn", "history", "recall")}
    return {
        "ingest": {"args": {"rate": 2000, "writers": 8, "durable_rate": 500},
                   "buffered": dist(rng, 15, "us"),
                   "buffered_without_long_term": dist(rng, 17, "us"),
                   "durable": dist(rng, 2000, "us"), "baseline_commit": dist(rng, 400, "us"),
                   "baseline_lmdb_turns_per_s": 200_000.0,
                   "bulk": {"turns": 1000, "turns_per_s": 50_000.0, "ratio_to_bare_lmdb": 0.25}},
        "recall-quality": {"locomo/bulk": {
            "turns": 100, "questions": 4, "modes": modes,
            "latency_limit_10": {"turns only": dist(rng, 7, "ms"),
                                 "full pipeline": dist(rng, 7, "ms"), "p50_ratio": 1.0}}},
        "recall-latency": {"one_user_10000": {"setup_s": 1.0,
                                              "exact_scan": dist(rng, 8, "ms")},
                           "across_users_100000": {"setup_s": 9.0,
                                                   "cold_users": dist(rng, 19, "ms"),
                                                   "warm_users": dist(rng, 8, "ms")}},
        "embed": {"q8": {"query_bare": dist(rng, 4, "ms"), "query_actor": dist(rng, 5, "ms"),
                         "batch_bare_per_s": 100.0, "batch_actor_per_s": 99.0}},
        "embed-throughput": {
            "source": "generated turns", "turns": 64, "baseline_texts_per_s": 60.0,
            "q8": {"texts_per_s": 110.0},
            "lag": [{"rate": rate, "achieved_rate": rate, "seconds": 3.0,
                     "lag_at_end_s": 2.0, "lag_at_end_records": int(rate),
                     "samples": [[t, int(rate * t / 2), t / 2] for t in (1.0, 2.0, 3.0)]}
                    for rate in (100.0, 500.0)]},
        "embed-quality": {"q8": {"recall@10_micro": 0.45, "recall@10_mean": 0.47}},
        "snapshot": {"args": {"rate": 2000}, "sizes": [
            {"memories": n, "snapshot_s": n / 2e5, "restore_s": n / 2.5e5,
             "first_answer_s": n / 2e5 + 1, "snapshot_bytes": n * 1400,
             "baseline_ingest": dist(rng, 20, "us"),
             "ingest_during_snapshot": dist(rng, 22, "us"), "p99_ratio": 1.1}
            for n in (10_000, 20_000)]},
        "crash": {"runs": 3, "seed": 11,
                  "summary": {"ingest": {"runs": 2, "killed_while_running": 2, "opened": 2,
                                         "found": 300, "lost": 0},
                              "forget": {"runs": 1, "killed_while_running": 1, "opened": 0,
                                         "found": 0, "lost": 0, "snapshots_restored": 1,
                                         "snapshots_missing_turns": 0}},
                  "each": [{"phase": "ingest", "delay_s": 0.5, "acknowledged": 300,
                            "opened": True, "lost": 0},
                           {"phase": "ingest", "delay_s": 2.5, "acknowledged": 0,
                            "opened": True, "lost": 0},
                           {"phase": "forget", "delay_s": 1.0, "acknowledged": 90,
                            "opened": False}]},
        "forget": {"memories": 1000, "users": 10, "rounds": 5,
                   "turns_per_forgotten_session": 10, "add_and_flush": dist(rng, 5, "ms"),
                   "forget_and_flush": dist(rng, 40, "ms"),
                   "data_mdb_bytes_before": 4_000_000, "data_mdb_bytes_after": 4_100_000},
        "rebuild": {"memories": 1000, "index_bytes": 100_000, "check_index_s": 0.002,
                    "check_mb_per_s": 50.0,
                    **{case: {"open_s": 0.1, "ready_s": 0.3, "flagged_recalls": 2}
                       for case in ("intact", "missing", "one_byte_damaged")}},
        "bridges": {"native": {**us, "add_turn_nowait": dist(rng, 5, "us")},
                    "asyncio": {**us, "add_turn_nowait": dist(rng, 9, "us")}, "sync": us},
        "http": {"mixes": {mix: {
                     "http": {"req_per_s": rate, **{kind: dist(rng, 30, "ms") for kind in kinds}},
                     "trivial_app": {"req_per_s": 1100.0,
                                     **{kind: dist(rng, 12, "ms") for kind in kinds}}}
                     for mix, rate, kinds in (("ingest", 800.0, ["ingest"]),
                                              ("recall", 150.0, ["recall"]),
                                              ("mixed", 300.0, ["ingest", "recall"]))},
                 "in_process": {"ingest": dist(rng, 0.03, "ms"), "recall": dist(rng, 1, "ms")},
                 "args": {"clients": 16, "seconds": 5}},
        "durable": {"args": {"rate": 500, "writers": 8, "bursts": 5, "burst_turns": 3000,
                             "burst_writers": 25},
                    "steady_floor": dist(rng, 400, "us"),
                    "steady": {**dist(rng, 900, "us"), "ratio_p99": 2.2},
                    "ideal": dist(rng, 500, "us"),
                    "burst_floor": dist(rng, 400, "us"),
                    "burst": {**dist(rng, 9000, "us"), "ratio_p99": 20.0}},
        "memory": {"results": [{"memories": n, "users": users, "raw_bytes": n * 1640,
                                "anon_growth": n * 2000, "file_growth": n * 900}
                               for n in (10_000, 100_000) for users in (1, 1000)]},
        "cluster": {"sync": "always", "n": 300, "rate": 500.0,
                    "bare_puback": dist(rng, 1.4, "ms"), "bridge_puback": dist(rng, 1.6, "ms"),
                    "durable_add_turn": dist(rng, 1.6, "ms"),
                    "single_durable": dist(rng, 2.0, "ms"),
                    "write_to_applied": dist(rng, 6, "ms"), "ryw_cluster": dist(rng, 14, "ms"),
                    "ryw_single": dist(rng, 9, "ms"), "bare_async_rate": 7000.0,
                    "buffered_rate": 3000.0, "single_rate": 1700.0,
                    "durable_over_bare_p50_ms": 0.2, "durable_over_bare_p99_ratio": 1.4,
                    "buffered_over_bare_async": 0.43},
        "cluster-faults": {
            "args": {"writers": 8, "rate": 750.0, "seconds": 40.0, "ttl": 5.0},
            "each": [{"run": i, "kind": ("leader", "owner")[i % 2], "acked_turns": 29_000}
                     for i in range(4)],
            "summary": {"runs": 4, "acked_turns": 116_000, "lost": 0, "duplicated": 0,
                        "users_unlike_log": 0, "writes_back_s": [5.1, 6.2],
                        "claimed_s": [5.4, 5.9], "caught_up_s": [6.0, 6.3],
                        "restart_s": [3.0, 3.5, 4.1, 4.0]},
            "ryw": {"pairs": 1000, "found": 1000, "retried": 3,
                    "read_min_seq": dist(rng, 8, "ms"), "read_plain": dist(rng, 7, "ms")}},
    }


def assert_svg(path: Path) -> None:
    """A well-formed SVG document with a size and something drawn in it."""
    root = ET.parse(path).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    assert re.fullmatch(r"[\d.]+pt", root.attrib["width"])
    assert re.fullmatch(r"[\d.]+pt", root.attrib["height"])
    assert len(list(root.iter("{http://www.w3.org/2000/svg}path"))) > 10


def test_every_bench_has_a_fixture_and_a_drawer() -> None:
    """A bench added to the drawers without a fixture here (or the reverse) fails this test."""
    assert set(fixtures()) == set(plots.DRAWERS)


def test_report_draws_a_valid_picture_beside_each_json(tmp_path) -> None:
    """Each bench's JSON in a folder gets an SVG of the same name beside it."""
    for name, results in fixtures().items():
        (tmp_path / f"{name}.json").write_text(json.dumps({"bench": name, **results}))
    written = bench_main.report([tmp_path])
    assert sorted(p.name for p in written) == sorted(f"{name}.svg" for name in fixtures())
    for path in written:
        assert_svg(path)


def test_the_same_json_draws_the_same_bytes(tmp_path) -> None:
    """A redraw of unchanged results leaves the picture unchanged (no dates, fixed ids)."""
    source = tmp_path / "forget.json"
    source.write_text(json.dumps({"bench": "forget", **fixtures()["forget"]}))
    first = plots.draw(source).read_bytes()
    assert plots.draw(source).read_bytes() == first


def test_json_of_no_known_bench_is_refused_with_the_names_expected(tmp_path) -> None:
    """A JSON file no bench wrote gets an error naming the benches that can be drawn."""
    (tmp_path / "other.json").write_text(json.dumps({"bench": "nonsense"}))
    with pytest.raises(ValueError, match=r"expected results of one of the benches .*ingest.*"
                                         r"found 'nonsense'"):
        bench_main.report([tmp_path])


def test_report_on_an_empty_or_missing_folder_says_what_it_expected(tmp_path) -> None:
    with pytest.raises(SystemExit, match="expected bench JSON files in"):
        bench_main.report([tmp_path])
    with pytest.raises(SystemExit, match="found no folder at"):
        bench_main.report([tmp_path / "missing"])


def test_the_published_results_draw_and_the_readme_shows_each_picture(tmp_path) -> None:
    """docs/bench holds real bench JSON, each with its picture, and the README shows every
    one; the JSON draws (a copy, so the committed pictures stay as they are)."""
    published = sorted((REPO / "docs" / "bench").glob("*.json"))
    assert published, "docs/bench/ holds no bench JSON"
    readme = (REPO / "README.md").read_text()
    for source in published:
        assert source.with_suffix(".svg").is_file(), f"{source} has no picture beside it"
        assert f"docs/bench/{source.stem}.svg" in readme, f"README does not show {source.stem}"
        shutil.copy(source, tmp_path / source.name)
    for path in bench_main.report([tmp_path]):
        assert_svg(path)


def test_the_command_line_answers_help_and_draws_a_folder(tmp_path) -> None:
    """`python -m bench report --help` exits 0 and describes the command; given a folder, the
    command draws its JSON."""
    done = subprocess.run([sys.executable, "-m", "bench", "report", "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "Redraw every picture" in done.stdout
    (tmp_path / "rebuild.json").write_text(json.dumps({"bench": "rebuild",
                                                       **fixtures()["rebuild"]}))
    done = subprocess.run([sys.executable, "-m", "bench", "report", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert_svg(tmp_path / "rebuild.svg")
