"""Tamper evidence and record checksums: a CLOSED store edited with raw lmdb is caught by
``engram-trio verify`` and by open (the tail) or by the read that would have served the edit."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import subprocess
import sys
from pathlib import Path

import lmdb
import msgspec
import numpy as np
import pytest
import trio

import actors.store as store_mod
import engine._snapshot as snapshot_mod
from actors.store.integrity import content_digest, seal, unseal
from engine import (Engine, NewTurn, NotFound, StoreCorrupt, StoreIncompatible, StoreTampered,
                    Turn)
from engine.__main__ import main

from ..conftest import (StepClock, downgrade_to_schema_4, downgrade_to_schema_5,
                        open_engine)

KEY = "k" * 32
FILLER = 70  # turns logged after ana's: her records lie outside the tail that open checks

_turn = msgspec.msgpack.Decoder(Turn)
_encode = msgspec.msgpack.Encoder().encode


def _build(path: Path, key: str | None = None) -> None:
    """ana: six turns, then a forgotten session, an updated and a deleted note, a fact and
    plenty of later turns; bo: three turns."""

    async def fill() -> None:
        async with open_engine(path, clock=StepClock(),
                               config={"integrity_key": key, "long_term": False}) as mem:
            for i in range(6):
                await mem.add_turn("ana", "s1", "user" if i % 2 == 0 else "assistant",
                                   f"ana says thing number {i} about lisbon")
            for i in range(3):
                await mem.add_turn("bo", "x", "user", f"bo's private turn {i}")
            await mem.add_turn("ana", "gone", "user", "forget this session")
            await mem.forget_session("ana", "gone")
            await mem.store_note("ana", "first note", note_id="n1")
            await mem.update_note("ana", "n1", "second note")
            await mem.update_note("ana", "n1", "third note")
            await mem.store_note("ana", "deleted note", note_id="n2")
            await mem.delete_note("ana", "n2")
            await mem.remember_fact("ana", "identity", "location", "Lisbon")
            await mem.remember_fact("ana", "identity", "location", "Porto")
            for i in range(FILLER):
                await mem.add_turn("cy", "c", "user", f"filler {i}")
            await mem.flush()

    trio.run(fill)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("built") / "store"
    _build(path)
    return path


@pytest.fixture
def store(built: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "store"
    dest.mkdir()
    (dest / "data.mdb").write_bytes((built / "data.mdb").read_bytes())
    return dest


class Raw:
    """A closed store opened with bare lmdb, as an attacker (or a bad disk) would."""

    def __init__(self, path: Path) -> None:
        self.env = lmdb.open(str(path), max_dbs=32, lock=False)
        self.txn = self.env.begin(write=True)

    def db(self, name: str):
        return self.env.open_db(name.encode(), txn=self.txn)

    def get(self, name: str, key: bytes) -> bytes:
        return unseal(self.txn.get(key, db=self.db(name)), name.encode(), key)

    def put(self, name: str, key: bytes, value: bytes) -> None:
        self.txn.put(key, value if name == "meta" else seal(value), db=self.db(name))

    def delete(self, name: str, key: bytes) -> None:
        assert self.txn.delete(key, db=self.db(name))

    def turn(self, user: str, session: str, seq: int) -> tuple[bytes, Turn]:
        key = f"{user}\0{session}\0".encode() + seq.to_bytes(8, "big")
        return key, _turn.decode(self.get("turns", key))

    def __enter__(self) -> "Raw":
        return self

    def __exit__(self, *exc) -> None:
        self.txn.commit()
        self.env.close()


def _verify(path: Path, key: str | None = None) -> dict:
    return trio.run(lambda: Engine.verify(path, integrity_key=key))


async def _open_and_read(path: Path, **config) -> None:
    async with open_engine(path, config={"long_term": False, **config}) as mem:
        await mem.session_history("ana", "s1")
        await mem.recall("ana", "thing number about lisbon", limit=10)


def _problems(report: dict) -> str:
    return "\n".join(f"{p['where']}: {p['what']}" for p in report["problems"])


def test_an_untouched_store_verifies_after_forgets_note_updates_and_facts(built) -> None:
    """Forgetting, note versions and superseded facts remove log entries without breaking the
    chain: verify passes and names no problem."""
    report = _verify(built)
    assert report["ok"], _problems(report)
    assert report["last_lsn"] > FILLER and report["sessions"] == 3


def test_changed_text_is_caught_by_verify_and_by_the_read(store) -> None:
    """A turn's text edited (checksum recomputed) fails the chain's content digest."""
    with Raw(store) as raw:
        key, turn = raw.turn("ana", "s1", 2)
        raw.put("turns", key, _encode(msgspec.structs.replace(turn, text="ana never said this")))
    report = _verify(store)
    assert not report["ok"]
    assert f"lsn {turn.lsn}" in _problems(report) and "differs" in _problems(report)
    with pytest.raises(StoreTampered, match=rf"log position {turn.lsn} is not what the engine"):
        trio.run(_open_and_read, store)


def test_a_damaged_record_is_store_corrupt_naming_its_database_and_key(store) -> None:
    """One flipped byte is a StoreCorrupt naming the database and key, not a decode error."""
    with Raw(store) as raw:
        key, _ = raw.turn("ana", "s1", 1)
        value = bytearray(raw.txn.get(key, db=raw.db("turns")))
        value[len(value) // 2] ^= 0x20
        raw.txn.put(key, bytes(value), db=raw.db("turns"))
    with pytest.raises(StoreCorrupt) as info:
        trio.run(_open_and_read, store)
    assert (info.value.database, info.value.key) == ("turns", key)
    assert "fails its checksum" in str(info.value)
    report = _verify(store)
    assert f"turns {key!r}: fails its checksum" in _problems(report)


def test_a_cut_tail_is_caught_at_open_and_by_verify(store) -> None:
    """The last turns deleted, the counters set back to match: the chain's head disagrees."""
    with Raw(store) as raw:
        last = int.from_bytes(raw.txn.get(b"last_lsn", db=raw.db("meta")), "big")
        for seq in range(FILLER - 3, FILLER):
            key, turn = raw.turn("cy", "c", seq)
            raw.delete("turns", key)
            raw.delete("log", turn.lsn.to_bytes(8, "big"))
            raw.delete("ids", b"cy\0" + turn.turn_id.encode())
        info_key = b"cy\0c"
        info = msgspec.msgpack.decode(raw.get("sessions", info_key))
        info[4] = FILLER - 3
        raw.put("sessions", info_key, _encode(info))
        raw.put("meta", b"last_lsn", (last - 3).to_bytes(8, "big"))
    with pytest.raises(StoreTampered, match=r"hash chain ends at log position"):
        trio.run(_open_and_read, store)
    assert not _verify(store)["ok"]


