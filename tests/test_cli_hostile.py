"""The engram command against careless operators and broken disks: paths that are not what
they should be, damaged snapshots and stores, stores that are in use or sealed. Every refusal
exits 1 with a message (no traceback), and nothing already stored is lost."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest
import trio

from actors.base.records import NewTurn
from engine import Engine, InvalidInput
from engine.__main__ import _inspect, _print_inspect, main

from .conftest import open_engine

KEY = "0123456789abcdef-key"  # 16 characters or more: one Config accepts
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def snap(store, tmp_path, capsys):
    assert main(["snapshot", str(store), str(tmp_path / "snap")]) == 0
    capsys.readouterr()
    return tmp_path / "snap"


def _tree(root: Path) -> dict[str, bytes]:
    """Every file under root with its bytes (LMDB's lock file aside: a reader may make one)."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != "lock.mdb"}


def _edit_manifest(snapshot: Path, edit) -> None:
    path = snapshot / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


def _failed(capsys, *words: str) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for word in words:
        assert word in err, err
    return err


def _foreign_lmdb(path: Path) -> None:
    """Another program's data: an LMDB file with its own database, and a fulltext/ folder."""
    env = lmdb.open(str(path), max_dbs=4)
    with env.begin(write=True) as txn:
        txn.put(b"k", b"theirs", db=env.open_db(b"mine", txn=txn))
    env.close()
    (path / "fulltext").mkdir()
    (path / "fulltext" / "notes.txt").write_text("theirs")
    (path / "lock.mdb").unlink()


# -- snapshot -----------------------------------------------------------------------------------

def test_snapshot_refuses_a_destination_inside_the_store(store, capsys) -> None:
    """A snapshot inside its store would go with the store on a restore over it."""
    before = _tree(store)
    for dest in (store / "inside", store / "fulltext" / "snap"):
        assert main(["snapshot", str(store), str(dest)]) == 1
        _failed(capsys, "InvalidInput: dest: expected a directory outside the store")
    assert _tree(store) == before


def test_snapshot_and_restore_take_the_current_directory(store, tmp_path, monkeypatch,
                                                         capsys) -> None:
    """`engram-trio snapshot STORE .` in an empty directory, and restore into `.` likewise."""
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    assert main(["snapshot", str(store), "."]) == 0
    assert (tmp_path / "here" / "manifest.json").is_file()
    capsys.readouterr()
    (tmp_path / "there").mkdir()
    monkeypatch.chdir(tmp_path / "there")
    assert main(["restore", str(tmp_path / "here"), ".", "--json"]) == 0
    assert _json_out(capsys)["turns"] == 3


def test_snapshot_onto_a_file_says_it_is_a_file(store, tmp_path, capsys) -> None:
    """A file where the snapshot should go is named a file, and left alone."""
    (tmp_path / "f").write_text("mine")
    assert main(["snapshot", str(store), str(tmp_path / "f")]) == 1
    _failed(capsys, "expected a new or empty directory, found a file at")
    assert (tmp_path / "f").read_text() == "mine"


# -- restore ------------------------------------------------------------------------------------

def test_restore_refuses_a_manifest_naming_files_outside_the_snapshot(snap, tmp_path,
                                                                      capsys) -> None:
    """An edited manifest's ``store/../../x`` would be written outside the new store."""
    (tmp_path / "outside").mkdir()
    data = b"not yours\n"
    (tmp_path / "outside" / "x").write_bytes(data)
    # snap/store/../../outside/x is that file; the restore would copy it to
    # a/b/new.restoring/../../outside/x, that is a/outside/x.
    deep = tmp_path / "a" / "b" / "new"
    deep.parent.mkdir(parents=True)
    name = "store/../../outside/x"
    _edit_manifest(snap, lambda m: m["files"].__setitem__(
        name, [len(data), hashlib.sha256(data).hexdigest()]))
    assert main(["restore", str(snap), str(deep)]) == 1
    _failed(capsys, "StoreIncompatible:", repr(name), "the manifest was edited")
    assert not deep.exists() and not (tmp_path / "a" / "outside").exists()


def test_restore_refuses_a_manifest_whose_lsn_is_not_the_stores(snap, tmp_path, capsys) -> None:
    """A manifest's lsn edited (+100) was taken as it stood, and restore returned a Manifest
    naming positions the store never had, though its chain head says where the store ends."""
    _edit_manifest(snap, lambda m: m.__setitem__("lsn", m["lsn"] + 100))
    assert main(["restore", str(snap), str(tmp_path / "new")]) == 1
    _failed(capsys, "StoreTampered:", "the manifest's lsn")
    assert not (tmp_path / "new").exists()


def test_restore_refuses_a_manifest_without_the_store_file(snap, tmp_path, capsys) -> None:
    """A manifest that lists no files is refused before anything is copied."""
    _edit_manifest(snap, lambda m: (m.__setitem__("files", {}), m.__setitem__("chain_head", "")))
    assert main(["restore", str(snap), str(tmp_path / "new")]) == 1
    _failed(capsys, "StoreIncompatible:", "lists no store/data.mdb")
    assert not (tmp_path / "new").exists()


def test_restore_overwrite_replaces_only_a_store(snap, tmp_path, capsys) -> None:
    """--overwrite aimed at a folder of other files, or at the store that holds the snapshot,
    is refused and deletes nothing."""
    other = tmp_path / "documents"
    other.mkdir()
    (other / "thesis.txt").write_text("mine")
    assert main(["restore", str(snap), str(other), "--overwrite"]) == 1
    _failed(capsys, "InvalidInput: store_path: expected a store to replace")
    assert (other / "thesis.txt").read_text() == "mine"
    store = tmp_path / "store"
    shutil.copytree(snap, store / "kept")
    before = _tree(store)
    assert main(["restore", str(store / "kept"), str(store), "--overwrite"]) == 1
    _failed(capsys, "expected a snapshot outside the store it replaces")
    assert _tree(store) == before


def test_a_restore_cut_short_while_replacing_keeps_a_whole_store(snap, store, tmp_path,
                                                                 monkeypatch, capsys) -> None:
    """Ctrl-C while the old store is being deleted leaves a whole store at its path, never
    half of the old one."""
    real = shutil.rmtree

    def interrupted(path, *args, **kwargs):
        path = Path(path)
        if path.name.startswith("store") and (path / "data.mdb").exists():
            (path / "data.mdb").unlink()  # the deletion got this far
            raise KeyboardInterrupt
        return real(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", interrupted)
    assert main(["restore", str(snap), str(store), "--overwrite"]) == 130
    monkeypatch.setattr(shutil, "rmtree", real)
    assert main(["stats", str(store), "--json"]) == 0
    assert _json_out(capsys)["turns"] == 3


def test_restore_of_a_sealed_snapshot_without_the_key_replaces_nothing(tmp_path, capsys,
                                                                       monkeypatch) -> None:
    """The store a sealed snapshot makes opens with its key only: without the key set, the
    restore is refused before it replaces the store there."""
    async def fill() -> None:
        async with open_engine(tmp_path / "sealed", config={"integrity_key": KEY}) as mem:
            await mem.add_turn("ana", "s1", "user", "hello")
            await mem.snapshot(tmp_path / "snap")

    trio.run(fill)
    target = tmp_path / "sealed"
    before = _tree(target)
    monkeypatch.delenv("ENGRAM_INTEGRITY_KEY", raising=False)
    assert main(["restore", str(tmp_path / "snap"), str(target), "--overwrite"]) == 1
    _failed(capsys, "ENGRAM_INTEGRITY_KEY", "unset")
    assert _tree(target) == before
    monkeypatch.setenv("ENGRAM_INTEGRITY_KEY", KEY)
    assert main(["restore", str(tmp_path / "snap"), str(target), "--overwrite"]) == 0


# -- stores that are not stores -----------------------------------------------------------------

COMMANDS = [["stats"], ["inspect", "--user", "ana"], ["inspect", "--failures"],
            ["export", "--user", "ana"], ["import", "{export}"], ["compact"], ["verify"],
            ["reindex"], ["snapshot", "{snap}"]]


@pytest.mark.parametrize("kind", ["foreign", "empty"])
def test_commands_leave_another_programs_data_alone(kind, tmp_path, capsys) -> None:
    """An LMDB file of another program, or an empty data.mdb: every command exits 1 with a
    message and writes nothing there (none adopts it as a store, reindex deletes no fulltext/)."""
    path = tmp_path / "theirs"
    path.mkdir()
    if kind == "foreign":
        _foreign_lmdb(path)
    else:
        (path / "data.mdb").write_bytes(b"")
    export = tmp_path / "a.jsonl"
    export.write_text('{"record":"header"}\n')
    before = _tree(path)
    for command in COMMANDS:
        argv = [command[0], str(path)] + [a.format(export=export, snap=tmp_path / "snap")
                                          for a in command[1:]]
        assert main(argv) == 1, argv
        err = _failed(capsys)
        assert "expected an Engram store" in err or "verify: " in err, (argv, err)
        assert _tree(path) == before, argv
        assert not (path / "owner.lock").exists(), argv


def test_verify_reports_damaged_pages_and_other_commands_refuse_them(store, tmp_path) -> None:
    """Pages past LMDB's meta pages overwritten: verify exits 1 with a JSON report, the
    commands that read the store exit 1 with a message, none with a traceback."""
    data = bytearray((store / "data.mdb").read_bytes())
    for page in range(2, len(data) // 4096):  # every page's header: LMDB notices
        data[page * 4096:page * 4096 + 16] = b"\xa5" * 16
    (store / "data.mdb").write_bytes(bytes(data))

    def run(*argv: str) -> subprocess.CompletedProcess:
        done = subprocess.run([sys.executable, "-m", "engine", *argv], capture_output=True,
                              text=True, timeout=60, cwd=REPO)
        assert "Traceback" not in done.stderr, done.stderr[-3000:]
        return done

    done = run("verify", str(store), "--json")
    report = json.loads(done.stdout)
    assert done.returncode == 1 and not report["ok"] and report["problem_count"] >= 1
    for argv in (["stats", str(store)], ["compact", str(store)],
                 ["export", str(store), "--user", "ana"]):
        done = run(*argv)
        assert done.returncode == 1 and "restore" in done.stderr, (argv, done.stderr)


def test_verify_reports_a_zeroed_leaf_page_instead_of_dying_with_lmdb(tmp_path) -> None:
    """A 4 KiB leaf page of the vectors zeroed (a disk's lost write): LMDB's cursor trusts the
    page's layout, and its assertion (IS_LEAF) aborted verify with SIGABRT, no report. The
    trees' pages are now walked with plain reads first, and the damage is reported."""
    store = tmp_path / "store"

    async def fill() -> None:
        async with open_engine(store, config={"long_term": False}) as mem:
            await mem.add_turns([NewTurn(user_id="ana", session_id="s", role="user",
                                         text=f"lisbon flat number {i}") for i in range(300)])
            await mem.flush()

    trio.run(fill)
    data = bytearray((store / "data.mdb").read_bytes())
    leaves = []
    for page in range(2, len(data) // 4096):  # leaf pages whose first record is a vector
        at = page * 4096
        flags, lower = int.from_bytes(data[at + 10:at + 12], "little"), int.from_bytes(
            data[at + 12:at + 14], "little")
        if flags != 0x02 or lower <= 16:
            continue
        node = at + int.from_bytes(data[at + 16:at + 18], "little")
        size = int.from_bytes(data[node:node + 2], "little")
        if data[node + 6] == 12 and data[node + 8:node + 12] == b"ana\x00" and 700 < size < 900:
            leaves.append(at)
    at = leaves[len(leaves) // 2]  # one in the middle of the tree: LMDB's cursor steps onto it
    data[at:at + 4096] = bytes(4096)
    (store / "data.mdb").write_bytes(bytes(data))
    done = subprocess.run([sys.executable, "-m", "engine", "verify", str(store), "--json"],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 1, (done.returncode, done.stderr[-500:])
    report = json.loads(done.stdout)
    assert "a page of its trees is damaged" in report["problems"][0]["what"]


# -- sealing and keys ---------------------------------------------------------------------------

_HOLD = """
import sys, trio
sys.path.insert(0, sys.argv[2])
from tests.conftest import open_engine
async def hold():
    async with open_engine(sys.argv[1]):
        print("ready", flush=True)
        await trio.to_thread.run_sync(sys.stdin.read)
trio.run(hold)
"""


def test_verify_seal_refuses_a_store_an_engine_owns(store, capsys, monkeypatch) -> None:
    """Sealing rewrites the chain's head: with an engine serving the store (another process)
    it is refused, and the store is left unsealed."""
    monkeypatch.setenv("ENGRAM_INTEGRITY_KEY", KEY)
    with subprocess.Popen([sys.executable, "-c", _HOLD, str(store), str(REPO)],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as child:
        try:
            assert child.stdout.readline().strip() == "ready"
            assert main(["verify", str(store), "--seal"]) == 1
            _failed(capsys, "StoreInUse:", f"process {child.pid}")
        finally:
            child.stdin.close()
            child.wait(timeout=60)
    monkeypatch.delenv("ENGRAM_INTEGRITY_KEY")
    assert main(["verify", str(store), "--json"]) == 0
    assert _json_out(capsys)["mac"] == "absent"


def test_a_key_the_engine_refuses_never_seals_a_store(store, capsys, monkeypatch) -> None:
    """A short ENGRAM_INTEGRITY_KEY is refused, naming the variable, before it seals the store
    under a key no engine would open it with; Engine.verify refuses it too."""
    monkeypatch.setenv("ENGRAM_INTEGRITY_KEY", "short")
    assert main(["verify", str(store), "--seal"]) == 1
    _failed(capsys, "InvalidInput: ENGRAM_INTEGRITY_KEY: expected a store's integrity key")
    with pytest.raises(InvalidInput, match="nothing was sealed"):
        trio.run(lambda: Engine.verify(store, integrity_key="short", seal=True))
    monkeypatch.delenv("ENGRAM_INTEGRITY_KEY")
    assert main(["stats", str(store)]) == 0  # still opens without a key


# -- export -------------------------------------------------------------------------------------

def test_export_out_never_replaces_the_stores_own_files(store, capsys) -> None:
    """`--out STORE/data.mdb` would replace the store with the export: refused."""
    before = _tree(store)
    for out in (store / "data.mdb", store / "ana.jsonl"):
        assert main(["export", str(store), "--user", "ana", "--out", str(out)]) == 1
        _failed(capsys, "InvalidInput: dest: expected a file outside the store")
    assert _tree(store) == before


def test_export_out_to_a_directory_or_a_missing_folder_is_refused(store, tmp_path,
                                                                  capsys) -> None:
    """A directory, or a file in a folder that is not there: exit 1, a message, no traceback."""
    assert main(["export", str(store), "--user", "ana", "--out", str(tmp_path)]) == 1
    _failed(capsys, "expected a file, found a directory")
    assert main(["export", str(store), "--user", "ana", "--out",
                 str(tmp_path / "missing" / "a.jsonl")]) == 1
    _failed(capsys, "expected a file in an existing directory")


def test_export_out_to_a_device_writes_to_it(store, tmp_path, capsys) -> None:
    """`--out /dev/stdout` (or any device or pipe) is written to, never replaced by a file."""
    os.mkfifo(tmp_path / "pipe")
    with subprocess.Popen(["cat", str(tmp_path / "pipe")], stdout=subprocess.PIPE) as reader:
        try:
            assert main(["export", str(store), "--user", "ana", "--out",
                         str(tmp_path / "pipe")]) == 0
            lines = reader.communicate(timeout=30)[0].splitlines()
        finally:
            reader.kill()
    assert json.loads(lines[0])["record"] == "header" and len(lines) > 3
    assert (tmp_path / "pipe").is_fifo()


def test_a_full_disk_under_stdout_exits_1_without_a_traceback(store) -> None:
    """`engram-trio export ... > file` on a full disk: exit 1 and a line saying so."""
    if not Path("/dev/full").is_char_device():
        pytest.skip("no /dev/full here")
    for argv in (["export", str(store), "--user", "ana"], ["stats", str(store), "--json"]):
        with open("/dev/full", "wb") as full:
            done = subprocess.run([sys.executable, "-m", "engine", *argv], stdout=full,
                                  stderr=subprocess.PIPE, text=True, timeout=60, cwd=REPO)
        assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
        assert "No space left on device" in done.stderr


# -- --json -------------------------------------------------------------------------------------

def _json_out(capsys) -> dict:
    return json.loads(capsys.readouterr().out)


def test_json_failures_print_one_json_document(store, tmp_path, capsys) -> None:
    """With --json a refusal prints a JSON document on stdout too (ok false, the error), not
    nothing that a script's JSON parse would fail on."""
    assert main(["stats", str(tmp_path / "nowhere"), "--json"]) == 1
    out = _json_out(capsys)
    assert out["ok"] is False and out["error"] == "InvalidInput"
    assert "expected an Engram store" in out["message"]
    assert main(["restore", str(tmp_path / "nowhere"), str(tmp_path / "new"), "--json"]) == 1
    assert _json_out(capsys)["error"] == "InvalidInput"


# -- hostile terminals, pipes and arguments -----------------------------------------------------

def _run(*argv: str, **kwargs) -> subprocess.CompletedProcess:
    kwargs.setdefault("capture_output", True)
    return subprocess.run([sys.executable, "-m", "engine", *argv], timeout=60, cwd=REPO,
                          **kwargs)


@pytest.fixture
def accented(tmp_path) -> Path:
    """A closed store whose user has text beyond ASCII, and enough of it (about 300 KB of
    export) to overflow a pipe's buffer."""
    async def fill() -> None:
        async with open_engine(tmp_path / "accented", config={"long_term": False}) as mem:
            await mem.add_turn("ana", "s1", "user", "Je suis allée à Zürich ☃ 日本")
            await mem.add_turns([NewTurn(user_id="ana", session_id="s2", role="user",
                                         text=f"turn {i} " + "x" * 250) for i in range(1000)],
                                durable=True)

    trio.run(fill)
    return tmp_path / "accented"


def test_an_ascii_terminal_shows_stored_text_escaped(accented) -> None:
    """LANG=C (stdout that takes ASCII only): inspect's tables show other characters escaped,
    and exit 0, not a UnicodeEncodeError's traceback."""
    env = {**os.environ, "PYTHONIOENCODING": "ascii"}
    done = _run("inspect", str(accented), "--user", "ana", "--turns", "1", env=env, text=True)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "Z\\xfcrich" in done.stdout.replace("\n", "")


def test_inspect_shows_stored_text_that_looks_like_markup_as_it_is(tmp_path) -> None:
    """A turn holding "[/]" (a user typing it) ended `inspect --user` in rich's MarkupError
    traceback, and "[red]hunter2[/red]" was shown as "hunter2": what a user said was read
    as rich's markup. Stored text, ids included, is shown as it is."""
    async def fill() -> None:
        async with open_engine(tmp_path / "s", config={"long_term": False}) as mem:
            await mem.add_turn("ana", "[b]s1", "user", "see the docs [/] for more")
            await mem.add_turn("ana", "s2", "user", "my password is [red]hunter2[/red] lol")

            # An escape sequence a user typed: clear the screen, set the terminal's title.
            await mem.add_turn("ana", "s3", "user", "hi \x1b[2J\x1b]0;pwned\x07 there")

    trio.run(fill)
    done = _run("inspect", str(tmp_path / "s"), "--user", "ana", text=True)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    shown = done.stdout.replace("\n", "").replace("│", "").replace(" ", "")
    for said in ("[b]s1", "[/]", "[red]hunter2[/red]", "\\x1b[2J\\x1b]0;pwned\\x07"):
        assert said.replace(" ", "") in shown, (said, done.stdout)
    assert "\x1b]0" not in done.stdout and "\x1b[2J" not in done.stdout


def test_a_store_path_that_is_not_utf8_is_refused_on_the_command_line(store, tmp_path,
                                                                      capsys) -> None:
    """A path of undecodable bytes (the text index and LMDB take UTF-8 names only): exit 2
    with a line naming the argument, nothing created, no traceback."""
    odd = os.fsdecode(bytes(tmp_path) + b"/odd\xff")
    for argv in (["snapshot", str(store), odd], ["restore", str(store), odd],
                 ["demo", "--store", odd], ["stats", odd]):
        with pytest.raises(SystemExit) as exit:
            main(argv)
        assert exit.value.code == 2, argv
        _failed(capsys, "expected a path of UTF-8 text, found undecodable bytes")
        assert not Path(odd).exists(), argv


def test_serve_refuses_a_port_out_of_range_before_it_makes_a_store(tmp_path, capsys) -> None:
    """--port -1 or 70000 is a wrong command line (exit 2), not a store made and then an
    engine failure."""
    for port in ("-1", "70000", "99999999999999999999"):
        with pytest.raises(SystemExit) as exit:
            main(["serve", str(tmp_path / "new"), "--port", port])
        assert exit.value.code == 2
        _failed(capsys, "expected a port from 0 to 65535", port)
    assert not (tmp_path / "new").exists()


def test_inspect_failures_reads_a_served_store(store, capsys) -> None:
    """`inspect --failures` on a store an engine serves lists what that engine recorded,
    as inspect without it does, instead of refusing with StoreInUse."""
    with subprocess.Popen([sys.executable, "-c", _HOLD, str(store), str(REPO)],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as child:
        try:
            assert child.stdout.readline().strip() == "ready"
            assert main(["inspect", str(store), "--failures", "--json"]) == 0
            assert _json_out(capsys) == {"failures": []}
        finally:
            child.stdin.close()
            child.wait(timeout=60)


class _ReaderGone(io.StringIO):
    """stdout whose reader went away: what was written stays in a buffer until the flush
    finds the pipe closed."""

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")


def test_inspect_tables_into_a_closed_pipe_end_as_a_broken_pipe(store, capsys,
                                                                monkeypatch) -> None:
    """`inspect STORE --user ana | head -c 3` without --json: rich's tables meeting the
    closed pipe raise BrokenPipeError for main's exit 141, not rich's SystemExit(1)."""
    report = trio.run(_inspect, str(store), "ana", 3)
    monkeypatch.setattr(sys, "stdout", _ReaderGone())
    with pytest.raises(BrokenPipeError):
        _print_inspect(report, False)


def test_import_from_a_closed_stdin_is_refused(store, capsys, monkeypatch) -> None:
    """`engram-trio import STORE - <&-`: no stdin at all is a refusal naming it, not an
    AttributeError's traceback."""
    monkeypatch.setattr(sys, "stdin", None)
    assert main(["import", str(store), "-"]) == 1
    _failed(capsys, "InvalidInput: file: expected an export on stdin, found stdin closed")


def test_an_export_whose_reader_leaves_exits_141(accented) -> None:
    """`export STORE --user ana | head -c 10`: the export did not arrive, so exit 141 and no
    line claiming every record was exported."""
    with subprocess.Popen([sys.executable, "-m", "engine", "export", str(accented), "--user",
                           "ana"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          cwd=REPO) as process:
        assert process.stdout.read(10) == b'{"record":'
        process.stdout.close()
        err = process.stderr.read()
        process.wait(timeout=60)
    assert process.returncode == 141 and b"Traceback" not in err, err[-2000:]
    assert b"1001 turn" not in err
