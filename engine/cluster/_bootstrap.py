"""Partition snapshots: what an owner publishes to the object store, and how a new owner
starts from one instead of replaying the whole log.

A snapshot is every user of one partition, tagged with the partition's watermark, taken while
nothing is applied to the partition: it is the memory after exactly the log up to that
watermark. Each user's records are those ``export_user`` writes (ids, times, history and
derivations) as msgpack structs (``Engine.export_records``), with their stored vectors in one
buffer; a snapshot of the first format (tag ``engram-partition-snapshot``: each user's JSON
Lines export and ``export_vectors``) still restores. A new owner whose copy starts from
nothing (watermark 0) drops whatever a half-done earlier restore or deletion left of the
partition, writes the users (``Engine.restore_users``: one import, the log's followers held
until its last record is written), then sets the watermark in the store; a crash before that
leaves the watermark at 0, and the next owner starts over. It then replays the log after the
watermark.
"""

from __future__ import annotations

import logging
import zlib
from datetime import datetime, timezone

import msgspec
import trio

from .._engine import Engine
from .._export import UserRecords, UserVectors, VectorRows
from ..errors import InvalidInput, RecordRefused
from ._partition import partition_of

__all__ = ["PartitionSnapshot", "PartitionRecords", "take", "read", "pack", "settle", "restore",
           "drop_local", "users_of"]

log = logging.getLogger("engine.cluster")

LEVEL = 1  # zlib level: exports are text and shrink several times even at the fastest
# Bytes of exports and vectors a restore of the first format imports in one
# ``import_users`` call: large enough that a partition of many small users costs a few round
# trips to the store, not ~17 a user, and small enough that one call's parsed records stay a
# bounded share of memory.
RESTORE_BATCH_BYTES = 32 << 20


class PartitionSnapshot(msgspec.Struct, frozen=True, tag="engram-partition-snapshot"):
    """One partition's users at one watermark, as snapshots of the first format hold them
    (restored still; taken no more).

    Attributes:
        partition / partitions: which partition, of how many (a snapshot of another
            partition count is refused: its users belong elsewhere).
        watermark: the last log sequence its memory includes.
        node / taken_at: who took it, and when.
        users: (user id, the user's export) pairs.
        vectors: each user's stored vectors (``export_vectors``), so that a new owner with
            the same model stores them instead of embedding every text again (a snapshot
            taken before they were carried has none).
    """

    partition: int
    partitions: int
    watermark: int
    node: str
    taken_at: datetime
    users: list[tuple[str, bytes]]
    vectors: dict[str, UserVectors] = msgspec.field(default_factory=dict)


class PartitionRecords(msgspec.Struct, frozen=True, tag="engram-partition-snapshot-2"):
    """One partition's users at one watermark.

    Attributes:
        partition / partitions: which partition, of how many (a snapshot of another
            partition count is refused: its users belong elsewhere).
        watermark: the last log sequence its memory includes.
        node / taken_at: who took it, and when.
        users: each user's records (``Engine.export_records``): msgpack decodes them in a
            fraction of the time the JSON Lines of an export took to parse.
        vectors: each user's stored vectors, in the order of ``users``, so that a new owner
            with the same model stores them instead of embedding every text again.
    """

    partition: int
    partitions: int
    watermark: int
    node: str
    taken_at: datetime
    users: list[UserRecords]
    vectors: list[VectorRows]


Snapshot = PartitionSnapshot | PartitionRecords

_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(Snapshot).decode


async def users_of(engine: Engine, partition: int, partitions: int) -> list[str]:
    """The users of ``partition`` this store holds anything of."""
    return [u for u in await engine.list_users() if partition_of(u, partitions) == partition]


async def settle(engine: Engine) -> None:
    """``flush`` for a snapshot: every index and the long-term layer take in what was
    applied. A record the store refused is no reason to skip the snapshot, nor to end the
    node: flush raises it once its waits are done, and it is kept in ``failures()``."""
    try:
        await engine.flush()
    except RecordRefused as exc:
        log.warning("a record was refused before a partition snapshot (kept among the "
                    "failures): %s", exc)


