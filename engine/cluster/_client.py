"""A bot's thin client of a cluster: writes go to the log itself, reads to the user's owner.

No node stands on a write's way: the client makes the turn id, publishes the entry to the
user's partition and, with ``durable=True``, returns after the PubAck, as a node's
``add_turn`` does (:class:`LogWriter`, shared with the nodes). A read goes over HTTP straight
to the node that holds the user's partition, found in the lease bucket (the lease, then its
holder's heartbeat), with the ``min_seq`` of the caller's last write for read-your-writes; a
503 (the owner catching up, or the partition moving) is retried as ``Retry-After`` says, with
the owner looked up again.

    async with ClusterClient.connect(["nats://127.0.0.1:4222"]) as fleet:
        receipt = await fleet.add_turn("maya", "s1", "user", "I moved to Lisbon", durable=True)
        hits = await fleet.recall("maya", "where does she live", min_seq=receipt.log_seq)
"""

from __future__ import annotations

import email.utils
import math
import os
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from datetime import datetime, timezone
from typing import Any
from urllib.parse import quote

import httpx
import msgspec
import trio

from actors.base import validate as v
from actors.base.config import Config

from ..errors import EngineError, InvalidInput
from ._leases import Leases
from ._log import ClusterConfig, Log, LogUnavailable
from ._partition import partition_of
from ._writes import LogWriter

__all__ = ["ClusterClient"]

READ_SECONDS = 10.0  # how long a read is retried (503s, a moving partition) before it fails
READ_PAUSE = 0.05  # seconds before the first retry when the answer names none
MAX_SEQ = 2**64 - 1  # the largest log sequence JetStream has (a uint64)


class ClusterClient(LogWriter):
    """Writes to the log and reads from the owners, without a node of its own. Open it with
    :meth:`connect`.

    Writes (``add_turn``, ``add_turns``, ``forget_user``, ``forget_session``) are a node's:
    checked against ``limits`` (give the nodes' own: an entry the owner refuses is counted
    invalid there, not reported here), then published; receipts carry ``log_seq``. Reads
    (``recall``, ``retrieve_memory``, ``session_history``) answer as the owner's HTTP API does
    (JSON decoded, Markdown as text). Other writes (notes, facts) go through a node's HTTP
    API, where the owner applies them and answers with the result.
    """

    def __init__(self, log: Log, limits: Config, http: httpx.AsyncClient) -> None:
        super().__init__(log, limits)
        self._http = http
        # Lookups only: this client claims nothing, so its Leases never tick.
        self._leases = Leases(log, f"client-{os.urandom(4).hex()}", "", "", _nothing, _nothing)

    @classmethod
    @asynccontextmanager
    async def connect(cls, nats: Sequence[str], config: ClusterConfig | dict | None = None, *,
                      api_key: str | None = None, limits: Config | dict | None = None,
                      timeout: float = 30.0) -> AsyncIterator[ClusterClient]:
        """Connect to the cluster's log for the ``async with`` body.

        Args:
            nats: the log's servers (``nats://host:port``).
            config: the cluster's settings (its partitions above all: the nodes' own).
            api_key: sent to the owners as ``Authorization: Bearer`` on reads.
            limits: the engine settings writes are checked against (default: ``Config()``).
            timeout: seconds an owner may take to answer a read (at most what is left of
                the read's READ_SECONDS).

        Raises:
            LogUnavailable: no log server answered, or the cluster's stream is not made yet
                (``engram-trio cluster init``, or a node, makes it).
            InvalidInput: a bad setting, or a cluster made with other settings.
        """
        limits = Config.checked(limits)
        log = await Log.connect(nats, config, name="engram-client", create=False)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        try:
            async with httpx.AsyncClient(timeout=timeout, headers=headers) as http:
                yield cls(log, limits, http)
        finally:
            await log.close()

    async def recall(self, user_id: str, query: str, *, min_seq: int | None = None,
                     **filters: Any) -> list[dict[str, Any]]:
        """The owner's ``recall``: hits as ``POST /v1/users/{u}/recall`` answers them.

        Args:
            min_seq: the ``log_seq`` of this user's last write: the owner answers once it
                has applied the log that far.
            filters: the route's body fields (``limit``, ``kinds``, ``since``...).
        """
        answer = await self._read(user_id, "POST", f"/v1/users/{_seg(user_id)}/recall",
                                  min_seq, json={"query": query, **filters})
        return _decoded(answer, list, "hits")

    async def retrieve_memory(self, user_id: str, query: str, *, min_seq: int | None = None,
                              **body: Any) -> str:
        """The owner's seed-001 Markdown (``POST /v1/retrieve_memory``)."""
        answer = await self._read(user_id, "POST", "/v1/retrieve_memory", min_seq,
                                  json={"user_id": user_id, "query": query, **body})
        return answer.text

    async def session_history(self, user_id: str, session_id: str, limit: int = 50, *,
                              min_seq: int | None = None) -> list[dict[str, Any]]:
        """The session's latest ``limit`` turns, oldest first, from the owner."""
        v.check_id("session_id", session_id, self._config.max_id_chars)
        answer = await self._read(
            user_id, "GET", f"/v1/users/{_seg(user_id)}/sessions/{_seg(session_id)}/turns",
            min_seq, params={"limit": limit})
        return _decoded(answer, list)

    async def owner(self, user_id: str) -> str | None:
        """The HTTP base URL of the node that holds the user's partition now (None: none)."""
        v.check_id("user_id", user_id, self._config.max_id_chars)
        _, url = await self._leases.lookup(partition_of(user_id, self._partitions))
        return url

    async def _read(self, user_id: str, method: str, path: str, min_seq: int | None,
                    params: dict[str, Any] | None = None, **kwargs: Any) -> httpx.Response:
        """The owner's answer. A 503, or an owner that does not answer (the partition
        moving, a node restarted elsewhere), is tried again with the owner looked up anew,
        for READ_SECONDS; each attempt has the client's own timeout or what is left of
        READ_SECONDS, whichever is shorter.

        Raises:
            InvalidInput / NotFound: the owner's 422 / 404, as the engine's error.
            LogUnavailable: no owner answered in time.
        """
        v.check_id("user_id", user_id, self._config.max_id_chars)
        params = dict(params or {})
        if min_seq is not None:
            if type(min_seq) is not int or not 0 <= min_seq <= MAX_SEQ:
                found = (f"an int of {min_seq.bit_length()} bits"
                         if type(min_seq) is int and min_seq.bit_length() > 128
                         else repr(min_seq)[:40])  # repr() of a huge int raises ValueError
                raise InvalidInput("min_seq", f"expected a log sequence from 0 to {MAX_SEQ}, "
                                              f"found {found}")
            params["min_seq"] = min_seq
        p = partition_of(user_id, self._partitions)
        deadline = trio.current_time() + READ_SECONDS
        while True:
            lease, url = await self._leases.lookup(p)
            wait = READ_PAUSE
            if url is None:
                why = f"no owner of partition {p}"
            else:
                answer = None
                try:
                    # The attempt gets what is left of the read's budget at most: an owner
                    # that hangs past it would hold the read for the client's whole timeout.
                    with trio.move_on_at(deadline):
                        answer = await self._http.request(method, url.rstrip("/") + path,
                                                          params=params, **kwargs)
                except httpx.TransportError as exc:
                    why = f"{url} did not answer ({type(exc).__name__})"
                    if lease is not None:  # its heartbeat may name a new address now
                        self._leases.members.pop(lease.node, None)
                else:
                    if answer is None:
                        why = f"{url} did not answer within the read's {READ_SECONDS} s"
                    elif answer.status_code != 503:
                        _raise_for(answer)
                        return answer
                    else:
                        why = _message(answer)
                        wait = max(wait, _retry_after(answer.headers.get("retry-after")))
            if trio.current_time() + wait > deadline:
                raise LogUnavailable(f"no owner of {user_id!r}'s partition answered within "
                                     f"{READ_SECONDS} s (last: {why})")
            await trio.sleep(wait)


