"""The engram command: results on stdout (JSON on request), errors on stderr, exit codes."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import pytest

from engine.__main__ import human_bytes, human_duration, main


def _json(capsys) -> dict:
    return json.loads(capsys.readouterr().out)


def test_stats_and_inspect_print_json(store, capsys) -> None:
    """stats counts the store; inspect shows a user's sessions and latest turns, no one else's."""
    assert main(["stats", str(store), "--json"]) == 0
    stats = _json(capsys)
    assert (stats["users"], stats["sessions"], stats["turns"]) == (2, 2, 3)
    assert main(["inspect", str(store), "--user", "ana", "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    head = lines[0]
    assert head["type"] == "user" and head["user_id"] == "ana" and head["counts"]["turns"] == 2
    (session,) = [line for line in lines if line["type"] == "session"]
    assert session["session_id"] == "s1"
    assert [t["text"] for t in session["latest"]] == ["I moved to Lisbon", "Welcome to Lisbon!"]
    (fact,) = [line for line in lines if line["type"] == "fact"]
    assert (fact["key"], fact["value"], fact["origin"]) == ("location", "Lisbon", "rules")
    assert not [line for line in lines if line["type"] == "episode"]


def test_inspect_prints_tables_for_people(store, capsys) -> None:
    """Without --json, inspect prints a header line and a table per kind."""
    assert main(["inspect", str(store), "--user", "ana"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ana  turns 2")
    assert "sessions" in out and "s1" in out and "#0 user: I moved to Lisbon" in out
    assert "location" in out and "Lisbon" in out and "episodes: none" in out


def test_durations_read_in_human_units() -> None:
    """Seconds become ms, s, min or h as their size asks; bytes B, KiB, MiB or GiB."""
    assert [human_duration(s) for s in (0.0042, 4.25, 83, 7260)] == [
        "4.2 ms", "4.25 s", "1 min 23 s", "2 h 01 min"]
    assert [human_bytes(n) for n in (512, 323584, 1_048_000, 10 << 20, 1000 << 20, 3 << 40)] == [
        "512 B", "316 KiB", "1023 KiB", "10 MiB", "1000 MiB", "3 TiB"]


def test_stats_read_in_human_units(store, capsys) -> None:
    """`stats` without --json: sizes and durations in units, lists as items, none as -."""
    assert main(["stats", str(store)]) == 0
    lines = dict(line.strip().split(": ", 1) for line in capsys.readouterr().out.splitlines())
    assert lines["store_bytes"].endswith(("KiB", "MiB")) and lines["turns"] == "3"
    assert lines["vector_lag_seconds"].endswith(("ms", " s")) and lines["durable_stages"] == "-"
    assert "(" not in lines["degraded"] and lines["text_index_rebuilt"] == "-"


def test_a_closed_pipe_ends_quietly(store) -> None:
    """`engram-trio inspect ... | head -c 1`: exit 141, no traceback on stderr."""
    with subprocess.Popen([sys.executable, "-m", "engine", "inspect", str(store),
                           "--user", "ana", "--json"], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE) as process:
        process.stdout.close()  # the reader is gone before a byte is written
        err = process.stderr.read()
        process.wait(timeout=60)
    assert process.returncode == 141 and b"Traceback" not in err and b"Exception" not in err


def _interruptible() -> None:
    """In a child about to get SIGINT: the disposition a terminal's Ctrl-C meets. A suite run
    in the background (`nohup ... &`) hands its children SIGINT ignored, which the command
    rightly keeps, and these tests would then wait for an interrupt that never comes."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


# Ctrl-C that lands while the command imports trio (a finder on the import path sends it).
_INTERRUPTED_IMPORT = """
import importlib.abc, os, runpy, signal, sys
class Interrupt(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "trio":
            os.kill(os.getpid(), signal.SIGINT)
        return None
sys.meta_path.insert(0, Interrupt())
sys.argv = ["engram-trio", "stats", sys.argv[1]]
runpy.run_module("engine", run_name="__main__", alter_sys=True)
"""


def test_ctrl_c_during_the_first_imports_exits_130_without_a_traceback(tmp_path) -> None:
    """The first second of a command is its imports: Ctrl-C there exits as it does later."""
    done = subprocess.run([sys.executable, "-c", _INTERRUPTED_IMPORT, str(tmp_path / "s")],
                          capture_output=True, timeout=60,
                          preexec_fn=_interruptible)
    assert done.returncode == 130 and b"Traceback" not in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "s").exists()  # stopped before the command ran


