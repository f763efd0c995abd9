"""The engine a cluster node's HTTP app drives: a write on any node (``add_turn``, a
batch, a forget, a logged call such as ``store_note``) becomes a log entry published to the
user's partition; the node that holds the partition's lease applies it (:class:`Node`).
Reads go to the local engine, which the router only lets the owner answer; what a read
records (a pending review, the facts' use) is a log entry too, published without the read
waiting for it.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Awaitable, Callable, Iterable, Mapping
from datetime import datetime, timezone
from functools import partial
from typing import Any

import msgspec

from actors.base import validate as v
from actors.base.config import Config
from actors.base.records import NewTurn
from actors.session_buffer import new_turn_id

from .._engine import Engine
from .._stats import Stats
from .._logbatch import (
    CALLS,
    RECORD_SHOWN,
    LogCall,
    LogEntry,
    LogForget,
    LogForgetScope,
    LogTurn,
    decode_entry,
    encode_entry,
)
from .._recall import recorded_by
from .._tools import call_tool
from ..errors import EngineClosed, EngineError, InvalidInput
from ._log import CallLogged, Log, LogUnavailable, Pending
from ._node import Node
from ._partition import partition_of, subject_of

__all__ = ["ClusterEngine", "ClusterReceipt", "LogWriter", "NotInCluster"]

CALL_WAIT = 10.0  # seconds the owner waits to apply its own logged call before answering
SESSION_CALLS = ("write_session_summary", "close_session")  # calls that name one session
_IMPORT_REFUSED = ("{method} writes this node's store without log entries; in a cluster "
                   "send the history through add_turns (each turn becomes an entry), or "
                   "import into a single-node engine")

_APPLIER_ONLY = ("{method} is the node's applier's own (it applies the log and moves the "
                 "watermarks); a caller writes through add_turn, the logged calls and the forgets")


class NotInCluster(EngineError):
    """This write is not carried by the cluster's log yet, so a node refuses it rather than
    writing a copy that the partition's next owner would not have."""


class ClusterReceipt:
    """What a write through the cluster returns.

    Attributes:
        turn_id: the turn's id (made before publishing; it is the log's message id).
        seq: None: a turn's position in its session is assigned when its owner applies it.
        log_seq: the stream sequence, once the log acknowledged it (None before).
    """

    __slots__ = ("turn_id", "seq", "log_seq", "_pending")

    def __init__(self, turn_id: str, log_seq: int | None = None,
                 pending: Pending | None = None) -> None:
        self.turn_id = turn_id
        self.seq = None
        self.log_seq = log_seq
        self._pending = pending

    async def durable(self) -> None:
        """Return once the log's quorum holds the turn (``log_seq`` is then set).

        Raises:
            LogUnavailable: the log took no PubAck within the retry time.
        """
        if self.log_seq is None:
            assert self._pending is not None
            self.log_seq = (await self._pending.wait())[0]

    def __repr__(self) -> str:
        return f"ClusterReceipt(turn_id={self.turn_id!r}, log_seq={self.log_seq})"


