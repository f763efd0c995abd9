"""The Embedder actor: model parity, batching, priorities, the caches and background embedding.

Driven bare: its model lanes alone, or with its follower over a real Store (tests/actors/
ground.py), turns appended as ingest appends them and forgets passed as the engine passes them.
What the engine makes of it (``add_turn`` never waiting, ``embed``'s arguments, the model a
store opens with, ``stats``) is in tests/test_embedder_in_engine.py.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
import pytest
import trio

import actors.embedder as embedder_mod
import actors.embedder.embedder as actor_mod
import actors.embedder.models as models_mod
import actors.store as store_mod
from actors.base.config import Config
from actors.base.errors import EngineBroken, EngineClosed, ModelMismatch, ModelMissing
from actors.embedder import EmbeddingBackend, Embedder, HashEmbedder, OnnxEmbedder
from native_models.build import NEIGHBOUR_MARGIN, fidelity

from ..conftest import raw_databases
from .ground import Ground, running_store

REFERENCE = Path(__file__).resolve().parents[1] / "data" / "minilm-l6-v2-reference.json"


@asynccontextmanager
async def running_model(backend: EmbeddingBackend, query_cache: int = Config().query_cache
                        ) -> AsyncIterator[Embedder]:
    """The Embedder's model lanes, running in a nursery of their own; closed on leaving."""
    embedder = Embedder(backend, query_cache)
    async with trio.open_nursery() as nursery:
        await nursery.start(embedder.run)
        try:
            yield embedder
        finally:
            embedder.close()


@asynccontextmanager
async def running_embedder(path: Path, backend: EmbeddingBackend, *, follow: bool = True,
                           reembed: bool = False) -> AsyncIterator[tuple[Ground, Embedder]]:
    """A store at ``path`` that keeps ``backend``'s vectors, the Embedder, and (``follow``) its
    follower embedding what the store commits; closed before the store, as the engine does."""
    embedder = Embedder(backend, Config().query_cache)
    async with running_store(path, model=embedder.model, reembed=reembed) as ground:
        await ground.start(embedder.run)
        if follow:
            await ground.nursery.start(embedder.follow, ground.store)
        try:
            yield ground, embedder
        finally:
            embedder.close()


async def embedded(ground: Ground, embedder: Embedder) -> None:
    """Wait until everything queued is committed and has its vector."""
    await ground.store.wait_written()
    await embedder.wait_embedded(ground.store.next_lsn - 1)


async def stored_vectors(ground: Ground, user_id: str, dim: int = 384) -> dict[int, np.ndarray]:
    """The user's vectors as stored, by lsn: each value is the index's 16-byte header (its
    little-endian u16 at byte 10 counts the chunks past the first), then each chunk's vector
    in float16; a record of several chunks gives its first chunk's."""
    lsns, values = await ground.store.read(store_mod.read_user_vectors, user_id)
    out, at = {}, 0
    for lsn in lsns:
        extra = int.from_bytes(values[at + 10: at + 12], "little")
        first = values[at + 16: at + 16 + 2 * dim]
        out[lsn] = np.frombuffer(first, dtype="<f2").astype(np.float32)
        at += 16 + (extra + 1) * 2 * dim
    assert at == len(values)
    return out


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


