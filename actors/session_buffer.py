"""SessionBuffer: the short-term layer and the hot ingest path.

It holds every session's counters (next seq, times) and, for the most recently used sessions,
a window of their latest turns. ``append`` is synchronous: trio runs every task on one thread,
so a plain method call is already atomic, and the hot path's budget (p50 < 50 µs) has no room
for a request/reply hop through an inbox (~14 µs plus scheduling). This is the one actor without
an inbox; its state is touched only from the trio thread, and everything slow (the disk) sits
behind the Store's queue.
"""

from __future__ import annotations

import os
import random
from collections import OrderedDict, deque
from datetime import datetime, timezone
from itertools import compress, repeat
from operator import attrgetter, ne, or_
from typing import Any

import msgspec

from .base.config import Config
from .base.messages import AppendTurn, AppendTurns
from .base.records import SessionInfo, Turn
from .store import Store, read_session_tail, read_sessions, session_prefix, user_prefix

__all__ = ["SessionBuffer", "Receipt"]

_encode = msgspec.msgpack.Encoder().encode
_UTC = timezone.utc


# Turn ids need uniqueness, not secrecy: a PRNG seeded from os.urandom gives 80 random bits for
# ~0.2 µs, where os.urandom itself is a ~3 µs syscall on the hot path.
_ids = random.Random(os.urandom(32))


def new_turn_id() -> str:
    """A unique turn id: 80 random bits, so ids never repeat across restarts or processes."""
    return f"t_{_ids.getrandbits(80):020x}"


def new_turn_ids(n: int) -> list[str]:
    """``n`` turn ids as :func:`new_turn_id` makes them, from one draw of 80 bits each."""
    digits = f"{_ids.getrandbits(80 * n):0{20 * n}x}"
    return ["t_" + digits[i : i + 20] for i in range(0, 20 * n, 20)]


_tzinfo = attrgetter("tzinfo")


def _run_ends(user_ids: list[str], session_ids: list[str]) -> list[int]:
    """Where each run of consecutive turns of one session ends (exclusive), in order; loops
    in C, with no object made per turn."""
    changed = map(or_, map(ne, user_ids[1:], user_ids[:-1]),
                  map(ne, session_ids[1:], session_ids[:-1]))
    return [*compress(range(1, len(user_ids)), changed), len(user_ids)]


class Receipt(msgspec.Struct, frozen=True, gc=False):
    """What ``add_turn`` returns: the turn's identity, and a way to wait for the disk.

    A Struct the garbage collector does not track (it refers to no object that could refer
    back): an import makes one per turn, ~4x faster than a slotted class's, and a caller
    holding 200k of them does not make every collection walk them.

    Attributes:
        turn_id: the turn's id (``get_turn`` and hits refer to it).
        seq: its position in the session.
        lsn: its position in the store's global log.
    """

    turn_id: str
    seq: int
    lsn: int
    _store: Store

    async def durable(self) -> None:
        """Return once the turn is committed to LMDB and flushed (it then survives ``kill -9``,
        and with ``fsync`` on, the default, a power cut).

        Raises:
            RecordRefused: the store could not write this turn (the rest of its batch landed).
            EngineBroken: the store failed before committing it.
            EngineClosed: the engine closed before committing it.
        """
        await self._store.wait_committed(self.lsn)

    def __repr__(self) -> str:
        return f"Receipt(turn_id={self.turn_id!r}, seq={self.seq}, lsn={self.lsn})"


class _Session:
    __slots__ = ("user_id", "session_id", "prefix", "user_prefix", "started_at", "last_at",
                 "next_seq", "last_lsn", "window", "agent_id", "run_id")

    def __init__(self, user_id: str, session_id: str, started_at: datetime,
                 agent_id: str = "", run_id: str = "") -> None:
        self.user_id = user_id
        self.session_id = session_id
        self.agent_id, self.run_id = agent_id, run_id  # the scope of all its turns
        self.prefix = session_prefix(user_id, session_id)
        self.user_prefix = user_prefix(user_id)
        self.started_at = started_at
        self.last_at = started_at
        self.next_seq = 0
        self.last_lsn = 0  # lsn of the latest turn ingested by this process (0: all on disk)
        # The latest turns, contiguous up to next_seq; None while not loaded (cold or evicted).
        self.window: deque[Turn] | None = None

    def info(self) -> SessionInfo:
        return SessionInfo(self.user_id, self.session_id, self.started_at, self.last_at,
                           self.next_seq, self.agent_id, self.run_id)