class LogWriter:
    """Writes as log entries: turns, batches and forgets published to the user's partition.
    What a node's engine and a bot's thin client (:class:`~engine.cluster.ClusterClient`)
    share.

    Args:
        log: the cluster's log.
        config: the limits a write is checked against before it is published (the nodes'
            own: an entry they refuse is counted invalid there, not reported here).
    """

    def __init__(self, log: Log, config: Config) -> None:
        self._log = log
        self._config = config
        self._partitions = log.config.partitions

    def _turn(self, field: str, user_id: Any, session_id: Any, role: Any, text: Any, at: Any,
              meta: Any, agent_id: Any = None, run_id: Any = None) -> LogTurn:
        config = self._config
        try:
            v.check_id("user_id", user_id, config.max_id_chars)
            v.check_id("session_id", session_id, config.max_id_chars)
            v.check_role(role)
            v.check_text("text", text, config.max_text_chars)
            at = datetime.now(timezone.utc) if at is None else v.check_at(at)
            meta = v.check_meta(meta, config.max_meta_bytes)
            for name, value in (("agent_id", agent_id), ("run_id", run_id)):
                if value is not None:
                    v.check_id(name, value, config.max_id_chars)
        except InvalidInput as exc:
            if not field:
                raise
            raise InvalidInput(f"{field}.{exc.field}", str(exc).split(": ", 1)[-1]) from None
        return LogTurn(user_id, session_id, new_turn_id(), role, text,
                       at.astimezone(timezone.utc), meta or None, agent_id, run_id)

    async def add_turn(self, user_id: str, session_id: str, role: str, text: str,
                       at: datetime | None = None, meta: dict[str, Any] | None = None,
                       durable: bool = False, *, agent_id: str | None = None,
                       run_id: str | None = None) -> ClusterReceipt:
        """:meth:`Engine.add_turn` through the log: the turn is published to the user's
        partition; ``durable`` waits for the PubAck (a quorum of the log holds it). Its scope
        (``agent_id`` / ``run_id``) goes with it; the owner files it as ``add_turn`` does,
        and a turn naming another scope than its session's is refused there (counted
        invalid), since only the owner holds the session.

        Raises:
            InvalidInput: a bad argument; nothing was published.
            LogUnavailable: (durable) no PubAck within the retry time.
        """
        turn = self._turn("", user_id, session_id, role, text, at, meta, agent_id, run_id)
        v.check_flag("durable", durable)
        return await self._publish(turn, turn.turn_id, durable)

    async def add_turns(self, items: Iterable[NewTurn | Mapping[str, Any]], *,
                        durable: bool = False) -> list[ClusterReceipt]:
        """:meth:`Engine.add_turns` through the log: all are checked before any is published."""
        v.check_flag("durable", durable)
        turns = []
        for index, item in enumerate(items):
            if isinstance(item, Mapping):
                try:
                    item = NewTurn(**item)
                except TypeError as exc:
                    raise InvalidInput(f"items[{index}]", f"expected NewTurn fields, found "
                                                          f"{exc}") from None
            turns.append(self._turn(f"items[{index}]", item.user_id, item.session_id,
                                    item.role, item.text, item.at, item.meta, item.agent_id,
                                    item.run_id))
        # Every entry is encoded and sized before any is published: none or all go out.
        payloads = [self._encoded(t, f"items[{index}].") for index, t in enumerate(turns)]
        receipts = [await self._publish(t, t.turn_id, False, payload)
                    for t, payload in zip(turns, payloads)]
        if durable:
            for receipt in receipts:
                await receipt.durable()
        return receipts

    async def _publish(self, entry: LogEntry, msg_id: str, durable: bool,
                       payload: bytes | None = None) -> ClusterReceipt:
        subject = subject_of(entry.user_id, self._partitions)
        if payload is None:
            payload = self._encoded(entry)
        if durable:
            seq, _ = await self._log.publish(subject, payload, msg_id)
            return ClusterReceipt(msg_id, seq)
        return ClusterReceipt(msg_id, None, self._log.publish_soon(subject, payload, msg_id))

    def _encoded(self, entry: LogEntry, prefix: str = "") -> bytes:
        """The entry's bytes, if the log can take them: the engine's limits (max_text_chars,
        max_meta_bytes) may allow a write larger than the servers' ``max_payload``, which
        NATS refuses outright (never a retry).

        Raises:
            InvalidInput: too large, naming its largest field (``prefix`` before it).
        """
        payload = encode_entry(entry)
        limit = self._log.max_payload
        if len(payload) > limit:
            raise InvalidInput(prefix + _largest_field(entry),
                               f"expected a write of at most {limit} bytes as a log entry (the "
                               f"log servers' max_payload), found {len(payload)}; shorten it, "
                               "or keep Config.max_text_chars and max_meta_bytes within what "
                               "max_payload takes")
        return payload

    async def forget_user(self, user_id: str) -> int:
        """Forget a user through the log: a tombstone, then the user's earlier entries are
        purged from the stream (the tombstone stays until every owner applied it). Returns
        the tombstone's log sequence: a read with that ``min_seq`` sees the user gone."""
        v.check_id("user_id", user_id, self._config.max_id_chars)
        seq, _ = await self._log.publish(subject_of(user_id, self._partitions),
                                         encode_entry(LogForget(user_id)), new_turn_id())
        await self._log.purge(subject_of(user_id, self._partitions), before=seq)
        return seq

    async def forget_session(self, user_id: str, session_id: str) -> int:
        """Forget a session through the log: a tombstone, then the session's earlier entries
        (its turns, summaries and closing) are deleted from the stream one by one (a subject
        holds the whole user's). Returns the tombstone's log sequence, as
        :meth:`forget_user`."""
        v.check_id("user_id", user_id, self._config.max_id_chars)
        v.check_id("session_id", session_id, self._config.max_id_chars)
        subject = subject_of(user_id, self._partitions)
        seq, _ = await self._log.publish(subject, encode_entry(LogForget(user_id, session_id)),
                                         new_turn_id())
        await self._log.delete_where(subject, seq, partial(_of_session, session_id))
        return seq



