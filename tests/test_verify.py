"""verify and compact on paths that hold no store: the caller's mistake, said as one."""

from __future__ import annotations

import pytest

from engine import Engine, InvalidInput


async def test_verify_and_compact_refuse_a_path_that_holds_no_store_as_invalid_input(
        tmp_path) -> None:
    """A name too long, a NUL, a lone surrogate, a path through a file or a data.mdb that is a
    folder is InvalidInput naming the store (never an OSError), and nothing is made there."""
    (tmp_path / "a-file").write_text("not a directory")
    (tmp_path / "folder" / "data.mdb").mkdir(parents=True)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    for store in (tmp_path / ("x" * 300), tmp_path / "nul\x00", tmp_path / "\ud800",
                  tmp_path / "a-file" / "store", tmp_path / "folder"):
        for call in (Engine.verify, Engine.compact):
            with pytest.raises(InvalidInput, match=r"^store: expected an Engram store") as refused:
                await call(store)
            assert refused.value.field == "store", (call, store)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


async def test_a_compacted_store_above_lmdbs_default_map_is_sealed(tmp_path) -> None:
    """verify --seal opened LMDB with py-lmdb's default 10 MiB map: a store compacted to more
    than that had no page for the seal's one write (MDB_MAP_FULL), and verify called the
    healthy store broken and said to restore it from a snapshot, which would throw away
    everything written since. It is sealed; the MAC then checks."""
    from engine import Config, HashEmbedder

    key = "k0123456789abcdef0123456789abcdef"
    store = tmp_path / "store"
    async with Engine.open(store, config=Config(background_embedding=False, long_term=False),
                           embedder=HashEmbedder()) as mem:
        await mem.add_turns([{"user_id": "u", "session_id": f"s{i // 100}", "role": "user",
                              "text": f"turn {i} " + "w" * 1500} for i in range(8000)])
        await mem.flush()
    await Engine.compact(store)
    assert (store / "data.mdb").stat().st_size > 10 << 20
    report = await Engine.verify(store, integrity_key=key, seal=True)
    assert (report["ok"], report["mac"]) == (True, "sealed"), report
    assert (await Engine.verify(store, integrity_key=key))["mac"] == "checked"


async def test_two_active_versions_of_one_fact_key_are_a_problem_verify_names(tmp_path) -> None:
    """A store written before 79cbe2a could hold two active values of one key (a forget
    under a clock behind the recording one): recall showed both and the user's export did
    not import, while verify said the store was fine. It names the key and what to do."""
    import lmdb
    import msgspec

    from actors.store import decode_fact
    from actors.store.integrity import seal, unseal
    from engine import HashEmbedder

    store = tmp_path / "store"
    async with Engine.open(store, embedder=HashEmbedder()) as mem:
        await mem.remember_fact("u", "identity", "city", "Porto")
        await mem.correct_fact("u", "identity", "city", "Lisbon")
    assert (await Engine.verify(store))["ok"]
    env = lmdb.open(str(store), max_dbs=32)
    with env.begin(write=True) as txn:  # Porto made active again, as the old defect left it
        facts = env.open_db(b"facts", txn=txn, create=False)
        for key, value in list(txn.cursor(facts)):
            fact = decode_fact(unseal(value, b"facts", key))
            if fact.value == "Porto":
                revived = msgspec.structs.replace(fact, status="active", invalid_at=None)
                txn.put(key, seal(msgspec.msgpack.encode(revived), key), db=facts)
    env.close()
    report = await Engine.verify(store)
    assert not report["ok"]
    (problem,) = report["problems"]
    what = problem["what"]
    assert "identity/city" in what and "'u'" in what and "forget_fact" in what, what