# Ctrl-C while the command line is parsed: the parser imports the cluster's modules (nats,
# pydantic, FastAPI), half a second more of imports after the first ones.
_INTERRUPTED_PARSE = _INTERRUPTED_IMPORT.replace('name == "trio"', 'name == "engine.cluster"')


def test_ctrl_c_while_the_command_line_is_parsed_exits_130(tmp_path) -> None:
    """The imports the parser makes are cut short as quietly as the first ones."""
    done = subprocess.run([sys.executable, "-c", _INTERRUPTED_PARSE, str(tmp_path / "s")],
                          capture_output=True, timeout=60,
                          preexec_fn=_interruptible)
    assert done.returncode == 130 and b"Traceback" not in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "s").exists()


def _interrupted(argv: list[str], ready: str, within: float = 60) -> str:
    """Run ``argv``; once a line of its stderr holds ``ready``, Ctrl-C (SIGINT): it must exit
    130 within ``within`` seconds, with no traceback. Returns its stderr after that line."""
    with subprocess.Popen(argv, stderr=subprocess.PIPE, text=True,
                          preexec_fn=_interruptible) as process:
        try:
            for line in process.stderr:
                if ready in line:
                    break
            process.send_signal(signal.SIGINT)
            rest = process.stderr.read()
            assert process.wait(timeout=within) == 130, rest
        finally:
            if process.poll() is None:
                process.kill()
    assert "Traceback" not in rest
    return rest


def test_serve_stops_on_ctrl_c_with_exit_130(tmp_path) -> None:
    """SIGINT stops `serve` gracefully: the engine closes, exit 130, no traceback."""
    _interrupted([sys.executable, "-m", "engine", "serve", str(tmp_path / "s"), "--port", "0"],
                 "serving")


# serve whose engine takes 30 s to open (a model loading on a slow disk): Ctrl-C meanwhile.
_SLOW_OPEN = """
import contextlib, runpy, sys, trio
import engine._server as server
real = server.Engine.open
@contextlib.asynccontextmanager
async def slow(*args, **kwargs):
    print("opening", file=sys.stderr, flush=True)
    await trio.sleep(30)
    async with real(*args, **kwargs) as mem:
        yield mem
server.Engine.open = slow
sys.argv = ["engram-trio", "serve", sys.argv[1], "--port", "0"]
runpy.run_module("engine", run_name="__main__", alter_sys=True)
"""


