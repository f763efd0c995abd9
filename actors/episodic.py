"""EpisodicCompressor actor: turns the oldest turns of long sessions into episodes, and keeps
the FSRS state (seed 001) of what retrieval shows.

It follows the store's log, never the hot path. When a session has EPISODE_AFTER turns not yet in
an episode (seed 002: compress at 20, keep the last 10), the oldest ones become an episode; a
finished session's remainder is consolidated by maintenance. An episode has a title, an extractive
summary (the most central, least redundant sentences by embedding: maximal marginal relevance
over sentence vectors from the background embedding lane), keyphrases, its turn range and times,
surprise (novelty against the user's earlier episodes) and initial FSRS state, boosted by
surprise. With an LLM configured, the LLM writes title, summary and keywords instead.

The turns stay searchable; the episode is logged (both indexes take it) and linked to its turns.

Reviews: ``retrieve_memory`` records what it showed as a pending review; when the next assistant
turn of that conversation is committed, each shown memory is rated GOOD if the reply used it
(shares content words with it) and HARD if not. HARD, not AGAIN: a memory that was not needed
this time was not forgotten. ``review`` rates explicitly.

Times: an episode's creation (its initial FSRS state), its links' and a rating's are the
clock's; on a cluster node (``timed_by_log``) they are the time of the logged turn that made
the episode or rating due, so every node that applies the log makes the same ones, however
much later it replays it (a ``close_session`` call's are the call's, ``engine._parts.pinned``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import msgspec
import numpy as np
import trio
from fsrs import Card, Rating, Scheduler, State

from .ann_index import AnnIndex, Filters
from .base.errors import EngineBroken
from .base.logs import RepeatedWarning
from .base.messages import PutEpisode, PutState, Searchable, WriteSummary
from .base.records import Episode, Link, PendingReview, ReviewState, SessionInfo, SummaryState, Turn
from .base.text import composed
from .embedder import Embedder
from .imported import Imported
from .store import (
    LogFollower,
    Store,
    decode_pending,
    decode_review,
    failure_put,
    read_derived_id,
    read_last_episode_seqs,
    read_memories_by_id,
    read_session_turns,
    read_summary,
    user_prefix,
)

__all__ = ["EpisodicCompressor", "summarise", "initial_state", "retrievability", "review_state",
           "RATINGS", "STOPWORDS", "content_words"]

log = logging.getLogger("engram.episodic")

FOLLOW_CHUNK = 1_024  # log records per step of the follower
WATERMARK = b"episodic_lsn"
SUMMARY_SENTENCES = 3  # sentences an extractive summary keeps
MMR_LAMBDA = 0.7  # relevance (centrality) against redundancy when picking summary sentences
KEYWORDS = 6
# A title's characters and a keyword's, as the LLM's are cut: ten "words" of a turn may be
# thousands of characters each, and titles are quoted whole (reflections, Markdown).
MAX_TITLE_CHARS = 120
MAX_KEYWORD_CHARS = 64
FIRST_SURPRISE = 0.5  # a user's first episode has nothing to be novel against
USED_WORDS = 2  # content words a reply must share with a shown memory to have used it
# Surprise waits for the user's previous episode to be embedded, unless the background lane
# is further behind than this (a burst): then it compares with the episodes embedded so far,
# rather than holding every episode behind the whole embedding backlog.
SURPRISE_WAIT_BACKLOG = 512
ROLLING_SENTENCES = 5  # sentences a rolling session summary keeps
# Sentences of one turn a summary weighs, its first: a turn of thousands of short sentences
# must not cost thousands of embeddings and an n-by-n similarity matrix of gigabytes.
SENTENCES_PER_TURN = 20
# Sentences one summary weighs, spread evenly over what was said (an episode of ten turns has
# at most this many): a session closed, or a rolling summary brought up to date, right after a
# burst of a thousand turns gave one similarity matrix 20,000 sentences square (1.6 GB, 9 s
# of the loop).
MAX_SENTENCES = 200

RATINGS = {"again": Rating.Again, "hard": Rating.Hard, "good": Rating.Good, "easy": Rating.Easy,
           1: Rating.Again, 2: Rating.Hard, 3: Rating.Good, 4: Rating.Easy}

# FSRS-6 with its published default parameters. No learning steps: memories are not flash
# cards in a session, every review is a review. No fuzz: tests and benchmarks stay exact.
_SCHEDULER = Scheduler(learning_steps=(), relearning_steps=(), enable_fuzzing=False)
_encode = msgspec.msgpack.Encoder().encode
# Cards are made only to be computed with, never stored: a fixed id, because without one the
# fsrs package makes one from the clock and sleeps 1 ms so the next differs (2 ms a recall).
_CARD_ID = 0

STOPWORDS = frozenset(
    "a an the and or but if so of to in on at for from by with about as into over after before "
    "is am are was were be been being do does did have has had i me my mine we us our you your "
    "he him his she her it its they them their this that these those what which who whom how why "
    "when where there here not no yes just very really also too can could would should will shall "
    "may might must than then now some any all each every much many more most other such only own "
    "same up down out off again once ok okay oh well sure thanks thank please hi hello hey yeah "
    "like get got go going went one two lot bit thing things it's i'm i've i'll don't that's "
    "let me tell want know think good great nice sounds let's".split())
_WORD = re.compile(r"[A-Za-zÀ-ÿ][\wÀ-ÿ'-]*")
_SENTENCE = re.compile(r"(?<=[.!?])\s+|\n+")


def content_words(text: str) -> set[str]:
    """A text's lower-case words of three letters or more, stopwords aside, composed first
    (:func:`composed`): a combining accent would cut a word in two."""
    return {w.lower() for w in _WORD.findall(composed(text))
            if len(w) > 2 and w.lower() not in STOPWORDS}


# -- FSRS ------------------------------------------------------------------------------------


def initial_state(surprise: float, at: datetime) -> tuple[float, float]:
    """Stability and difficulty of a new memory: FSRS's first GOOD review, with stability
    boosted by surprise (x1 to x2)."""
    card, _ = _SCHEDULER.review_card(Card(card_id=_CARD_ID), Rating.Good, at)
    return card.stability * (1.0 + surprise), card.difficulty


def retrievability(stability: float, last_review: datetime, now: datetime) -> float:
    """FSRS-6 probability of recall after ``now - last_review``."""
    if now <= last_review:
        return 1.0
    card = Card(card_id=_CARD_ID, state=State.Review, stability=stability, difficulty=5.0,
                last_review=last_review, due=last_review)
    return float(_SCHEDULER.get_card_retrievability(card, now))


def review_state(current: ReviewState, rating: Rating, now: datetime) -> ReviewState:
    card = Card(card_id=_CARD_ID, state=State.Review, stability=current.stability,
                difficulty=current.difficulty, last_review=current.last_review,
                due=current.last_review)
    after, _ = _SCHEDULER.review_card(card, rating, max(now, current.last_review))
    return ReviewState(after.stability, after.difficulty, max(now, current.last_review),
                       current.reps + 1)


def memory_review_state(memory: Any) -> ReviewState:
    """The FSRS state a memory starts from before any review: an episode's own, or a turn's
    (or a turn hit's) first GOOD review at the time it was said."""
    if type(memory) is Episode:
        return ReviewState(memory.stability, memory.difficulty, memory.created_at, 0)
    stability, difficulty = initial_state(0.0, memory.at)
    return ReviewState(stability, difficulty, memory.at, 0)


# -- the extractive summariser -----------------------------------------------------------------


def _sentences(turns: list[Turn]) -> list[tuple[int, str]]:
    out = []
    for i, turn in enumerate(turns):
        kept = 0
        for sentence in _SENTENCE.split(turn.text.strip()):
            sentence = sentence.strip()
            if len(content_words(sentence)) >= 2:
                out.append((i, sentence))
                kept += 1
                if kept == SENTENCES_PER_TURN:
                    break
    if not out:  # nothing but small talk: keep the turns whole
        out = [(i, t.text.strip()) for i, t in enumerate(turns) if t.text.strip()]
    return _spread(out, MAX_SENTENCES)


def _spread(items: list, limit: int) -> list:
    """At most ``limit`` of ``items``, evenly spaced, in their order."""
    if len(items) <= limit:
        return items
    return [items[i * len(items) // limit] for i in range(limit)]


def keyphrases(texts: list[str], limit: int = KEYWORDS) -> tuple[str, ...]:
    """Frequent content words, capitalised names counting double; in order of weight."""
    weight: dict[str, float] = {}
    first: dict[str, int] = {}
    for text in texts:
        for n, word in enumerate(_WORD.findall(text)):
            low = word.lower()
            if len(low) <= 2 or len(low) > MAX_KEYWORD_CHARS or low in STOPWORDS:
                continue
            weight[low] = weight.get(low, 0.0) + (2.0 if word[0].isupper() and n else 1.0)
            first.setdefault(low, len(first))
    ranked = sorted(weight, key=lambda w: (-weight[w], first[w]))
    return tuple(ranked[:limit])


def mmr(vectors: np.ndarray, weights: np.ndarray, k: int) -> list[int]:
    """Maximal marginal relevance over unit ``vectors``: relevance is a sentence's mean cosine
    to the others (its centrality) times its weight; ``k`` picks, in the order picked."""
    sims = vectors @ vectors.T
    n = len(vectors)
    centrality = (sims.sum(axis=1) - 1.0) / max(1, n - 1) if n > 1 else np.ones(1)
    relevance = centrality * weights
    picked: list[int] = []
    while len(picked) < min(k, n):
        if picked:
            redundancy = sims[:, picked].max(axis=1)
            score = MMR_LAMBDA * relevance - (1 - MMR_LAMBDA) * redundancy
            score[picked] = -np.inf
        else:
            score = relevance.copy()
        picked.append(int(np.argmax(score)))
    return picked


def summarise(turns: list[Turn], vectors: np.ndarray, sentences: list[tuple[int, str]]
              ) -> tuple[str, str, tuple[str, ...], np.ndarray]:
    """Title, summary, keywords and the episode's centroid vector.

    ``vectors`` are the unit vectors of ``sentences``. A sentence's centrality is its mean
    cosine to the others; maximal marginal relevance picks the central ones that do not repeat
    each other, and the summary keeps them in the order they were said.
    """
    sims = vectors @ vectors.T
    n = len(sentences)
    centrality = (sims.sum(axis=1) - 1.0) / max(1, n - 1) if n > 1 else np.ones(1)
    # Users' sentences carry what the episode is about; the assistant's mostly echo them.
    roles = np.array([1.0 if turns[i].role == "user" else 0.8 for i, _ in sentences])
    relevance = centrality * roles
    picked = mmr(vectors, roles, SUMMARY_SENTENCES)
    order = sorted(picked)
    summary = " ".join(sentences[i][1] for i in order)
    # The title: the most relevant sentence that says something (four content words or more).
    by_relevance = sorted(range(n), key=lambda i: -relevance[i])
    head = next((i for i in by_relevance if len(content_words(sentences[i][1])) >= 4), picked[0])
    title = _title(sentences[head][1])
    weights = np.maximum(centrality, 1e-3)[:, None]
    centroid = (vectors * weights).sum(axis=0)
    centroid /= max(float(np.linalg.norm(centroid)), 1e-12)
    return title, summary, keyphrases([t.text for t in turns]), centroid.astype(np.float32)


def plain_summary(turns: list[Turn], sentences: list[tuple[int, str]]
                  ) -> tuple[str, str, tuple[str, ...]]:
    """Title, summary and keywords without sentence vectors (the model failed on them): the
    first sentences said."""
    summary = " ".join(s for _, s in sentences[:SUMMARY_SENTENCES])
    head = next((s for _, s in sentences if len(content_words(s)) >= 4), sentences[0][1])
    return _title(head), summary, keyphrases([t.text for t in turns])


def _title(sentence: str) -> str:
    words = sentence.split()
    title = " ".join(words[:10])
    if len(words) > 10 or len(title) > MAX_TITLE_CHARS:
        title = title[:MAX_TITLE_CHARS].rstrip() + "..."
    return title


def _read_review_inputs(txn: Any, dbs: dict[bytes, Any], keys: list[tuple[str, str]]
                        ) -> dict[tuple[str, str],
                                  tuple[PendingReview, dict[str, tuple[ReviewState, int]]]]:
    """Pending reviews of these conversations, with each shown memory's current FSRS state:
    an episode's or a turn's, the memories ``review`` accepts (a note or fact a cluster's
    logged ``record_shown`` names has no FSRS state; it failed every reply of the
    conversation, whose pending review then stayed)."""
    out = {}
    for user_id, conversation in keys:
        raw = txn.get(user_prefix(user_id) + conversation.encode(), db=dbs[b"pending"])
        if raw is None:
            continue
        pending = decode_pending(raw)
        states: dict[str, tuple[ReviewState, int]] = {}
        memories = read_memories_by_id(txn, dbs, user_id, list(pending.memory_ids))
        for memory_id, memory in memories.items():
            if type(memory) not in (Episode, Turn):
                continue
            stored = txn.get(user_prefix(user_id) + memory_id.encode(), db=dbs[b"reviews"])
            states[memory_id] = (decode_review(stored) if stored is not None
                                 else memory_review_state(memory), memory.lsn)
        out[(user_id, conversation)] = (pending, states)
    return out


class EpisodicCompressor:
    """The actor. ``follow`` runs in the engine's nursery."""

    def __init__(self, store: Store, embedder: Embedder, ann: AnnIndex,
                 clock: Callable[[], datetime], *,
                 after_turns: int, keep_turns: int, llm: Any = None,
                 vectors_follow: bool = True, imported: Imported | None = None,
                 sessions: Callable[[str], list[SessionInfo]] | None = None,
                 summary_every: int = 0) -> None:
        self._store = store
        self._embedder = embedder
        self._ann = ann
        self._clock = clock
        self._after = after_turns
        self._keep = keep_turns
        self._llm = llm
        self._next_seq: dict[tuple[str, str], int] = {}  # first seq not yet in an episode
        # The session ``compress`` works on (one at a time: it holds the lock), and whether a
        # forget took that session meanwhile.
        self._compressing: tuple[str, str] | None = None
        self._compressing_forgotten = False
        self._vectors_follow = vectors_follow  # background embedding runs
        # Log positions of imported records: they came with their episodes and ratings.
        self._imported = imported if imported is not None else Imported()
        # A user's sessions (the session buffer's view), to consolidate the earlier ones when
        # a new one starts; None: only maintenance and close_session consolidate.
        self._sessions = sessions
        self._summary_every = summary_every
        self._summarised: dict[tuple[str, str], int] = {}  # upper_seq of the stored summary
        self._last_episode: dict[str, int] = {}  # per user, the lsn of the last episode made
        # Users whose earlier sessions a new session consolidated, each with the lsn of the
        # new session's first turn: waiting for their reflection (``switches``).
        self._switched: dict[str, int] = {}
        # Parked: the reflection writer, until a new session consolidates earlier ones.
        self._switch = trio.lowlevel.ParkingLot()
        # Held while a session is being compressed: the follower and maintenance never make
        # two episodes of the same turns.
        self._lock = trio.Lock()
        self.episodes_made = 0
        # A cluster node's (set once, by the engine): what the follower derives is timed by
        # the logged turn that made it due, never by this node's clock when it replays.
        self.timed_by_log = False
        self._model_warning = RepeatedWarning(log)  # each failure is a failure record
        self.follower = LogFollower(store, WATERMARK, FOLLOW_CHUNK, self._handle)

    async def _handle(self, records: list[Searchable], last: int) -> tuple[tuple, tuple]:
        counts: dict[tuple[str, str], int] = {}
        # Each conversation's first reply of the step, which rates its pending review (a
        # later one finds none: the review is taken), with its time.
        replies: dict[tuple[str, str], tuple[str, datetime]] = {}
        times: dict[tuple[str, str, int], datetime] = {}  # the step's turns' times, by seq
        # Sessions whose first turn this is, with its time and lsn.
        started: list[tuple[str, str, datetime, int]] = []
        for r in records:
            if r.kind != "turn" or r.lsn in self._imported:
                continue
            key = (r.user_id, r.session_id)
            counts[key] = max(counts.get(key, 0), r.seq + 1)
            times[(r.user_id, r.session_id, r.seq)] = r.at
            if r.seq == 0 and self._sessions is not None:
                started.append((r.user_id, r.session_id, r.at, r.lsn))
            if r.role == "assistant":
                replies.setdefault(key, (r.text, r.at))
        puts = await self._rate_replies(replies) if replies else ()
        for key, turn_count in counts.items():
            start = await self._mark(key)
            # Always the oldest (after - keep) turns: episode boundaries do not depend on how
            # far behind the follower was.
            while turn_count - start >= self._after:
                last_seq = start + self._after - self._keep - 1
                # Due at the session's after-th turn not in an episode.
                at = await self._log_time(key, start + self._after - 1, times)
                await self.compress(key[0], key[1], start, last_seq, consolidated=False,
                                    queued=True, at=at)
                start = last_seq + 1
            if self._summary_every and turn_count >= self._summary_every:
                upper = turn_count - turn_count % self._summary_every
                await self._roll_summary(key[0], key[1], upper,
                                         await self._log_time(key, upper - 1, times))
        for user_id, session_id, at, lsn in started:
            if await self._consolidate_earlier(user_id, session_id, at):
                self._switched[user_id] = lsn
                self._switch.unpark_all()
        return puts, ()

    @property
    def switched(self) -> bool:
        """Whether a switch is waiting to be taken by ``switches``."""
        return bool(self._switched)

    async def switches(self) -> dict[str, int]:
        """Wait until a new session has consolidated a user's earlier ones; then every such
        user so far, each with the lsn of the first turn of the session that started (the
        reflection on what came before, seed 004, is written from what was derived up to
        there)."""
        while not self._switched:
            await self._switch.park()
        switched, self._switched = self._switched, {}
        return switched

    async def _log_time(self, key: tuple[str, str], seq: int,
                        times: dict[tuple[str, str, int], datetime]) -> datetime | None:
        """On a cluster node (``timed_by_log``), the time of the session's turn ``seq``,
        which made a derivation due: from the step's turns (``times``), else the store's.
        None: the clock's (not a cluster node, or the turn is gone)."""
        if not self.timed_by_log:
            return None
        at = times.get((*key, seq))
        if at is None:
            turns = await self._store.read(read_session_turns, key[0], key[1], seq, seq)
            at = turns[0].at if turns else None
        return at

    async def _consolidate_earlier(self, user_id: str, session_id: str, at: datetime) -> bool:
        """A new session started (seed 004): the user's sessions begun before it are over as
        far as memory goes; their remaining turns become episodes now (on a cluster node,
        at ``at``, the new session's first turn's time). Sessions begun later are left
        alone, so replaying the log after a restart consolidates only what had ended by
        then. Returns whether there were earlier sessions."""
        earlier = [info for info in self._sessions(user_id)
                   if info.session_id != session_id and info.started_at <= at]
        await self.prefetch([(user_id, info.session_id) for info in earlier])
        made_at = at if self.timed_by_log else None
        for info in earlier:
            await self.consolidate(user_id, info.session_id, info.turn_count, at=made_at)
        return bool(earlier)

    async def _roll_summary(self, user_id: str, session_id: str, upper: int,
                            at: datetime | None = None) -> None:
        """Bring the session's rolling summary (seed 003) up to turn ``upper``: the previous
        summary's sentences and the new turns', the most central kept. Written with the epoch
        it read, so a summary someone wrote meanwhile is never overwritten by a late one."""
        key = (user_id, session_id)
        if self._summarised.get(key, -1) >= upper:
            return
        store = self._store
        state = await store.read(read_summary, user_id, session_id)
        if state is not None and state.upper_seq >= upper:
            self._summarised[key] = state.upper_seq
            return
        first = 0 if state is None else state.upper_seq
        await store.wait_logged()
        turns = await store.read(read_session_turns, user_id, session_id, first, upper - 1)
        if not turns:
            return  # forgotten meanwhile
        previous = "" if state is None else state.summary
        text = await self._rolling_text(user_id, previous, turns)
        epoch = 0 if state is None else state.epoch
        now = (self._clock() if at is None else at).astimezone(timezone.utc)
        applied: list[bool] = []
        await store.write_unlogged(WriteSummary(
            user_id, session_id, SummaryState(epoch + 1, text, upper, now), epoch,
            trio.Event(), applied.append, tuple(t.turn_id for t in turns)))
        if applied and applied[0]:
            self._summarised[key] = upper

    async def _rolling_text(self, user_id: str, previous: str, turns: list[Turn]) -> str:
        if self._llm is not None:
            try:
                _, summary, _ = await self._llm.summarise(
                    ([("summary so far", previous)] if previous else [])
                    + [(t.role, t.text) for t in turns])
                return summary
            except Exception as exc:  # the extractive summary stands in for a failing model
                self._model_failed("rolling summary", turns[-1], exc)
        sentences = [(-1, s.strip()) for s in _SENTENCE.split(previous) if s.strip()]
        sentences = _spread(sentences + _sentences(turns), MAX_SENTENCES)
        if len(sentences) <= ROLLING_SENTENCES:
            return " ".join(s for _, s in sentences)
        try:
            vectors = await self._embedder.embed([s for _, s in sentences], query=False)
        except EngineBroken as exc:  # the model failed on these sentences: the latest stand in
            self._embedding_failed("rolling summary", turns[-1], exc)
            return " ".join(s for _, s in sentences[-ROLLING_SENTENCES:])
        weights = np.array([1.0 if i < 0 or turns[i].role == "user" else 0.8
                            for i, _ in sentences])
        picked = sorted(mmr(vectors, weights, ROLLING_SENTENCES))
        return " ".join(sentences[i][1] for i in picked)

    async def prefetch(self, keys: list[tuple[str, str]]) -> None:
        """Learn where many sessions' episodes end in one read (maintenance's sweep)."""
        missing = [k for k in keys if k not in self._next_seq]
        if missing:
            found = await self._store.read(read_last_episode_seqs, missing)
            for key, seq in found.items():
                self._next_seq.setdefault(key, seq + 1)

    async def _mark(self, key: tuple[str, str]) -> int:
        if key not in self._next_seq:
            found = await self._store.read(read_last_episode_seqs, [key])
            self._next_seq[key] = found[key] + 1
        return self._next_seq[key]

    def forget(self, user_id: str, session_id: str | None) -> None:
        if (self._compressing is not None and self._compressing[0] == user_id
                and session_id in (None, self._compressing[1])):
            self._compressing_forgotten = True
        if session_id is None:
            self._last_episode.pop(user_id, None)
        for cache in (self._next_seq, self._summarised):
            for key in [k for k in cache
                        if k[0] == user_id and (session_id is None or k[1] == session_id)]:
                del cache[key]

    async def consolidate(self, user_id: str, session_id: str, turn_count: int,
                          at: datetime | None = None) -> bool:
        """Make episodes of a finished session's remaining turns (maintenance): those the
        follower has not reached yet in the episodes it would make, the rest in one; made
        at ``at`` (None: the clock's)."""
        key = (user_id, session_id)
        made = False
        # A session closed right after a burst of thousands of turns: not one episode of them
        # all (one record naming every turn, one summary over all their sentences).
        while turn_count - (start := await self._mark(key)) >= self._after:
            last_seq = start + self._after - self._keep - 1
            made = await self.compress(user_id, session_id, start, last_seq,
                                       consolidated=True, at=at) or made
            if await self._mark(key) == start:  # its turns are gone (forgotten meanwhile)
                return made
        if turn_count - start < 2:
            return made
        return await self.compress(user_id, session_id, start, turn_count - 1,
                                   consolidated=True, at=at) or made

    async def compress(self, user_id: str, session_id: str, first_seq: int, last_seq: int, *,
                       consolidated: bool, queued: bool = False,
                       at: datetime | None = None) -> bool:
        """Make one episode of the session's turns first_seq..last_seq; False if they are gone
        (forgotten meanwhile) or already in an episode. ``queued``: the follower's call, whose
        turns are committed (it read them from the log); the episode's write is queued, not
        awaited (the step's watermark commits after it, in queue order), and True means
        queued. Two commit waits an episode made a bulk import's episodes ~8 a second on a
        loaded machine; the store still drops the episode if its session is forgotten first.
        ``at``: the episode's time (None: the clock's)."""
        async with self._lock:
            self._compressing, self._compressing_forgotten = (user_id, session_id), False
            try:
                return await self._compress(user_id, session_id, first_seq, last_seq,
                                            consolidated, queued, at)
            finally:
                self._compressing = None

    async def _compress(self, user_id: str, session_id: str, first_seq: int, last_seq: int,
                        consolidated: bool, queued: bool, at: datetime | None) -> bool:
        if await self._mark((user_id, session_id)) > first_seq:
            return False
        store = self._store
        if not queued:  # turns counted from the session buffer may not be committed yet
            await store.wait_logged()
        turns = await store.read(read_session_turns, user_id, session_id, first_seq, last_seq)
        if not turns:
            return False
        title, summary, keywords, surprise = await self._describe(user_id, turns)
        now = (self._clock() if at is None else at).astimezone(timezone.utc)
        stability, difficulty = initial_state(surprise, now)
        # Its id is its turns' (their ids are the log's in a cluster): every node that
        # applies the log makes this episode under the same id, and one made of the same
        # session's turns after a forget does not take the old one's.
        episode_id = await store.read(read_derived_id, user_id, "e_",
                                      (user_id, session_id, tuple(t.turn_id for t in turns)))
        await store.reserve(1)
        lsn = store.next_lsn
        episode = Episode(
            lsn, episode_id, user_id, session_id, turns[0].seq, turns[-1].seq,
            # From the earliest turn to the latest, whatever their order (a late note's
            # ``at`` may be a month back), as the session's listing spans them.
            tuple(t.turn_id for t in turns), title, summary, keywords, min(t.at for t in turns),
            max(t.at for t in turns), surprise, stability, difficulty, now,
            now if consolidated else None)
        links = tuple(Link(episode.episode_id, t.turn_id, "summarises", now) for t in turns)
        stored: list[Episode | None] = []

        def committed(episode: Episode | None) -> None:
            stored.append(episode)
            if episode is not None:
                self.episodes_made += 1

        store.submit(PutEpisode(lsn, episode, links, committed))
        if not self._compressing_forgotten:
            self._next_seq[(user_id, session_id)] = turns[-1].seq + 1
        # Else a forget took these turns meanwhile (the store drops the episode) and the
        # session may start again at seq 0: where its episodes end is read again.
        if queued:
            # Surprise waits for this one's vector next: a dropped episode's position is
            # passed by the embedder as any other.
            self._last_episode[user_id] = lsn
            return True
        await store.wait_committed(lsn)
        if stored[0] is not None:
            self._last_episode[user_id] = lsn
        return stored[0] is not None

    async def _describe(self, user_id: str, turns: list[Turn]
                        ) -> tuple[str, str, tuple[str, ...], float]:
        sentences = _sentences(turns)
        try:
            vectors = await self._embedder.embed([s for _, s in sentences], query=False)
        except EngineBroken as exc:
            # The model failed on these sentences (the embedder goes on, keeping the records it
            # fails on as failures): an episode all the same, without the centroid of surprise.
            self._embedding_failed("summary", turns[-1], exc)
            title, summary, keywords = plain_summary(turns, sentences)
            centroid = None
        else:
            # The numpy work is a few hundred microseconds for a 10-turn episode: no thread hop.
            title, summary, keywords, centroid = summarise(turns, vectors, sentences)
        if self._llm is not None:
            try:
                title, summary, keywords = await self._llm.summarise(
                    [(t.role, t.text) for t in turns])
            except Exception as exc:  # the offline summary stands in for a failing model
                self._model_failed("summary", turns[-1], exc)
        if centroid is None:
            return title, summary, keywords, FIRST_SURPRISE
        # Novelty is measured against every earlier episode, so the last one made must have
        # its vector (the background lane embeds in log order).
        last = self._last_episode.get(user_id)
        if (last is not None and self._vectors_follow
                and last - self._embedder.embedded_lsn <= SURPRISE_WAIT_BACKLOG):
            await self._embedder.wait_embedded(last)
        earlier = await self._ann.search(user_id, centroid, 1, Filters(kinds=("episode",)))
        if not earlier:
            return title, summary, keywords, FIRST_SURPRISE
        # Cosine between MiniLM sentence vectors runs from ~0.1 (unrelated) to ~0.9 (same
        # topic): map that span onto 1..0.
        surprise = min(1.0, max(0.0, (0.9 - earlier[0][1]) / 0.7))
        return title, summary, keywords, round(surprise, 3)

    def _model_failed(self, what: str, turn: Turn, exc: Exception) -> None:
        """The model failed on turns ending with ``turn``: kept as that turn's failure
        (``Engine.failures``), guarded by it, so a forgotten session leaves none behind."""
        self._model_warning("LLM %s failed, keeping the extractive one: %r", what, exc)
        self._store.submit(PutState((failure_put(turn.lsn, "episodic", turn.user_id,
                                                 turn.turn_id, exc),)))

    def _embedding_failed(self, what: str, turn: Turn, exc: Exception) -> None:
        """The embedding model failed on the sentences of turns ending with ``turn``: kept as
        that turn's failure, as a model's failure is."""
        self._model_warning("embedding for a %s failed, keeping the first sentences: %r", what,
                            exc)
        self._store.submit(PutState((failure_put(turn.lsn, "episodic", turn.user_id,
                                                 turn.turn_id, exc),)))

    async def _rate_replies(self, replies: dict[tuple[str, str], tuple[str, datetime]]
                            ) -> tuple:
        """Rate the pending reviews of these conversations by their first reply of the step
        (text, time): the next reply after the review was recorded, however the follower's
        steps fall (a logged record of a read applies only once the follower has passed
        the turns before it). Rated at the clock's time, or on a cluster node the reply's."""
        found = await self._store.read(_read_review_inputs, list(replies))
        # A cluster node rates at the replies' logged times and never reads its own clock.
        clock = None if self.timed_by_log else self._clock().astimezone(timezone.utc)
        puts: list[tuple[bytes, bytes, bytes | None, int]] = []
        for (user_id, conversation), (pending, states) in found.items():
            text, said_at = replies[(user_id, conversation)]
            reply = content_words(text)
            now = said_at.astimezone(timezone.utc) if self.timed_by_log else clock
            prefix = user_prefix(user_id)
            for memory_id, text in zip(pending.memory_ids, pending.texts, strict=True):
                if memory_id not in states:
                    continue  # deleted since it was shown
                used = len(reply & content_words(text)) >= USED_WORDS
                current, lsn = states[memory_id]
                state = review_state(current, Rating.Good if used else Rating.Hard, now)
                puts.append((b"reviews", prefix + memory_id.encode(), _encode(state), lsn))
            puts.append((b"pending", prefix + conversation.encode(), None, 0))
        return tuple(puts)
