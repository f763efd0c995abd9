"""The Embedder: model parity, batching, priorities, the cache and background embedding."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
import trio

import actors.embedder as embedder_mod
from actors.ann_index import decode_vectors
from actors.store import read_user_vectors
from engine import (
    Engine,
    EngineBroken,
    EngineClosed,
    HashEmbedder,
    InvalidInput,
    ModelMismatch,
    ModelMissing,
    OnnxEmbedder,
)

from ..conftest import open_engine, raw_databases

REFERENCE = Path(__file__).resolve().parents[1] / "data" / "minilm-l6-v2-reference.json"


async def stored_vectors(mem: Engine, user_id: str, dim: int = 384) -> dict[int, np.ndarray]:
    """The user's vectors as stored, by lsn, without their index headers."""
    lsns, values = await mem._store.read(read_user_vectors, user_id)
    if not lsns:
        return {}
    _, matrix = decode_vectors(values, len(lsns), dim)
    return dict(zip(lsns, matrix, strict=True))


class GatedEmbedder(HashEmbedder):
    """A HashEmbedder whose calls wait for the test to open the gate, recording each batch."""

    def __init__(self, only: str = "") -> None:
        super().__init__()
        self.only = only  # gate only batches with a text starting with this
        self.gate = threading.Event()
        self.running = threading.Event()  # set once a gated call is inside the model
        self.batches: list[list[str]] = []

    def encode(self, texts):
        self.batches.append(list(texts))
        if any(t.startswith(self.only) for t in texts):
            self.running.set()
            self.gate.wait(10)
        return super().encode(texts)

    async def wait_running(self) -> None:
        await trio.to_thread.run_sync(self.running.wait, 10)


@pytest.fixture(scope="module")
def reference() -> dict:
    return json.loads(REFERENCE.read_text())


def _nearest(vectors: np.ndarray) -> np.ndarray:
    sims = vectors @ vectors.T
    np.fill_diagonal(sims, -np.inf)
    return sims.argmax(axis=1)


@pytest.mark.parametrize(("model", "min_cosine"), [("minilm-l6-v2", 0.9999), ("minilm-l6-v2-q8", 0.995)])
async def test_model_matches_the_reference_implementation(tmp_path, reference, model, min_cosine) -> None:
    """Through the actor, at batch 1 and in batches, every text embeds like sentence-transformers
    does, and every text keeps its nearest neighbour."""
    expected = np.asarray(reference["embeddings"], dtype=np.float32)
    texts = reference["texts"]
    async with Engine.open(tmp_path / "s", config={"model": model}) as mem:
        batched = await mem.embed(texts)
        one_by_one = np.concatenate([await mem.embed([t]) for t in texts])
    assert batched.shape == (64, 384) and batched.dtype == np.float32
    assert np.allclose(np.linalg.norm(batched, axis=1), 1.0, atol=1e-5)
    for got in (batched, one_by_one):
        cosines = (got * expected).sum(axis=1)
        assert cosines.min() >= min_cosine, (model, int(cosines.argmin()), float(cosines.min()))
        assert (_nearest(got) == _nearest(expected)).all()


@pytest.mark.parametrize(("model", "min_cosine"), [("minilm-l6-v2", 0.99999),
                                                   ("minilm-l6-v2-q8", 0.999)])
async def test_real_model_embeds_committed_turns_in_the_background(tmp_path, model,
                                                                   min_cosine) -> None:
    """Turns get the same vector in the store as mem.embed gives for their text (q8's 8-bit
    activations vary a little with the batch a text shares)."""
    async with Engine.open(tmp_path / "s", config={"model": model}) as mem:
        receipts = [await mem.add_turn("ana", "s1", "user", text)
                    for text in ("I moved to Lisbon", "My dog is called Pixel")]
        await mem.flush()
        stored = await stored_vectors(mem, "ana")
        direct = await mem.embed(["I moved to Lisbon", "My dog is called Pixel"])
        assert (await mem.stats()).model == embedder_mod.MODELS[model][1]
    for receipt, vector in zip(receipts, direct):
        assert stored[receipt.lsn] @ vector > min_cosine