async def take(engine: Engine, partition: int, partitions: int, watermark: int, node: str
               ) -> bytes:
    """The partition's snapshot at ``watermark``, as stored: :func:`read`, then :func:`pack`."""
    return await pack(await read(engine, partition, partitions, watermark, node))


async def read(engine: Engine, partition: int, partitions: int, watermark: int, node: str
               ) -> PartitionRecords:
    """The partition's records at ``watermark``: the caller holds the partition still (no
    batch applied meanwhile). Everything applied is first taken in by every index and by the
    long-term layer (:func:`settle`), so the records carry what the engine derived from it."""
    await settle(engine)
    users, vectors = [], []
    for user in await users_of(engine, partition, partitions):
        records, rows = await engine.export_records(user)
        users.append(records)
        vectors.append(rows)
    return PartitionRecords(partition, partitions, watermark, node, datetime.now(timezone.utc),
                            users, vectors)


async def pack(snapshot: PartitionRecords) -> bytes:
    """A snapshot's bytes, compressed in a worker thread: ~100 MB for 100k turns (the vectors
    are most of it) held the node's trio thread, which serves every other partition, for
    about a second. The records are already read: the partition need not be held."""
    return await trio.to_thread.run_sync(_pack, snapshot)


def _pack(snapshot: Snapshot) -> bytes:
    return zlib.compress(_encode(snapshot), LEVEL)


def decode(data: bytes, partition: int, partitions: int) -> Snapshot:
    """A snapshot from its bytes (either format), checked to be of this partition.

    Raises:
        InvalidInput: not a snapshot, or one of another partition or partition count.
    """
    try:
        snapshot = _decode(zlib.decompress(data))
    except (zlib.error, msgspec.DecodeError) as exc:
        raise InvalidInput("snapshot", f"expected a partition snapshot, found: {exc}") from None
    if (snapshot.partition, snapshot.partitions) != (partition, partitions):
        raise InvalidInput("snapshot", f"expected partition {partition} of {partitions}, found "
                                       f"{snapshot.partition} of {snapshot.partitions}")
    if isinstance(snapshot, PartitionRecords) and len(snapshot.vectors) != len(snapshot.users):
        raise InvalidInput("snapshot", f"expected the vectors of each of its "
                                       f"{len(snapshot.users)} users, found "
                                       f"{len(snapshot.vectors)}")
    return snapshot


async def drop_local(engine: Engine, partition: int, partitions: int) -> int:
    """Delete this store's copy of the partition: its watermark first (so a crash midway
    leaves a copy that starts over), then each of its users. Returns the users dropped."""
    await engine.set_log_watermark(partition, 0)
    users = await users_of(engine, partition, partitions)
    for user in users:
        await engine.forget_user(user)
    return len(users)


async def restore(engine: Engine, snapshot: Snapshot) -> None:
    """Write the snapshot's users into a copy of the partition that holds nothing (the
    caller dropped it), then set the partition's watermark to the snapshot's.

    The users go in with their vectors (stored when this engine has the same model: its
    embedder takes them instead of running the model): a snapshot of records as one
    ``restore_users``; one of exports in ``import_users`` calls of up to
    :data:`RESTORE_BATCH_BYTES`. A failing write is raised as it was raised; the watermark
    is then never set, and the next owner starts over."""
    if isinstance(snapshot, PartitionRecords):
        await engine.restore_users(snapshot.users, snapshot.vectors)
    else:
        await _import_exports(engine, snapshot)
    await engine.set_log_watermark(snapshot.partition, snapshot.watermark)


async def _import_exports(engine: Engine, snapshot: PartitionSnapshot) -> None:
    batch: list[bytes] = []
    vectors: list[UserVectors | None] = []
    size = 0
    for user, export in snapshot.users:
        given = snapshot.vectors.get(user)
        bytes_ = len(export) + (sum(map(len, given.vectors.values())) if given else 0)
        if batch and size + bytes_ > RESTORE_BATCH_BYTES:
            await engine.import_users(batch, vectors=vectors)
            batch, vectors, size = [], [], 0
        batch.append(export)
        vectors.append(given)
        size += bytes_
    if batch:
        await engine.import_users(batch, vectors=vectors)