class RecordingEmbedder(HashEmbedder):
    """A HashEmbedder that records each batch's texts and the thread that ran it."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[tuple[str, list[str]]] = []

    def encode(self, texts):
        self.batches.append((threading.current_thread().name, list(texts)))
        return super().encode(texts)


@pytest.fixture(scope="module")
def reference() -> dict:
    return json.loads(REFERENCE.read_text())


@pytest.mark.parametrize(("model", "min_cosine", "margin"), [
    ("minilm-l6-v2", 0.9999, 0.0), ("minilm-l6-v2-q8", 0.995, 0.0),
    ("minilm-l6-v2-i8", 0.97, NEIGHBOUR_MARGIN)])
async def test_model_matches_the_reference_implementation(reference, model, min_cosine,
                                                          margin) -> None:
    """Through the actor, at batch 1 and in batches, every text embeds like sentence-transformers
    does, and keeps its nearest neighbour unless the new one was within ``margin`` of it in
    the reference (fp32 and q8: none may change). i8's integer arithmetic differs by processor: it
    flipped 2 of the 64 on an AVX2 EPYC and up to 5 batched on an AVX-512 VNNI Xeon, each
    with a reference margin under 0.025; its retrieval recall is fp32's on both
    (bench/embed.py --quality)."""
    expected = np.asarray(reference["embeddings"], dtype=np.float32)
    texts = reference["texts"]
    async with running_model(OnnxEmbedder(model)) as embedder:
        batched = await embedder.embed(texts)
        one_by_one = np.concatenate([await embedder.embed([t]) for t in texts])
    assert batched.shape == (64, 384) and batched.dtype == np.float32
    assert np.allclose(np.linalg.norm(batched, axis=1), 1.0, atol=1e-5)
    for got in (batched, one_by_one):
        cosines = (got * expected).sum(axis=1)
        assert cosines.min() >= min_cosine, (model, int(cosines.argmin()), float(cosines.min()))
        assert fidelity(got, expected, margin)["neighbours_flipped"] == 0, model


def _tasks() -> set[int]:
    return {int(tid) for tid in os.listdir("/proc/self/task")}


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread niceness is Linux's")
def test_the_models_helper_threads_yield_to_the_hot_path() -> None:
    """A model call shares its work with onnxruntime's helper threads; those run at
    MODEL_NICE, so on 2 cores they take only what the loop and the LMDB writer leave idle,
    while the thread that loads the model (a reused worker of the caller's) keeps its own."""
    import onnxruntime  # noqa: F401  # its import starts a thread of its own, at nice 0

    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    before = _tasks()
    backend = OnnxEmbedder("minilm-l6-v2-i8", threads=2)
    backend.load()
    helpers = _tasks() - before
    assert helpers, "onnxruntime started no helper thread for 2 intra-op threads"
    assert {os.getpriority(os.PRIO_PROCESS, tid) for tid in helpers} == {models_mod.MODEL_NICE}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own
    assert backend.encode(["I moved to Lisbon"]).shape == (1, 384)


@pytest.mark.parametrize(("model", "min_cosine"), [("minilm-l6-v2", 0.99999),
                                                   ("minilm-l6-v2-q8", 0.999),
                                                   ("minilm-l6-v2-i8", 0.99)])
async def test_real_model_embeds_committed_turns_in_the_background(tmp_path, model,
                                                                   min_cosine) -> None:
    """Turns get the same vector in the store as embed gives for their text (the 8-bit
    variants' activations vary a little with the batch a text shares)."""
    async with running_embedder(tmp_path / "s", OnnxEmbedder(model)) as (ground, embedder):
        lsns = [await ground.add_turn("ana", "s1", text)
                for text in ("I moved to Lisbon", "My dog is called Pixel")]
        await embedded(ground, embedder)
        stored = await stored_vectors(ground, "ana")
        direct = await embedder.embed(["I moved to Lisbon", "My dog is called Pixel"])
        assert embedder.model.id == embedder_mod.MODELS[model][1]
    for lsn, vector in zip(lsns, direct):
        assert stored[lsn] @ vector > min_cosine


async def test_requests_arriving_while_the_model_runs_form_the_next_batch() -> None:
    """Ten callers queued behind a busy model are served in one model call."""
    backend = GatedEmbedder()
    async with running_model(backend) as embedder:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(embedder.embed, ["first"])
            await backend.wait_running()
            for i in range(10):
                nursery.start_soon(embedder.embed, [f"queued {i}"])
            await trio.testing.wait_all_tasks_blocked()
            backend.gate.set()
    assert [len(b) for b in backend.batches] == [1, 10]


async def test_a_query_is_answered_while_background_work_is_stuck() -> None:
    """Queries have their own lane: a background batch stuck in the model does not hold them."""
    backend = GatedEmbedder(only="background")
    async with running_model(backend) as embedder:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: embedder.embed(["background work"], query=False))
            await backend.wait_running()
            vector = await embedder.embed_query("the query")
            assert not backend.gate.is_set()
            backend.gate.set()
    assert np.array_equal(vector, HashEmbedder().encode(["the query"])[0])