async def test_requests_arriving_while_the_model_runs_form_the_next_batch(tmp_path) -> None:
    """Ten callers queued behind a busy model are served in one model call."""
    backend = GatedEmbedder()
    async with open_engine(tmp_path / "s", embedder=backend,
                           config={"background_embedding": False}) as mem:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(mem.embed, ["first"])
            await backend.wait_running()
            for i in range(10):
                nursery.start_soon(mem.embed, [f"queued {i}"])
            await trio.testing.wait_all_tasks_blocked()
            backend.gate.set()
    assert [len(b) for b in backend.batches] == [1, 10]


async def test_a_query_is_answered_while_background_work_is_stuck(tmp_path) -> None:
    """Queries have their own lane: a background batch stuck in the model does not hold them."""
    backend = GatedEmbedder(only="background")
    async with open_engine(tmp_path / "s", embedder=backend,
                           config={"background_embedding": False}) as mem:
        embedder = mem._embedder
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: embedder.embed(["background work"], query=False))
            await backend.wait_running()
            vector = await embedder.embed_query("the query")
            assert not backend.gate.is_set()
            backend.gate.set()
    assert np.array_equal(vector, HashEmbedder().encode(["the query"])[0])


async def test_query_embeddings_are_cached_in_a_bounded_lru(tmp_path) -> None:
    """A repeated query costs no model call; the least recently used entry is dropped."""
    backend = HashEmbedder()
    async with open_engine(tmp_path / "s", embedder=backend,
                           config={"background_embedding": False, "query_cache": 2}) as mem:
        embedder = mem._embedder
        first = await embedder.embed_query("where does Maya live")
        again = await embedder.embed_query("where does Maya live")
        assert again is first and len(backend.calls) == 1
        await embedder.embed_query("b")
        await embedder.embed_query("where does Maya live")  # refreshes it
        await embedder.embed_query("c")  # evicts "b"
        await embedder.embed_query("b")
        assert len(backend.calls) == 4
        with pytest.raises(ValueError):
            first[0] = 1.0  # shared by every hit, so read-only


async def test_add_turn_never_waits_for_embedding(tmp_path) -> None:
    """With the model stuck, turns are still acknowledged and durable; vectors follow later,
    and stored vectors are exactly the backend's for each text."""
    backend = GatedEmbedder()
    async with open_engine(tmp_path / "s", embedder=backend) as mem:
        receipts = [await mem.add_turn("ana", "s1", "user", f"note number {i}", durable=True)
                    for i in range(40)]
        assert (await mem.stats()).embedded_lsn == 0
        backend.gate.set()
        await mem.flush()
        # Past the turns: also the episodes the long-term layer made of them.
        assert (await mem.stats()).embedded_lsn >= receipts[-1].lsn
        stored = await stored_vectors(mem, "ana")
    expected = HashEmbedder().encode([f"note number {i}" for i in range(40)])
    for receipt, vector in zip(receipts, expected):
        assert np.allclose(stored[receipt.lsn], vector, atol=1e-3)  # stored as float16


async def test_embedding_resumes_from_the_watermark_after_reopen(tmp_path) -> None:
    """Turns stored with background embedding off are embedded by the next engine that has it on."""
    path = tmp_path / "s"
    turns_only = {"long_term": False}  # no episodes: every vector is a turn's
    async with open_engine(path, config={"background_embedding": False, **turns_only}) as mem:
        await mem.add_turns([{"user_id": "ana", "session_id": "s", "role": "user", "text": f"t{i}"}
                             for i in range(100)], durable=True)
    backend = HashEmbedder()
    async with open_engine(path, embedder=backend, config=turns_only) as mem:
        await mem.flush()
        assert len(await stored_vectors(mem, "ana")) == 100
    async with open_engine(path, embedder=(again := HashEmbedder()), config=turns_only) as mem:
        await mem.flush()
    assert again.calls == []  # nothing embedded twice


async def test_a_user_forgotten_while_being_embedded_leaves_no_vectors(tmp_path) -> None:
    """Vectors computed for a user who is forgotten meanwhile are never stored."""
    backend = GatedEmbedder()
    path = tmp_path / "s"
    async with open_engine(path, embedder=backend) as mem:
        for i in range(5):
            await mem.add_turn("zed", "s", "user", f"zed says {i}", durable=True)
        await mem.add_turn("ana", "s", "user", "ana stays", durable=True)
        await backend.wait_running()
        await mem.forget_user("zed")
        backend.gate.set()
        await mem.flush()
    vectors = raw_databases(path)["vectors"]
    assert [key.startswith(b"ana\x00") for key, _ in vectors] == [True]


