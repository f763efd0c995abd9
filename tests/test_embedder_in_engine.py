"""The Embedder as the engine wires it: ``add_turn`` never waiting for vectors, ``embed``'s
arguments, the model a store is opened with (and refused with), what ``stats`` says of the
vectors, and forgetting through the facade (the actor alone: tests/actors/test_embedder.py)."""

from __future__ import annotations

import numpy as np
import pytest
import trio

import actors.embedder as embedder_mod
import actors.embedder.models as models_mod
from actors.ann_index import decode_vectors
from actors.store import read_user_vectors
from engine import (
    Engine,
    HashEmbedder,
    InvalidInput,
    ModelMismatch,
    ModelMissing,
    OnnxEmbedder,
)

from .actors.test_embedder import GatedEmbedder, RecordingEmbedder, _other_model
from .conftest import open_engine


async def stored_vectors(mem: Engine, user_id: str, dim: int = 384) -> dict[int, np.ndarray]:
    """The user's vectors as stored, by lsn, without their index headers."""
    lsns, values = await mem._store.read(read_user_vectors, user_id)
    if not lsns:
        return {}
    _, matrix = decode_vectors(values, len(lsns), dim)
    return dict(zip(lsns, matrix, strict=True))


@pytest.mark.parametrize(("model", "min_cosine"), [("minilm-l6-v2", 0.99999),
                                                   ("minilm-l6-v2-q8", 0.999),
                                                   ("minilm-l6-v2-i8", 0.99)])
async def test_real_model_embeds_committed_turns_in_the_background(tmp_path, model,
                                                                   min_cosine) -> None:
    """Turns get the same vector in the store as mem.embed gives for their text (the 8-bit
    variants' activations vary a little with the batch a text shares)."""
    async with Engine.open(tmp_path / "s", config={"model": model}) as mem:
        receipts = [await mem.add_turn("ana", "s1", "user", text)
                    for text in ("I moved to Lisbon", "My dog is called Pixel")]
        await mem.flush()
        stored = await stored_vectors(mem, "ana")
        direct = await mem.embed(["I moved to Lisbon", "My dog is called Pixel"])
        assert (await mem.stats()).model == embedder_mod.MODELS[model][1]
    for receipt, vector in zip(receipts, direct):
        assert stored[receipt.lsn] @ vector > min_cosine


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


async def test_other_files_under_the_stores_model_name_are_refused_until_reembedded(
        tmp_path) -> None:
    """The store recorded its model's name and width only: another model's files under the
    same names (or another tokenizer) opened, embedded new turns into vectors unlike the
    store's (cosine about 0 for the same text), and `reindex` said there was nothing to do.
    The store keeps the vector its model's files gave a probe sentence and refuses files that
    give another; a re-embedding adopts them."""
    real, where = embedder_mod.default_model_dir(), tmp_path / "model"
    where.mkdir()
    for name in ("tokenizer.json", "model.onnx"):
        (where / name).write_bytes((real / name).read_bytes())
    path = tmp_path / "s"
    config = {"model": "minilm-l6-v2", "model_dir": str(where)}
    async with Engine.open(path, config=config) as mem:
        await mem.add_turn("ana", "s", "user", "I moved to Lisbon", durable=True)
        await mem.flush()
    _other_model(where / "model.onnx", 384, unit=True)
    with pytest.raises(ModelMismatch, match=r"not the ones .* agree to cosine .*reindex .* --force"):
        async with Engine.open(path, config=config):
            pass
    async with Engine.open(path, config=config, reembed=True) as mem:
        await mem.flush()
    async with Engine.open(path, config=config) as mem:  # the new files are the store's now
        assert (await mem.stats()).model == "sentence-transformers/all-MiniLM-L6-v2"


async def test_reembed_with_the_stores_own_model_embeds_every_record_again(
        tmp_path, monkeypatch) -> None:
    """`engram-trio reindex --force` on a store whose vectors came from its own model said it
    had re-embedded every record and embedded none: reembed dropped the vectors only when the
    model differed. A store whose vectors are suspect (here: made wrongly under the model's
    name) is re-embedded with its own model, and no graph saved from the old vectors is
    searched."""
    import actors.ann_index.ann_index as ann_mod

    monkeypatch.setattr(ann_mod, "HNSW_THRESHOLD", 16)  # a graph for 300 vectors

    class Wrong(HashEmbedder):
        def encode(self, texts: list[str]) -> np.ndarray:
            return super().encode([t[::-1] for t in texts])

    class Counting(HashEmbedder):
        texts = 0

        def encode(self, texts: list[str]) -> np.ndarray:
            Counting.texts += len(texts)
            return super().encode(texts)

    path = tmp_path / "s"
    texts = [f"note {i} about {w}" for i, w in enumerate(("river", "train", "market") * 100)]
    async with open_engine(path, embedder=Wrong(), config={"long_term": False}) as mem:
        await mem.add_turns([{"user_id": "ana", "session_id": "s", "role": "user", "text": t}
                             for t in texts])
        await mem.flush()
        await mem.recall("ana", "river", legs=["vector"])  # builds her graph, saved at close
    assert list((path / "ann").glob("*.sum.json"))
    loaded: list[str] = []
    load_index = ann_mod.hnswlib.Index.load_index
    monkeypatch.setattr(ann_mod.hnswlib.Index, "load_index",
                        lambda graph, file, **kw: (loaded.append(file), load_index(graph, file,
                                                                                   **kw)))
    async with open_engine(path, embedder=Counting(), config={"long_term": False},
                           reembed=True) as mem:  # as `engram-trio reindex --force`: no search
        await mem.flush()
        assert Counting.texts >= len(texts)
    async with open_engine(path, embedder=Counting(), config={"long_term": False}) as mem:
        hits = await mem.recall("ana", texts[7], legs=["vector"], limit=1)
        assert [h.text for h in hits] == [texts[7]]
    assert loaded == []  # the old vectors' graph was dropped, not searched