async def test_query_embeddings_are_cached_in_a_bounded_lru() -> None:
    """A repeated query costs no model call; the least recently used entry is dropped."""
    backend = HashEmbedder()
    async with running_model(backend, query_cache=2) as embedder:
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


async def test_a_forgotten_users_queries_leave_the_cache() -> None:
    """forget_user drops that user's cached queries only: theirs cost a model call again."""
    backend = HashEmbedder()
    async with running_model(backend) as embedder:
        await embedder.embed_query("where do I live", "ana")
        await embedder.embed_query("where do I live", "bo")
        embedder.forget_user("ana")
        await embedder.embed_query("where do I live", "bo")
        assert len(backend.calls) == 2
        await embedder.embed_query("where do I live", "ana")
        assert len(backend.calls) == 3


async def test_committed_turns_are_embedded_later_while_the_model_is_stuck(tmp_path) -> None:
    """With the model stuck, turns still commit and the watermark stays put; vectors follow
    later, and stored vectors are exactly the backend's for each text."""
    backend = GatedEmbedder()
    async with running_embedder(tmp_path / "s", backend) as (ground, embedder):
        lsns = [await ground.add_turn("ana", "s1", f"note number {i}", durable=True)
                for i in range(40)]
        assert embedder.embedded_lsn == 0
        backend.gate.set()
        await embedded(ground, embedder)
        assert embedder.embedded_lsn >= lsns[-1]
        stored = await stored_vectors(ground, "ana")
    expected = HashEmbedder().encode([f"note number {i}" for i in range(40)])
    for lsn, vector in zip(lsns, expected):
        assert np.allclose(stored[lsn], vector, atol=1e-3)  # stored as float16


async def test_embedding_resumes_from_the_watermark_after_reopen(tmp_path) -> None:
    """Turns stored without the follower are embedded by the next one that runs."""
    path = tmp_path / "s"
    async with running_embedder(path, HashEmbedder(), follow=False) as (ground, _):
        for i in range(100):
            await ground.add_turn("ana", "s", f"t{i}")
    async with running_embedder(path, HashEmbedder()) as (ground, embedder):
        await embedded(ground, embedder)
        assert len(await stored_vectors(ground, "ana")) == 100
    async with running_embedder(path, again := HashEmbedder()) as (ground, embedder):
        await embedded(ground, embedder)
    assert again.calls == []  # nothing embedded twice


async def test_a_user_forgotten_while_being_embedded_leaves_no_vectors(tmp_path) -> None:
    """Vectors computed for a user who is forgotten meanwhile are never stored."""
    backend = GatedEmbedder()
    path = tmp_path / "s"
    async with running_embedder(path, backend) as (ground, embedder):
        for i in range(5):
            await ground.add_turn("zed", "s", f"zed says {i}", durable=True)
        await ground.add_turn("ana", "s", "ana stays", durable=True)
        await backend.wait_running()
        embedder.forget_user("zed")
        await ground.store.forget("zed", None)
        backend.gate.set()
        await embedded(ground, embedder)
    vectors = raw_databases(path)["vectors"]
    assert [key.startswith(b"ana\x00") for key, _ in vectors] == [True]