async def test_a_store_from_another_model_is_refused_until_reembedded(tmp_path) -> None:
    """Opening with another model names both and the fix; reembed adopts it and re-embeds."""
    path = tmp_path / "s"
    async with open_engine(path, embedder=HashEmbedder(model_id="model-a")) as mem:
        await mem.add_turn("ana", "s", "user", "hello")
        await mem.flush()
    with pytest.raises(ModelMismatch, match=r"vectors from model-a .* engine runs model-b .*`engram-trio reindex") as info:
        async with open_engine(path, embedder=HashEmbedder(model_id="model-b")):
            pass
    assert (info.value.stored, info.value.configured) == ("model-a", "model-b")
    backend = HashEmbedder(dim=64, model_id="model-b")
    async with open_engine(path, embedder=backend, reembed=True) as mem:
        await mem.flush()
        (vector,) = (await stored_vectors(mem, "ana", dim=64)).values()
        assert vector.shape == (64,) and (await mem.stats()).model == "model-b"
    async with open_engine(path, embedder=HashEmbedder(dim=64, model_id="model-b")):
        pass


async def test_a_model_failure_is_raised_to_its_caller_and_the_engine_goes_on(tmp_path) -> None:
    """A batch the backend cannot embed raises EngineBroken for that caller only."""

    class Picky(HashEmbedder):
        def encode(self, texts):
            if "boom" in texts:
                raise RuntimeError("cannot embed boom")
            return super().encode(texts)

    async with open_engine(tmp_path / "s", embedder=Picky(),
                           config={"background_embedding": False}) as mem:
        with pytest.raises(EngineBroken, match=r"embedding 1 texts failed") as info:
            await mem.embed(["boom"])
        assert isinstance(info.value.__cause__, RuntimeError)
        assert (await mem.embed(["fine"])).shape == (1, 384)


async def test_embed_input_is_checked(tmp_path) -> None:
    """embed takes a list of strings; a lone string gets a hint."""
    async with open_engine(tmp_path / "s", config={"background_embedding": False}) as mem:
        with pytest.raises(InvalidInput, match=r"texts: expected a list of strings, found str; wrap one text in a list"):
            await mem.embed("hello")
        with pytest.raises(InvalidInput, match=r"texts\[1\]: expected a string, found int"):
            await mem.embed(["a", 1])
        assert (await mem.embed([])).shape == (0, 384)


async def test_large_embed_calls_are_cut_into_model_batches_in_order(tmp_path) -> None:
    """A long list goes to the model in batches of similar length and comes back in order."""
    backend = HashEmbedder()
    texts = [("word " * (i % 7 + 1)) + str(i) for i in range(100)]
    async with open_engine(tmp_path / "s", embedder=backend,
                           config={"background_embedding": False}) as mem:
        vectors = await mem.embed(texts)
    assert max(backend.calls) == embedder_mod.QUERY_BATCH
    assert np.array_equal(vectors, HashEmbedder().encode(texts))


async def test_a_missing_model_names_the_build_command(tmp_path) -> None:
    """Without built model files the engine refuses to open and says the one command that
    builds them where it looked."""
    where = tmp_path / "none"
    with pytest.raises(ModelMissing, match=rf"`engram-trio model build --dir {where}`"):
        async with Engine.open(tmp_path / "s", embedder=OnnxEmbedder(model_dir=where)):
            pass


async def test_an_installed_engine_looks_where_model_build_writes(tmp_path, monkeypatch) -> None:
    """With no model in a checkout, the engine looks in the per-user data directory (or
    $ENGRAM_MODEL_DIR), the place `engram-trio model build` writes to by default."""
    monkeypatch.setattr(embedder_mod, "CHECKOUT_MODEL_DIR", tmp_path / "no-checkout")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.delenv(embedder_mod.MODEL_ENV, raising=False)
    expected = tmp_path / "data" / "engram-trio" / "models" / "all-MiniLM-L6-v2"
    assert embedder_mod.default_model_dir() == expected == embedder_mod.build_target()
    with pytest.raises(ModelMissing, match=r"found nothing; build it with `engram-trio model build`$"):
        async with Engine.open(tmp_path / "s"):
            pass
    monkeypatch.setenv(embedder_mod.MODEL_ENV, str(tmp_path / "elsewhere"))
    assert embedder_mod.default_model_dir() == tmp_path / "elsewhere" == embedder_mod.build_target()