class ClusterEngine(LogWriter):
    """The engine a cluster node's HTTP app drives: writes become log entries, reads go to
    the local engine (the :class:`Router` sends a user's reads only to the owner).

    Args:
        engine: the node's open engine.
        log: the cluster's log.
        node: the node that applies this engine's partitions (calls other than turns and
            forgets wait for it); None for a writer that only publishes turns.
    """

    def __init__(self, engine: Engine, log: Log, node: Node | None = None) -> None:
        super().__init__(log, engine.config)
        self._engine = engine
        self._node = node
        # The counts of the router in front of this node's app (set by serve_node), for stats.
        self.routed: Mapping[str, int] | None = None

    async def stats(self) -> Stats:
        """:meth:`Engine.stats` of this node's store, with the node's own figures in
        ``cluster`` (per partition: owned, watermark, lag, gaps, replays and bootstraps with
        their durations; lease events; the router's counts), as ``/cluster/node`` has them."""
        stats = await self._engine.stats()
        if self._node is None:
            return stats
        return msgspec.structs.replace(stats, cluster=self._node.stats(self.routed))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def add_turn_nowait(self, *args: Any, **kwargs: Any) -> Any:
        """Refused: it would write this node's store alone, without a log entry.

        Raises:
            NotInCluster: always; ``add_turn`` (``durable=False``) returns as soon as the
                turn is handed to the log.
        """
        raise NotInCluster("add_turn_nowait writes this node's store without a log entry; "
                           "in a cluster use add_turn (durable=False returns at once, its "
                           "receipt's durable() waits for the log)")

    async def import_user(self, *args: Any, **kwargs: Any) -> Any:
        """Refused, as :meth:`import_users`."""
        raise NotInCluster(_IMPORT_REFUSED.format(method="import_user"))

    async def import_users(self, *args: Any, **kwargs: Any) -> Any:
        """Refused: an import writes this node's store alone; the partition's next owner,
        replaying the log, would not have what it wrote.

        Raises:
            NotInCluster: always (see the message for what to do instead).
        """
        raise NotInCluster(_IMPORT_REFUSED.format(method="import_users"))

    async def restore_users(self, *args: Any, **kwargs: Any) -> Any:
        """Refused, as :meth:`import_users`: the node's own bootstrap restores a partition
        snapshot through its engine, never a caller.

        Raises:
            NotInCluster: always.
        """
        raise NotInCluster(_IMPORT_REFUSED.format(method="restore_users"))

    async def set_log_watermark(self, *args: Any, **kwargs: Any) -> Any:
        """Refused: only the node's applier moves a partition's watermark (moved by a caller,
        this copy would skip or repeat part of the log).

        Raises:
            NotInCluster: always.
        """
        raise NotInCluster(_APPLIER_ONLY.format(method="set_log_watermark"))

    async def apply_log_batch(self, *args: Any, **kwargs: Any) -> Any:
        """Refused, as :meth:`set_log_watermark`: the node applies its partitions' entries.

        Raises:
            NotInCluster: always.
        """
        raise NotInCluster(_APPLIER_ONLY.format(method="apply_log_batch"))

    async def retrieve_memory(self, user_id: str, query: str, *args: Any, **kwargs: Any
                              ) -> str:
        """:meth:`Engine.retrieve_memory` of this node's engine, whose pending review and
        use of the facts shown are logged (see :meth:`_record_shown`), not written here."""
        with recorded_by(self._record_shown):
            return await self._engine.retrieve_memory(user_id, query, *args, **kwargs)

    async def retrieve_memory_raw(self, user_id: str, query: str, *args: Any, **kwargs: Any
                                  ) -> Any:
        """:meth:`Engine.retrieve_memory_raw`, recorded through the log as
        :meth:`retrieve_memory`."""
        with recorded_by(self._record_shown):
            return await self._engine.retrieve_memory_raw(user_id, query, *args, **kwargs)

    async def context_pre_retrieve(self, user_id: str, query: str, *args: Any,
                                   **kwargs: Any) -> str:
        """:meth:`Engine.context_pre_retrieve`, its use of the facts shown recorded through
        the log as :meth:`retrieve_memory`'s."""
        with recorded_by(self._record_shown):
            return await self._engine.context_pre_retrieve(user_id, query, *args, **kwargs)

    async def context_for_prompt(self, user_id: str, session_id: str, **kwargs: Any) -> str:
        """:meth:`Engine.context_for_prompt`, its use of the facts shown recorded through the
        log as :meth:`retrieve_memory`'s."""
        with recorded_by(self._record_shown):
            return await self._engine.context_for_prompt(user_id, session_id, **kwargs)

    def _record_shown(self, user_id: str, args: dict[str, Any]) -> None:
        """Log what a read recorded as a ``record_shown`` call, without the read waiting:
        the owner writes it when it applies the entry, as does every node that replays the
        log, so they all hold the same pending reviews and fact uses. A record the log does
        not take (too large, the log closing, no PubAck) is lost, as a single node loses one
        when its store closes: the facts decay a little sooner, nothing is rated."""
        entry = LogCall(user_id, RECORD_SHOWN, args, at=datetime.now(timezone.utc))
        try:
            self._log.publish_soon(subject_of(user_id, self._partitions), self._encoded(entry),
                                   "c_" + new_turn_id()[2:])
        except (InvalidInput, EngineClosed):
            pass

    async def _logged(self, method: str, user_id: str, args: dict[str, Any]) -> Any:
        """Publish a :class:`LogCall` and return what the owner's engine returned applying it.

        Only the owner runs this (the router forwards these routes there), so it waits for
        its own applier and takes the result from it.

        Raises:
            The engine's own error for the call (raised on the owner when it applied it).
            LogUnavailable: this node is not the partition's owner (nothing was logged), or
                the log did not take the entry in time.
            CallLogged: the entry is in the log but was not seen applied in time: its owner
                applies it; not to be retried.
        """
        # Its time, logged: the owner, and every node that replays it, applies it then.
        return await self._applied(method, LogCall(user_id, method, args,
                                                   at=datetime.now(timezone.utc)))

    async def _applied(self, method: str, entry: LogCall | LogForgetScope) -> Any:
        """Publish ``entry`` (a call or a scope's tombstone) and return what the owner's
        engine returned applying it; raises as :meth:`_logged`."""
        user_id = entry.user_id
        v.check_id("user_id", user_id, self._config.max_id_chars)
        p = partition_of(user_id, self._partitions)
        node = self._node
        if node is None or not node.owns(p):
            raise LogUnavailable(f"partition {p} is not held here: its owner takes {method} "
                                 "(a node forwards it there); retry")
        seq, _ = await self._log.publish(subject_of(user_id, self._partitions),
                                         self._encoded(entry), "c_" + new_turn_id()[2:])
        if not await node.wait_applied(p, seq, CALL_WAIT):
            raise CallLogged(f"{method} is in the log at {seq} but was not seen applied here "
                             f"within {CALL_WAIT} s; the partition's owner applies it once: "
                             f"do not retry it; read with min_seq={seq} to see it", seq)
        result = node.results.pop(seq, None)
        if isinstance(result, BaseException):
            raise result
        return result

    async def call_tool(self, name: str, arguments: Mapping[str, Any] | str) -> dict[str, Any]:
        """:meth:`Engine.call_tool` on the owner of the tool's user: its writes (facts, notes)
        go through the log like the same calls made directly, its reads are the local
        engine's (the :class:`Router` sends a tool call to the owner of its ``user_id``).

        Raises:
            InvalidInput: an unknown tool, or arguments that do not fit its schema.
            LogUnavailable: this node is not the user's partition's owner (any more).
        """
        self._engine.check_open()
        return await call_tool(self, name, arguments)

    async def snapshot(self, dest: str | os.PathLike[str]) -> Any:
        """:meth:`Engine.snapshot` of this node's own store: the partitions it has applied,
        each with its watermark (committed in the same transactions as what they cover).
        A node whose store is restored from it resumes each partition it then holds from
        that watermark, replaying only the log after it; copies of partitions held
        elsewhere go after the grace period. The cluster-wide backup is the log itself,
        with the per-partition snapshots in the object store.

        Args:
            dest: a new or empty directory on this node's machine.

        Returns:
            The snapshot's :class:`~engine.Manifest`.
        """
        return await self._engine.snapshot(dest)

    async def forget_scope(self, user_id: str, *, agent_id: str | None = None,
                           run_id: str | None = None) -> dict[str, int]:
        """:meth:`Engine.forget_scope` through the log: a tombstone (:class:`LogForgetScope`)
        that every node applies at its place in the log, as ``forget_session``'s; on the
        owner (the router forwards it there), it returns what the owner's apply forgot.

        Raises:
            InvalidInput: neither ``agent_id`` nor ``run_id``, or a bad id (nothing logged).
            LogUnavailable: as a logged call's.
        """
        if agent_id is None and run_id is None:
            raise InvalidInput("agent_id", "expected agent_id or run_id (or both), found "
                                           "neither; forget_user forgets the whole user")
        for field, value in (("agent_id", agent_id), ("run_id", run_id)):
            if value is not None:
                v.check_id(field, value, self._config.max_id_chars)
        return await self._applied("forget_scope", LogForgetScope(user_id, agent_id, run_id))