async def _nothing(partition: int) -> None:
    return None


def _seg(value: str) -> str:
    """An id as one path segment (its '/' and '%' escaped, as the API's routes expect; '.'
    and '..' escaped too, or the URL would resolve them as dot segments)."""
    segment = quote(value, safe="")
    return segment.replace(".", "%2E") if segment in (".", "..") else segment


def _decoded(answer: httpx.Response, kind: type, key: str | None = None) -> Any:
    """The owner's JSON answer (its ``key``), checked to be the ``kind`` a node sends.

    Raises:
        EngineError: something else answered (not JSON, or not that shape).
    """
    try:
        body = msgspec.json.decode(answer.content)
        if key is not None:
            body = body[key]
    except (msgspec.DecodeError, KeyError, TypeError):
        body = None
    if not isinstance(body, kind):
        raise EngineError(f"the owner at {answer.url} answered {answer.status_code} with "
                          f"{answer.content[:200]!r}; expected JSON"
                          f"{f' with {key!r}' if key else ''} holding a {kind.__name__}")
    return body


def _retry_after(value: str | None) -> float:
    """Seconds a 503's ``Retry-After`` asks for: a node sends whole seconds; a proxy in front
    of one may send an HTTP date. Anything else (words, inf, nan) asks for no wait."""
    if not value:
        return 0.0
    try:
        seconds = float(value)
    except ValueError:
        try:
            at = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return 0.0
        if at.tzinfo is None:
            at = at.replace(tzinfo=timezone.utc)
        seconds = (at - datetime.now(timezone.utc)).total_seconds()
    return seconds if math.isfinite(seconds) and seconds > 0 else 0.0


def _message(answer: httpx.Response) -> str:
    try:
        body = msgspec.json.decode(answer.content)
        return f"{answer.status_code} {body.get('error')}: {body.get('message')}"
    except (msgspec.DecodeError, AttributeError):
        return f"{answer.status_code} {answer.text[:200]}"


def _raise_for(answer: httpx.Response) -> None:
    """An error answer as the engine's error of the same name (InvalidInput, NotFound...),
    anything else as EngineError with the owner's message."""
    if answer.status_code < 400:
        return
    from .. import errors

    try:
        body = msgspec.json.decode(answer.content)
    except msgspec.DecodeError:
        body = {}
    if not isinstance(body, dict):  # an answer a node never sends: its text is the message
        body = {}
    kind = {"InvalidInput": errors.InvalidInput, "NotFound": errors.NotFound}.get(
        str(body.get("error")))
    message = str(body.get("message", answer.text[:300]))
    if kind is not None:
        field, _, rest = message.partition(": ")
        raise kind(body.get("field") or field, rest or message)
    raise EngineError(f"the owner answered {answer.status_code}: {message}")
