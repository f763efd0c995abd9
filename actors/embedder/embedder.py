"""Embedder actor: owns the embedding model on its own thread; callers get unit-length vectors.

Batching is its business. Requests that arrive while the model runs form the next batch (no
timers: a model call takes milliseconds, so whatever queued meanwhile is the natural batch).
Queries (a caller on the hot path) and background work have separate lanes, so a query never
waits behind background embedding. What it runs is a backend of ``models.py``.

:meth:`Embedder.follow` embeds everything the store commits, in log order, in the background:
windows of pending texts sorted by token count, cut into batches by padded tokens, identical
texts embedded once per process.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import sys
import threading
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

import numpy as np
import outcome
import trio

from ..base.errors import EngineBroken, EngineClosed
from ..base.messages import EmbedRequest, PutState, PutVectors, Searchable
from ..ann_index import encode_vector
from ..chunking import Assembly, Piece, chunk_texts
from ..store import (
    Damaged,
    ModelInfo,
    Store,
    damage_puts,
    failure_put,
    read_log_range,
    read_searchables,
)
from .models import MODEL_NICE, EmbeddingBackend

__all__ = ["Embedder"]

INBOX_SIZE = 64  # queued requests before callers wait: the model is far behind by then
QUERY_BATCH = 32  # texts per model call while queries wait
log = logging.getLogger("engram.embedder")

# Texts per background call at most: each call's vectors are one write of ~25 KB (float16), so
# no commit a durable turn waits behind grows large.
BACKGROUND_BATCH = 32
# Padded tokens per background call (texts x the longest's tokens). A batch is padded to its
# longest text, so the follower sorts a window of pending texts by token count and cuts it by
# this budget: ~16 turns of 30 tokens, 32 short ones ("ok", "thanks!"), one long text alone.
# Measured on LoCoMo turns (bare onnxruntime, one thread): batches of 8-16 sorted by tokens run
# 1.6-2.3x the rate of unsorted batches of 16, and batches of 64 lose 10-20% again.
BATCH_TOKENS = 512
FOLLOW_CHUNK = 256  # records read from the log per step: the window sorted by token count
# Model threads serving the background lane. The second one takes work only while no query is
# in the model, and both run at MODEL_NICE, so they use what the hot path leaves idle.
BACKGROUND_WORKERS = 2
# Background texts whose vectors are kept by content hash, so "ok", "thanks!" and every other
# repeated text is embedded once per process (~1.5 KB each: 8,192 entries are ~12 MB).
CONTENT_CACHE = 8192
BACKLOG_REPORT = 1_024  # backlog records between two progress lines in the log
# How long a stopping actor waits for its model threads to finish their batches: a batch is
# cut to BATCH_TOKENS, tens of ms here, seconds at worst on a loaded machine.
STOP_SECONDS = 10.0


class _Lane:
    """Model threads sharing one inbox.

    With ``coalesce`` (the query lane, one thread) a thread batches every request that queued
    while the model ran. Without it each request is one model call, already sized by its
    caller (the follower cuts batches by tokens), so several threads can share the inbox: a
    thread that took everything queued would leave the others idle.
    """

    def __init__(self, name: str, nice: int, batch_texts: int, workers: int = 1,
                 coalesce: bool = True) -> None:
        self.name = name
        self.nice = nice
        self.batch_texts = batch_texts
        self.workers = workers
        self.coalesce = coalesce
        self.inbox: queue.SimpleQueue[EmbedRequest | None] = queue.SimpleQueue()
        # Set when the actor is cancelled: what is still queued is answered EngineClosed,
        # not embedded, so the threads stop after the batches they are in.
        self.abandoned = False

    def serve(self, encode: Callable[[list[str]], np.ndarray],
              busy: threading.Event | None = None, idle: threading.Event | None = None) -> None:
        """One thread's loop; returns after a stop marker, once what queued before it is
        answered.

        Args:
            encode: the backend's.
            busy: cleared while this thread has requests, set when it has none (the query
                lane tells the background lane when a query is in the model).
            idle: waited for before taking each request (a second background thread yields
                the model to queries).
        """
        if sys.platform == "linux" and self.nice:  # per-thread nice is Linux's
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
        pending: deque[EmbedRequest] = deque()
        stopping = False
        while True:
            if not pending:
                if busy is not None:
                    busy.set()
                if stopping:
                    return
                if idle is not None:
                    idle.wait()
                request = self.inbox.get()
                if request is None:
                    stopping = True
                    continue
                if idle is not None:
                    idle.wait()  # a query may have come while this thread waited for work
                pending.append(request)
            if busy is not None:
                busy.clear()
            while self.coalesce:
                try:
                    request = self.inbox.get_nowait()
                except queue.Empty:
                    break
                if request is None:
                    stopping = True
                else:
                    pending.append(request)
            batch = _take(pending, self.batch_texts)
            if self.abandoned:
                closed = outcome.Error(EngineClosed("the engine stopped before these texts "
                                                    "were embedded"))
                for request in batch:
                    request.reply(closed)
                continue
            result = outcome.capture(encode, [text for request in batch for text in request.texts])
            start = 0
            for request in batch:
                n = len(request.texts)
                if isinstance(result, outcome.Value):
                    request.reply(outcome.Value(result.value[start : start + n]))
                else:
                    request.reply(result)
                start += n


class Embedder:
    """The actor: one model, two lanes of long-lived threads that batch their own inboxes.
    Start ``run`` (and ``follow``, for background embedding) in the nursery.

    - The query lane (one thread, normal priority) serves callers on the hot path: requests
      that queued while the model ran form the next batch, up to QUERY_BATCH texts.
    - The background lane (``background_workers`` threads at nice MODEL_NICE) serves the
      follower one batch a call; every thread past the first waits while a query is in the
      model, so the second core goes to background work only while the hot path leaves it.

    All call the same onnxruntime session, whose ``run`` is thread-safe, so a query never
    waits behind a background batch (~160 ms for 16 turns), and on 2 cores the hot path
    preempts background inference instead of queueing behind it for CPU.

    Why threads that answer callers directly (``TrioToken.run_sync_soon``) and no trio task in
    between: measured here, each hop between trio tasks costs 30-250 µs once the loop has idled
    through a 5 ms model call; an actor task between callers and a worker made a query 12-17%
    slower than bare onnxruntime, and ``to_thread.run_sync`` alone ~14%. This shape makes two
    wake-ups per query. The inbox is a thread-safe queue bounded by a trio semaphore; each
    request carries its own one-shot reply.

    Background texts (the follower's, the episode summariser's) go through a bounded cache
    keyed by a hash of their content: a repeated text ("ok", "thanks!", a one-sentence turn
    the summariser splits out again) costs no model call.
    """

    def __init__(self, backend: EmbeddingBackend, query_cache: int,
                 background_workers: int = BACKGROUND_WORKERS) -> None:
        self.backend = backend
        self.model = ModelInfo(backend.model_id, backend.dim)
        self._lanes = {True: _Lane("query", 0, QUERY_BATCH),
                       False: _Lane("background", MODEL_NICE, BACKGROUND_BATCH,
                                    workers=background_workers, coalesce=False)}
        # Set while no query is in the model: a background thread past the first waits for it.
        self._query_idle = threading.Event()
        self._query_idle.set()
        self._slots = trio.Semaphore(INBOX_SIZE)  # a slot per queued request: backpressure
        self._cache: OrderedDict[tuple[str, str], np.ndarray] = OrderedDict()
        self._cache_size = query_cache
        self._content: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._content_generation = 0  # moves on each forget: results computed before it are not kept
        self.cache_hits = 0  # background texts answered without a model call of their own
        self.texts_embedded = 0  # background texts the model embedded
        self.embedded_lsn = 0
        self.backlog = 0  # records behind the watermark still to embed (a migration's list)
        # Vectors an import brought with its records (lsn -> chunks x dim), stored as they
        # are when the follower reaches them instead of running the model; in lsn order.
        self._preset: dict[int, np.ndarray] = {}
        self._preset_order: deque[int] = deque()
        self.vectors_imported = 0  # records whose vectors came with their import
        # Parked: callers of wait_embedded, until the follower passes their lsn.
        self._progress = trio.lowlevel.ParkingLot()
        self._closed = False

    # -- the actor ---------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Load the model, start both lanes, and live until their threads stop."""
        await trio.to_thread.run_sync(self.backend.load)
        token = trio.lowlevel.current_trio_token()
        threads = [(lane, i) for lane in self._lanes.values() for i in range(lane.workers)]
        stopped = [trio.Event() for _ in threads]  # set as each thread ends

        def thread_main(lane: _Lane, index: int, done: trio.Event) -> None:
            try:
                if lane.coalesce:
                    lane.serve(self.backend.encode, busy=self._query_idle)
                else:
                    lane.serve(self.backend.encode, idle=self._query_idle if index else None)
            finally:
                try:
                    token.run_sync_soon(done.set)
                except trio.RunFinishedError:
                    pass  # the engine's trio run is over; nobody is left to tell

        started = []
        for (lane, index), done in zip(threads, stopped, strict=True):
            thread = threading.Thread(target=thread_main, args=(lane, index, done), daemon=True,
                                      name=f"engram-embedder-{lane.name}-{index}")
            thread.start()
            started.append(thread)
        try:
            task_status.started()
            for event in stopped:
                await event.wait()
        except BaseException:
            for lane in self._lanes.values():
                lane.abandoned = True
            raise
        finally:
            self._stop_lanes()  # after a cancellation too: each thread ends after its batch
            # ...and is waited for: a thread still inside onnxruntime when the interpreter
            # exits (Ctrl-C during a batch) aborts the process ("terminate called without an
            # active exception"). Its batch is bounded, so is this wait.
            with trio.move_on_after(STOP_SECONDS, shield=True):
                for event in stopped:
                    await event.wait()
                # Each has told it is done from its last lines: let it end them.
                await trio.to_thread.run_sync(_join_all, started)

    def _stop_lanes(self) -> None:
        for lane in self._lanes.values():
            for _ in range(lane.workers):
                lane.inbox.put(None)

    def close(self) -> None:
        """Stop taking requests; queued ones are still answered, then the lanes end."""
        self._closed = True
        self._stop_lanes()
        self._progress.unpark_all()

    # -- callers -----------------------------------------------------------------------------

    async def embed(self, texts: list[str], *, query: bool = True) -> np.ndarray:
        """Vectors for ``texts`` (n x dim, float32, unit length), in order.

        More than QUERY_BATCH texts are embedded in batches of similar length, since a batch
        is padded to its longest text. Background texts (``query=False``) are looked up in
        the content cache first, and each distinct text is embedded once.

        Raises:
            EngineBroken: the model failed on this batch (``__cause__`` has why).
            EngineClosed: the engine is closed.
        """
        if query:
            return await self._embed_many(texts, True)
        out = np.empty((len(texts), self.model.dim), dtype=np.float32)
        missing: dict[bytes, list[int]] = {}
        content = self._content
        for row, text in enumerate(texts):
            key = hashlib.blake2b(text.encode(), digest_size=16).digest()
            vector = content.get(key)
            if vector is not None:
                content.move_to_end(key)
                out[row] = vector
            else:
                missing.setdefault(key, []).append(row)
        self.cache_hits += len(texts) - len(missing)  # repeats within the call count too
        if not missing:
            await trio.lowlevel.checkpoint()
            return out
        generation = self._content_generation
        vectors = await self._embed_many([texts[rows[0]] for rows in missing.values()], False)
        self.texts_embedded += len(missing)
        keep = generation == self._content_generation  # a forget meanwhile: keep nothing
        for (key, rows), vector in zip(missing.items(), vectors, strict=True):
            out[rows] = vector
            if keep:
                content[key] = vector
        while len(content) > CONTENT_CACHE:
            content.popitem(last=False)
        return out

    async def _embed_many(self, texts: list[str], query: bool) -> np.ndarray:
        if len(texts) <= QUERY_BATCH:
            return await self._embed_batch(texts, query)
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        out = np.empty((len(texts), self.model.dim), dtype=np.float32)
        for at in range(0, len(order), QUERY_BATCH):
            rows = order[at : at + QUERY_BATCH]
            out[rows] = await self._embed_batch([texts[i] for i in rows], query)
        return out

    async def _embed_batch(self, texts: list[str], query: bool) -> np.ndarray:
        if not texts:
            await trio.lowlevel.checkpoint()
            return np.zeros((0, self.model.dim), dtype=np.float32)
        try:
            # A free slot is taken at once: the request reaches the model now, not after a
            # round of the scheduler in which the caller's other tasks run first (a recall's
            # other legs, while its query waits to be embedded). ``done.wait`` below is the
            # checkpoint.
            self._slots.acquire_nowait()
        except trio.WouldBlock:
            await self._slots.acquire()
        # Checked after the last checkpoint and right before the put: a request queued behind
        # close()'s stop marker would never be answered.
        if self._closed:
            self._slots.release()
            raise EngineClosed("the engine is closed; open a new one with Engine.open(path)")
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()  # set on the trio thread when the model thread has answered
        box: list[outcome.Outcome] = []

        def answered(result: outcome.Outcome) -> None:  # on the trio thread
            box.append(result)
            self._slots.release()
            done.set()

        def reply(result: outcome.Outcome) -> None:  # on the model thread
            try:
                token.run_sync_soon(answered, result)
            except trio.RunFinishedError:
                pass

        self._lanes[query].inbox.put(EmbedRequest(tuple(texts), query, reply))
        await done.wait()  # a cancelled caller leaves; answered() still frees its slot
        try:
            return box[0].unwrap()
        except EngineClosed:
            raise  # the actor stopped before this batch reached the model
        except Exception as exc:
            raise EngineBroken(f"embedding {len(texts)} texts failed: {exc!r}") from exc

    async def embed_query(self, text: str, user_id: str = "") -> np.ndarray:
        """One query's vector, from a bounded LRU cache when this user asked it before.

        The cache is keyed by user as well as text, so forgetting a user can clear it
        (:meth:`forget_user`): a query can hold what a user said.
        """
        key = (user_id, text)
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            await trio.lowlevel.checkpoint()
            return cached
        vector = (await self.embed([text], query=True))[0]
        vector.setflags(write=False)  # shared by every later hit
        self._cache[key] = vector
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return vector

    def forget_user(self, user_id: str) -> None:
        """Drop the user's cached query embeddings, and the content cache (see
        :meth:`forget_texts`)."""
        for key in [k for k in self._cache if k[0] == user_id]:
            del self._cache[key]
        self.forget_texts()

    def forget_texts(self) -> None:
        """Empty the content cache. Its entries are not tied to a user (the same "thanks!" is
        everyone's), so a forget drops them all rather than leave a forgotten text's vector
        in memory; it refills from the next texts embedded."""
        self._content.clear()
        self._content_generation += 1

    async def wait_embedded(self, lsn: int) -> None:
        """Return once every searchable record up to ``lsn`` has its vector committed, the
        backlog a migration listed included."""
        while self.embedded_lsn < lsn or self.backlog:
            if self._closed:
                raise EngineClosed("the engine is closed; open a new one with Engine.open(path)")
            await self._progress.park()
        await trio.lowlevel.checkpoint()

    # -- the background follower -------------------------------------------------------------

    async def follow(self, store: Store,
                     on_vectors: Callable[[list[tuple[int, str, bytes]]], None] | None = None, *,
                     task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Embed every committed record past the store's watermark, in log order, forever.

        Each step reads up to FOLLOW_CHUNK records, sorts them by token count and cuts them
        into batches of at most BATCH_TOKENS padded tokens; as many batches are in the model
        at once as the background lane has threads (plus one queued, so no thread waits for
        the next), and their vectors are written in order, each batch on its own, so no
        commit that a durable turn waits behind carries more than ~25 KB of vectors. The
        watermark moves with the step's last write only.

        ``on_vectors`` gets each batch's written vectors on the trio thread, in commit order
        (the ANN index's feed).
        """
        self.embedded_lsn = store.embedded_lsn
        self.backlog = len(store.embed_backlog)
        task_status.started()
        try:
            await self._embed_backlog(store, on_vectors)
            while True:
                await store.wait_commit_beyond(self.embedded_lsn)
                await store.yield_to_receipts(before_step=True)
                damaged: list[Damaged] = []
                records, _, last = await store.read(
                    read_log_range, self.embedded_lsn, store.committed_lsn, FOLLOW_CHUNK, damaged
                )
                if damaged:  # kept as failures; the vectors go on without those records
                    await store.write_unlogged(PutState(damage_puts("embedder", damaged), (),
                                                        trio.Event()))
                if self._preset:
                    records = await self._write_preset(store, records, last, on_vectors)
                if records or self.embedded_lsn < last:  # else the preset moved the watermark
                    batches = await self._token_batches(records)
                    await self._embed_in_order(store, batches, last, on_vectors)
                self.embedded_lsn = last
                self._progress.unpark_all()
        except EngineClosed:
            return  # the engine is closing; the watermark on disk says where to resume

    def preset(self, vectors: list[tuple[int, np.ndarray]]) -> None:
        """Take vectors that came with imported records (lsn, its vector or chunks x dim),
        in lsn order, before the follower can read those records (synchronous: the import
        calls this in the same step that queues them). The follower stores them instead of
        embedding the records; one it never reads (a record refused, or forgotten first) is
        dropped once its step has passed that lsn."""
        for lsn, vector in vectors:
            self._preset[lsn] = vector
            self._preset_order.append(lsn)

    async def _write_preset(self, store: Store, records: list[Searchable], last: int,
                            on_vectors: Any) -> list[Searchable]:
        """Store the preset vectors of ``records``, BACKGROUND_BATCH records a commit (as a
        model batch's are); returns the records left to embed. The watermark moves to
        ``last`` with the final write when none is left, else with the model's."""
        preset, rest = [], []
        for record in records:
            vector = self._preset.pop(record.lsn, None)
            if vector is None:
                rest.append(record)
            else:
                preset.append((record.lsn, record.user_id, encode_vector(record, vector)))
        while self._preset_order and self._preset_order[0] <= last:
            self._preset.pop(self._preset_order.popleft(), None)
        for start in range(0, len(preset), BACKGROUND_BATCH):
            final = not rest and start + BACKGROUND_BATCH >= len(preset)
            await store.write_unlogged(PutVectors(
                preset[start:start + BACKGROUND_BATCH], last if final else self.embedded_lsn,
                trio.Event(), on_vectors))
            self.vectors_imported += min(BACKGROUND_BATCH, len(preset) - start)
            if final:
                self.embedded_lsn = last
        return rest

    async def _pieces(self, records: list[Searchable]) -> list[Piece]:
        """Each record's chunks (:mod:`actors.chunking`), cut in a worker thread with the
        backend's tokenizer: a text the model's window holds is one piece, as it is."""
        if not records:
            return []
        fit = getattr(self.backend, "fit_chars", None)
        chunks = await trio.to_thread.run_sync(chunk_texts, [r.text for r in records], fit)
        return [Piece(record, i, len(texts), text)
                for record, texts in zip(records, chunks, strict=True)
                for i, text in enumerate(texts)]

    async def _token_batches(self, records: list[Searchable]) -> list[list[Piece]]:
        """``records``' chunks sorted by token count, cut where a batch would pad past
        BATCH_TOKENS or hold more than BACKGROUND_BATCH texts."""
        pieces = await self._pieces(records)
        if not pieces:
            return []
        count = getattr(self.backend, "count_tokens", None)
        texts = [p.text for p in pieces]
        if count is None:  # a backend without a tokenizer of its own: words approximate
            tokens = [len(t.split()) + 2 for t in texts]
        else:
            tokens = await trio.to_thread.run_sync(count, texts)
        order = sorted(range(len(pieces)), key=tokens.__getitem__)
        batches: list[list[Piece]] = []
        batch: list[Piece] = []
        for i in order:
            # Sorted ascending, so this text is the batch's longest once added.
            if batch and (len(batch) == BACKGROUND_BATCH
                          or (len(batch) + 1) * tokens[i] > BATCH_TOKENS):
                batches.append(batch)
                batch = []
            batch.append(pieces[i])
        batches.append(batch)
        return batches

    async def _embed_in_order(self, store: Store, batches: list[list[Piece]], last: int,
                              on_vectors: Any) -> None:
        """Embed ``batches`` with up to one per background thread in the model (plus one
        queued), and write the vectors in batch order: a record's once its last chunk's batch
        is in (its chunks are stored together); the last write moves the watermark to
        ``last``.

        Raises:
            EngineClosed / EngineBroken: from the model or the store, in batch order.
        """
        if not batches:
            await store.write_unlogged(PutVectors([], last, trio.Event(), on_vectors))
            return
        results: list[Any] = [None] * len(batches)  # each an outcome of (pieces, vectors)
        ready = [trio.Event() for _ in batches]  # each set once its batch's outcome is in
        room = trio.Semaphore(self._lanes[False].workers + 1)  # batches in the model or queued
        assembly = Assembly()

        async def embed_one(i: int) -> None:
            try:
                results[i] = outcome.Value(await self._embed_pieces(store, batches[i]))
            except (EngineClosed, EngineBroken) as exc:  # raised in order by the writer
                results[i] = outcome.Error(exc)
            finally:
                room.release()
                ready[i].set()

        async def feed(nursery: trio.Nursery) -> None:
            for i in range(len(batches)):
                await room.acquire()
                nursery.start_soon(embed_one, i)

        failure: outcome.Outcome | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(feed, nursery)
            for i in range(len(batches)):
                await ready[i].wait()
                result = results[i]
                if isinstance(result, outcome.Error):
                    failure = result
                    nursery.cancel_scope.cancel()
                    break
                items = assembly.add(*result.value)
                watermark = last if i == len(batches) - 1 else self.embedded_lsn
                try:
                    await store.write_unlogged(PutVectors(items, watermark, trio.Event(),
                                                          on_vectors))
                except (EngineClosed, EngineBroken) as exc:
                    failure = outcome.Error(exc)
                    nursery.cancel_scope.cancel()
                    break
        if failure is not None:
            failure.unwrap()

    async def _embed_backlog(self, store: Store,
                             on_vectors: Callable[[list[tuple[int, str, bytes]]], None] | None
                             ) -> None:
        """Embed the records behind the watermark that a migration found without a vector,
        each batch's vectors written with what is left of the list (so a crash resumes it)."""
        backlog = list(store.embed_backlog)
        total = len(backlog)
        if not total:
            return
        log.info("embedder: %d records behind the watermark are without vectors (a store "
                 "written before schema 4); embedding them first", total)
        done = 0
        while backlog:
            lsns, backlog = backlog[:BACKGROUND_BATCH], backlog[BACKGROUND_BATCH:]
            records = await store.read(read_searchables, lsns)
            items = []
            if records:
                pieces = await self._pieces(records)
                vectors = await self.embed([p.text for p in pieces], query=False)
                items = Assembly().add(pieces, list(vectors))
            rest = array("Q", backlog)
            rest.byteswap()  # big-endian on disk, like every integer in the store
            await store.write_unlogged(PutVectors(items, self.embedded_lsn, trio.Event(),
                                                  on_vectors, rest.tobytes()))
            done += len(lsns)
            self.backlog = len(backlog)
            if not backlog or done % BACKLOG_REPORT < BACKGROUND_BATCH:
                log.info("embedder: %d of %d records without vectors embedded", done, total)
        self._progress.unpark_all()


    async def _embed_pieces(self, store: Store, chunk: list[Piece]
                            ) -> tuple[list[Piece], list[np.ndarray]]:
        """The batch's pieces and their vectors. If the model fails on the batch, each piece
        is embedded alone: a record with a piece the model cannot take is kept as a failure
        in the store and left without vectors (BM25 still finds it), and the others go on.
        A failure that lands once the actor is closed ends the follower as a close does
        (EngineClosed): its records are taken up again at the next open."""
        try:
            return chunk, list(await self.embed([p.text for p in chunk], query=False))
        except EngineBroken as exc:
            if self._closed:
                raise EngineClosed("the engine closed while the batch was embedded") from exc
        kept, vectors, failures = [], [], []
        failed: set[int] = set()
        for piece in chunk:
            record = piece.record
            try:
                vectors.append((await self.embed([piece.text], query=False))[0])
                kept.append(piece)
            except EngineBroken as exc:
                if self._closed:
                    raise EngineClosed("the engine closed while the batch was embedded") from exc
                if record.lsn in failed:
                    continue
                failed.add(record.lsn)
                log.warning("embedder: record %d failed and is kept as a failure: %r",
                            record.lsn, exc.__cause__)
                failures.append(failure_put(record.lsn, "embedder", record.user_id,
                                            record.memory_id, exc.__cause__ or exc))
        if failures:
            store.submit(PutState(tuple(failures)))
        return ([p for p in kept if p.record.lsn not in failed],
                [v for p, v in zip(kept, vectors, strict=True) if p.record.lsn not in failed])


def _join_all(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.join(STOP_SECONDS)


def _take(requests: deque[EmbedRequest], limit: int) -> list[EmbedRequest]:
    """Whole requests from the front, up to ``limit`` texts (at least one request)."""
    batch = [requests.popleft()]
    count = len(batch[0].texts)
    while requests and count + len(requests[0].texts) <= limit:
        request = requests.popleft()
        batch.append(request)
        count += len(request.texts)
    return batch
