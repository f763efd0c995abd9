"""Stats: what the engine holds and how far each part has got, for a health check; the
records some part could not take; a user's memory counts (seed 004's memory_stats).
"""

from __future__ import annotations

from typing import Any

import msgspec
import trio

from actors.base.records import SCHEMA_VERSION, Failure
from actors.store import count_failures, read_failures, read_user_counts

from ._parts import Parts

__all__ = ["Stats", "failures", "memory_stats", "stats"]


class Stats(msgspec.Struct, frozen=True, kw_only=True):
    """What ``Engine.stats`` reports.

    Attributes:
        users / sessions / turns: what the engine holds (turns include those not yet on disk).
        last_lsn: the newest log sequence number handed out.
        committed_lsn: everything up to here is on disk.
        queued: turns and deletions waiting for the disk.
        live_windows: sessions whose short-term window is in RAM.
        store_bytes: size of the LMDB data file; map_bytes: its current map size.
        schema_version: the store's schema.
        model: the embedding model's id; embedded_lsn: every record up to here has its vector.
        indexed_lsn: every record up to here is in the full-text index.
        vector_lag_records: records logged and not yet embedded (turns, mostly).
        vector_lag_seconds: how long ago the oldest record not yet embedded was committed
            (0: none is waiting; to within 0.1 s).
        texts_embedded / embed_cache_hits: background texts the model embedded, and those the
            content cache answered instead, since the engine opened.
        vectors_imported: records whose vectors came with their import (``import_users``
            given ``export_vectors``: a cluster's partition snapshot) and were stored without
            a model call, since the engine opened.
        long_term_lsn: how far each long-term follower has taken in the log, by name
            (``entities``, ``facts``, ``episodic``); empty with the long-term layer off.
        episodes_made: episodes the compressor made since the engine opened.
        text_index_rebuilt: why the text index found at open was not used and is rebuilt
            from the store (``missing``, or the damage its check found); None if it was used.
        vector_graphs_behind: users whose vector searches run on the exact scan while their
            hnswlib graph is built or brought up to date (a large user's first search after
            open, or a burst of new vectors).
        failures: records some part of the engine could not take and went on without
            (listed by :meth:`Engine.failures` and ``engram inspect STORE --failures``).
        degraded: the search legs whose index is being rebuilt or caught up with what the
            store held at open (``bm25``, ``vector``); ``recall`` flags its results meanwhile.
        read_only: the engine was opened with ``read_only=True``.
        cluster: on a cluster node, the node's own figures (``engine.cluster.NodeStats``:
            per partition, leases, retries, routing); None on an engine of its own.
        durable_stages: where the latest waits for a commit to land (durable receipts,
            mostly; up to 1,024 since open) spent their time, by stage of their way from the caller to the disk and back (``queued``,
            ``to_writer``, ``plan``, ``write``, ``commit``, ``flush_wait``, ``flush``,
            ``to_trio``, ``wake``, and the ``total``): each stage's ``p50_ms``, ``p99_ms`` and
            ``max_ms``; empty until a durable receipt was awaited. README, Durability.
    """

    users: int
    sessions: int
    turns: int
    last_lsn: int
    committed_lsn: int
    queued: int
    live_windows: int
    store_bytes: int
    map_bytes: int
    schema_version: int
    model: str
    embedded_lsn: int
    indexed_lsn: int
    failures: int = 0
    degraded: tuple[str, ...] = ()
    read_only: bool = False
    cluster: Any = None
    vector_lag_records: int = 0
    vector_lag_seconds: float = 0.0
    texts_embedded: int = 0
    embed_cache_hits: int = 0
    vectors_imported: int = 0
    long_term_lsn: dict[str, int] = {}
    episodes_made: int = 0
    text_index_rebuilt: str | None = None
    vector_graphs_behind: int = 0
    durable_stages: dict[str, dict[str, float]] = {}


async def stats(parts: Parts) -> Stats:
    """See ``Engine.stats``."""
    parts.check_open()
    await trio.lowlevel.checkpoint()
    users, sessions, turns, live = parts.buffer.counts()
    store, embedder = parts.store, parts.embedder
    data = store.path / "data.mdb"
    failed = await store.read(count_failures)
    embedded = max(embedder.embedded_lsn, store.embedded_lsn)
    return Stats(
        users=users,
        sessions=sessions,
        turns=turns,
        last_lsn=store.next_lsn - 1,
        committed_lsn=store.committed_lsn,
        queued=store.queued,
        live_windows=live,
        store_bytes=data.stat().st_size if data.exists() else 0,
        map_bytes=store.map_size(),
        schema_version=SCHEMA_VERSION,
        model=embedder.model.id,
        embedded_lsn=embedded,
        indexed_lsn=parts.fulltext.indexed_lsn,
        failures=failed,
        degraded=parts.degraded(),
        read_only=parts.read_only,
        vector_lag_records=store.next_lsn - 1 - embedded,
        vector_lag_seconds=store.committed_since(embedded + 1),
        texts_embedded=embedder.texts_embedded,
        embed_cache_hits=embedder.cache_hits,
        vectors_imported=embedder.vectors_imported,
        long_term_lsn={follower.name: follower.watermark for follower in parts.followers},
        episodes_made=parts.compressor.episodes_made,
        text_index_rebuilt=parts.fulltext.damage,
        vector_graphs_behind=parts.ann.graphs_behind(),
        durable_stages=store.receipt_stages(),
    )


async def failures(parts: Parts, user_id: Any) -> list[Failure]:
    """See ``Engine.failures``."""
    parts.check_open()
    if user_id is not None:
        parts.check_lookup_ids(user_id)
    await parts.store.wait_written()
    return await parts.store.read(read_failures, user_id)


async def memory_stats(parts: Parts, user_id: Any) -> dict[str, Any]:
    """See ``Engine.memory_stats``."""
    parts.check_open()
    parts.check_lookup_ids(user_id)
    await parts.committed()
    counts = await parts.store.read(read_user_counts, user_id)
    return msgspec.to_builtins(counts)