class SessionBuffer:
    """Per-session counters and recent-turn windows over the Store."""

    def __init__(self, store: Store, config: Config) -> None:
        self._store = store
        self._window_turns = config.window_turns
        self._live_windows = config.live_windows
        self._users: dict[str, dict[str, _Session]] = {}
        # Sessions whose window is in RAM, least recently used first.
        self._live: OrderedDict[bytes, _Session] = OrderedDict()
        # Per user, the lsn of the latest turn this process ingested (none: all on disk): at
        # or above every session's ``last_lsn``, so a recall whose text index has passed it
        # skips the walk over the user's sessions (thousands, for a long-lived user).
        self._newest: dict[str, int] = {}

    async def load(self) -> None:
        """Rebuild every session's counters from the store. No window is read here: a
        session's window is read from the store when it is first used (:meth:`history`), or
        begins with the next turn said in it; reading the windows of the ``live_windows``
        latest sessions at open held up to 82k turns of a 100k-turn store as objects (35 MiB,
        a tenth of the engine's memory), for sessions nobody might ask for again."""
        infos = await self._store.read(read_sessions)
        for info in infos:
            state = _Session(info.user_id, info.session_id, info.started_at, info.agent_id,
                             info.run_id)
            state.last_at = info.last_at
            state.next_seq = info.turn_count
            self._users.setdefault(info.user_id, {})[info.session_id] = state

    # -- the hot path ------------------------------------------------------------------------

    def append(self, user_id: str, session_id: str, role: str, text: str, at: datetime,
               meta: dict[str, Any], turn_id: str | None = None, agent_id: str | None = None,
               run_id: str | None = None) -> Receipt:
        """Append a validated turn: window, counters, and the Store's queue. Synchronous.

        The turn is encoded before any state changes, so a failure leaves nothing behind.
        ``turn_id`` keeps an id made elsewhere (an import, a cluster's log); by default a new
        one is made. ``agent_id`` / ``run_id`` scope a new session; a turn of an existing
        session takes the session's (the facade refused a turn naming another).
        """
        if at.tzinfo is not _UTC:
            at = at.astimezone(_UTC)
        sessions = self._users.get(user_id)
        state = None if sessions is None else sessions.get(session_id)
        seq = 0 if state is None else state.next_seq
        store = self._store
        lsn = store.next_lsn
        if state is not None:
            agent, run = state.agent_id, state.run_id
        else:
            agent, run = agent_id or "", run_id or ""
        turn = Turn(lsn, new_turn_id() if turn_id is None else turn_id, user_id, session_id,
                    seq, role, text, at, meta, agent, run)
        value = _encode(turn)
        if state is None:
            state = _Session(user_id, session_id, at, agent, run)
            if sessions is None:
                sessions = self._users[user_id] = {}
            sessions[session_id] = state
        # A turn may be back-dated (late notes, a clock behind): the session spans from its
        # earliest turn time to its latest, whatever their order.
        started_at = at if at < state.started_at else state.started_at
        last_at = at if at > state.last_at else state.last_at
        store.submit(AppendTurn(turn, state.prefix + seq.to_bytes(8, "big"), value,
                                started_at, state.user_prefix + turn.turn_id.encode(), last_at))
        state.next_seq = seq + 1
        state.started_at, state.last_at = started_at, last_at
        state.last_lsn = lsn
        self._newest[user_id] = lsn
        window = state.window
        if window is None:
            self._set_window(state, (turn,))
        else:
            window.append(turn)
            self._live.move_to_end(state.prefix)
        return Receipt(turn.turn_id, seq, lsn, store)

    def append_many(self, user_ids: list[str], session_ids: list[str], roles: list[str],
                    texts: list[str], ats: list[datetime], metas: list[dict[str, Any]],
                    agent_ids: list[str | None], run_ids: list[str | None],
                    turn_ids: list[str] | None = None) -> list[Receipt]:
        """Append validated turns, in order, as many :meth:`append` calls would (the same ids,
        seqs, lsns, windows and records), with one op for the Store and each column made in
        bulk: what one turn of a history import costs is a few list items, not a call chain.
        Synchronous; everything is made before any state changes, so a failure leaves
        nothing behind.

        Args:
            user_ids ... run_ids: one list per argument of :meth:`append`, one item per turn.
            turn_ids: ids made elsewhere (an import), one per turn; by default new ones.

        Returns:
            One receipt per turn, in order.
        """
        n = len(texts)
        if not n:
            return []
        if set(map(_tzinfo, ats)) != {_UTC}:
            ats = [at if at.tzinfo is _UTC else at.astimezone(_UTC) for at in ats]
        store = self._store
        first = store.next_lsn
        lsns = range(first, first + n)
        if turn_ids is None:
            turn_ids = new_turn_ids(n)
        seqs: list[int] = []
        keys: list[bytes] = []
        id_keys: list[bytes] = []
        agents: list[str] = []
        scopes: list[str] = []
        # Each session the call writes: [its state (None: begun here), prefix, user prefix,
        # next seq, agent, run, earliest turn time, latest turn time]; and the runs of
        # consecutive turns of one session, as (session, end).
        touched: dict[tuple[str, str], list[Any]] = {}
        runs: list[tuple[tuple[str, str], int]] = []
        start = 0
        for end in _run_ends(user_ids, session_ids):
            pair = (user_ids[start], session_ids[start])
            session = touched.get(pair)
            if session is None:
                state = self._lookup(*pair)
                session = touched[pair] = (
                    [None, session_prefix(*pair), user_prefix(pair[0]), 0, agent_ids[start] or "",
                     run_ids[start] or "", ats[start], ats[start]] if state is None else
                    [state, state.prefix, state.user_prefix, state.next_seq, state.agent_id,
                     state.run_id, state.started_at, state.last_at])
            _, prefix, uprefix, seq, agent, scope, _, _ = session
            session[3] = seq + end - start
            run_ats = ats[start:end]  # in any order: a turn may be back-dated
            session[6] = min(session[6], min(run_ats))
            session[7] = max(session[7], max(run_ats))
            numbers = range(seq, seq + end - start)
            seqs += numbers
            keys += map(prefix.__add__, map(int.to_bytes, numbers, repeat(8), repeat("big")))
            id_keys += map(uprefix.__add__, map(str.encode, turn_ids[start:end]))
            agents += repeat(agent, end - start)
            scopes += repeat(scope, end - start)
            runs.append((pair, end))
            start = end
        turns = list(map(Turn, lsns, turn_ids, user_ids, session_ids, seqs, roles, texts, ats,
                         metas, agents, scopes))
        values = list(map(_encode, turns))
        sessions: dict[bytes, tuple[datetime, datetime, Turn]] = {}
        for pair, end in runs:
            session = touched[pair]
            sessions[session[1][:-1]] = (session[6], session[7], turns[end - 1])  # key less NUL
        store.submit_turns(AppendTurns(
            turns, keys, values, id_keys, list(map(int.to_bytes, lsns, repeat(8), repeat("big"))),
            sessions))
        start = 0
        for pair, end in runs:
            session = touched[pair]
            state = session[0]
            if state is None:
                user_id, session_id = pair
                state = session[0] = _Session(user_id, session_id, session[6], session[4],
                                              session[5])
                per_user = self._users.get(user_id)
                if per_user is None:
                    per_user = self._users[user_id] = {}
                per_user[session_id] = state
            state.next_seq = seqs[end - 1] + 1
            state.started_at, state.last_at = session[6], session[7]
            state.last_lsn = self._newest[pair[0]] = first + end - 1
            if state.window is None:
                self._set_window(state, turns[start:end])
            else:
                state.window.extend(turns[start:end])
                self._live.move_to_end(state.prefix)
            start = end
        return list(map(Receipt, turn_ids, seqs, lsns, repeat(store)))

    def _set_window(self, state: _Session, turns: Any) -> None:
        state.window = deque(turns, maxlen=self._window_turns)
        self._live[state.prefix] = state
        self._live.move_to_end(state.prefix)
        while len(self._live) > self._live_windows:
            _, evicted = self._live.popitem(last=False)
            evicted.window = None

    # -- reads -------------------------------------------------------------------------------

    def _lookup(self, user_id: str, session_id: str) -> _Session | None:
        sessions = self._users.get(user_id)
        return None if sessions is None else sessions.get(session_id)

    async def history(self, user_id: str, session_id: str, limit: int) -> list[Turn]:
        """The session's latest ``limit`` turns, oldest first, including turns not yet on disk."""
        state = self._lookup(user_id, session_id)
        if state is None:
            return []
        have = list(state.window) if state.window is not None else []
        if len(have) >= min(limit, state.next_seq):
            return have[-limit:]
        # Older turns are on disk, once everything this process queued for the session is.
        next_seq = state.next_seq
        await self._store.wait_committed(state.last_lsn)
        before = have[0].seq if have else None
        older = await self._store.read(
            read_session_tail, user_id, session_id, limit - len(have), before
        )
        turns = older + have
        if self._lookup(user_id, session_id) is state:
            window = state.window
            if window is None:
                if state.next_seq == next_seq:
                    self._set_window(state, turns[-self._window_turns:])
            elif older and have and window[0] is have[0]:
                # A window begun by a turn said since open: the turns read go in front of it
                # (as many as it has room for), so the next history is answered from RAM.
                room = self._window_turns - len(window)
                if room > 0:
                    window.extendleft(reversed(older[-room:]))
        return turns

    def scope(self, user_id: str, session_id: str) -> tuple[str, str] | None:
        """The session's (agent_id, run_id); None for an unknown session."""
        state = self._lookup(user_id, session_id)
        return None if state is None else (state.agent_id, state.run_id)

    def sessions_in_scope(self, user_id: str, agent_id: str | None,
                          run_id: str | None) -> list[str]:
        """The user's sessions of this scope (a None part matches any)."""
        return [s.session_id for s in self._users.get(user_id, {}).values()
                if (agent_id is None or s.agent_id == agent_id)
                and (run_id is None or s.run_id == run_id)]

    def next_seq(self, user_id: str, session_id: str) -> int | None:
        """The session's next seq (its turn count); None for an unknown session."""
        state = self._lookup(user_id, session_id)
        return None if state is None else state.next_seq

    def turns_after(self, user_id: str, lsn: int) -> list[Turn]:
        """The user's turns in RAM windows with an lsn above ``lsn`` (not yet indexed)."""
        if self._newest.get(user_id, 0) <= lsn:
            return []
        out = []
        for state in self._users.get(user_id, {}).values():
            if state.window is not None and state.last_lsn > lsn:
                out.extend(t for t in state.window if t.lsn > lsn)
        return out

    def recent_turn(self, user_id: str, lsn: int) -> Turn | None:
        """A turn of the user's RAM windows by lsn (it may not be committed yet)."""
        if self._newest.get(user_id, 0) < lsn:
            return None
        for state in self._users.get(user_id, {}).values():
            if state.window is not None and state.last_lsn >= lsn:
                for turn in state.window:
                    if turn.lsn == lsn:
                        return turn
        return None

    def sessions(self, user_id: str) -> list[SessionInfo]:
        """The user's sessions, most recently active first."""
        sessions = self._users.get(user_id, {})
        infos = [s.info() for s in sessions.values()]
        infos.sort(key=lambda i: i.last_at, reverse=True)
        return infos

    def users(self) -> list[str]:
        return list(self._users)

    def idle_sessions(self, before: datetime) -> list[SessionInfo]:
        """Sessions whose latest turn is older than ``before`` (finished, for maintenance)."""
        return [s.info() for per_user in self._users.values() for s in per_user.values()
                if s.last_at < before]

    # -- deletion ----------------------------------------------------------------------------

    def drop_session(self, user_id: str, session_id: str) -> None:
        sessions = self._users.get(user_id)
        state = None if sessions is None else sessions.pop(session_id, None)
        if state is not None:
            self._live.pop(state.prefix, None)
            if not sessions:
                del self._users[user_id]

    def drop_user(self, user_id: str) -> None:
        self._newest.pop(user_id, None)
        for state in self._users.pop(user_id, {}).values():
            self._live.pop(state.prefix, None)

    # -- figures -----------------------------------------------------------------------------

    def counts(self) -> tuple[int, int, int, int]:
        """(users, sessions, turns, sessions with a window in RAM)."""
        sessions = turns = 0
        for per_user in self._users.values():
            sessions += len(per_user)
            turns += sum(s.next_seq for s in per_user.values())
        return len(self._users), sessions, turns, len(self._live)