async def test_a_caller_waiting_for_room_when_the_engine_closes_is_told_so(tmp_path, monkeypatch) -> None:
    """A request that gets its inbox slot only after close() raises EngineClosed instead of
    queueing behind the stop marker, where no one would ever answer it."""
    monkeypatch.setattr(embedder_mod, "INBOX_SIZE", 1)
    backend = GatedEmbedder()
    results: dict[str, str] = {}

    async def call(mem: Engine, name: str) -> None:
        try:
            await mem.embed([name])
            results[name] = "answered"
        except EngineClosed:
            results[name] = "closed"

    async def open_gate_once_all_wait() -> None:
        await trio.testing.wait_all_tasks_blocked()
        backend.gate.set()

    async with trio.open_nursery() as outer:
        async with open_engine(tmp_path / "s", embedder=backend,
                               config={"background_embedding": False}) as mem:
            outer.start_soon(call, mem, "in the model")
            await backend.wait_running()
            outer.start_soon(call, mem, "waiting for a slot")
            await trio.testing.wait_all_tasks_blocked()
            outer.start_soon(open_gate_once_all_wait)
    assert results == {"in the model": "answered", "waiting for a slot": "closed"}


class RecordingEmbedder(HashEmbedder):
    """A HashEmbedder that records each batch's texts and the thread that ran it."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[tuple[str, list[str]]] = []

    def encode(self, texts):
        self.batches.append((threading.current_thread().name, list(texts)))
        return super().encode(texts)


async def test_the_follower_batches_a_window_sorted_by_tokens_within_the_budget(tmp_path) -> None:
    """Pending texts reach the model sorted by token count, each batch padded to at most
    BATCH_TOKENS tokens (or one text alone) and at most BACKGROUND_BATCH texts; every text
    gets its vector once."""
    path = tmp_path / "s"
    texts = [" ".join(f"w{i}x{j}" for j in range(1 + (i * 37) % 90)) for i in range(200)]
    turns_only = {"long_term": False}
    async with open_engine(path, config={"background_embedding": False, **turns_only}) as mem:
        await mem.add_turns([{"user_id": "ana", "session_id": "s", "role": "user", "text": t}
                             for t in texts], durable=True)
    backend = RecordingEmbedder()
    async with open_engine(path, embedder=backend, config=turns_only) as mem:
        await mem.flush()
        assert len(await stored_vectors(mem, "ana")) == 200
    count = backend.count_tokens
    seen = []
    for _, batch in backend.batches:
        tokens = count(batch)
        assert tokens == sorted(tokens)
        assert len(batch) <= embedder_mod.BACKGROUND_BATCH
        assert len(batch) == 1 or len(batch) * max(tokens) <= embedder_mod.BATCH_TOKENS
        seen.extend(batch)
    assert sorted(seen) == sorted(texts)
    # The window is cut by tokens: short texts share a batch, the longest go alone.
    assert max(len(b) for _, b in backend.batches) > 4
    assert min(len(b) for _, b in backend.batches) == 1


async def test_repeated_texts_are_embedded_once_until_a_forget(tmp_path) -> None:
    """"ok" said by many users costs one model call; forgetting anyone empties the content
    cache, so the forgotten text's vector does not stay in memory."""
    backend = RecordingEmbedder()
    async with open_engine(tmp_path / "s", embedder=backend, config={"long_term": False}) as mem:
        for user in ("ana", "bo", "cy"):
            for i in range(5):
                await mem.add_turn(user, "s", "user", "ok")
                await mem.add_turn(user, "s", "user", f"{user} says {i}")
        await mem.flush()
        embedded = [t for _, batch in backend.batches for t in batch]
        assert embedded.count("ok") == 1 and len(embedded) == 16
        stats = await mem.stats()
        assert (stats.texts_embedded, stats.embed_cache_hits) == (16, 14)
        for user in ("ana", "bo", "cy"):
            vectors = await stored_vectors(mem, user)
            assert len(vectors) == 10
        await mem.forget_session("cy", "s")
        await mem.add_turn("ana", "s", "user", "ok")
        await mem.flush()
        embedded = [t for _, batch in backend.batches for t in batch]
        assert embedded.count("ok") == 2