def test_a_cut_tail_with_a_rebuilt_head_is_caught_only_with_the_key(tmp_path) -> None:
    """An attacker who also cuts the chain and rewrites its head cannot make its MAC."""
    store = tmp_path / "store"
    _build(store, key=KEY)
    with Raw(store) as raw:
        last = int.from_bytes(raw.txn.get(b"last_lsn", db=raw.db("meta")), "big")
        key, turn = raw.turn("cy", "c", FILLER - 1)
        assert turn.lsn == last
        for name, k in (("turns", key), ("log", turn.lsn.to_bytes(8, "big")),
                        ("chain", turn.lsn.to_bytes(8, "big"))):
            raw.delete(name, k)
        digest = raw.get("chain", (last - 1).to_bytes(8, "big"))[:16]
        raw.put("meta", b"chain_head", (last - 1).to_bytes(8, "big") + digest + b"\0" * 32)
        raw.put("meta", b"last_lsn", (last - 1).to_bytes(8, "big"))
    with pytest.raises(StoreTampered, match=r"MAC of the hash-chain head does not match"):
        trio.run(functools.partial(_open_and_read, store, integrity_key=KEY))
    assert _verify(store, KEY)["mac"] == "fails"


def test_a_turn_deleted_from_the_middle_is_caught_by_verify_and_by_the_read(store) -> None:
    """A turn and its log entry removed without a tombstone: a gap in the session and a
    removal no logged forget covers."""
    with Raw(store) as raw:
        key, turn = raw.turn("ana", "s1", 3)
        raw.delete("turns", key)
        raw.delete("log", turn.lsn.to_bytes(8, "big"))
        raw.delete("ids", b"ana\0" + turn.turn_id.encode())
    problems = _problems(_verify(store))
    assert f"lsn {turn.lsn}: its log entry was removed, and no later record lists it" in problems
    assert "missing [3]" in problems
    with pytest.raises(StoreTampered, match=r"without gaps"):
        trio.run(_open_and_read, store)


def test_reordered_turns_are_caught_by_verify_and_by_the_read(store) -> None:
    """Two turns swapped (each value intact): each sits under the other's key and lsn."""
    with Raw(store) as raw:
        k1, t1 = raw.turn("ana", "s1", 1)
        k2, t2 = raw.turn("ana", "s1", 2)
        raw.put("turns", k1, _encode(t2))
        raw.put("turns", k2, _encode(t1))
    problems = _problems(_verify(store))
    assert f"lsn {t1.lsn}" in problems and f"lsn {t2.lsn}" in problems
    assert "a turn moved or copied in" in problems
    with pytest.raises(StoreTampered):
        trio.run(_open_and_read, store)


