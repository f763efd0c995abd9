"""Record codecs: one msgpack encoder, and one decoder per persisted record type, made once and
reused (msgspec's advice); the Failure record a part writes when it skips one."""

from __future__ import annotations

from datetime import datetime, timezone

import msgspec

from ..base.records import (
    Entity,
    Episode,
    Fact,
    Failure,
    Link,
    Note,
    PendingReview,
    ReviewState,
    SessionInfo,
    SummaryState,
    Turn,
)
from .layout import IDS_EPISODE, IDS_FACT, failure_key

_decode_prefixes = msgspec.msgpack.Decoder(list[bytes]).decode

_encode = msgspec.msgpack.Encoder().encode
_decode_session = msgspec.msgpack.Decoder(SessionInfo).decode
_decode_turn = msgspec.msgpack.Decoder(Turn).decode


class _TurnHead(msgspec.Struct, array_like=True):
    """The leading fields of a stored Turn: what deletion needs, without decoding the text."""

    lsn: int
    turn_id: str


_decode_head = msgspec.msgpack.Decoder(_TurnHead).decode
_decode_link = msgspec.msgpack.Decoder(Link).decode
_decode_note = msgspec.msgpack.Decoder(Note).decode
_decode_summary = msgspec.msgpack.Decoder(SummaryState).decode
decode_episode = msgspec.msgpack.Decoder(Episode).decode
decode_fact = msgspec.msgpack.Decoder(Fact).decode
decode_entity = msgspec.msgpack.Decoder(Entity).decode
decode_review = msgspec.msgpack.Decoder(ReviewState).decode
decode_pending = msgspec.msgpack.Decoder(PendingReview).decode
decode_failure = msgspec.msgpack.Decoder(Failure).decode
_IDS_TARGETS = {IDS_EPISODE: (b"episodes", decode_episode), IDS_FACT: (b"facts", decode_fact)}


def _printable(text: str) -> str:
    """Text that encodes whatever it holds (a lone surrogate becomes its escape)."""
    return text.encode("utf-8", "backslashreplace").decode()


def described(error: BaseException) -> str:
    """``Type: message`` of an error, whatever its ``__str__`` does (a model SDK's may raise:
    recording a failure must not fail the fallback that follows it)."""
    try:
        message = str(error)
    except Exception as exc:
        message = f"(its message raised {type(exc).__name__})"
    return f"{type(error).__name__}: {message}"


def failure_put(lsn: int, actor: str, user_id: str, memory_id: str,
                error: BaseException) -> tuple[bytes, bytes, bytes, int]:
    """A PutState put that records a failure, guarded by its record (a record forgotten
    meanwhile leaves no failure behind)."""
    failure = Failure(lsn, actor, _printable(user_id), _printable(memory_id),
                      _printable(described(error))[:1000], datetime.now(timezone.utc))
    return (b"failures", failure_key(lsn, actor), _encode(failure), lsn)
