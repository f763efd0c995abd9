"""Case 5 of issue 11: notes and facts get vectors, so a paraphrase finds them; stores written
before they did are healed on open."""

from __future__ import annotations

import logging
from pathlib import Path

import lmdb

from engine import Engine

from ..conftest import downgrade_to_schema_4, raw_databases

USER = "ana"
DISTRACTORS = ["train leaves at nine tomorrow", "we repainted our kitchen blue",
               "laptop battery died again", "concert tickets sold out fast"]
NOTE = "Her daughter must never eat peanuts"
NOTE_QUERY = "which nuts are dangerous for the kid"
FACT = "works as a veterinary surgeon"
FACT_QUERY = "what is her job with animals"


async def _shares_no_word(mem: Engine, text: str, query: str) -> None:
    # The premise of each test: BM25 finds nothing, only the record's vector can.
    for other in (text, *DISTRACTORS):
        assert not set(mem._fulltext.terms(other)) & set(mem._fulltext.terms(query)), other


async def _fill(mem: Engine) -> tuple[str, str]:
    for i, text in enumerate(DISTRACTORS):
        await mem.add_turn(USER, "s1", "user" if i % 2 else "assistant", text)
    note = await mem.store_note(USER, NOTE)
    fact = await mem.remember_fact(USER, "identity", "occupation", "veterinary surgeon",
                                   text=FACT)
    return note.note_id, fact.fact_id


async def _found_by_paraphrase(mem: Engine, note_id: str, fact_id: str) -> None:
    await _shares_no_word(mem, NOTE, NOTE_QUERY)
    await _shares_no_word(mem, FACT, FACT_QUERY)
    note_hits = await mem.recall(USER, NOTE_QUERY, limit=3, kinds=["note", "turn"])
    assert note_hits and (note_hits[0].id, note_hits[0].via) == (note_id, ("vector",))
    fact_hits = await mem.recall(USER, FACT_QUERY, limit=3, kinds=["fact", "turn"])
    assert fact_hits and (fact_hits[0].id, fact_hits[0].via) == (fact_id, ("vector",))


async def test_notes_and_facts_are_found_by_a_paraphrase_sharing_no_word(tmp_path: Path) -> None:
    """With the real model, a note and a fact come back for questions that share no word
    with them: both were embedded."""
    async with Engine.open(tmp_path / "s", config={"long_term": False}) as mem:
        note_id, fact_id = await _fill(mem)
        await mem.flush()
        await _found_by_paraphrase(mem, note_id, fact_id)


def _unembed_notes_and_facts(path: Path) -> int:
    """Make the store look as the code before the fix left it: notes and facts without
    vectors, the embedding watermark past them, and the schema of that code (3): its values
    bare of the checksums schema 5 added."""
    downgrade_to_schema_4(path)
    env = lmdb.open(str(path), max_dbs=32)
    dropped = 0
    with env.begin(write=True) as txn:
        log = env.open_db(b"log", txn=txn)
        vectors = env.open_db(b"vectors", txn=txn)
        meta = env.open_db(b"meta", txn=txn)
        for key, entry in txn.cursor(log):
            if entry[:1] in (b"N", b"F"):
                dropped += txn.delete(b"ana\x00" + key, db=vectors)
        txn.put(b"schema", (3).to_bytes(8, "big"), db=meta)
        assert int.from_bytes(txn.get(b"embedded_lsn", db=meta), "big") == int.from_bytes(
            txn.get(b"last_lsn", db=meta), "big")
    env.close()
    return dropped


async def test_a_store_whose_notes_and_facts_lack_vectors_is_healed_on_open(
        tmp_path: Path, caplog) -> None:
    """Opening a store written before notes and facts were embedded embeds them (reporting its
    progress), after which a paraphrase finds them and the next open has nothing to do."""
    path = tmp_path / "s"
    async with Engine.open(path, config={"long_term": False}) as mem:
        note_id, fact_id = await _fill(mem)
        await mem.flush()
    assert _unembed_notes_and_facts(path) == 2

    caplog.set_level(logging.INFO, logger="engram")
    async with Engine.open(path, config={"long_term": False}) as mem:
        await mem.flush()
        await _found_by_paraphrase(mem, note_id, fact_id)
        assert (await mem.stats()).schema_version >= 4
    progress = [r.getMessage() for r in caplog.records if "without vectors" in r.getMessage()]
    assert progress and "2 of 2" in progress[-1], progress
    meta = dict(raw_databases(path)["meta"])
    assert not meta.get(b"embed_backlog")
    caplog.clear()
    async with Engine.open(path, config={"long_term": False}) as mem:
        await mem.flush()
    assert not [r for r in caplog.records if "without vectors" in r.getMessage()]