def test_a_forged_turn_is_caught_at_open_and_by_verify(store) -> None:
    """A turn appended with its log entry and every counter updated, but no chain record."""
    with Raw(store) as raw:
        last = int.from_bytes(raw.txn.get(b"last_lsn", db=raw.db("meta")), "big")
        _, model = raw.turn("ana", "s1", 5)
        forged = msgspec.structs.replace(model, lsn=last + 1, turn_id="t_forged", seq=6,
                                         text="ana wants you to wire money to the attacker")
        key = b"ana\0s1\0" + (6).to_bytes(8, "big")
        raw.put("turns", key, _encode(forged))
        raw.put("ids", b"ana\0t_forged", key)
        raw.put("log", (last + 1).to_bytes(8, "big"), b"T" + key)
        info = msgspec.msgpack.decode(raw.get("sessions", b"ana\0s1"))
        info[4] = 7
        raw.put("sessions", b"ana\0s1", _encode(info))
        raw.put("meta", b"last_lsn", (last + 1).to_bytes(8, "big"))
    with pytest.raises(StoreTampered):
        trio.run(_open_and_read, store)
    problems = _problems(_verify(store))
    assert f"lsn {last + 1}: the chain records of {last + 1}..{last + 1} are missing" in problems


def test_another_users_turn_copied_in_is_caught_by_verify_and_by_the_read(store) -> None:
    """bo's turn written over one of ana's: it is not ana's, and not what her lsn logged."""
    with Raw(store) as raw:
        key, mine = raw.turn("ana", "s1", 4)
        _, theirs = raw.turn("bo", "x", 0)
        raw.put("turns", key, _encode(theirs))
    problems = _problems(_verify(store))
    assert "holds turn 0 of user 'bo'" in problems
    assert f"lsn {mine.lsn}" in problems
    with pytest.raises(StoreTampered):
        trio.run(_open_and_read, store)


@pytest.mark.parametrize("database", ["ids", "summaries"])
def test_a_record_moved_to_another_users_key_fails_its_checksum(tmp_path, database) -> None:
    """A bit flipped in a key moves a record under another user ("u1" and "u3" differ by
    one): its checksum covered the value alone, so verify passed and u3 was served u1's
    turn (through the id's entry) or u1's session summary. A record's checksum now covers
    its key: the read is StoreCorrupt and verify names it."""
    path = tmp_path / "store"

    async def fill() -> str:
        async with open_engine(path, config={"long_term": False}) as mem:
            turn = await mem.add_turn("u1", "s1", "user", "SECRET of u1")
            await mem.add_turn("u3", "s1", "user", "u3's own turn")
            await mem.write_session_summary("u1", "s1", "SECRET summary of u1", 1, 0)
            await mem.flush()
            return turn.turn_id

    turn_id = trio.run(fill)
    with Raw(path) as raw:
        db = raw.db(database)
        [(key, value)] = [(k, v) for k, v in raw.txn.cursor(db)
                          if k.startswith(b"u1\0") and (database != "ids"
                                                        or k.endswith(turn_id.encode()))]
        raw.txn.delete(key, db=db)
        moved = b"u3" + key[2:]
        raw.txn.put(moved, value, db=db)  # the bytes as they were: one bit of the key flipped

    async def read() -> None:
        async with open_engine(path, config={"long_term": False}) as mem:
            if database == "ids":
                await mem.get_turn("u3", turn_id)
            else:
                await mem.session_summary("u3", "s1")

    with pytest.raises(StoreCorrupt) as info:
        trio.run(read)
    assert (info.value.database, info.value.key) == (database, moved)
    assert f"{database} {moved!r}: fails its checksum" in _problems(_verify(path))


def test_verify_cli_says_where_it_breaks_and_exits_non_zero(store, capsys) -> None:
    """`engram-trio verify` exits 0 on a sound store and 1 on an edited one, naming the place."""
    assert main(["verify", str(store), "--json"]) == 0
    capsys.readouterr()
    with Raw(store) as raw:
        key, turn = raw.turn("ana", "s1", 0)
        raw.put("turns", key, _encode(msgspec.structs.replace(turn, text="edited")))
    assert main(["verify", str(store)]) == 1
    out, err = capsys.readouterr()
    assert f"lsn {turn.lsn}" in out and "is broken" in err