async def test_a_second_background_thread_waits_while_a_query_is_in_the_model(tmp_path) -> None:
    """While a query is in the model, only the first background thread runs background
    batches; the second runs again once the query is answered."""

    class Recording(GatedEmbedder):
        def __init__(self) -> None:
            super().__init__(only="the query")
            self.runs: list[tuple[str, bool]] = []  # (thread, a query was in the model)
            self.five_done = threading.Event()  # set once five background batches ran

        def encode(self, texts):
            if not texts[0].startswith("the query"):
                self.runs.append((threading.current_thread().name, self.running.is_set()
                                  and not self.gate.is_set()))
                if len(self.runs) >= 5:
                    self.five_done.set()
            return super().encode(texts)

    backend = Recording()
    async with open_engine(tmp_path / "s", embedder=backend,
                           config={"background_embedding": False}) as mem:
        embedder = mem._embedder
        async with trio.open_nursery() as nursery:
            nursery.start_soon(embedder.embed_query, "the query")
            await backend.wait_running()
            for i in range(6):
                nursery.start_soon(lambda i=i: embedder.embed([f"background {i}"], query=False))
            await trio.to_thread.run_sync(backend.five_done.wait, 10)
            backend.gate.set()
    assert len(backend.runs) == 6
    during_query = [name for name, query_inside in backend.runs if query_inside]
    assert len(during_query) >= 5
    assert set(during_query) == {"engram-embedder-background-0"}


async def test_stats_report_how_far_vectors_lag(tmp_path, mock_clock) -> None:
    """With the model stuck, the lag in records and seconds grows with the trio clock; once
    the model runs again and everything is embedded, both are zero."""
    mock_clock.autojump_threshold = 0.05  # jump only when idle: waits on threads stay real
    backend = GatedEmbedder()
    async with open_engine(tmp_path / "s", embedder=backend, config={"long_term": False}) as mem:
        before = trio.current_time()
        for i in range(10):
            await mem.add_turn("ana", "s", "user", f"note {i}", durable=True)
        await backend.wait_running()
        await trio.sleep(30)
        stats = await mem.stats()
        assert stats.vector_lag_records == 10
        # At least the 30 s slept; at most since before the first commit (the clock may also
        # jump while a commit's thread runs), to within a commit-time sample's step.
        assert 30 <= stats.vector_lag_seconds <= trio.current_time() - before + 0.1
        backend.gate.set()
        await mem.flush()
        stats = await mem.stats()
        assert (stats.vector_lag_records, stats.vector_lag_seconds) == (0, 0.0)


async def test_a_store_keeps_its_model_when_the_default_changes(tmp_path) -> None:
    """A store made with fp32 (the default before q8) opens with fp32 under the default
    config and its vectors stay; a new store gets the default, q8."""
    old = tmp_path / "old"
    async with Engine.open(old, config={"model": "minilm-l6-v2", "long_term": False}) as mem:
        await mem.add_turn("ana", "s", "user", "I moved to Lisbon")
        await mem.flush()
        before = await stored_vectors(mem, "ana")
    async with Engine.open(old, config={"long_term": False}) as mem:
        assert (await mem.stats()).model == "sentence-transformers/all-MiniLM-L6-v2"
        await mem.add_turn("ana", "s", "user", "I moved to Lisbon")
        await mem.flush()
        after = await stored_vectors(mem, "ana")
    assert set(before) < set(after)
    first, second = after.values()
    assert first @ second > 0.9999  # the same model embedded both
    async with Engine.open(tmp_path / "new", config={"long_term": False}) as mem:
        assert (await mem.stats()).model == embedder_mod.MODELS[embedder_mod.DEFAULT_MODEL][1]


def test_token_counts_do_not_include_padding() -> None:
    """The follower sorts and cuts its batches by token count: a count must be the text's own
    (the model's tokenizer.json pads every text to 128, which made every turn count 128 and
    cut batches of short turns at 4)."""
    model = OnnxEmbedder("minilm-l6-v2")
    model.load()
    assert model.count_tokens(["hello", "hello there my friend"]) == [3, 6]
    assert model.count_tokens(["word " * 400]) == [embedder_mod.MAX_TOKENS]