def _largest_field(entry: LogEntry) -> str:
    """The field (a call's argument) that takes the most bytes of an entry."""
    fields = entry.args if type(entry) is LogCall else msgspec.structs.asdict(entry)
    return max(fields, key=lambda name: len(msgspec.msgpack.encode(fields[name])))


def _of_session(session_id: str, data: bytes) -> bool:
    """Whether a log entry belongs to the session: a turn of it, or a call naming it
    (its summary, its closing). Tombstones stay, as an undecodable entry does."""
    try:
        entry = decode_entry(data)
    except InvalidInput:
        return False
    if type(entry) is LogTurn:
        return entry.session_id == session_id
    return (type(entry) is LogCall and entry.method in SESSION_CALLS
            and entry.args.get("session_id") == session_id)


def _logged_method(name: str) -> Callable[..., Awaitable[Any]]:
    """A ClusterEngine method that logs the Engine method ``name`` as a :class:`LogCall`."""
    signature = inspect.signature(getattr(Engine, name))

    async def method(self: ClusterEngine, user_id: str, *args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(None, user_id, *args, **kwargs)
        except TypeError as exc:
            raise InvalidInput("arguments", f"{name}: {exc}") from None
        call = {k: _plain(v) for k, v in bound.arguments.items() if k not in ("self", "user_id")}
        # A time is checked before it is logged: msgpack carries a naive one as a string,
        # which every node would then refuse as a string instead of saying it has no zone.
        for field, value in call.items():
            if isinstance(value, datetime) or (field in _TIMES and value is not None):
                call[field] = v.check_at(value, field)
        # What the owner would make up when it applies, made here once, so that every node
        # that replays the entry makes the same record.
        if name == "store_note" and call.get("note_id") is None:
            call["note_id"] = "n_" + new_turn_id()[2:]
        if name in ("remember_fact", "link"):
            stamp = "valid_at" if name == "remember_fact" else "at"
            if call.get(stamp) is None:
                call[stamp] = datetime.now(timezone.utc)
        return await self._logged(name, user_id, call)

    method.__name__ = name
    method.__doc__ = f":meth:`Engine.{name}` through the log, applied by the owner."
    return method


# The logged calls' time arguments: checked whatever they are (a date, a string), as the
# engine checks them, before msgpack carries one as a string every node would refuse.
_TIMES = frozenset({"valid_at", "at"})


def _plain(value: Any) -> Any:
    """An argument as msgpack carries it: iterables (tags, keywords) as lists."""
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, Iterable):
        return value
    return list(value)


for _name in sorted(CALLS - {RECORD_SHOWN}):  # RECORD_SHOWN: logged by the reads above
    setattr(ClusterEngine, _name, _logged_method(_name))
