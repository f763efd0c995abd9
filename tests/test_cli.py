"""The engram command: results on stdout (JSON on request), errors on stderr, exit codes."""

from __future__ import annotations

import json

import pytest
import trio

from engine.__main__ import main

from .conftest import open_engine


@pytest.fixture
def store(tmp_path):
    async def fill() -> None:
        async with open_engine(tmp_path / "store") as mem:
            await mem.add_turn("ana", "s1", "user", "I moved to Lisbon")
            await mem.add_turn("ana", "s1", "assistant", "Welcome to Lisbon!")
            await mem.add_turn("bo", "x", "user", "hello")
            await mem.flush()

    trio.run(fill)
    return tmp_path / "store"


def _json(capsys) -> dict:
    return json.loads(capsys.readouterr().out)


def test_stats_and_inspect_print_json(store, capsys) -> None:
    """stats counts the store; inspect shows a user's sessions and latest turns, no one else's."""
    assert main(["stats", str(store), "--json"]) == 0
    stats = _json(capsys)
    assert (stats["users"], stats["sessions"], stats["turns"]) == (2, 2, 3)
    assert main(["inspect", str(store), "--user", "ana", "--json"]) == 0
    report = _json(capsys)
    (session,) = report["sessions"]
    assert session["session_id"] == "s1"
    assert [t["text"] for t in session["latest"]] == ["I moved to Lisbon", "Welcome to Lisbon!"]
    (fact,) = report["facts"]
    assert (fact["key"], fact["value"], fact["origin"]) == ("location", "Lisbon", "rules")
    assert report["episodes"] == [] and report["counts"]["turns"] == 2


def test_snapshot_restore_round_trip_and_refusals(store, tmp_path, capsys) -> None:
    """snapshot then restore gives back the same turns; restoring over a store is refused with
    exit code 1 and a message that says how to go on."""
    assert main(["snapshot", str(store), str(tmp_path / "snap"), "--json"]) == 0
    manifest = _json(capsys)
    # Three turns, and the fact "Lives in Lisbon" the rules extracted from one of them.
    assert manifest["lsn"] == 4 and manifest["counts"]["turns"] == 3
    assert main(["restore", str(tmp_path / "snap"), str(tmp_path / "restored"), "--json"]) == 0
    assert _json(capsys)["turns"] == 3
    assert main(["restore", str(tmp_path / "snap"), str(tmp_path / "restored")]) == 1
    err = capsys.readouterr().err
    assert "engram-trio restore: InvalidInput: store_path: expected a new or empty directory" in err
    assert "overwrite=True" in err
    assert main(["restore", str(tmp_path / "snap"), str(tmp_path / "restored"), "--overwrite"]) == 0


def test_compact_and_a_missing_store(store, tmp_path, capsys) -> None:
    """compact reports what it did; a path without a store is an error, not a new store."""
    assert main(["compact", str(store), "--json"]) == 0
    assert set(_json(capsys)) == {"store_bytes_before", "store_bytes_after", "fulltext_rebuilt"}
    assert main(["stats", str(tmp_path / "nowhere")]) == 1
    assert "expected an Engram store, found no data.mdb" in capsys.readouterr().err
    assert not (tmp_path / "nowhere").exists()


def test_a_wrong_command_line_exits_2(capsys) -> None:
    """argparse's usage errors keep their exit code."""
    with pytest.raises(SystemExit) as info:
        main(["bench", "nonsense"])
    assert info.value.code == 2