def test_ctrl_c_while_serve_opens_its_engine_stops_it_at_once(tmp_path) -> None:
    """The signals a serving server absorbs until its drain is done are held only once it
    serves: while the engine opens, Ctrl-C stops the command at once, exit 130."""
    rest = _interrupted([sys.executable, "-c", _SLOW_OPEN, str(tmp_path / "s")], "opening",
                        within=20)
    assert "serving" not in rest


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_serve_signalled_twice_still_drains_what_it_acknowledged(tmp_path, signum,
                                                                 capsys) -> None:
    """A process manager (or an impatient kill) signals twice: the first stops the server,
    which lets the request in flight finish (1,000 turns, answered 202 once buffered); the
    second came after trio's signal receiver had closed, so SIGTERM had its default action
    back and killed the process before the engine drained those turns. Every later signal
    is absorbed until the engine has closed: exit 0 (130 for SIGINT), every turn there."""
    store = tmp_path / "s"
    with subprocess.Popen([sys.executable, "-m", "engine", "serve", str(store), "--port",
                           "0"], stderr=subprocess.PIPE, text=True,
                          preexec_fn=_interruptible) as process:
        try:
            for line in process.stderr:
                if "serving" in line:
                    break
            host, port = line.split(" on http://", 1)[1].split()[0].rstrip(",").rsplit(":", 1)
            body = json.dumps({"turns": [{"session_id": "s", "role": "user",
                                          "text": f"turn {i} " + "x" * 200}
                                         for i in range(1000)]}).encode()
            with socket.create_connection((host, int(port))) as held:
                held.sendall(b"POST /v1/users/ana/turns HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                             b"Content-Length: %d\r\n\r\n" % len(body) + body[:10])
                time.sleep(0.3)
                process.send_signal(signum)  # the held request is in flight
                time.sleep(0.5)
                held.sendall(body[10:])
                answer = b""
                while b"\r\n\r\n" not in answer:
                    answer += held.recv(65536)
                process.send_signal(signum)  # as soon as the 202 came
            assert answer.startswith(b"HTTP/1.1 202"), answer
            rest = process.stderr.read()
            assert process.wait(timeout=60) == (130 if signum == signal.SIGINT else 0), rest
        finally:
            if process.poll() is None:
                process.kill()
    assert "Traceback" not in rest
    assert main(["stats", str(store), "--json"]) == 0
    assert _json(capsys)["turns"] == 1000


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
    assert "overwrite=True (--overwrite on the command line)" in err
    assert main(["restore", str(tmp_path / "snap"), str(tmp_path / "restored"), "--overwrite"]) == 0


def test_compact_and_a_missing_store(store, tmp_path, capsys) -> None:
    """compact reports what it did; a path without a store is an error, not a new store."""
    assert main(["compact", str(store), "--json"]) == 0
    assert set(_json(capsys)) == {"store_bytes_before", "store_bytes_after", "fulltext_rebuilt"}
    assert main(["stats", str(tmp_path / "nowhere")]) == 1
    assert "expected an Engram store, found no data.mdb" in capsys.readouterr().err
    assert not (tmp_path / "nowhere").exists()
    (tmp_path / "a-file").write_text("notes")
    assert main(["stats", str(tmp_path / "a-file")]) == 1
    assert "expected an Engram store, found a file, not a directory, at" in (
        capsys.readouterr().err)


def test_a_wrong_command_line_exits_2(capsys) -> None:
    """argparse's usage errors keep their exit code."""
    with pytest.raises(SystemExit) as info:
        main(["bench", "nonsense"])
    assert info.value.code == 2


def test_mcp_stops_on_ctrl_c_with_exit_130(tmp_path) -> None:
    """SIGINT stops `mcp` once it serves: the engine closes, exit 130, no traceback (trio and
    the MCP SDK's task groups deliver the interrupt inside an exception group)."""
    hello = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
             "params": {"protocolVersion": "2025-03-26", "capabilities": {},
                        "clientInfo": {"name": "test", "version": "0"}}}
    with subprocess.Popen([sys.executable, "-m", "engine", "mcp", str(tmp_path / "s"),
                           "--user", "ana"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True,
                          preexec_fn=_interruptible) as process:
        try:
            process.stdin.write(json.dumps(hello) + "\n")
            process.stdin.flush()
            assert json.loads(process.stdout.readline())["id"] == 1  # it serves
            process.send_signal(signal.SIGINT)
            rest = process.stderr.read()
            assert process.wait(timeout=60) == 130, rest
        finally:
            if process.poll() is None:
                process.kill()
    assert "Traceback" not in rest


def test_commands_that_embed_nothing_run_without_the_model(tmp_path, capsys,
                                                           monkeypatch) -> None:
    """stats, inspect, snapshot and export read a store and embed nothing, yet each loaded
    the model and failed with ModelMissing where its files were not (a fresh install, a
    moved model folder): no backup without a model build first."""
    import trio

    from engine import Engine

    store = tmp_path / "store"

    async def fill() -> None:
        async with Engine.open(store) as mem:  # the real model: its vectors in the store
            await mem.add_turn("ana", "s1", "user", "I moved to Lisbon", durable=True)
            await mem.flush()

    trio.run(fill)
    monkeypatch.setenv("ENGRAM_MODEL_DIR", str(tmp_path / "no-model-here"))
    assert main(["stats", str(store), "--json"]) == 0
    assert _json(capsys)["turns"] == 1
    assert main(["inspect", str(store), "--user", "ana", "--json"]) == 0
    assert '"I moved to Lisbon"' in capsys.readouterr().out
    assert main(["snapshot", str(store), str(tmp_path / "snap"), "--json"]) == 0
    assert main(["export", str(store), "--user", "ana", "--out", str(tmp_path / "ana.jsonl")]) == 0
    assert "I moved to Lisbon" in (tmp_path / "ana.jsonl").read_text()
    assert main(["restore", str(tmp_path / "snap"), str(tmp_path / "back")]) == 0
    monkeypatch.delenv("ENGRAM_MODEL_DIR")

    async def recalled() -> list[str]:
        async with Engine.open(tmp_path / "back") as mem:
            return [h.text for h in await mem.recall("ana", "where do I live now",
                                                     legs=("vector",))]

    assert trio.run(recalled)  # the snapshot's vectors, searched with the model back
