"""Long texts are embedded in chunks (seed 003): nothing past the model's window goes
unembedded, a chunk's hit returns its memory once, and forget, snapshots and restarts keep
every chunk's vector (or none)."""

from __future__ import annotations

import base64
import random
import re

import pytest
from tokenizers import Tokenizer

from actors.chunking import CHUNK_CHARS, CHUNK_OVERLAP, chunk_texts
from actors.embedder import MAX_TOKENS, OnnxEmbedder, default_model_dir
from actors.store import read_user_vectors
from engine import Engine
from engine._retrieval import MIN_COSINE

from .conftest import open_engine

# The sentence the long note ends with, and a question about it sharing none of its words.
SENTENCE = "My grandmother taught me to bake sourdough bread every Sunday morning."
QUESTION = "Who introduced this person into fermented loaf cooking at weekends?"
FILLER = (
    "The quarterly report for the logistics team is due at the end of the month, and the "
    "spreadsheet still lacks the numbers from the warehouse in Rotterdam. Our manager asked "
    "for a summary of delayed shipments, grouped by carrier, with the reasons each carrier "
    "gave. The car needs new winter tyres before November; the garage on the corner quoted "
    "a fair price but cannot fit them until the second week. Holiday plans are still open: "
    "a week of hiking in the Dolomites, or a quiet stay by a lake in Finland with a sauna. "
    "The new laptop arrived with the wrong keyboard layout, so it goes back to the shop on "
    "Tuesday and the old one stays in use until the replacement comes. ")


def _words(text: str) -> set[str]:
    return set(re.findall(r"\w+", text.lower()))


def _covers(text: str, chunks: list[str]) -> bool:
    """Whether the chunks are pieces of the text, in order, leaving no gap between them and
    none at either end."""
    end = 0
    for chunk in chunks:
        at = text.find(chunk, max(0, end - len(chunk)))
        if at < 0 or at > end or at + len(chunk) < end:
            return False
        end = at + len(chunk)
    return end == len(text)


def _model() -> OnnxEmbedder:
    model = OnnxEmbedder("minilm-l6-v2")
    model.load()
    return model


def test_the_question_shares_no_word_with_the_sentence() -> None:
    """The test below is about meaning: no word of the question is in the sentence."""
    assert not _words(SENTENCE) & _words(QUESTION)


def test_chunks_keep_seed_003s_size_and_overlap_and_cover_the_text() -> None:
    """640 characters at most, each repeating the end of the one before it, together holding
    every word of the text; a short text is its own chunk."""
    text = FILLER * 3 + SENTENCE
    chunks = chunk_texts([text, "hello there"], None)
    assert chunks[1] == ["hello there"]
    long = chunks[0]
    assert len(long) >= 3 and all(len(c) <= CHUNK_CHARS for c in long)
    for before, after in zip(long, long[1:]):
        assert after[:20] in before[-CHUNK_OVERLAP - 20:]  # the overlap is repeated
    assert _covers(text, long)
    assert long[-1].endswith(SENTENCE)


@pytest.mark.parametrize("text", [
    "".join(f"第{i}章、長い文章を読むのは大変ですが、最後まで読むと意味が分かります。"
            for i in range(40)),                                                # Japanese
    "".join(f"第{i}天我们周末去公园散步，然后在湖边的咖啡馆喝茶聊天。"
            for i in range(40)),                                                # Chinese
    "".join(f"def f{i}(x):\n    return {{k: [v ** {i} for v in x[k]] for k in sorted(x)}}\n"
            for i in range(30)),                                                # code
    base64.b64encode(random.Random(1).randbytes(3000)).decode(),                  # base64
])
def test_no_chunk_exceeds_the_models_window(text: str) -> None:
    """Where 640 characters are more than 256 tokens (CJK, code, base64 without a space), chunks
    are cut again at the window by the real tokenizer (unpadded: tokenizer.json pads to 128),
    and together they still hold all of the text."""
    model = _model()
    chunks = chunk_texts([text], model.fit_chars)[0]
    counter = Tokenizer.from_file(str(default_model_dir() / "tokenizer.json"))
    counter.no_truncation()
    counter.no_padding()
    sizes = [len(e.ids) for e in counter.encode_batch(chunks)]
    assert len(counter.encode(text).ids) > MAX_TOKENS  # the text itself would not fit
    assert max(sizes) <= MAX_TOKENS and len(chunks) > 1
    assert all(len(c) <= CHUNK_CHARS for c in chunks)
    assert _covers(text, chunks)


