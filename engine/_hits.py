"""What retrieval returns: recalled hits, why they rank where they do, and seed 001's raw
shape (semantic facts and episodic memories). Records in, nothing searched here.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

import msgspec

from actors.base.records import Episode, Fact, Note, Turn

__all__ = ["Explain", "Hit", "Hits", "Message", "SemanticItem", "EpisodicItem",
           "RetrieveResult", "estimate_tokens", "hit_for"]


def estimate_tokens(text: str) -> int:
    """Prompt tokens a text costs: ~4 characters a token for English with a BPE tokenizer."""
    return max(1, (len(text) + 3) // 4)


class Explain(msgspec.Struct, frozen=True, kw_only=True):
    """Why a hit ranks where it does.

    Attributes:
        ranks: its rank (from 1) in each leg that found it.
        fused: the weighted sum of its legs' z-scores (0 for a turn only lifted).
        lift: what neighbouring turns and covering episodes added to ``fused``.
        lifted_by: the memories (turn or episode ids) that lifted it.
        fsrs: the FSRS retrievability factor the score was multiplied by (1.0 but episodes).
        speaker: what was added to ``fused`` because the turn was said by the one speaker the
            query names (0 otherwise; see ``engine._retrieval.speaker_of``).
        cosine: its similarity to the query, when the vector leg scored it.
        chunk: for a text long enough to be embedded in chunks (``actors.chunking``), the
            place (from 0) of the chunk the vector leg found it by; None otherwise.
    """

    ranks: dict[str, int]
    fused: float
    lift: float = 0.0
    lifted_by: tuple[str, ...] = ()
    fsrs: float = 1.0
    speaker: float = 0.0
    cosine: float | None = None
    chunk: int | None = None


class Hit(msgspec.Struct, frozen=True, kw_only=True):
    """One recalled memory.

    Attributes:
        id: the memory's id (a turn id for a turn).
        kind: turn, episode, fact or note.
        text: its text.
        score: relevance in (0, 1), the logistic of fused score plus lift, times the FSRS
            factor (higher is better); linked memories get a decayed share.
        session_id: the session it belongs to ("" for a note: notes belong to the user).
        at: when it was said or made.
        turn_ids: the turns it stands for (itself, for a turn).
        role: who said it (turns).
        via: what found it: the legs ``vector``, ``bm25``, ``entity``, ``window``; for a turn
            no leg found, ``neighbour`` / ``episode`` (lifted by a neighbouring turn or a
            covering episode); ``link`` (reached along a link).
        explain: per-leg ranks, fused score, lift and FSRS factor (None for a linked memory).
    """

    id: str
    kind: str
    text: str
    score: float
    session_id: str
    at: datetime
    turn_ids: tuple[str, ...]
    role: str | None = None
    via: tuple[str, ...] = ()
    explain: Explain | None = None

    def __hash__(self) -> int:
        # By what it is, not every field: ``explain`` holds a dict, and a frozen hit must go
        # in a set or be a dict's key. Equal hits have equal ids, so equal hashes.
        return hash((self.kind, self.id))


class Hits(list):
    """What ``recall`` returns: a list of :class:`Hit`, best first (it is a plain ``list``
    for every other purpose), that also says which search legs were degraded.

    Attributes:
        degraded: the legs whose index was being rebuilt (or catching up with what the store
            held when the engine opened) when the query ran: ``bm25`` (the text index) and/or
            ``vector`` (the embeddings). Empty when every leg searched a complete index. A
            degraded leg may miss memories the others then cannot make up for.
    """

    __slots__ = ("degraded",)

    def __init__(self, hits: Iterable[Hit] = (), degraded: tuple[str, ...] = ()) -> None:
        super().__init__(hits)
        self.degraded = degraded

    @property
    def partial(self) -> bool:
        """True if a leg was degraded: the answer may lack memories a complete index finds."""
        return bool(self.degraded)


class Message(msgspec.Struct, frozen=True):
    role: str
    content: str


class SemanticItem(msgspec.Struct, frozen=True, kw_only=True):
    """A structured fact, in seed 001's raw shape (facts arrive with the long-term layer)."""

    id: str
    conversation_id: str | None
    category: str
    fact: str
    keywords: list[str]
    source_episodic_ids: list[str]
    valid_at: datetime | None
    invalid_at: datetime | None
    score: float
    conversations: int = 0  # sessions its sources were said in ("sources: N conversations")


class EpisodicItem(msgspec.Struct, frozen=True, kw_only=True):
    """An episodic memory in seed 001's raw shape (no embedding). Until episodes exist, each
    recalled turn is one, with its neighbouring turns as ``messages``."""

    id: str
    conversation_id: str
    messages: list[Message]
    title: str
    summary: str
    stability: float
    difficulty: float
    surprise: float
    start_at: datetime
    end_at: datetime
    created_at: datetime
    last_reviewed_at: datetime | None
    consolidated_at: datetime | None
    score: float
    kind: str = "turn"


class RetrieveResult(msgspec.Struct, frozen=True, omit_defaults=True):
    """What ``retrieve_memory_raw`` returns: seed 001's ``semantic`` and ``episodic`` lists,
    and ``degraded``: the search legs being rebuilt when it ran (see :class:`Hits`; left out
    of the JSON when empty)."""

    semantic: list[SemanticItem]
    episodic: list[EpisodicItem]
    degraded: tuple[str, ...] = ()


def hit_for(memory: Turn | Note | Episode | Fact, score: float, via: tuple[str, ...],
            explain: Explain | None = None) -> Hit:
    """A stored memory as a recalled hit, whatever its kind."""
    kind = type(memory)
    if kind is Episode:
        return Hit(id=memory.episode_id, kind="episode", text=f"{memory.title}: {memory.summary}",
                   score=score, session_id=memory.session_id, at=memory.end_at,
                   turn_ids=memory.turn_ids, via=via, explain=explain)
    if kind is Fact:
        return Hit(id=memory.fact_id, kind="fact", text=memory.text, score=score, session_id="",
                   at=memory.created_at, turn_ids=memory.source_turn_ids, via=via,
                   explain=explain)
    if kind is Note:
        return Hit(id=memory.note_id, kind="note", text=memory.text, score=score,
                   session_id="", at=memory.updated_at, turn_ids=(), via=via, explain=explain)
    return Hit(id=memory.turn_id, kind="turn", text=memory.text, score=score,
               session_id=memory.session_id, at=memory.at, turn_ids=(memory.turn_id,),
               role=memory.role, via=via, explain=explain)