async def test_a_store_from_another_model_is_refused_until_reembedded(tmp_path) -> None:
    """A store whose vectors came from another model refuses to open, naming both and the
    fix; with reembed it adopts the new model and the follower embeds everything again."""
    path = tmp_path / "s"
    async with running_embedder(path, HashEmbedder(model_id="model-a")) as (ground, embedder):
        await ground.add_turn("ana", "s", "hello")
        await embedded(ground, embedder)
    with pytest.RaisesGroup(pytest.RaisesExc(
            ModelMismatch, match=r"vectors from model-a .* engine runs model-b .*`engram-trio reindex")
            ) as info:
        async with running_embedder(path, HashEmbedder(model_id="model-b")):
            pass
    (mismatch,) = info.value.exceptions
    assert (mismatch.stored, mismatch.configured) == ("model-a", "model-b")
    backend = HashEmbedder(dim=64, model_id="model-b")
    async with running_embedder(path, backend, reembed=True) as (ground, embedder):
        await embedded(ground, embedder)
        (vector,) = (await stored_vectors(ground, "ana", dim=64)).values()
        assert vector.shape == (64,)
    async with running_embedder(path, HashEmbedder(dim=64, model_id="model-b")):
        pass


async def test_a_model_failure_is_raised_to_its_caller_and_the_actor_goes_on() -> None:
    """A batch the backend cannot embed raises EngineBroken for that caller only."""

    class Picky(HashEmbedder):
        def encode(self, texts):
            if "boom" in texts:
                raise RuntimeError("cannot embed boom")
            return super().encode(texts)

    async with running_model(Picky()) as embedder:
        with pytest.raises(EngineBroken, match=r"embedding 1 texts failed") as info:
            await embedder.embed(["boom"])
        assert isinstance(info.value.__cause__, RuntimeError)
        assert (await embedder.embed(["fine"])).shape == (1, 384)
        assert (await embedder.embed([])).shape == (0, 384)


async def test_large_embed_calls_are_cut_into_model_batches_in_order() -> None:
    """A long list goes to the model in batches of similar length and comes back in order."""
    backend = HashEmbedder()
    texts = [("word " * (i % 7 + 1)) + str(i) for i in range(100)]
    async with running_model(backend) as embedder:
        vectors = await embedder.embed(texts)
    assert max(backend.calls) == embedder_mod.QUERY_BATCH
    assert np.array_equal(vectors, HashEmbedder().encode(texts))


async def test_a_missing_model_names_the_build_command(tmp_path) -> None:
    """Without built model files the actor refuses to start and says the one command that
    builds them where it looked."""
    where = tmp_path / "none"
    with pytest.RaisesGroup(pytest.RaisesExc(
            ModelMissing, match=rf"`engram-trio model build --dir {where}`")):
        async with running_model(OnnxEmbedder(model_dir=where)):
            pass


def _other_model(path: Path, dim: int, unit: bool = False) -> None:
    """A tiny ONNX encoder under the engine's inputs and output: each token's row of a small
    random table, averaged (made unit vectors with ``unit``), ``dim`` wide."""
    from onnx import TensorProto, helper, numpy_helper, save

    table = np.random.default_rng(0).standard_normal((16, dim)).astype(np.float32)
    nodes = [helper.make_node("Mod", ["input_ids", "rows"], ["row"]),
             helper.make_node("Gather", ["table", "row"], ["each"], axis=0),
             helper.make_node("ReduceMean", ["each"], ["mean" if unit else "embeddings"],
                              axes=[1], keepdims=0)]
    if unit:
        nodes.append(helper.make_node("LpNormalization", ["mean"], ["embeddings"], axis=1, p=2))
    inputs = [helper.make_tensor_value_info(name, TensorProto.INT64, ["batch", "tokens"])
              for name in ("input_ids", "attention_mask")]
    output = helper.make_tensor_value_info("embeddings", TensorProto.FLOAT, ["batch", dim])
    graph = helper.make_graph(nodes, "other", inputs, [output], initializer=[
        numpy_helper.from_array(table, "table"),
        numpy_helper.from_array(np.array(16, dtype=np.int64), "rows")])
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(path))