async def test_a_sentence_at_the_end_of_a_long_note_is_found_by_meaning(tmp_path) -> None:
    """With the real model and the vector leg alone: a note whose last sentence answers a
    paraphrased question comes first, as the sentence stored alone does, once, with the
    chunk it matched by named; the same holds for a long turn."""
    async with Engine.open(tmp_path / "s", config={"long_term": False}) as mem:
        long_note = await mem.store_note("ana", FILLER * 2 + SENTENCE)
        for text in ("I prefer tea to coffee in the afternoon.",
                     "The dentist appointment moved to Thursday at ten.",
                     "Our flat has a balcony facing the river."):
            await mem.store_note("ana", text)
        await mem.store_note("bo", SENTENCE)
        await mem.add_turn("cy", "s1", "user", FILLER * 2 + SENTENCE)
        await mem.add_turn("cy", "s1", "user", FILLER)
        await mem.flush()
        alone = await mem.recall("bo", QUESTION, limit=3, legs=["vector"])
        assert alone[0].text == SENTENCE
        hits = await mem.recall("ana", QUESTION, limit=5, legs=["vector"])
        assert hits[0].id == long_note.note_id
        assert len({h.id for h in hits}) == len(hits)
        chunks = chunk_texts([long_note.text], _model().fit_chars)[0]
        assert len(chunks) > 2 and hits[0].explain.chunk == len(chunks) - 1
        # Above the floor below which a memory only the vector leg found is dropped.
        assert hits[0].explain.cosine > MIN_COSINE
        assert (await mem.recall("ana", QUESTION, limit=3))[0].id == long_note.note_id
        assert all(h.explain.chunk is None for h in hits[1:])
        turns = await mem.recall("cy", QUESTION, limit=2, legs=["vector"])
        assert turns[0].text.endswith(SENTENCE) and turns[0].explain.chunk is not None


async def test_forget_snapshot_and_restart_keep_every_chunk_or_none(tmp_path) -> None:
    """A long note's chunk vectors survive a restart and a snapshot's restore (still found by
    its last chunk, the graph or not); deleting it leaves none of its vectors."""
    path = tmp_path / "s"
    text = " ".join(f"word{i}" for i in range(300)) + " zebra crossing bakery" * 3
    async with open_engine(path, config={"long_term": False}) as mem:
        note = await mem.store_note("ana", text)
        other = await mem.store_note("ana", "the bakery timetable")
        await mem.flush()
        before = await mem.recall("ana", "zebra crossing bakery", limit=2, legs=["vector"])
        assert before[0].id == note.note_id and before[0].explain.chunk is not None
        await mem.snapshot(tmp_path / "snap")
    async with open_engine(path, config={"long_term": False}) as mem:
        again = await mem.recall("ana", "zebra crossing bakery", limit=2, legs=["vector"])
        assert [(h.id, h.explain.chunk) for h in again] == [
            (h.id, h.explain.chunk) for h in before]
        assert await mem.delete_note("ana", note.note_id)
        await mem.flush()
        lsns, _ = await mem._store.read(read_user_vectors, "ana")
        assert lsns == [other.lsn]
        after = await mem.recall("ana", "zebra crossing bakery", limit=2, legs=["vector"])
        assert [h.id for h in after] == [other.note_id]
    await Engine.restore(tmp_path / "snap", tmp_path / "restored")
    async with open_engine(tmp_path / "restored", config={"long_term": False}) as mem:
        restored = await mem.recall("ana", "zebra crossing bakery", limit=2, legs=["vector"])
        assert [(h.id, h.explain.chunk) for h in restored] == [
            (h.id, h.explain.chunk) for h in before]


async def test_a_turn_said_twice_is_kept_twice_and_its_chunks_embedded_once(tmp_path) -> None:
    """Turns are never dropped from the store (a user may mean it twice): both stay in the
    session, and recall shows the words once (seed 003's content-hash dedupe). Their chunks
    are shared by content hash, so a repeated long text, or one that repeats another's
    opening chunks, costs the model only its new chunks."""
    words = " ".join(f"word{i}" for i in range(300))
    first, ending = words + " alpha ending here", words + " omega ending there"
    async with open_engine(tmp_path / "s", config={"long_term": False}) as mem:
        await mem.add_turn("ana", "s1", "user", first)
        await mem.flush()
        once = (await mem.stats()).texts_embedded
        chunks = chunk_texts([first], None)[0]
        assert once == len(chunks) > 2
        await mem.add_turn("ana", "s1", "user", first)
        await mem.add_turn("ana", "s1", "user", ending)
        await mem.flush()
        stats = await mem.stats()
        new = [c for c in chunk_texts([ending], None)[0] if c not in chunks]
        assert stats.texts_embedded - once == len(new) == 1
        history = await mem.session_history("ana", "s1")
        assert [t.text for t in history] == [first, first, ending]
        hits = await mem.recall("ana", "word150 word151 word152", limit=5, legs=["vector"])
        assert sorted(h.text for h in hits) == [first, ending]
        assert {h.id for h in hits} < {t.turn_id for t in history}


def test_a_reindexed_store_embeds_long_texts_in_chunks(tmp_path) -> None:
    """`engram-trio reindex` re-embeds every record through the same follower: a long note of
    a store re-embedded with another model is found by its last sentence, at its last chunk."""
    import trio

    from engine.__main__ import main

    async def build() -> str:
        async with Engine.open(tmp_path / "s", config={"long_term": False,
                                                       "model": "minilm-l6-v2-q8"}) as mem:
            note = await mem.store_note("ana", FILLER * 2 + SENTENCE)
            await mem.store_note("ana", "I prefer tea to coffee in the afternoon.")
            await mem.flush()
            return note.note_id

    async def ask() -> list:
        async with Engine.open(tmp_path / "s", config={"long_term": False}) as mem:
            return list(await mem.recall("ana", QUESTION, limit=2, legs=["vector"]))

    note_id = trio.run(build)
    assert main(["reindex", str(tmp_path / "s"), "--model", "minilm-l6-v2", "--json"]) == 0
    hits = trio.run(ask)
    chunks = chunk_texts([FILLER * 2 + SENTENCE], _model().fit_chars)[0]
    assert hits[0].id == note_id and hits[0].explain.chunk == len(chunks) - 1
