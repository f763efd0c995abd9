"""Applying a replicated log to the store: the one entry point a cluster node drives.

A cluster (``engine.cluster``) keeps its users' writes in a replicated log cut into
partitions; the node that owns a partition reads it in order and hands each batch to
:meth:`Engine.apply_log_batch`. Here a batch becomes ordinary engine writes, with two
promises the log needs:

- **Exactly once.** The partition's watermark (the last log sequence applied) is written in
  the same LMDB transaction as the batch's turns (``Store.hold_together``), and as each
  forget's or call's write (``Store.attached``); entries at or below it are skipped, so a crash anywhere and a replay from the watermark leave every
  entry applied once. A turn id already in the store is skipped too (a publisher that
  retried past the log's duplicate window), and counted.
- **Same log, same memory.** Per-session ``seq`` is assigned here, in log order, so two nodes
  that apply the same log hold the same sessions. A call that reads what the long-term
  followers derive from the turns (episodes, extracted facts) applies only once they have
  taken in everything before it, so its outcome is the log's, not how far behind this
  node's followers were; and they time what they derive by the log (``Parts.time_by_log``).

The entries are plain records of this module: the engine knows nothing of NATS.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from typing import Any

import msgspec
import trio

from actors.base import validate as v
from actors.base.messages import PutState
from actors.store import read_meta_lsn, user_prefix

from ._forget import Forgetting
from ._parts import Parts, pinned
from ._recall import record_shown
from .errors import InvalidInput

__all__ = ["LogTurn", "LogForget", "LogForgetScope", "LogCall", "CALLS", "RECORD_SHOWN",
           "READS_DERIVED", "LogEntry", "encode_entry", "decode_entry", "PartitionLog",
           "watermark_key", "holds_a_log"]

log = logging.getLogger("engine.cluster")

RECENT_IDS = 65_536  # turn ids applied lately, checked before the store (commits in flight)
MAX_BATCH = 1_024  # entries per call: one transaction, and a few ms of loop time
MAX_PARTITION = 2 ** 31 - 1  # a partition's watermark key holds its number in decimal
# How long a call waits for the long-term followers before the wait is logged and counted
# (a node's own caller hears CallLogged after as long); it waits on, the followers always
# move on (a record they fail on is kept as a failure and passed).
FOLLOWERS_WAIT = 10.0


class LogTurn(msgspec.Struct, frozen=True, tag="turn", omit_defaults=True):
    """A turn as the log carries it: its id was made by the writer, its seq is made here.
    ``agent_id`` / ``run_id``: its scope, as ``add_turn``'s (left out of the bytes when None,
    so an entry written before scopes decodes with none, and an unscoped turn's bytes are
    what they were)."""

    user_id: str
    session_id: str
    turn_id: str
    role: str
    text: str
    at: datetime
    meta: dict[str, Any] | None = None
    agent_id: str | None = None
    run_id: str | None = None


class LogForget(msgspec.Struct, frozen=True, tag="forget", omit_defaults=True):
    """A tombstone: forget the user, or one of their sessions."""

    user_id: str
    session_id: str | None = None


class LogForgetScope(msgspec.Struct, frozen=True, tag="forget_scope", omit_defaults=True):
    """A tombstone for one scope of a user (``forget_scope``): the sessions and notes of
    that scope as they stand at its place in the log. A tag of its own, not LogForget's
    fields: a node of an older version refuses the entry (counted invalid) rather than
    reading it as a LogForget without a session, which forgets the whole user."""

    user_id: str
    agent_id: str | None = None
    run_id: str | None = None


class LogCall(msgspec.Struct, frozen=True, tag="call", omit_defaults=True):
    """Any other write a caller makes (notes, facts, links, reviews, summaries, closing a
    session): the engine method of that name, called on the owner with these arguments; or
    what a read recorded (``RECORD_SHOWN``), which the applier writes itself.
    Ids a call would make (a new note's) are made by the writer and carried here, and so is
    the time it was logged (``at``): the call applies with the engine's clock reading that
    time, so every node that applies the entry makes the same record, with the same times,
    whenever it replays it. An entry without ``at`` (logged before it was carried) applies
    at the applier's own time."""

    user_id: str
    method: str
    args: dict[str, Any] = msgspec.field(default_factory=dict)
    at: datetime | None = None


# What a read records (a pending review, the facts' use) is a write too: a node's reads log
# it as a call of this name, which the applier runs itself (``_recall.record_shown``), never an
# engine method a caller may make. A node of an older version refuses the entry as a method
# not in its CALLS (counted invalid, the watermark moves on) rather than misapplying it.
RECORD_SHOWN = "record_shown"

# The methods a LogCall may name: every write a caller makes that is not a turn or a forget,
# and what a read records. What the engine derives by itself (episodes, extracted facts,
# entities, vectors) is recomputed by each node from the turns, so it is never logged.
CALLS = frozenset({
    "store_note", "update_note", "delete_note", "remember_fact", "correct_fact",
    "confirm_fact", "forget_fact", "link", "review", "write_session_summary", "close_session",
    RECORD_SHOWN,
})

# The calls whose outcome reads what the long-term followers derive from the turns: a review
# or a link names an episode or an extracted fact, what a read recorded names both, a fact
# call decides against the extracted facts, closing a session or writing its summary goes
# by the episodes and summaries made so far. Notes are the caller's own: they apply at once.
READS_DERIVED = CALLS - {"store_note", "update_note", "delete_note"}

LogEntry = LogTurn | LogForget | LogForgetScope | LogCall

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(LogEntry)


def encode_entry(entry: LogEntry) -> bytes:
    """The entry's bytes in the log (msgpack, tagged)."""
    return _encoder.encode(entry)


def decode_entry(data: bytes) -> LogEntry:
    """An entry from its bytes.

    Raises:
        InvalidInput: the bytes are not an entry of this version (the message says why).
    """
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise InvalidInput("entry", f"expected a log entry (msgpack, tagged), found: {exc}"
                           ) from None
    except RecursionError:  # the decoder recurses into each level of nesting
        raise InvalidInput("entry", "expected a log entry (msgpack, tagged), found one nested "
                                    "deeper than the decoder descends") from None


def _check_partition(partition: Any) -> None:
    """A partition number: an int itself (True is not partition 1) from 0 to MAX_PARTITION."""
    if type(partition) is not int or not 0 <= partition <= MAX_PARTITION:
        raise InvalidInput("partition", f"expected a partition number from 0 to "
                                        f"{MAX_PARTITION}, found {v.found(partition)}")


def watermark_key(partition: int) -> bytes:
    """Where a partition's watermark lives in the store's ``meta`` database."""
    return b"cluster:partition:%d" % partition


class PartitionLog:
    """The watermarks of one engine's partitions and the code that applies batches.

    Args:
        parts: the running engine's actors and settings.
        forgetting: the engine's forget_user / forget_session (a tombstone applies as one).
        call: runs a :class:`LogCall` (method name, user id, arguments) on the engine.
    """

    def __init__(self, parts: Parts, forgetting: Forgetting,
                 call: Callable[[str, str, dict[str, Any]], Awaitable[Any]]) -> None:
        self._parts = parts
        self._forgetting = forgetting
        self._call = call
        self._marks: dict[int, int] = {}
        # One batch at a time per partition: a batch reads the watermark and moves it.
        self._locks: dict[int, trio.Lock] = {}
        self._recent: OrderedDict[str, None] = OrderedDict()
        self.duplicates = 0  # turns skipped because their id was already applied
        self.invalid = 0  # entries skipped because they failed the engine's checks
        # Entries whose apply wrote ops in more than one transaction: only the first holds
        # the watermark (each call writes one op, or holds its ops together; a test holds
        # every call to that).
        self.split = 0
        self.waited = 0  # calls that waited for the long-term followers to catch up
        self.waited_long = 0  # of those, the ones that waited FOLLOWERS_WAIT or more

    async def watermark(self, partition: int) -> int:
        """The last log sequence applied to ``partition`` (0: none)."""
        mark = self._marks.get(partition)
        if mark is None:
            mark = await self._parts.store.read(read_meta_lsn, watermark_key(partition))
            self._marks.setdefault(partition, mark)
            mark = self._marks[partition]
        return mark

    def known_watermark(self, partition: int) -> int | None:
        """The watermark if this engine has read it already (no store read)."""
        return self._marks.get(partition)

    async def set_watermark(self, partition: int, seq: int) -> None:
        """Set the partition's watermark on disk: 0 before its users' records are dropped
        here, a snapshot's once its records are restored."""
        _check_partition(partition)
        if type(seq) is not int or not 0 <= seq <= v.MAX_INT:
            raise InvalidInput("seq", f"expected a log sequence from 0 to 2**63-1, found "
                                      f"{v.found(seq)}")
        async with self._lock(partition):
            await self._put_mark(partition, seq)
            self._marks[partition] = seq

    def _lock(self, partition: int) -> trio.Lock:
        lock = self._locks.get(partition)
        if lock is None:
            lock = self._locks[partition] = trio.Lock()
        return lock

    async def apply(self, partition: int, entries: Sequence[tuple[int, LogEntry]],
                    results: dict[int, Any] | None = None) -> int:
        """Apply ``(log_seq, entry)`` pairs in order; return the new watermark. What each
        :class:`LogCall` returned (or the engine error it raised) goes to ``results`` by its
        log sequence, for the caller that published it.

        Raises:
            InvalidInput: the batch is malformed (sequences not increasing, too many entries,
                a partition out of range); nothing was written.
            EngineClosed / EngineBroken: as any write.
        """
        self._parts.check_open()
        _check_partition(partition)
        if len(entries) > MAX_BATCH:
            raise InvalidInput("entries", f"expected at most {MAX_BATCH} entries a batch, "
                                          f"found {len(entries)}; split the batch")
        last = 0
        for index, (seq, _) in enumerate(entries):
            if type(seq) is not int or seq <= last or seq > v.MAX_INT:
                raise InvalidInput(f"entries[{index}]", f"expected log sequences increasing "
                                                        f"from 1 to 2**63-1, found "
                                                        f"{v.found(seq)} after {last}")
            last = seq
        self._parts.time_by_log()  # before the first turn of a log reaches the followers
        async with self._lock(partition):
            mark = await self.watermark(partition)
            turns: list[tuple[int, LogTurn]] = []
            for seq, entry in entries:
                if seq <= mark:
                    continue
                if type(entry) is not LogTurn:
                    if turns:
                        mark = await self._write_turns(partition, turns)
                        turns = []
                    # A forget too: it deletes the facts extracted from its session and
                    # not the versions they retired, so what it leaves depends on how far
                    # the extraction had come.
                    if type(entry) is not LogCall or entry.method in READS_DERIVED:
                        await self._followed(f"{partition}:{seq}")
                    if type(entry) is LogForgetScope:
                        result = await self._forget_scope(partition, seq, entry)
                    else:
                        result = await self._apply_one(partition, seq, entry)
                    if results is not None and type(entry) is not LogForget:
                        results[seq] = result
                    mark = self._marks[partition] = seq
                else:
                    turns.append((seq, entry))
            if turns:
                mark = await self._write_turns(partition, turns)
            return mark

    async def _followed(self, place: str) -> None:
        """Wait until every long-term follower has taken in what the store held when the
        applier reached the call at ``place``: the episodes and facts the turns before it
        make are derived then, on every node, however far behind its followers were. Not
        bounded by time: a follower always moves on (a record it fails on is kept as a
        failure), and applying the call without it would diverge; a wait past
        FOLLOWERS_WAIT is logged and counted (``waited_long``), and the partition's lag
        shows it meanwhile.

        Raises:
            EngineClosed / EngineBroken: the engine closed or broke meanwhile (the followers
                stop then: the call is left to the next open's replay).
        """
        parts = self._parts
        if not parts.followers:
            return
        store = parts.store
        await store.wait_logged()
        target = store.next_lsn - 1
        if all(f.watermark >= target for f in parts.followers):
            return
        self.waited += 1
        while True:
            with trio.move_on_after(FOLLOWERS_WAIT) as waiting:
                for follower in parts.followers:
                    await follower.wait(target)
            if not waiting.cancelled_caught:
                break
            self.waited_long += 1
            behind = ", ".join(f"{f.name} at {f.watermark}" for f in parts.followers
                               if f.watermark < target)
            log.warning("the call at %s waits for the long-term followers to reach %d (%s)",
                        place, target, behind)
        parts.check_open()

    async def _apply_one(self, partition: int, seq: int, entry: LogForget | LogCall) -> Any:
        """A forget or a call, with the watermark moved to ``seq`` in the transaction of the
        write it makes (:meth:`Store.attached`): a crash leaves both or neither, so a replay
        neither loses the entry nor applies it twice. A call that wrote nothing (refused,
        or nothing to change) moves the watermark in a commit of its own."""
        store = self._parts.store
        with store.attached(_mark_puts(partition, seq)) as attached:
            if type(entry) is LogForget:
                result = await self._forget(entry)
            else:
                result = await self._apply_call(entry, f"{partition}:{seq}")
        if attached.ops == 0:
            await self._put_mark(partition, seq)
        elif attached.ops > attached.together:
            self.split += 1
        return result

    async def _apply_call(self, entry: LogCall, place: str) -> Any:
        """Run the call at its writer's time, the ids it makes drawn from its ``place`` in
        the log (partition and sequence; see :func:`pinned`); the error its arguments meet
        (InvalidInput) is its result (the log goes on: every node that replays the entry
        gets the same error). An error of this engine's state (closed, broken, a store it
        cannot use) is raised: the entry was not applied, and the watermark must stay
        before it."""
        if entry.method not in CALLS:
            self.invalid += 1
            return InvalidInput("method", f"expected one of {sorted(CALLS)}, found "
                                          f"{entry.method!r}")
        try:
            at = None if entry.at is None else v.check_at(entry.at, "at")
            with pinned(at, place):
                if entry.method == RECORD_SHOWN:
                    return await record_shown(self._parts, entry.user_id, **entry.args)
                return await self._call(entry.method, entry.user_id, entry.args)
        except (InvalidInput, TypeError) as exc:
            # TypeError: arguments the method does not take (a newer writer's entry).
            self.invalid += 1
            return exc if isinstance(exc, InvalidInput) else InvalidInput("args", str(exc))

    async def _forget_scope(self, partition: int, seq: int, entry: LogForgetScope) -> Any:
        """A scope's tombstone: ``forget_scope`` writes one op per session and note, so the
        watermark moves after the last of them, in a commit of its own (not attached to the
        first op, which a crash would leave as the whole entry applied). A crash midway
        replays the entry, and forgetting a scope again finishes what is left. What it
        returned (or the engine error it raised) is the result, as a call's."""
        try:
            result: Any = await self._call("forget_scope", entry.user_id,
                                           {"agent_id": entry.agent_id, "run_id": entry.run_id})
        except InvalidInput as exc:
            self.invalid += 1
            result = exc
        await self._put_mark(partition, seq)
        return result

    async def _forget(self, entry: LogForget) -> None:
        try:
            if entry.session_id is None:
                await self._forgetting.forget_user(entry.user_id)
            else:
                await self._forgetting.forget_session(entry.user_id, entry.session_id)
        except InvalidInput:
            self.invalid += 1

    async def _write_turns(self, partition: int, turns: list[tuple[int, LogTurn]]) -> int:
        """The turns and the watermark, submitted back to back so one commit takes them."""
        parts = self._parts
        store, buffer, config = parts.store, parts.buffer, parts.config
        known = await store.read(_known_ids, [t for _, t in turns])
        last_seq = turns[-1][0]
        checked = []
        fresh: dict[tuple[str, str], tuple[str, str]] = {}  # scopes of sessions it begins
        for seq, turn in turns:
            if turn.turn_id in self._recent or turn.turn_id in known:
                self.duplicates += 1
                continue
            try:
                v.check_id("user_id", turn.user_id, config.max_id_chars)
                v.check_id("session_id", turn.session_id, config.max_id_chars)
                v.check_id("turn_id", turn.turn_id, config.max_id_chars)
                v.check_role(turn.role)
                v.check_text("text", turn.text, config.max_text_chars)
                at = v.check_at(turn.at)
                meta = v.check_meta(turn.meta, config.max_meta_bytes)
                if turn.agent_id is not None or turn.run_id is not None:
                    _check_scope(turn, buffer.scope(turn.user_id, turn.session_id), fresh,
                                 config.max_id_chars)
            except InvalidInput:
                self.invalid += 1
                continue
            checked.append((turn, at, meta))
            self._recent[turn.turn_id] = None
            if len(self._recent) > RECENT_IDS:
                self._recent.popitem(last=False)
        await store.reserve(len(checked) + 1)
        parts.check_open()
        # No checkpoint from here to the watermark's submit: the turns and the watermark sit
        # next to each other in the store's queue, and the writer keeps them in one commit.
        store.hold_together(len(checked) + 1)
        for turn, at, meta in checked:
            buffer.append(turn.user_id, turn.session_id, turn.role, turn.text, at, meta,
                          turn.turn_id, turn.agent_id, turn.run_id)
        await self._put_mark(partition, last_seq)
        self._marks[partition] = last_seq
        return last_seq

    async def _put_mark(self, partition: int, seq: int) -> None:
        done = trio.Event()  # set by the store once the watermark (and what precedes it) commits
        await self._parts.store.write_unlogged(PutState(_mark_puts(partition, seq), done=done))


def _check_scope(turn: LogTurn, held: tuple[str, str] | None,
                 fresh: dict[tuple[str, str], tuple[str, str]], max_chars: int) -> None:
    """A logged turn's scope, by add_turn's rule: valid ids, and the session's scope if the
    session exists (or an earlier turn of this batch begins it); a turn naming another is
    refused. ``fresh``: the scopes of the sessions this batch begins.

    Raises:
        InvalidInput: a bad id, or another scope than the session's.
    """
    if turn.agent_id is not None:
        v.check_id("agent_id", turn.agent_id, max_chars)
    if turn.run_id is not None:
        v.check_id("run_id", turn.run_id, max_chars)
    key = (turn.user_id, turn.session_id)
    if held is None:
        held = fresh.get(key)
        if held is None:
            fresh[key] = (turn.agent_id or "", turn.run_id or "")
            return
    for field, given, own in (("agent_id", turn.agent_id, held[0]),
                              ("run_id", turn.run_id, held[1])):
        if given is not None and given != own:
            raise InvalidInput(field, f"expected {own!r}, the {field} of session "
                                      f"{turn.session_id!r}, found {given!r}")


def holds_a_log(txn: Any, dbs: dict[bytes, Any]) -> bool:
    """Whether the store holds a partition's watermark: it applied a cluster's log."""
    prefix = watermark_key(0).rsplit(b":", 1)[0] + b":"
    cursor = txn.cursor(dbs[b"meta"])
    return cursor.set_range(prefix) and cursor.key().startswith(prefix)


def _mark_puts(partition: int, seq: int) -> tuple[tuple[bytes, bytes, bytes, int]]:
    """The ``PutState`` put that moves a partition's watermark to ``seq``."""
    return ((b"meta", watermark_key(partition), seq.to_bytes(8, "big"), 0),)


def _known_ids(txn: Any, dbs: dict[bytes, Any], turns: list[LogTurn]) -> set[str]:
    """The turn ids of ``turns`` the store already holds."""
    ids = dbs[b"ids"]
    return {t.turn_id for t in turns
            if txn.get(user_prefix(t.user_id) + t.turn_id.encode(), db=ids) is not None}