@pytest.mark.parametrize(("damage", "says"), [
    ("tokenizer", r"cannot load .*tokenizer\.json"),
    ("768 wide", r"vectors of 768 dimensions where this engine needs 384"),
    ("not unit", r"vectors of length [0-9.]+ where this engine needs unit vectors"),
])
async def test_a_model_directory_holding_other_files_is_refused_at_load(tmp_path, damage,
                                                                        says) -> None:
    """Garbage in tokenizer.json came out of the load as the tokenizers library's bare
    Exception, naming no file; a model of another width or with vectors of another length
    under the engine's file name loaded, and the first batch of the background embedding
    broke the engine (a numpy broadcast error), or a store filled with vectors recall
    cannot compare."""
    real = embedder_mod.default_model_dir()
    where = tmp_path / "model"
    where.mkdir()
    for name in ("tokenizer.json", "model.onnx"):
        (where / name).write_bytes((real / name).read_bytes())
    if damage == "tokenizer":
        (where / "tokenizer.json").write_text('{"not": "a tokenizer"}')
    else:
        _other_model(where / "model.onnx", 768 if damage == "768 wide" else 384)
    with pytest.RaisesGroup(pytest.RaisesExc(ModelMissing, match=says)):
        async with running_model(OnnxEmbedder(model="minilm-l6-v2", model_dir=where)):
            pass


async def test_without_a_checkout_model_the_backend_looks_where_model_build_writes(
        tmp_path, monkeypatch) -> None:
    """With no model in a checkout, the backend looks in the per-user data directory (or
    $ENGRAM_MODEL_DIR), the place `engram-trio model build` writes to by default."""
    monkeypatch.setattr(models_mod, "CHECKOUT_MODEL_DIR", tmp_path / "no-checkout")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.delenv(embedder_mod.MODEL_ENV, raising=False)
    expected = tmp_path / "data" / "engram-trio" / "models" / "all-MiniLM-L6-v2"
    assert embedder_mod.default_model_dir() == expected == embedder_mod.build_target()
    with pytest.RaisesGroup(pytest.RaisesExc(
            ModelMissing, match=r"found nothing; build it with `engram-trio model build`$")):
        async with running_model(OnnxEmbedder()):
            pass
    monkeypatch.setenv(embedder_mod.MODEL_ENV, str(tmp_path / "elsewhere"))
    assert embedder_mod.default_model_dir() == tmp_path / "elsewhere" == embedder_mod.build_target()


async def test_a_caller_waiting_for_room_when_the_actor_closes_is_told_so(monkeypatch) -> None:
    """A request that gets its inbox slot only after close() raises EngineClosed instead of
    queueing behind the stop marker, where no one would ever answer it."""
    monkeypatch.setattr(actor_mod, "INBOX_SIZE", 1)
    backend = GatedEmbedder()
    results: dict[str, str] = {}

    async def call(embedder: Embedder, name: str) -> None:
        try:
            await embedder.embed([name])
            results[name] = "answered"
        except EngineClosed:
            results[name] = "closed"

    async def open_gate_once_all_wait() -> None:
        await trio.testing.wait_all_tasks_blocked()
        backend.gate.set()

    async with trio.open_nursery() as outer:
        async with running_model(backend) as embedder:
            outer.start_soon(call, embedder, "in the model")
            await backend.wait_running()
            outer.start_soon(call, embedder, "waiting for a slot")
            await trio.testing.wait_all_tasks_blocked()
            outer.start_soon(open_gate_once_all_wait)
    assert results == {"in the model": "answered", "waiting for a slot": "closed"}