def test_a_truncated_data_file_is_refused_without_a_crash(store, tmp_path) -> None:
    """A data.mdb cut short gives a clear error in a fresh process (no SIGBUS)."""
    data = store / "data.mdb"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    code = (
        "import trio, sys\n"
        "from engine import Engine, HashEmbedder, StoreCorrupt\n"
        "async def go():\n"
        f"    async with Engine.open({str(store)!r}, embedder=HashEmbedder()) as mem:\n"
        "        await mem.session_history('ana', 's1')\n"
        "try:\n"
        "    trio.run(go)\n"
        "except StoreCorrupt as exc:\n"
        "    print(type(exc).__name__, exc.database, exc)\n"
        "    sys.exit(3)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 3, done.stderr
    assert "StoreCorrupt data.mdb" in done.stdout and "cut short" in done.stdout
    cli = subprocess.run([sys.executable, "-m", "engine", "verify", str(store)],
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 1 and "cut short" in cli.stdout


def test_a_read_only_open_checks_the_heads_mac(tmp_path) -> None:
    """A reader (Engine.open read_only, as `engram-trio stats`, `inspect` and `snapshot` open a
    store another process serves) checks the chain head's MAC as the owner does: a cut tail
    behind a head rebuilt without the key is refused, and so is a sealed store without the key."""
    store = tmp_path / "store"
    _build(store, key=KEY)
    with Raw(store) as raw:
        last = int.from_bytes(raw.txn.get(b"last_lsn", db=raw.db("meta")), "big")
        digest = raw.get("chain", (last - 1).to_bytes(8, "big"))[:16]
        raw.put("meta", b"chain_head", (last - 1).to_bytes(8, "big") + digest + b"\0" * 32)
        raw.put("meta", b"last_lsn", (last - 1).to_bytes(8, "big"))

    async def read_only(**config) -> None:
        async with open_engine(store, read_only=True, config=config) as mem:
            await mem.session_history("ana", "s1")

    with pytest.raises(StoreTampered, match=r"MAC of the hash-chain head does not match"):
        trio.run(functools.partial(read_only, integrity_key=KEY))
    with pytest.raises(StoreIncompatible, match=r"sealed with an integrity key"):
        trio.run(read_only)
    cli = subprocess.run([sys.executable, "-m", "engine", "stats", str(store)], text=True,
                         capture_output=True, timeout=120,
                         env={**os.environ, "ENGRAM_INTEGRITY_KEY": KEY})
    assert cli.returncode != 0 and "MAC of the hash-chain head does not match" in cli.stderr


def test_a_sealed_store_opens_only_with_its_key(tmp_path) -> None:
    """Without the key (or with another) a sealed store is refused; an unsealed store is
    sealed by `verify --seal` and opens with the key from then on."""
    sealed = tmp_path / "sealed"
    _build(sealed, key=KEY)
    with pytest.raises(StoreIncompatible, match=r"sealed with an integrity key"):
        trio.run(_open_and_read, sealed)
    with pytest.raises(StoreTampered, match=r"MAC"):
        trio.run(functools.partial(_open_and_read, sealed,
                                   integrity_key="another key of 32 chars......"))
    trio.run(functools.partial(_open_and_read, sealed, integrity_key=KEY))
    assert _verify(sealed, KEY)["mac"] == "checked"

    plain = tmp_path / "plain"
    _build(plain)
    with pytest.raises(StoreIncompatible, match=r"--seal"):
        trio.run(functools.partial(_open_and_read, plain, integrity_key=KEY))
    report = trio.run(lambda: Engine.verify(plain, integrity_key=KEY, seal=True))
    assert report["ok"] and report["mac"] == "sealed"
    trio.run(functools.partial(_open_and_read, plain, integrity_key=KEY))


def _reseal_manifest(snapshot: Path) -> None:
    """What an attacker without the key can do: recompute the manifest's sha256s."""
    path = snapshot / "manifest.json"
    manifest = msgspec.json.decode(path.read_bytes())
    data = (snapshot / "store" / "data.mdb").read_bytes()
    manifest["files"]["store/data.mdb"] = [len(data), hashlib.sha256(data).hexdigest()]
    path.write_bytes(msgspec.json.encode(manifest))


def _keyed_snapshot(tmp_path: Path) -> None:
    """A store built under KEY at tmp_path/store, and its snapshot at tmp_path/snap."""
    store = tmp_path / "store"
    _build(store, key=KEY)

    async def snap() -> None:
        async with open_engine(store, config={"integrity_key": KEY, "long_term": False}) as mem:
            await mem.snapshot(tmp_path / "snap")

    trio.run(snap)


def test_a_snapshot_edited_without_the_key_is_refused(tmp_path) -> None:
    """An attacker edits a snapshot's store and recomputes the manifest's sha256s: restore with
    the key refuses the manifest's MAC; without it, restore refuses a chain record patched to
    match, and an edit that leaves the chain alone is installed but never served."""
    _keyed_snapshot(tmp_path)
    snapshot = tmp_path / "snap"
    assert len(msgspec.json.decode((snapshot / "manifest.json").read_bytes())["mac"]) == 64
    with Raw(snapshot / "store") as raw:
        key, turn = raw.turn("ana", "s1", 2)
        edited = _encode(msgspec.structs.replace(turn, text="planted"))
        raw.put("turns", key, edited)
    _reseal_manifest(snapshot)
    with pytest.raises(StoreTampered, match=r"fails its MAC"):
        trio.run(lambda: Engine.restore(snapshot, tmp_path / "r1", integrity_key=KEY))
    assert not (tmp_path / "r1").exists()

    # Without the key: the chain's links are intact, so restore installs; the edit is found
    # by verify and refused by the read.
    trio.run(lambda: Engine.restore(snapshot, tmp_path / "r2"))
    report = _verify(tmp_path / "r2")
    assert f"lsn {turn.lsn}" in _problems(report)
    with pytest.raises(StoreTampered, match=rf"log position {turn.lsn}"):
        trio.run(functools.partial(_open_and_read, tmp_path / "r2", integrity_key=KEY))

    # Patching the chain record's content digest to match breaks the chain's links.
    with Raw(snapshot / "store") as raw:
        lsn = turn.lsn.to_bytes(8, "big")
        record = raw.get("chain", lsn)
        digest = content_digest(lsn, b"T" + key, edited)
        raw.put("chain", lsn, record[:16] + digest + record[32:])
    _reseal_manifest(snapshot)
    with pytest.raises(StoreTampered, match=rf"lsn {turn.lsn}: the hash chain breaks"):
        trio.run(lambda: Engine.restore(snapshot, tmp_path / "r3"))
    assert not (tmp_path / "r3").exists()


def test_a_restore_under_the_key_checks_the_chains_head_not_every_link(tmp_path,
                                                                        monkeypatch) -> None:
    """With the key, the manifest's MAC vouches for every file's bytes, so restore checks the
    chain's head and leaves the walk over every link to verify; without it, it walks."""
    _keyed_snapshot(tmp_path)
    walks = []
    check = snapshot_mod.verify_chain

    def spied(path, key=None, links=True):
        walks.append(links)
        return check(path, key, links)

    monkeypatch.setattr(snapshot_mod, "verify_chain", spied)
    trio.run(lambda: Engine.restore(tmp_path / "snap", tmp_path / "r1", integrity_key=KEY))
    trio.run(lambda: Engine.restore(tmp_path / "snap", tmp_path / "r2"))
    assert walks == [False, True]
    for restored in ("r1", "r2"):
        assert _verify(tmp_path / restored, KEY)["ok"]
        trio.run(functools.partial(_open_and_read, tmp_path / restored, integrity_key=KEY))


def _migrated(store: Path, monkeypatch, caplog) -> list[str]:
    """Open an older store (migrating it), check ana's turns read as before; the progress
    lines the migration logged."""
    monkeypatch.setattr(store_mod.migrate, "PROGRESS_FROM", 10)
    caplog.set_level(logging.INFO, logger="engram.store")

    async def reopen() -> list[str]:
        async with open_engine(store, config={"long_term": False}) as mem:
            return [t.text for t in await mem.session_history("ana", "s1")]

    assert trio.run(reopen) == [f"ana says thing number {i} about lisbon" for i in range(6)]
    return [r.getMessage() for r in caplog.records]


def test_a_schema_4_store_is_migrated_to_checksums_and_a_chain(store, monkeypatch,
                                                                caplog) -> None:
    """A store written before checksums opens (logging its progress), verifies, and answers
    as before."""
    downgrade_to_schema_4(store)
    progress = _migrated(store, monkeypatch, caplog)
    assert any("sealing records" in m and "(100%)" in m for m in progress), progress
    assert any("building the hash chain" in m and "(100%)" in m for m in progress), progress
    report = _verify(store)
    assert report["ok"], _problems(report)


def test_a_schema_5_store_is_sealed_again_with_its_keys(store, monkeypatch, caplog) -> None:
    """A store whose checksums are of values alone (schema 5) is sealed again at its first
    open: every record's checksum then takes in its key, so a record a damaged key moves is
    caught in it too, and a build of schema 5 refuses the store as newer (its checks would
    call every record edited) instead of calling it tampered."""
    downgrade_to_schema_5(store)
    progress = _migrated(store, monkeypatch, caplog)
    assert any("sealing records with their keys" in m and "(100%)" in m for m in progress)
    env = lmdb.open(str(store), max_dbs=32, readonly=True, lock=False)
    with env.begin() as txn:
        assert int.from_bytes(txn.get(b"schema", db=env.open_db(b"meta", txn=txn)),
                              "big") == 6
        for name in [key for key, _ in txn.cursor()]:
            if name != b"meta":
                for key, value in txn.cursor(env.open_db(name, txn=txn, create=False)):
                    assert seal(value[:-4], key) == value, (name, key)
    env.close()
    report = _verify(store)
    assert report["ok"], _problems(report)


def test_a_migration_that_outgrows_the_map_grows_it(tmp_path) -> None:
    """Sealing every record again rewrites every page, and LMDB's copy on write needs room
    for both copies: a schema-5 store larger than half the map (256 MiB by default, here 1
    MiB) failed every open with lmdb.MapFullError and stayed at schema 5. The open grows
    the map and tries again, as the writer does."""
    store = tmp_path / "store"
    config = {"long_term": False, "initial_map_bytes": 1 << 20}

    async def fill() -> None:
        async with open_engine(store, config=config) as mem:
            await mem.add_turns([NewTurn(user_id="ana", session_id="s", role="user",
                                         text=f"turn {i} " + "x" * 900) for i in range(1500)])
            await mem.flush()

    async def reopen() -> int:
        async with open_engine(store, config=config) as mem:
            return len(await mem.session_history("ana", "s", limit=5000))

    trio.run(fill)
    downgrade_to_schema_5(store)
    assert trio.run(reopen) == 1500
    report = _verify(store)
    assert report["ok"], _problems(report)


def test_the_integrity_key_never_shows_in_a_configs_repr() -> None:
    """A Config in a log line or traceback hides its key."""
    from engine import Config

    assert KEY not in repr(Config(integrity_key=KEY)) and "<secret>" in repr(Config(integrity_key=KEY))


def test_a_store_growing_while_its_length_is_checked_is_not_called_cut_short(
        tmp_path, monkeypatch) -> None:
    """A live owner committing between the length check's reads (as when `compact` or a
    read-only reader checks a served store) is no truncation: the file's length is taken after
    the meta page it is compared with."""
    from actors.store import integrity

    env = lmdb.open(str(tmp_path), map_size=1 << 26)
    with env.begin(write=True) as txn:
        txn.put(b"a", b"x")
    real_open = Path.open

    def open_while_the_owner_writes(self, *args, **kwargs):
        handle = real_open(self, *args, **kwargs)
        if self.name == "data.mdb":
            with env.begin(write=True) as txn:  # the owner commits ~4 MB of new pages now
                for i in range(1000):
                    txn.put(b"k%06d" % i, b"v" * 4000)
        return handle

    monkeypatch.setattr(Path, "open", open_while_the_owner_writes)
    try:
        integrity.check_file(tmp_path)
    finally:
        env.close()


def test_a_restore_without_the_key_refuses_a_chain_record_that_fails_its_checksum(
        tmp_path) -> None:
    """A chain record whose bytes no longer match their CRC (the manifest's sha256s
    recomputed to match) stops the walk there, names the position, and installs nothing."""
    _keyed_snapshot(tmp_path)
    snapshot = tmp_path / "snap"
    with Raw(snapshot / "store") as raw:
        _, turn = raw.turn("ana", "s1", 2)
        lsn = turn.lsn.to_bytes(8, "big")
        sealed = raw.txn.get(lsn, db=raw.db("chain"))
        raw.txn.put(lsn, sealed[:20] + bytes([sealed[20] ^ 1]) + sealed[21:], db=raw.db("chain"))
    _reseal_manifest(snapshot)
    with pytest.raises(StoreTampered, match=rf"lsn {turn.lsn}: its chain record fails its "
                                            "checksum"):
        trio.run(lambda: Engine.restore(snapshot, tmp_path / "r"))
    assert not (tmp_path / "r").exists()


async def test_a_store_whose_tree_pages_are_damaged_is_refused_as_corrupt(tmp_path) -> None:
    """What a power cut leaves of a store run with fsync off (tests/reliability/
    test_power_cut.py), or a disk that lost pages: meta pages over tree pages that are not
    what they point at. Opening it raised lmdb.CorruptedError from inside LMDB; it is the
    engine's StoreCorrupt now, saying what to do, and the files are left as they were."""
    store = tmp_path / "store"
    async with open_engine(store) as mem:
        await mem.add_turn("ana", "s1", "user", "hello", durable=True)
    data = bytearray((store / "data.mdb").read_bytes())
    page = 4096
    data[2 * page :] = bytes(len(data) - 2 * page)  # every page past the two meta pages
    (store / "data.mdb").write_bytes(data)
    with pytest.raises(StoreCorrupt, match=r"data.mdb.*damaged.*Restore the store from a "
                                           r"snapshot") as caught:
        async with open_engine(store):
            pass
    assert caught.value.database == "data.mdb"
    assert (store / "data.mdb").read_bytes() == data


async def test_an_engram_store_that_lost_its_schema_version_is_corrupt_not_foreign(
        tmp_path) -> None:
    """A store whose pages a power cut left half-written can still read as LMDB and hold the
    engine's databases and log, with its schema record gone. That was refused as another
    program's data ("point Engine.open at an empty directory or an Engram store"); it is a
    damaged Engram store, StoreCorrupt, to restore from a snapshot."""
    from actors.store.layout import SCHEMA_KEY

    store = tmp_path / "store"
    async with open_engine(store) as mem:
        await mem.add_turn("ana", "s1", "user", "hello", durable=True)
    env = lmdb.open(str(store), max_dbs=32)
    with env.begin(write=True) as txn:
        assert txn.delete(SCHEMA_KEY, db=env.open_db(b"meta", txn=txn))
    env.close()
    with pytest.raises(StoreCorrupt, match=r"data.mdb is damaged: it holds Engram's databases "
                                           r"and log but no schema version.*snapshot"):
        async with open_engine(store):
            pass


async def test_an_emptied_data_file_beside_indexes_that_hold_data_is_corrupt(tmp_path) -> None:
    """A data.mdb truncated to nothing (a copy that failed, a hand's mistake) opened as a new
    empty store: the memory was silently gone, and the text index, ahead of the new store,
    was deleted with it. Indexes holding data beside an empty data.mdb mean the store's data
    was lost: StoreCorrupt, and every file is left as it was. An empty data.mdb beside no
    index data (a first open that stopped before LMDB wrote) still opens as a new store."""
    store = tmp_path / "store"
    async with open_engine(store) as mem:
        await mem.add_turns([{"user_id": "ana", "session_id": "s1", "role": "user",
                              "text": f"turn {i} about Lisbon"} for i in range(300)])
        await mem.flush()
    os.truncate(store / "data.mdb", 0)
    before = {p.relative_to(store): p.stat().st_size for p in store.rglob("*") if p.is_file()}
    with pytest.raises(StoreCorrupt, match=r"data.mdb is empty.*restore the store from a "
                                           r"snapshot") as caught:
        async with open_engine(store):
            pass
    assert caught.value.database == "data.mdb"
    after = {p.relative_to(store): p.stat().st_size for p in store.rglob("*") if p.is_file()}
    assert after == before
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "data.mdb").write_bytes(b"")
    async with open_engine(fresh) as mem:
        assert await mem.list_users() == []


async def test_a_data_mdb_that_is_a_folder_is_refused_as_that(tmp_path) -> None:
    """Opening a directory whose data.mdb is a folder raised IsADirectoryError from deep in
    the open; it is refused naming what was expected and found, the folder left alone."""
    store = tmp_path / "store"
    (store / "data.mdb").mkdir(parents=True)
    (store / "data.mdb" / "keep.txt").write_text("not a store")
    with pytest.raises(StoreCorrupt, match=r"expected data.mdb to be LMDB's data file, found "
                                           r"a folder"):
        async with open_engine(store):
            pass
    assert (store / "data.mdb" / "keep.txt").read_text() == "not a store"


async def test_a_missing_data_file_beside_indexes_that_hold_data_is_corrupt(tmp_path) -> None:
    """A data.mdb deleted (or never copied) beside indexes that hold data is the same loss as
    one emptied: StoreCorrupt, not a new empty store that deletes the text index."""
    store = tmp_path / "store"
    async with open_engine(store) as mem:
        await mem.add_turns([{"user_id": "ana", "session_id": "s1", "role": "user",
                              "text": f"turn {i} about Lisbon"} for i in range(300)])
        await mem.flush()
    (store / "data.mdb").unlink()
    before = {p.relative_to(store): p.stat().st_size for p in store.rglob("*") if p.is_file()}
    with pytest.raises(StoreCorrupt, match=r"data.mdb is missing.*restore the store from a "
                                           r"snapshot") as caught:
        async with open_engine(store):
            pass
    assert caught.value.database == "data.mdb"
    after = {p.relative_to(store): p.stat().st_size for p in store.rglob("*") if p.is_file()}
    assert after == before


async def test_a_commit_that_gives_back_its_last_pages_leaves_a_store_that_opens(
        tmp_path) -> None:
    """Updates of one note and its delete in one group commit: LMDB takes pages at the end of
    the file for the big texts and gives them back before the commit, so it never writes
    them and the file ends before the meta page's last page. The scrub the delete asks for
    broke the engine on it, and the next open refused the store as cut short (found by a
    fuzzing run over HTTP). Every page in use is there: the store opens, whole."""
    from ..test_concurrency_hostile import _gate_writer

    store = tmp_path / "store"

    async def update(mem: Engine, size: int) -> None:
        with contextlib.suppress(NotFound):
            await mem.update_note("ana", "n", "y" * size)

    async with open_engine(store) as mem:
        await mem.add_turn("bo", "s", "user", "a bystander's turn", durable=True)
        for _ in range(10):
            await mem.store_note("ana", "a note", note_id="n")
            gate = _gate_writer(mem)
            gate.clear()
            try:
                async with trio.open_nursery() as nursery:
                    for i in range(8):
                        nursery.start_soon(update, mem, 3000 * (i + 1))
                    nursery.start_soon(mem.delete_note, "ana", "n")
                    await trio.testing.wait_all_tasks_blocked()
                    gate.set()
            finally:
                gate.set()
            await mem.flush()
    async with open_engine(store) as mem:
        assert [t.text for t in await mem.session_history("bo", "s")] == ["a bystander's turn"]
    assert (await Engine.verify(store))["ok"]
    # The same file as a process killed right after such a commit leaves it: cut after its
    # last page in use (free pages made at its end first, so that there are some to cut). A
    # reader and verify take it as it is; the owner gives it its length.
    _free_pages_at_the_end(store)
    data = store / "data.mdb"
    cut = _cut_after_last_page_in_use(data)
    assert cut > 0
    assert (await Engine.verify(store))["ok"]
    async with open_engine(store) as mem:
        assert [t.text for t in await mem.session_history("bo", "s")] == ["a bystander's turn"]
    assert data.stat().st_size % 4096 == 0 and (await Engine.verify(store))["ok"]


def _free_pages_at_the_end(store: Path) -> None:
    """A value written at the end of the file, then deleted: free pages there."""
    env = lmdb.open(str(store), max_dbs=32, lock=False)
    with env.begin(write=True) as txn:
        txn.put(b"engram-test", b"x" * 400_000)
    with env.begin(write=True) as txn:
        txn.delete(b"engram-test")
    env.close()


def _cut_after_last_page_in_use(data: Path) -> int:
    """Cut ``data`` after the last page a tree uses; returns how many pages went."""
    from actors.store import pages

    buf = np.frombuffer(data.read_bytes(), dtype=np.uint8)
    meta = pages.read_meta(buf)
    main = pages._walk(buf, meta, meta.main_root, keep_leaves=True)
    trees = [pages._walk(buf, meta, meta.free_root, keep_leaves=False), main,
             *(pages._walk(buf, meta, root, keep_leaves=False)
               for root in pages._subdb_roots(buf, main))]
    last = max(int(p.max()) for tree in trees for p in tree.pages if len(p))
    os.truncate(data, (last + 1) * meta.psize)
    return meta.last_pgno - last


async def test_a_reader_checking_a_live_store_looks_again_after_a_commit(
        tmp_path, monkeypatch) -> None:
    """A reader (verify, a read-only open) checks a file short of free pages while the owner
    commits: the walk of the trees can then meet pages the owner just reused and call the
    file cut short. When the newest meta page changed meanwhile, the check looks again."""
    from actors.store import integrity

    store = tmp_path / "store"
    async with open_engine(store) as mem:
        await mem.add_turn("bo", "s", "user", "a bystander's turn", durable=True)
    _free_pages_at_the_end(store)
    assert _cut_after_last_page_in_use(store / "data.mdb") > 0
    walks = []

    def walked_during_a_commit(data: Path) -> bool:
        walks.append(data)
        if len(walks) == 1:  # the owner commits while this walk runs: it sees a torn tree
            return _commit_meanwhile(store)
        return fits(data)

    fits = integrity.in_use_fits
    monkeypatch.setattr(integrity, "in_use_fits", walked_during_a_commit)
    integrity.check_file(store)
    assert len(walks) == 2
    # An owner committing through every walk: a live store, taken as it is after the last
    # try, not called cut short.
    walks.clear()

    def always_during_a_commit(data: Path) -> bool:
        walks.append(data)
        return _commit_meanwhile(store)

    monkeypatch.setattr(integrity, "in_use_fits", always_during_a_commit)
    integrity.check_file(store)
    assert len(walks) == 8


def test_verify_beside_a_commit_that_grows_the_file_reports_no_damaged_page(
        store, monkeypatch) -> None:
    """verify's walk of the pages took the file's length, then read the newest meta page from
    the map: a commit by the owner in between that grew the file named pages past the map,
    and a healthy live store was reported damaged. The meta page is read first now."""
    from actors.store import pages

    grow = ("import lmdb, sys\n"
            "env = lmdb.open(sys.argv[1], max_dbs=32)\n"
            "with env.begin(write=True) as txn:\n"
            "    txn.put(b'engram-test', b'x' * 2_000_000)\n")
    real_fstat = pages.os.fstat

    class _Os:
        def __getattr__(self, name):
            return getattr(os, name)

        @staticmethod
        def fstat(fd):
            taken = real_fstat(fd)  # the length, then the owner commits
            subprocess.run([sys.executable, "-c", grow, str(store)], check=True)
            return taken

    monkeypatch.setattr(pages, "os", _Os())
    report = _verify(store)
    assert report["ok"], _problems(report)


def _commit_meanwhile(store: Path) -> bool:
    """A commit by another process while a walk runs; the walk saw a torn tree."""
    env = lmdb.open(str(store), max_dbs=32, lock=False)
    with env.begin(write=True) as txn:
        txn.put(b"engram-test", b"a commit meanwhile")
    env.close()
    return False