async def test_embed_input_is_checked(tmp_path) -> None:
    """embed takes a list of strings; a lone string gets a hint."""
    async with open_engine(tmp_path / "s", config={"background_embedding": False}) as mem:
        with pytest.raises(InvalidInput, match=r"texts: expected a list of strings, found str; wrap one text in a list"):
            await mem.embed("hello")
        with pytest.raises(InvalidInput, match=r"texts\[1\]: expected a string, found int"):
            await mem.embed(["a", 1])
        assert (await mem.embed([])).shape == (0, 384)


async def test_embed_query_is_recalls_vector_cached_per_user(tmp_path) -> None:
    """embed_query gives the vector recall searches with: the model's, then the same cached
    array for that user's repeat; its arguments are checked like recall's."""
    async with open_engine(tmp_path / "s", config={"background_embedding": False}) as mem:
        first = await mem.embed_query("ana", "where does my sister live")
        assert first is await mem.embed_query("ana", "where does my sister live")
        assert not first.flags.writeable and abs(float(np.linalg.norm(first)) - 1.0) < 1e-5
        assert np.allclose(first, (await mem.embed(["where does my sister live"]))[0], atol=1e-5)
        with pytest.raises(InvalidInput, match="query"):
            await mem.embed_query("ana", "\ud800")
        with pytest.raises(InvalidInput, match="user_id"):
            await mem.embed_query("", "hello")


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
    monkeypatch.setattr(models_mod, "CHECKOUT_MODEL_DIR", tmp_path / "no-checkout")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.delenv(embedder_mod.MODEL_ENV, raising=False)
    expected = tmp_path / "data" / "engram-trio" / "models" / "all-MiniLM-L6-v2"
    assert embedder_mod.default_model_dir() == expected == embedder_mod.build_target()
    with pytest.raises(ModelMissing, match=r"found nothing; build it with `engram-trio model build`$"):
        async with Engine.open(tmp_path / "s"):
            pass
    monkeypatch.setenv(embedder_mod.MODEL_ENV, str(tmp_path / "elsewhere"))
    assert embedder_mod.default_model_dir() == tmp_path / "elsewhere" == embedder_mod.build_target()


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


def model_dir_preferring(tmp_path, preferred: str | None):
    """A model directory holding the built model's files (links) whose provenance says its
    build measured ``preferred`` as the faster variant (None: no measurement recorded)."""
    import json

    built = models_mod.default_model_dir()
    target = tmp_path / f"model-{preferred}"
    target.mkdir()
    for name in (*(file for file, _ in embedder_mod.MODELS.values()), "tokenizer.json"):
        (target / name).symlink_to(built / name)
    provenance = json.loads((built / "provenance.json").read_text())
    provenance.pop("preferred")
    if preferred is not None:
        provenance["preferred"] = preferred
    (target / "provenance.json").write_text(json.dumps(provenance))
    return target


@pytest.mark.parametrize(("preferred", "expected"), [("model.onnx", "minilm-l6-v2"),
                                                     ("model.q8.onnx", "minilm-l6-v2-q8"),
                                                     ("model.i8.onnx", "minilm-l6-v2-i8"),
                                                     (None, "minilm-l6-v2")])
async def test_a_new_store_gets_the_variant_its_model_build_measured_faster(
        tmp_path, preferred, expected) -> None:
    """A new store's model is the variant the model's build measured as the faster on this
    machine; with no measurement recorded, the reference fp32 model."""
    where = model_dir_preferring(tmp_path, preferred)
    async with Engine.open(tmp_path / "s", config={"long_term": False,
                                                   "model_dir": str(where)}) as mem:
        assert (await mem.stats()).model == embedder_mod.MODELS[expected][1]
    assert embedder_mod.default_model(where) == expected


@pytest.mark.parametrize("made_with", ["minilm-l6-v2", "minilm-l6-v2-q8"])
async def test_a_store_keeps_its_model_when_the_default_changes(tmp_path, made_with) -> None:
    """A store made with one variant opens with it under the default config, where the build
    now prefers the other, and its vectors stay; a new store gets the preferred one."""
    other = next(name for name in embedder_mod.MODELS if name != made_with)
    where = str(model_dir_preferring(tmp_path, embedder_mod.MODELS[other][0]))
    old = tmp_path / "old"
    async with Engine.open(old, config={"model": made_with, "long_term": False,
                                        "model_dir": where}) as mem:
        await mem.add_turn("ana", "s", "user", "I moved to Lisbon")
        await mem.flush()
        before = await stored_vectors(mem, "ana")
    async with Engine.open(old, config={"long_term": False, "model_dir": where}) as mem:
        assert (await mem.stats()).model == embedder_mod.MODELS[made_with][1]
        await mem.add_turn("ana", "s", "user", "I moved to Lisbon")
        await mem.flush()
        after = await stored_vectors(mem, "ana")
    assert set(before) < set(after)
    first, second = after.values()
    assert first @ second > 0.9999  # the same model embedded both
    async with Engine.open(tmp_path / "new", config={"long_term": False,
                                                     "model_dir": where}) as mem:
        assert (await mem.stats()).model == embedder_mod.MODELS[other][1]