async def test_the_follower_batches_a_window_sorted_by_tokens_within_the_budget(tmp_path) -> None:
    """Pending texts reach the model sorted by token count, each batch padded to at most
    BATCH_TOKENS tokens (or one text alone) and at most BACKGROUND_BATCH texts; every text
    gets its vector once."""
    path = tmp_path / "s"
    # At most 629 characters: each text is one chunk (actors.chunking).
    texts = [" ".join(f"{i}x{j}" for j in range(1 + (i * 37) % 90)) for i in range(200)]
    async with running_embedder(path, HashEmbedder(), follow=False) as (ground, _):
        for text in texts:
            await ground.add_turn("ana", "s", text)
    backend = RecordingEmbedder()
    async with running_embedder(path, backend) as (ground, embedder):
        await embedded(ground, embedder)
        assert len(await stored_vectors(ground, "ana")) == 200
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
    async with running_embedder(tmp_path / "s", backend) as (ground, embedder):
        for user in ("ana", "bo", "cy"):
            for i in range(5):
                await ground.add_turn(user, "s", "ok")
                await ground.add_turn(user, "s", f"{user} says {i}")
        await embedded(ground, embedder)
        texts = [t for _, batch in backend.batches for t in batch]
        assert texts.count("ok") == 1 and len(texts) == 16
        assert (embedder.texts_embedded, embedder.cache_hits) == (16, 14)
        for user in ("ana", "bo", "cy"):
            assert len(await stored_vectors(ground, user)) == 10
        embedder.forget_texts()
        await ground.store.forget("cy", "s")
        await ground.add_turn("ana", "s", "ok")
        await embedded(ground, embedder)
        texts = [t for _, batch in backend.batches for t in batch]
        assert texts.count("ok") == 2


async def test_a_second_background_thread_waits_while_a_query_is_in_the_model() -> None:
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
    async with running_model(backend) as embedder:
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


def test_token_counts_do_not_include_padding() -> None:
    """The follower sorts and cuts its batches by token count: a count must be the text's own
    (the model's tokenizer.json pads every text to 128, which made every turn count 128 and
    cut batches of short turns at 4)."""
    model = OnnxEmbedder("minilm-l6-v2")
    model.load()
    assert model.count_tokens(["hello", "hello there my friend"]) == [3, 6]
    assert model.count_tokens(["word " * 400]) == [embedder_mod.MAX_TOKENS]


class SlowBackend(HashEmbedder):
    """The test embedder, taking ``seconds`` (in its thread) over each batch."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.encoded = 0  # batches it embedded

    def encode(self, texts: list[str]) -> np.ndarray:
        time.sleep(self.seconds)
        self.encoded += 1
        return super().encode(texts)


async def test_a_cancelled_embedder_outlives_no_model_thread() -> None:
    """Cancelled while a model thread is inside a batch (Ctrl-C), the actor returns only once
    its threads have ended: a thread still inside onnxruntime when the interpreter exits
    aborts the process ("terminate called without an active exception")."""
    embedder = Embedder(SlowBackend(0.3), 8)

    def model_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("engram-embedder")]

    async with trio.open_nursery() as nursery:
        await nursery.start(embedder.run)
        nursery.start_soon(embedder.embed_query, "a query in the model")
        await trio.sleep(0.1)  # the query's batch is in the model now
        nursery.cancel_scope.cancel()
    assert model_threads() == []


async def test_a_cancelled_embedder_embeds_nothing_more_than_its_threads_hold() -> None:
    """Cancelled with batches queued behind those in the model, the actor waits for the
    running batches only: the queued ones are answered EngineClosed, not embedded."""
    backend = SlowBackend(0.3)
    embedder = Embedder(backend, 8, background_workers=1)
    closed: list[str] = []

    async def background(n: int) -> None:
        try:
            await embedder.embed([f"background text {n}"], query=False)
        except EngineClosed:
            closed.append(f"text {n}")

    async with trio.open_nursery() as outer:
        async with trio.open_nursery() as nursery:
            await nursery.start(embedder.run)
            for n in range(4):  # one lane thread: one batch in the model, three queued
                outer.start_soon(background, n)
            await trio.sleep(0.1)
            nursery.cancel_scope.cancel()
    assert backend.encoded == 1 and len(closed) == 3
