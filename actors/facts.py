"""Facts actor: structured user facts keyed (user, category, key), and the rules that keep one
active value per key.

A decision (is this new? a duplicate? does it supersede, or lose to a more confident value?) is
taken on the trio thread against a per-user cache of active facts, under one lock, and applied by
the store in one write transaction (``PutFact``). History is never deleted: a superseded version
gets ``invalid_at`` / ``expired_at`` and stays readable through ``history``.

Rules (seeds 002 and 004):

- exact duplicate (same key and value), or a sentence with word-set Jaccard >= DEDUP_JACCARD
  against an active fact: the existing fact is reinforced (confidence, sources, use count);
  a fact a caller names (``remember_fact``) under another key only if it holds the same value;
- same key, new value: the new value supersedes the old one unless its confidence is lower, or
  the old one was confirmed by the user and the new one only inferred;
- no shared key, but the same category and the same words with opposite polarity ("likes
  jazz" / "no longer likes jazz"): a contradiction, resolved the same way.

Confidence decays as ``confidence x exp(-decay_rate x days since last use)``; facts that fall
below PRUNE_BELOW are retired as ``pruned`` by maintenance. Confirmed facts never decay.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

import msgspec
import trio

from .base.errors import RecordRefused
from .base.logs import RepeatedWarning
from .base.messages import PutFact, PutState, Searchable
from .base.records import Fact, Link
from .base.text import composed, folded
from .extraction import STOPWORDS as _STOP
from .extraction import (
    Candidate,
    Extractor,
    RuleExtractor,
    checked_candidates,
    extract_facts,
    jaccard,
)
from .extraction import words as _words
from .imported import Imported
from .store import (
    LogFollower,
    Store,
    failure_put,
    fact_key,
    read_derived_id,
    read_fact_versions,
    read_facts,
    read_links,
    read_memories_by_id,
)

__all__ = ["Facts", "effective_confidence", "known_at", "spelling", "DECAY_RATES",
           "DEDUP_JACCARD", "PRUNE_BELOW"]

DEDUP_JACCARD = 0.75  # word-set similarity at which two fact sentences are one fact (seed 004)
CONTRADICTION_JACCARD = 0.5  # content-word overlap at which opposite polarity is a contradiction
PRUNE_BELOW = 0.05  # effective confidence under which maintenance retires a fact (seed 004)
# A statement given no date while the clock reads less than this before the value in force
# began is the later one (a clock stepped back, two writers' clocks apart), not a past version.
STEPPED_BACK = timedelta(minutes=1)
CACHE_USERS = 4096  # users whose active facts stay in RAM
FOLLOW_CHUNK = 512  # log records per step of the extraction follower
WATERMARK = b"facts_lsn"

log = logging.getLogger("engram.facts")

# Per-day decay of confidence without use, by category: standing facts about who someone is and
# what they must avoid fade slowly; passing preferences faster. Confirmed facts: 0.
DECAY_RATES = {"identity": 0.002, "constraint": 0.002, "instruction": 0.005,
               "relationship": 0.003, "pet": 0.003, "schedule": 0.02, "preference": 0.02}
DEFAULT_DECAY = 0.05

_encode = msgspec.msgpack.Encoder().encode
_NEGATIONS = frozenset({"not", "no", "never", "don't", "doesn't", "dont", "isn't", "aren't",
                        "won't", "can't", "cannot", "longer", "anymore", "stopped", "quit"})


def effective_confidence(fact: Fact, now: datetime) -> float:
    """Confidence after decay: ``confidence x exp(-rate x days since last use)``."""
    if fact.protected:
        return fact.confidence
    since = fact.last_access_at or fact.created_at
    days = max(0.0, (now - since).total_seconds() / 86400)
    return fact.confidence * math.exp(-DECAY_RATES.get(fact.category, DEFAULT_DECAY) * days)


def known_at(fact: Fact, when: datetime) -> bool:
    """Whether the store held this version as true at ``when``: recorded by then (transaction
    time) and in force then (valid time) on what the store knew then. Its ``invalid_at`` is
    learned when it is retired (``expired_at``): until then it is in force from ``valid_at``
    on; from then until ``invalid_at``, which is later only when a value in force from a
    later date superseded it (Lisbon until the move to Faro on the 20th)."""
    return (fact.created_at <= when and fact.valid_at <= when
            and (fact.expired_at is None or fact.expired_at > when
                 or (fact.invalid_at is not None and fact.invalid_at > when)))


# -- the actor -----------------------------------------------------------------------------------


@dataclass
class Outcome:
    """What a proposed fact became: ``created``, ``superseded`` (it replaced ``previous``),
    ``reinforced`` (a duplicate: ``fact`` is the existing one), ``past`` (true from before
    ``previous``, the active value: kept as a past version of the key), or ``refused``
    (``reason``; for a lower confidence, ``needed`` is the active value's after decay)."""

    status: str
    fact: Fact | None
    previous: Fact | None = None
    reason: str = ""
    needed: float = 0.0


Active = dict[tuple[str, str], Fact]  # a user's active facts by (category, key)


@dataclass(frozen=True)
class Proposal:
    """A fact the extraction follower proposes: the candidate, and the user turn it came from
    (``requires``: that turn's lsn, without which the fact is dropped)."""

    user_id: str
    candidate: Candidate
    origin: str
    sources: tuple[str, ...]
    session_id: str
    valid_at: datetime
    requires: int


class Facts:
    """The Facts actor. Decisions run one at a time under ``_lock``; ``removed`` is called with
    the lsns that left the indexes, on the trio thread in commit order (the ANN's feed)."""

    def __init__(self, store: Store, removed: Callable[[str, list[int]], None],
                 clock: Callable[[], datetime], new_id: Callable[[], str]) -> None:
        self._store = store
        self._removed = removed
        self._clock = clock
        self._new_id = new_id
        self._cache: dict[str, Active] = {}
        # Each user's latest decision's lsn until it is committed (see _decisions_written),
        # and the largest that gave way to newer users'.
        self._decided: dict[str, int] = {}
        self._evicted_upto = 0
        self._forgets = 0  # forget calls so far: a read that overlapped one is not cached
        # Users forgotten since the extraction follower's step in flight read its turns
        # (cleared as each step ends, before the next reads): what it decides for them may
        # come from a forgotten turn.
        self._forgotten: set[str] = set()
        # Held while a decision is taken and applied: two decisions on one key never interleave.
        self._lock = trio.Lock()
        self._extraction_failed = RepeatedWarning(log)  # each turn's is a failure record
        # A cluster node's (set once, by the engine): an extracted fact is decided and timed
        # at its turn's logged time, never by this node's clock when it replays the log.
        self.timed_by_log = False

    # -- reads ---------------------------------------------------------------------------------

    async def _user(self, user_id: str) -> Active:
        cached = self._cache.get(user_id)
        if cached is not None:
            self._cache[user_id] = self._cache.pop(user_id)  # most recently used last
            return cached
        forgets = self._forgets
        await self._store.wait_logged()
        facts = await self._store.read(read_facts, user_id, True)
        cached = self._cache.get(user_id)  # another task may have loaded it meanwhile
        if cached is None and forgets != self._forgets:
            # A forget committed while the read ran: it may hold what went. This caller's
            # call overlapped the forget and may see either; the cache must not.
            return {(f.category, f.key): f for f in facts}
        if cached is None:
            cached = {(f.category, f.key): f for f in facts}
            self._cache[user_id] = cached
            while len(self._cache) > CACHE_USERS:
                del self._cache[next(iter(self._cache))]
        return cached

    async def active(self, user_id: str) -> list[Fact]:
        return list((await self._user(user_id)).values())

    async def profile(self, user_id: str, category: str | None = None,
                      min_importance: float = 0.0, as_of: datetime | None = None
                      ) -> list[Fact]:
        """Active facts by importance, then effective confidence. With ``as_of``: the
        versions the store held as true then (see :func:`known_at`), as they were stored."""
        now = self._clock() if as_of is None else as_of
        if as_of is None:
            found = list((await self._user(user_id)).values())
        else:
            await self._store.wait_logged()
            found = [f for f in await self._store.read(read_facts, user_id, False)
                     if known_at(f, as_of)]
        wanted = None if category is None else folded(category)
        facts = [f for f in found
                 if (wanted is None or folded(f.category) == wanted)
                 and f.importance >= min_importance]
        facts.sort(key=lambda f: (-f.importance, -effective_confidence(f, now), f.category, f.key))
        return facts

    async def for_prompt(self, user_id: str, category: str | None = None,
                         min_importance: float = 0.0, now: datetime | None = None
                         ) -> list[tuple[Fact, Fact | None]]:
        """What a prompt should say of the user at ``now`` (default: the clock): the active
        facts as :meth:`profile` orders them, each version not yet in force ("I move to
        Porto on the 10th", told on the 1st) preceded by the versions held true until it
        (Lisbon, until the 10th), so a prompt says each with its dates instead of Porto a
        month early. Pairs of (fact, the version due later it gives way to, for a held one;
        None for an active one); a held version's ``invalid_at`` is where it gives way. The
        filters apply to each version alone. The store is read only while the user has a
        version due later."""
        now = self._clock() if now is None else now
        active = await self.profile(user_id)
        shown: list[tuple[Fact, Fact | None]] = [(f, None) for f in active]
        if any(f.valid_at > now for f in active):
            await self._decisions_written(user_id)
            active = await self.profile(user_id)  # as the decisions waited for left it
            due = [f for f in active if f.valid_at > now]
            versions, rivals = await self._store.read(_read_versions_and_rivals, user_id,
                                                      [f.fact_id for f in due])
            shown = _with_held(active, due, versions, rivals, now)
        wanted = None if category is None else folded(category)
        return [(f, then) for f, then in shown
                if (wanted is None or folded(f.category) == wanted)
                and f.importance >= min_importance]

    async def _decisions_written(self, user_id: str) -> None:
        """Return once the user's decisions taken so far are committed (a read then sees
        what they retired): a wait for the last one's lsn, not for every turn queued."""
        lsn = self._decided.get(user_id, self._evicted_upto)
        if not lsn:
            return
        try:
            await self._store.wait_committed(lsn)
        except RecordRefused:
            pass  # refused: its caller hears of it, and the read sees the store as it is
        if self._decided.get(user_id) == lsn:
            del self._decided[user_id]

    async def _replanned(self, current: Fact, valid_at: datetime, now: datetime
                         ) -> tuple[Fact, ...]:
        """The superseded versions of ``current``'s key (however spelt) held true past
        ``valid_at`` because ``current`` was due later (Lisbon until Porto's day 40), now true
        only until ``valid_at`` (Faro's day 20, a plan changed before Porto's day): otherwise
        both would be in force between the two dates. What the store knew before now stays
        what an ``as_of`` before now answers (:func:`known_at`): a capped version's
        ``expired_at`` moves to the end of the window it was held in, up to now, never past
        it. A retracted version was not held true by ``current`` and is left alone. So are
        the versions ``current`` superseded under other keys ("likes jazz", ended by "no
        longer likes jazz" from day 40, a plan now moved to day 20)."""
        wanted = spelling(current.category, current.key)
        await self._store.wait_logged()  # the versions decisions before this one queued
        versions = await self._store.read(_read_replanned, current.user_id, current.fact_id,
                                          lambda c, k: spelling(c, k) == wanted)
        capped = []
        for f in versions:
            end = max(valid_at, f.valid_at)
            if f.status == "superseded" and f.invalid_at is not None and f.invalid_at > end:
                held = min(max(f.expired_at or f.invalid_at, f.invalid_at), now)
                capped.append(msgspec.structs.replace(f, invalid_at=end, expired_at=held))
        return tuple(capped)

    async def history(self, user_id: str, category: str, key: str) -> list[Fact]:
        await self._store.wait_logged()
        facts = await self._store.read(read_facts, user_id, False)
        wanted = spelling(category, key)
        return sorted((f for f in facts if spelling(f.category, f.key) == wanted),
                      key=lambda f: f.lsn)

    # -- writes --------------------------------------------------------------------------------

    @asynccontextmanager
    async def held(self) -> AsyncIterator[None]:
        """No decision is taken while the block runs, and every one taken before it is queued
        to the store: a writer of facts from outside the actor (an import) checks the active
        facts and writes its own with no decision in between."""
        async with self._lock:
            yield

    async def propose(self, user_id: str, candidate: Candidate, *, origin: str,
                      source_turn_ids: tuple[str, ...] = (), session_id: str = "",
                      valid_at: datetime | None = None, force: bool = False,
                      requires: int = 0) -> Outcome:
        """Apply the rules to one proposed fact. ``force`` (a correction by the user)
        supersedes whatever is there, whatever its confidence; ``requires`` is the source
        turn's lsn, without which the fact is dropped (forgotten meanwhile)."""
        async with self._lock:
            return await self._propose(user_id, candidate, origin, source_turn_ids, session_id,
                                       valid_at, force, requires)

    async def propose_all(self, proposals: list[Proposal]) -> None:
        """Apply the rules to proposed facts in order, as ``propose`` one by one would, with
        one wait for the store at the end instead of one per fact: the extraction follower
        taking in a bulk import waited for a commit per fact (~11 turns a second on a loaded
        machine). Each decision sees those before it (the cache changes as each is queued).
        A fact the store refuses (its source turn forgotten meanwhile) drops the user's
        cached facts, to be read again; a later decision that retired it retires nothing
        (the store skips a version it does not hold), one that reinforced it writes nothing
        (the rewrite is guarded by its lsn)."""
        if not proposals:
            return
        async with self._lock:
            for p in proposals:
                await self._propose(p.user_id, p.candidate, p.origin, p.sources, p.session_id,
                                    p.valid_at, False, p.requires, wait=False,
                                    at=p.valid_at if self.timed_by_log else None)
                if p.user_id in self._forgotten:
                    # Its turn may be forgotten: the store refuses the fact then, and until
                    # that lands the cache must not show it (it is read again).
                    self._cache.pop(p.user_id, None)
            await self._store.wait_written()

    async def _propose(self, user_id: str, c: Candidate, origin: str,
                       sources: tuple[str, ...], session_id: str, valid_at: datetime | None,
                       force: bool, requires: int, wait: bool = True,
                       at: datetime | None = None) -> Outcome:
        """One decision, applied, at ``at`` (None: the clock's time): the fact's creation,
        a rival's decay and a reinforcement count from it. With ``wait`` False the write is
        queued, not awaited: the outcome is the one the store will apply unless it refuses
        the fact (see ``propose_all``)."""
        state = await self._user(user_id)
        now = (self._clock() if at is None else at).astimezone(timezone.utc)
        # A correction that names a new date for the value in force is a new version (the
        # value was right, since when was not); anything else saying that value reinforces it.
        redated = force and valid_at is not None
        dated = valid_at is not None
        valid_at = (valid_at or now).astimezone(timezone.utc)
        current = _find(state, c.category, c.key)
        if (current is not None and not dated
                and current.valid_at - STEPPED_BACK <= valid_at < current.valid_at
                <= max(now, current.created_at)):
            # Given no date, and the clock reads a moment before the value in force began (not
            # a plan, due later): the clock stepped back (NTP), or two writers' clocks are
            # apart. Recorded after it, it is the later statement, as the log has it. A date
            # the caller gave is kept as given.
            valid_at = current.valid_at + timedelta(microseconds=1)
        if (current is not None and _same_value(current.value, c.value)
                and not (redated and valid_at != current.valid_at)):
            return await self._reinforce(current, c, sources, now, wait)
        if not force:
            # A caller's key is its own: under another key a near sentence is the same fact
            # only when it holds the same value (an extractor's keys vary, so its facts merge
            # on the sentence alone).
            named = origin == "api"
            words = _words(c.text)
            for other in state.values():
                if (other is not current
                        and (not named or _same_value(other.value, c.value))
                        and jaccard(words, _words(other.text)) >= DEDUP_JACCARD):
                    return await self._reinforce(other, c, sources, now, wait)
        # The value in force began before the statement is decided, or when it was recorded
        # (not a plan, due later): a cluster node decides a back-filled turn at its own time,
        # a year back, and must come to what one engine alone does.
        if (not force and current is not None
                and valid_at < current.valid_at <= max(now, current.created_at)):
            return await self._past(user_id, c, origin, sources, session_id, valid_at, current,
                                    now, requires, wait)
        rivals = [current] if current is not None else []
        rivals += [f for f in _contradicted(state, c) if f is not current]
        for rival in rivals:
            if force:
                continue
            needed = effective_confidence(rival, now)
            if c.confidence < needed:
                return Outcome("refused", None, rival, "lower confidence than the active value",
                               needed)
            if rival.protected and origin != "api":
                return Outcome("refused", None, rival, "the active value was confirmed")
        # Read before the lsn is taken: nothing may be queued between taking it and the op.
        replanned = (await self._replanned(current, valid_at, now)
                     if current is not None and current.valid_at > valid_at else ())
        store = self._store
        fact_id = await self._fact_id(user_id, c, sources, rivals)
        await store.reserve(1)
        lsn = store.next_lsn
        fact = Fact(lsn, fact_id, user_id, c.category, c.key, c.value, c.text,
                    c.confidence, c.importance, c.keywords, sources, (), session_id, valid_at,
                    None, now, None, "active", False, origin)
        retired = tuple(msgspec.structs.replace(r, status="superseded", invalid_at=valid_at,
                                                expired_at=now) for r in rivals) + replanned
        links = tuple(Link(fact.fact_id, s, "derived_from", now) for s in sources)
        links += tuple(Link(fact.fact_id, r.fact_id, "supersedes", now) for r in rivals)
        # A version of another key that current had ended from a later date is ended by
        # this one from its own date now: the prompts pair it with this one (_with_held).
        links += tuple(Link(fact.fact_id, r.fact_id, "supersedes", now) for r in replanned
                       if spelling(r.category, r.key) != spelling(fact.category, fact.key))
        op = PutFact(lsn, user_id, fact, retired, links, requires=requires)
        if not wait:
            self._queue(user_id, op)
        elif not await self._apply(user_id, op):
            return Outcome("refused", None, None, "its source was forgotten")
        for r in rivals:
            state.pop((r.category, r.key), None)
        state[(fact.category, fact.key)] = fact
        return Outcome("superseded" if rivals else "created", fact, rivals[0] if rivals else None)

    async def _fact_id(self, user_id: str, c: Candidate, sources: tuple[str, ...],
                       rivals: list[Fact]) -> str:
        """An extracted fact's id is what it stands for (its turn, key and value, and the
        versions it retires: a value said again in the same turn is a new version), the same
        on every node that applies the log; a caller's is the call's (_parts.pinned)."""
        if not sources:
            return "f_" + self._new_id()
        return await self._store.read(read_derived_id, user_id, "f_", (
            user_id, sources, c.category, c.key, c.value,
            tuple(sorted(r.fact_id for r in rivals))))

    async def _past(self, user_id: str, c: Candidate, origin: str, sources: tuple[str, ...],
                    session_id: str, valid_at: datetime, current: Fact, now: datetime,
                    requires: int, wait: bool) -> Outcome:
        """A value stated as true from before the active one, which is in force (a back-filled
        turn, a late note, ``remember_fact`` with an earlier ``valid_at``): a past version of
        the key, true until the active one's date and retired as it is recorded, so no
        ``as_of`` takes it for the value in force; the active one stays (a correction, not
        this, replaces it whatever its date)."""
        fact_id = await self._fact_id(user_id, c, sources, [])
        store = self._store
        await store.reserve(1)
        lsn = store.next_lsn
        past = Fact(lsn, fact_id, user_id, c.category, c.key, c.value, c.text, c.confidence,
                    c.importance, c.keywords, sources, (), session_id, valid_at,
                    current.valid_at, now, now, "superseded", False, origin)
        # Written as history an import writes: at the op's own lsn, never logged as searchable.
        op = PutFact(lsn, user_id, None, (past,), requires=requires)
        if not wait:
            self._queue(user_id, op)
        elif not await self._apply(user_id, op):
            return Outcome("refused", None, None, "its source was forgotten")
        return Outcome("past", past, current)

    async def _reinforce(self, fact: Fact, c: Candidate, sources: tuple[str, ...],
                         now: datetime, wait: bool = True) -> Outcome:
        merged = tuple(dict.fromkeys(fact.source_turn_ids + sources))
        updated = msgspec.structs.replace(
            fact, confidence=max(fact.confidence, c.confidence),
            importance=max(fact.importance, c.importance), source_turn_ids=merged,
            access_count=fact.access_count + 1, last_access_at=now)
        if wait:
            await self._rewrite([updated])
        else:
            self._store.check_usable()
            self._queue_rewrite([updated])
        return Outcome("reinforced", updated)

    async def confirm(self, user_id: str, category: str, key: str) -> Fact | None:
        """Protect the active fact: confidence 1, never decays (seed 004's confirm_fact)."""
        async with self._lock:
            fact = _find(await self._user(user_id), category, key)
            if fact is None:
                return None
            updated = msgspec.structs.replace(fact, protected=True, confidence=1.0)
            await self._rewrite([updated])
            return updated

    async def retire(self, user_id: str, facts: Iterable[tuple[str, str]], status: str,
                     along: Callable[[list[Fact]], Awaitable[list[Callable[[int], Any]]]]
                     | None = None) -> list[Fact]:
        """Retire active facts by (category, key) as ``retracted`` or ``pruned``; they leave
        both indexes and stay in history. A retired value that was due later (a plan) ended
        the versions held true until it only because it was planned: each of those in force
        now, of a key with no other active value, is in force again as a new active version
        (see :meth:`_resumed`). ``along`` gets the facts about to be retired and returns
        makers of ops (each given its lsn) that commit with the retirement.

        Everything commits in one write transaction (a cluster's applier moves the
        partition's watermark in it: a crash leaves all or none of it)."""
        async with self._lock:
            state = await self._user(user_id)
            now = self._clock().astimezone(timezone.utc)
            found = list({f.fact_id: f for k in facts
                          if (f := _find(state, *k)) is not None}.values())
            if not found:
                return []
            retired = tuple(msgspec.structs.replace(f, status=status, invalid_at=now,
                                                    expired_at=now) for f in found)
            gone = {f.fact_id for f in found}
            held: dict[str, Fact] = {}
            for f in found:
                # A plan is a value due after it was recorded and after now: one in force when
                # recorded is none, whatever a clock behind the recording one reads (a step
                # back, a cluster node behind), as when _past decided what it ended.
                if f.valid_at > max(now, f.created_at):
                    for h in await self._held_by(f, now):
                        other = _find(state, h.category, h.key)
                        if other is None or other.fact_id in gone:  # no newer value of its own
                            held[h.fact_id] = h
            held = _latest_of_each_key(held)
            extra = await along(found) if along is not None else []
            store = self._store
            count = max(1, len(held)) + len(extra)
            await store.reserve(count)  # cancel-safe: nothing is taken yet
            lsn = store.next_lsn
            resumed = self._resumed(list(held.values()), lsn, now)
            capped = tuple(msgspec.structs.replace(f, invalid_at=now, expired_at=now)
                           for f in held.values())
            first, links = resumed[0] if resumed else (None, ())
            ops = [PutFact(lsn, user_id, first, retired + capped, links)]
            ops += [PutFact(fact.lsn, user_id, fact, (), links) for fact, links in resumed[1:]]
            ops += [make(lsn + len(ops) + i) for i, make in enumerate(extra)]
            store.hold_together(len(ops))
            for op in ops:  # no checkpoint between them: one group, in lsn order
                if type(op) is PutFact:
                    self._queue(user_id, op)
                else:
                    store.submit(op)
            for f in found:
                state.pop((f.category, f.key), None)
            for fact, _ in resumed:
                state[(fact.category, fact.key)] = fact
            with trio.CancelScope(shield=True):  # it lands; the cache knows it already
                await store.wait_committed(ops[-1].lsn)
            return list(retired)

    async def _held_by(self, plan: Fact, now: datetime) -> list[Fact]:
        """The superseded versions in force now that ``plan`` (a value due later) ends: of
        its key (however spelt), ended where it starts, and of the other keys it superseded
        ("likes jazz", ended by "no longer likes jazz" from day 40)."""
        wanted = spelling(plan.category, plan.key)
        await self._store.wait_logged()
        versions = await self._store.read(_read_replanned, plan.user_id, plan.fact_id,
                                          lambda c, k: spelling(c, k) == wanted)
        return [f for f in versions if f.status == "superseded" and f.valid_at <= now
                and f.invalid_at is not None and f.invalid_at == plan.valid_at]

    def _resumed(self, held: list[Fact], lsn: int, now: datetime
                 ) -> list[tuple[Fact, tuple[Link, ...]]]:
        """Each of ``held`` in force again from now on, a new active version (with its
        sources' links) at ``lsn`` and the lsns after it: the old one stays what an ``as_of``
        before now answers, once capped at now (:func:`known_at`)."""
        out = []
        for i, f in enumerate(held):
            fact = msgspec.structs.replace(f, lsn=lsn + i, fact_id="f_" + self._new_id(),
                                           invalid_at=None, created_at=now, expired_at=None,
                                           status="active")
            out.append((fact, tuple(Link(fact.fact_id, s, "derived_from", now)
                                    for s in f.source_turn_ids)))
        return out

    def touch(self, user_id: str, fact_ids: Iterable[str]) -> None:
        """Count a use of these active facts (shown in a prompt): resets their decay.

        Synchronous: the cache changes at once and the write is queued, so a retrieval never
        waits for it. A user no longer cached (the retrieval just read the profile, so rarely)
        or a closing store loses the count, which only lets the facts decay a little sooner.
        """
        ids = set(fact_ids)
        active = self._cache.get(user_id)
        if not ids or active is None or not self._store.usable():
            return
        self._queue_rewrite(self._used(active, ids))

    async def count_use(self, user_id: str, fact_ids: Iterable[str],
                        puts: tuple[tuple[bytes, bytes, bytes | None, int], ...] = ()
                        ) -> list[Fact]:
        """Count a use of these active facts, as :meth:`touch` does, but read from the store
        when the user is not cached, so every node that applies a cluster's logged use counts
        the same; ``puts`` (a ``PutState``'s) go in the same write. Returns once written.

        Returns:
            The facts counted (ids not of an active fact are left out).
        """
        ids = set(fact_ids)
        async with self._lock:
            used = self._used(await self._user(user_id), ids) if ids else []
            if used or puts:
                self._store.check_usable()
                self._queue_rewrite(used, puts)
                await self._store.wait_written()
            return used

    def _used(self, active: Active, ids: set[str]) -> list[Fact]:
        """The active facts among ``ids``, each with one more use, now."""
        now = self._clock().astimezone(timezone.utc)
        return [msgspec.structs.replace(f, access_count=f.access_count + 1, last_access_at=now)
                for f in active.values() if f.fact_id in ids]

    async def decay_and_prune(self, user_ids: Iterable[str]) -> int:
        """Retire the facts whose effective confidence fell below PRUNE_BELOW."""
        pruned = 0
        for user_id in user_ids:
            now = self._clock()
            state = await self._user(user_id)
            weak = [k for k, f in state.items()
                    if effective_confidence(f, now) < PRUNE_BELOW]
            pruned += len(await self.retire(user_id, weak, "pruned"))
        return pruned

    def forget(self, user_id: str) -> None:
        """Drop a user's cached facts (after a forget; they are reread from the store)."""
        self._cache.pop(user_id, None)
        self._forgets += 1
        self._forgotten.add(user_id)

    def _queue_rewrite(self, facts: list[Fact],
                       extra: tuple[tuple[bytes, bytes, bytes | None, int], ...] = ()) -> None:
        """Change facts in place (same version, same lsn: no index sees a difference), in the
        cache at once and in the store in queue order. Each put is guarded by the fact's lsn,
        so a version retired or forgotten before it lands is not brought back. ``extra``
        puts go first, in the same op."""
        if not facts and not extra:
            return
        puts = extra + tuple((b"facts", fact_key(f), _encode(f), f.lsn) for f in facts)
        self._store.submit(PutState(puts))
        for f in facts:
            active = self._cache.get(f.user_id)
            if active is not None and (f.category, f.key) in active:
                active[(f.category, f.key)] = f

    async def _rewrite(self, facts: list[Fact]) -> None:
        self._store.check_usable()
        self._queue_rewrite(facts)
        await self._store.wait_written()

    def _queue(self, user_id: str, op: PutFact) -> None:
        """Queue a decision's write without waiting for it: what it retires leaves the
        indexes at its commit; if the store refuses it, the user's cached facts (which
        already hold it) are dropped, to be read again."""

        def committed(left: list[int] | None) -> None:
            if left is None:
                self._cache.pop(user_id, None)
            elif left:
                self._removed(user_id, left)

        self._store.submit(msgspec.structs.replace(op, committed=committed))
        self._decided_at(user_id, op.lsn)

    def _decided_at(self, user_id: str, lsn: int) -> None:
        """Remember the user's latest decision's lsn (see :meth:`_decisions_written`); past
        CACHE_USERS users the oldest's gives way to a bound every forgotten one is under."""
        self._decided.pop(user_id, None)
        self._decided[user_id] = lsn
        if len(self._decided) > CACHE_USERS:
            oldest = next(iter(self._decided))
            self._evicted_upto = max(self._evicted_upto, self._decided.pop(oldest))

    async def _apply(self, user_id: str, op: PutFact) -> bool:
        applied: list[bool] = []

        def committed(left: list[int] | None) -> None:
            applied.append(left is not None)
            if left:
                self._removed(user_id, left)

        op = msgspec.structs.replace(op, committed=committed)
        self._store.submit(op)
        self._decided_at(user_id, op.lsn)
        # Queued, the decision lands whether or not its caller stays for it; the caller's
        # cached facts must learn of it (a caller cancelled here left the old value cached
        # beside the new one stored: two active versions of one key, for good).
        with trio.CancelScope(shield=True):
            await self._store.wait_committed(op.lsn)
        return applied[0]

    # -- the extraction follower ---------------------------------------------------------------

    def follower(self, extractor: Extractor | None = None,
                 imported: Imported | None = None) -> LogFollower:
        """The follower that extracts facts from every committed user turn, in log order,
        with ``extractor`` (default: the rules); the rules stand in for a turn it fails on,
        which is kept as a failure (``Engine.failures``) saying what went wrong. Imported
        turns (``imported``; default: none) came with their facts: they are skipped. On a
        cluster node (``timed_by_log``) a turn's facts are decided and timed at the turn's
        logged time, so every node that applies the log decides alike."""
        extractor = RuleExtractor() if extractor is None else extractor
        imported = Imported() if imported is None else imported
        rules = isinstance(extractor, RuleExtractor)  # no fallback needed: run them inline

        async def handle(records: list[Searchable], last: int) -> tuple[tuple, tuple]:
            # The step's facts are decided in order and written with one wait at its end (by
            # the rules, ~512 turns); a plugged-in extractor's after each turn, so a slow
            # model's facts land as it finds them.
            proposals: list[Proposal] = []
            failures = []  # turns the extractor failed on: kept, so that it is seen
            ruled = 0  # turns the rules ran on: the yields count these, not records
            for r in records:
                if r.kind != "turn" or r.role != "user" or r.lsn in imported:
                    continue
                candidates, origin = None, extractor.name
                if not rules:
                    try:
                        candidates = checked_candidates(await extractor.extract(r.text))
                    except Exception as exc:  # the rules stand in for a failing extractor
                        self._extraction_failed("fact extraction by %s failed, using the "
                                                "rules: %r", extractor.name, exc)
                        failures.append(failure_put(r.lsn, "facts", r.user_id, r.memory_id,
                                                    exc))
                if candidates is None:
                    candidates, origin = extract_facts(r.text), "rules"
                    ruled += 1
                    # Regex work in small steps. Counted in ruled turns: in a conversation
                    # every other record is an assistant's, which the rules skip.
                    if ruled % 8 == 0 or self._store.receipts_waiting:
                        await self._store.yield_to_receipts()
                proposals += [Proposal(r.user_id, c, origin, (r.memory_id,), r.session_id,
                                       r.at, r.lsn) for c in candidates]
                if not rules:
                    await self.propose_all(proposals)
                    proposals = []
            await self.propose_all(proposals)
            self._forgotten.clear()  # the next step reads after this
            return tuple(failures), ()

        return LogFollower(self._store, WATERMARK, FOLLOW_CHUNK, handle)


def _same_value(a: str, b: str) -> bool:
    """Case and spacing aside (lower(), not casefold(): 'Straße' is not 'Strasse'), and
    Unicode's composed or decomposed forms."""
    return " ".join(composed(a).lower().split()) == " ".join(composed(b).lower().split())


def _read_replanned(txn: Any, dbs: dict[bytes, Any], user_id: str, fact_id: str,
                    same: Callable[[str, str], bool]) -> list[Fact]:
    """The user's versions of the key ``same`` admits, then the facts of other keys that
    ``fact_id`` superseded (its ``supersedes`` links): one read."""
    versions = read_fact_versions(txn, dbs, user_id, same)
    ended = [link.to_id for link in read_links(txn, dbs, user_id, [fact_id])[fact_id]
             if link.type == "supersedes" and link.from_id == fact_id]
    others = read_memories_by_id(txn, dbs, user_id, ended).values()
    return versions + [f for f in others if type(f) is Fact and not same(f.category, f.key)]


def _read_versions_and_rivals(txn: Any, dbs: dict[bytes, Any], user_id: str,
                              due_ids: list[str]) -> tuple[list[Fact], dict[str, set[str]]]:
    """Every version of the user's facts, and the ids each of ``due_ids`` superseded when it
    was decided (its ``supersedes`` links): one read."""
    rivals = {memory_id: {link.to_id for link in links
                          if link.type == "supersedes" and link.from_id == memory_id}
              for memory_id, links in read_links(txn, dbs, user_id, due_ids).items()}
    return read_facts(txn, dbs, user_id, False), rivals


def _with_held(active: list[Fact], due: list[Fact], versions: list[Fact],
               rivals: dict[str, set[str]], now: datetime) -> list[tuple[Fact, Fact | None]]:
    """``active`` in order, each of ``due`` preceded by the superseded versions held true
    until it, oldest first. A held version gives way to the next version of its key shown
    (a plan forgotten and made again: where the new one starts, whatever the forgotten one
    had said), else to the version due later that superseded it under another key ("no
    longer likes jazz" from May); one that leads to no version due later is left out, as
    :meth:`Facts.profile` leaves it. ``rivals``: what each of ``due`` superseded."""
    held = [f for f in versions if f.status == "superseded" and f.invalid_at is not None
            and f.invalid_at > now and f.invalid_at > f.valid_at]
    if not held:
        return [(f, None) for f in active]
    by_key: dict[tuple[str, str], list[Fact]] = {}
    for f in (*held, *due):
        by_key.setdefault(spelling(f.category, f.key), []).append(f)
    then: dict[str, tuple[Fact, datetime]] = {}  # a held version's id: the next, and when
    for f in held:
        later = [g for g in by_key[spelling(f.category, f.key)] if g.valid_at > f.valid_at]
        if later:
            after = min(later, key=lambda g: (g.valid_at, g.lsn))
            then[f.fact_id] = (after, after.valid_at)
        else:
            by = [g for g in due if f.fact_id in rivals.get(g.fact_id, ())]
            if by:
                then[f.fact_id] = (by[0], f.invalid_at)
    before: dict[str, list[Fact]] = {}  # a due version's id: the held chain up to it
    for f in held:
        if f.fact_id not in then:
            continue
        step, ends = then[f.fact_id]
        while step.status != "active" and step.fact_id in then:
            step = then[step.fact_id][0]
        if step.status == "active" and ends > now:
            before.setdefault(step.fact_id, []).append(
                msgspec.structs.replace(f, invalid_at=ends))
    out: list[tuple[Fact, Fact | None]] = []
    for fact in active:
        chain = sorted(before.get(fact.fact_id, ()), key=lambda g: (g.valid_at, g.lsn))
        out += [(f, fact) for f in chain]
        out.append((fact, None))
    return out


def spelling(category: str, key: str) -> tuple[str, str]:
    """A fact's category and key as a reader tells them apart: case, spacing and Unicode's
    composed or decomposed forms aside."""
    return folded(category), folded(key)




def _latest_of_each_key(held: dict[str, Fact]) -> dict[str, Fact]:
    """Of the versions a retired plan held, the one of each key in force last before it (the
    latest begun; of those, the latest recorded): a key gets one value back, never two."""
    latest: dict[str, Fact] = {}
    for f in held.values():
        key = spelling(f.category, f.key)
        kept = latest.get(key)
        if kept is None or (f.valid_at, f.created_at) > (kept.valid_at, kept.created_at):
            latest[key] = f
    return {f.fact_id: f for f in latest.values()}


def _find(state: Active, category: str, key: str) -> Fact | None:
    """The active fact of this category and key, spelt so or in another case or spacing
    (an extractor's "Location" and the caller's "location" are one key)."""
    found = state.get((category, key))
    if found is None:
        wanted = spelling(category, key)
        found = next((f for (c, k), f in state.items() if spelling(c, k) == wanted), None)
    return found


def _contradicted(state: Active, c: Candidate) -> list[Fact]:
    """Active facts of the candidate's category saying the opposite about the same thing."""
    words = _words(c.text)
    negated = bool(words & _NEGATIONS)
    content = words - _NEGATIONS - _STOP
    out = []
    category, key = spelling(c.category, c.key)
    for fact in state.values():
        if folded(fact.category) != category or folded(fact.key) == key:
            continue
        other = _words(fact.text)
        if bool(other & _NEGATIONS) == negated:
            continue
        if jaccard(content, other - _NEGATIONS - _STOP) >= CONTRADICTION_JACCARD:
            out.append(fact)
    return out
