"""Partition snapshots: what an owner publishes to the object store, and how a new owner
starts from one instead of replaying the whole log.

A snapshot is every user of one partition, tagged with the partition's watermark, taken while
nothing is applied to the partition: it is the memory after exactly the log up to that
watermark. Each user's records are those ``export_user`` writes (ids, times, history and
derivations) as msgpack structs (``Engine.export_records``), with their stored vectors in one
buffer, stored in frames of users compressed apart (``engram-partition-snapshot-3``, decoded on
both cores by a new owner; one zlib stream of them, ``-2``, still restores); a snapshot of the
first format (tag ``engram-partition-snapshot``: each user's JSON
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
from .._retrieval import one_error
from ..errors import InvalidInput, RecordRefused
from ._partition import partition_of

__all__ = ["PartitionSnapshot", "PartitionRecords", "PartitionFrames", "Framed", "take", "read",
           "pack", "opened", "unframed", "decode", "frame_users", "settle", "restore",
           "drop_local", "users_of"]

log = logging.getLogger("engine.cluster")

LEVEL = 1  # zlib level: exports are text and shrink several times even at the fastest
# A snapshot is stored as frames of users, each compressed alone, of about this many bytes
# before compression, so that a new owner decompresses them on both cores at once (zlib lets
# go of the GIL): one zlib stream of a 100k-turn partition (7.5 MB, 101 MB unpacked) was 0.6 s
# of one core before the first record could be written. Restoring frame by frame while the
# next decoded was measured too, and was slower: a restore_users call a frame (13 here) cost
# more than the overlap saved (B served 2.1-2.3 s after its claim against 1.3-1.5 s).
FRAME_BYTES = 8 << 20
DECODE_THREADS = 2  # frames decoded at once by a new owner (this machine has 2 cores)
MAGIC = b"EGS3"  # a framed snapshot's first bytes (a zlib stream, the older formats, starts 0x78)
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


class PartitionFrames(msgspec.Struct, frozen=True, tag="engram-partition-snapshot-3"):
    """The head of a framed snapshot: :class:`PartitionRecords`' fields but its users, which
    follow it in frames (see :func:`_pack`).

    Attributes:
        frames: each frame's length in bytes, compressed, in order.
        users: how many users the frames hold in all.
    """

    partition: int
    partitions: int
    watermark: int
    node: str
    taken_at: datetime
    frames: list[int]
    users: int


class Framed(msgspec.Struct, frozen=True):
    """A framed snapshot opened: its head checked, its frames still compressed (decoded by
    :func:`unframed`)."""

    head: PartitionFrames
    frames: list[bytes]


Snapshot = PartitionSnapshot | PartitionRecords

_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(Snapshot).decode
_decode_head = msgspec.msgpack.Decoder(PartitionFrames).decode
_decode_frame = msgspec.msgpack.Decoder(list[tuple[UserRecords, VectorRows]]).decode


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
    """A snapshot's bytes: one of records as :data:`MAGIC`, the head's length (4 bytes, big
    endian), the head (:class:`PartitionFrames`), then its frames, each a zlib stream of a
    msgpack list of (user records, vectors) pairs of about FRAME_BYTES; one of the first
    format as one zlib stream, as it was stored."""
    if isinstance(snapshot, PartitionSnapshot):
        return zlib.compress(_encode(snapshot), LEVEL)
    groups: list[list[msgspec.Raw]] = [[]]
    size = 0
    for user, rows in zip(snapshot.users, snapshot.vectors, strict=True):
        pair = _encode((user, rows))
        if groups[-1] and size + len(pair) > FRAME_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(msgspec.Raw(pair))
        size += len(pair)
    frames = [zlib.compress(_encode(group), LEVEL) for group in groups if group]
    head = _encode(PartitionFrames(snapshot.partition, snapshot.partitions, snapshot.watermark,
                                   snapshot.node, snapshot.taken_at, [len(f) for f in frames],
                                   len(snapshot.users)))
    return b"".join([MAGIC, len(head).to_bytes(4, "big"), head, *frames])


def opened(data: bytes, partition: int, partitions: int) -> Snapshot | Framed:
    """A snapshot from its bytes, checked to be of this partition: a framed one with its
    frames still compressed, one of an older format decoded whole.

    Raises:
        InvalidInput: not a snapshot, or one of another partition or partition count.
    """
    if not data.startswith(MAGIC):
        try:
            snapshot = _decode(zlib.decompress(data))
        except (zlib.error, msgspec.DecodeError) as exc:
            raise _not_a_snapshot(exc) from None
        _check_partition(snapshot, partition, partitions)
        if (isinstance(snapshot, PartitionRecords)
                and len(snapshot.vectors) != len(snapshot.users)):
            raise InvalidInput("snapshot", f"expected the vectors of each of its "
                                           f"{len(snapshot.users)} users, found "
                                           f"{len(snapshot.vectors)}")
        return snapshot
    start = len(MAGIC) + 4
    end = start + int.from_bytes(data[len(MAGIC):start], "big")
    try:
        head = _decode_head(data[start:end])
    except msgspec.DecodeError as exc:
        raise _not_a_snapshot(exc) from None
    _check_partition(head, partition, partitions)
    if any(length < 1 for length in head.frames) or end + sum(head.frames) != len(data):
        raise InvalidInput("snapshot", f"expected a partition snapshot of "
                                       f"{end + sum(head.frames)} bytes (its head and frames), "
                                       f"found {len(data)}")
    frames = []
    for length in head.frames:
        frames.append(data[end:end + length])
        end += length
    return Framed(head, frames)


def frame_users(frame: bytes) -> tuple[list[UserRecords], list[VectorRows]]:
    """One frame's users and their vectors (a worker thread: the decompression lets go of the
    GIL).

    Raises:
        InvalidInput: the frame is not one.
    """
    try:
        pairs = _decode_frame(zlib.decompress(frame))
    except (zlib.error, msgspec.DecodeError) as exc:
        raise _not_a_snapshot(exc) from None
    return [user for user, _ in pairs], [rows for _, rows in pairs]


def decode(data: bytes, partition: int, partitions: int) -> Snapshot:
    """A snapshot from its bytes (any format), checked to be of this partition, decoded
    whole (a framed one as :class:`PartitionRecords`).

    Raises:
        InvalidInput: not a snapshot, or one of another partition or partition count.
    """
    found = opened(data, partition, partitions)
    if not isinstance(found, Framed):
        return found
    return _joined(found.head, [frame_users(frame) for frame in found.frames])


def _joined(head: PartitionFrames,
            decoded: list[tuple[list[UserRecords], list[VectorRows]]]) -> PartitionRecords:
    """A framed snapshot's frames, decoded, as one :class:`PartitionRecords`.

    Raises:
        InvalidInput: the frames do not hold the users its head counts.
    """
    users = [user for some, _ in decoded for user in some]
    if len(users) != head.users:
        raise InvalidInput("snapshot", f"expected a partition snapshot of {head.users} users, "
                                       f"found {len(users)}")
    return PartitionRecords(head.partition, head.partitions, head.watermark, head.node,
                            head.taken_at, users, [rows for _, some in decoded for rows in some])


def _not_a_snapshot(exc: Exception) -> InvalidInput:
    return InvalidInput("snapshot", f"expected a partition snapshot, found: {exc}")


def _check_partition(found: Snapshot | PartitionFrames, partition: int, partitions: int) -> None:
    if (found.partition, found.partitions) != (partition, partitions):
        raise InvalidInput("snapshot", f"expected partition {partition} of {partitions}, found "
                                       f"{found.partition} of {found.partitions}")


async def drop_local(engine: Engine, partition: int, partitions: int) -> int:
    """Delete this store's copy of the partition: its watermark first (so a crash midway
    leaves a copy that starts over), then each of its users. Returns the users dropped."""
    await engine.set_log_watermark(partition, 0)
    users = await users_of(engine, partition, partitions)
    for user in users:
        await engine.forget_user(user)
    return len(users)


async def restore(engine: Engine, snapshot: Snapshot | Framed) -> None:
    """Write the snapshot's users into a copy of the partition that holds nothing (the
    caller dropped it), then set the partition's watermark to the snapshot's.

    The users go in with their vectors (stored when this engine has the same model: its
    embedder takes them instead of running the model): a snapshot of records (a framed one
    decoded first, :func:`unframed`) as one ``restore_users``; one of exports in
    ``import_users`` calls of up to :data:`RESTORE_BATCH_BYTES`. A failing write, or a
    frame that is not one (then nothing is written), is raised as it was raised; the
    watermark is then never set, and the next owner starts over."""
    if isinstance(snapshot, Framed):
        snapshot = await unframed(snapshot)
    if isinstance(snapshot, PartitionRecords):
        await engine.restore_users(snapshot.users, snapshot.vectors)
    else:
        await _import_exports(engine, snapshot)
    await engine.set_log_watermark(snapshot.partition, snapshot.watermark)


async def unframed(snapshot: Framed) -> PartitionRecords:
    """A framed snapshot's users and vectors: its frames decoded DECODE_THREADS at a time in
    worker threads (their decompression lets go of the GIL: on 2 cores about half the wall
    time of one zlib stream of the whole partition).

    Raises:
        InvalidInput: a frame is not one (the first such, when several are not).
    """
    decoded: list[tuple[list[UserRecords], list[VectorRows]]] = [([], [])] * len(snapshot.frames)
    refused: list[InvalidInput] = []  # each frame's decode runs to its end in its thread
    limiter = trio.CapacityLimiter(DECODE_THREADS)

    async def decode(i: int) -> None:
        try:
            decoded[i] = await trio.to_thread.run_sync(frame_users, snapshot.frames[i],
                                                       limiter=limiter)
        except InvalidInput as exc:
            refused.append(exc)

    with one_error():
        async with trio.open_nursery() as nursery:
            for i in range(len(snapshot.frames)):
                nursery.start_soon(decode, i)
    if refused:
        raise refused[0]
    return _joined(snapshot.head, decoded)


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
