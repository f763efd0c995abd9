"""Routing in front of a node's HTTP app: a user's requests go to the owner of the user's
partition (forwarded over HTTP), writes through the log are served where they arrive, and a
read may carry ``?min_seq=N`` (the ``log_seq`` its caller's last write got): the owner answers
once its watermark for the partition reaches N, or 503 with ``Retry-After`` after
``read_wait``; 422 if N is past the log's last sequence (no write got it, so no wait helps).
"""

from __future__ import annotations

import json
import logging
import time
import urllib.parse
from collections.abc import Awaitable, Callable

import httpx
import msgspec
import trio

from actors.base.validate import encodable

from .._http_edge import BODY_WAIT, IdConvertor, routed_path
from .._tools import MAX_REQUEST_BYTES
from ._figures import render_metrics
from ._log import TRANSIENT, Log, LogUnavailable
from ._node import Node
from ._partition import partition_of

__all__ = ["Router"]

log = logging.getLogger("engine.cluster")

FORWARDED = "x-engram-forwarded"  # header on a forwarded request: never forward it again
RETRY_AFTER = "1"  # seconds, on a 503 from a read that could not be served here yet
FORWARD_TIMEOUT = 30.0  # seconds a forwarded request may take at the owner
# How long a read not caught up after read_wait may wait for the log to say its last sequence
# (a stream info request, ~1 ms): a 503 stays ~read_wait, not twice it, when the log is slow.
LAST_SEQ_SECONDS = 0.05
_ID = IdConvertor()  # a path segment of routed_path back to the id it stands for
# Routes whose user is in the JSON body (an agent tool's arguments name it too).
_BODY_USER = ("/v1/retrieve_memory", "/v1/retrieve_memory/raw", "/v1/context_pre_retrieve")
_TOOLS = "/v1/tools/"
_UI_USERS = "/ui/users/"  # the inspector's pages about one user


class Router:
    """ASGI middleware in front of the node's app: a user's requests go to the owner of the
    user's partition (forwarded over HTTP), writes through the log are served here, and a
    read with ``?min_seq=`` waits for the owner's watermark.

    Args:
        app: the node's app (``create_app`` over a :class:`ClusterEngine`).
        node: the node (its leases say who owns what).
        log: the cluster's log, asked for its last sequence when a read's ``min_seq`` is not
            applied after ``read_wait``: past it is a 422 (no write got it); None: a 503.
    """

    def __init__(self, app: Callable[..., Awaitable[None]], node: Node,
                 log: Log | None = None) -> None:
        self.app = app
        self.node = node
        self.log = log
        self.client = httpx.AsyncClient(timeout=FORWARD_TIMEOUT)
        # looked_up: leases read from the bucket because the view named no holder to forward
        # to (or the one it named had handed the partition on); reforwarded: requests sent
        # on to the holder the bucket named then.
        # redirected: inspector pages sent to the owner of their user.
        self.counts = {"forwarded": 0, "waited": 0, "unavailable": 0, "looked_up": 0,
                       "reforwarded": 0, "redirected": 0}

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope["path"].startswith(_UI_USERS):
            await self._inspector(scope, receive, send)
            return
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            if scope["type"] == "http" and scope["path"] == "/cluster/node":
                # No user data: partitions, watermarks and counters (engram cluster status).
                await _respond(send, 200, self.node.figures() | {"router": self.counts})
                return
            if scope["type"] == "http" and scope["path"] == "/metrics":
                await self._metrics(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        # The path as the app routes it: an id's '/' stays escaped, so "team/alice" is one
        # segment here, as in the app's routes (engine/_http_edge.py).
        path, method = routed_path(scope), scope["method"]
        body: bytes | None = None
        user = _path_user(path)
        try:
            if user is None and method == "POST" and (path in _BODY_USER
                                                      or path.startswith(_TOOLS)):
                body = await _read_body(receive)
                user = _user_in(body)
            await self._route(scope, receive, send, path, method, user, body)
        except _BodyRefused as refused:
            status, error, message = refused.args
            await _respond(send, status, {"error": error, "message": message})

    async def _route(self, scope: dict, receive: Callable, send: Callable, path: str,
                     method: str, user: object, body: bytes | None) -> None:
        """Serve, wait for or forward a request whose user (None: none) is known."""
        if not isinstance(user, str) or _is_log_write(method, path, user):
            await self.app(scope, _replay(body, receive) if body is not None else receive, send)
            return
        p = partition_of(user, self.node.config.partitions)
        # Blank values kept: a caller's "?min_seq=" (its None formatted) asked for a wait.
        query = urllib.parse.parse_qs(scope.get("query_string", b"").decode(),
                                      keep_blank_values=True)
        given = query.get("min_seq", [])
        min_seq = ",".join(given) if given else None  # two values are refused below
        if self.node.owns(p):
            if min_seq is not None:
                # ASCII digits only: str.isdigit() takes '²' and '٣', and int() refuses
                # more than 4300 digits; a log sequence is a uint64 (20 digits at most).
                if not (min_seq.isascii() and min_seq.isdigit()) or len(min_seq) > 20:
                    await _respond(send, 422, {"error": "InvalidInput", "field": "min_seq",
                                               "message": "min_seq: expected a log sequence "
                                                          f"number, found {min_seq[:40]!r}"})
                    return
                self.counts["waited"] += 1
                started = time.perf_counter()
                caught_up = await self.node.wait_applied(p, int(min_seq),
                                                         self.node.config.read_wait)
                # What min_seq cost this read, as a standard Server-Timing entry: the caller
                # (and bench/cluster_faults.py) sees it without timing a second read.
                send = _timed(send, (time.perf_counter() - started) * 1e3)
                if not caught_up:
                    last = await self._last_seq()
                    if last is not None and int(min_seq) > last:
                        await _respond(send, 422, {
                            "error": "InvalidInput", "field": "min_seq", "message":
                            f"min_seq: expected at most {last}, the log's last sequence "
                            f"(a log_seq some write got), found {min_seq}; pass the "
                            "log_seq of the caller's own last write"})
                        return
                    self.counts["unavailable"] += 1
                    await _respond(send, 503, {
                        "error": "NotCaughtUp", "message": f"partition {p} has applied the "
                        f"log up to {self.node.marks.get(p, 0)}, not yet {min_seq}; retry"},
                        retry=True)
                    return
            await self.app(scope, _replay(body, receive) if body is not None else receive, send)
            return
        headers = dict(scope.get("headers", []))
        if FORWARDED.encode() in headers:  # the sender's view was behind: it asks again
            self.counts["unavailable"] += 1
            why = (f"{headers[FORWARDED.encode()].decode('latin-1')} forwarded it to "
                   f"{self.node.node_id}, which does not hold partition {p} now")
            await _respond(send, 503, {"error": "NoOwner", "message": f"{why}; retry"},
                           retry=True)
            return
        url = await self._holder(p, send)
        if url is None:
            return
        if body is None:
            body = await _read_body(receive)
        answer = await self._forward(scope, url, body, send)
        if answer is not None and _moved_away(answer):
            # Forwarded to a node this view still named, which has handed the partition on:
            # once more, to the holder the bucket names now.
            self.counts["looked_up"] += 1
            fresh, fresh_url = await self.node.leases.lookup(p)
            if (fresh is not None and fresh_url is not None and fresh_url != url
                    and fresh.node != self.node.node_id):
                self.counts["reforwarded"] += 1
                answer = await self._forward(scope, fresh_url, body, send)
        if answer is not None:
            await _relay(answer, send)

    async def _last_seq(self) -> int | None:
        """The log's last sequence now, or None without a log or if it does not say within
        LAST_SEQ_SECONDS (then a read not caught up is a 503, as before: retrying may help)."""
        if self.log is None:
            return None
        with trio.move_on_after(min(self.node.config.read_wait, LAST_SEQ_SECONDS)):
            try:
                return await self.log.last_seq()
            except (*TRANSIENT, LogUnavailable):
                return None
        return None

    async def _inspector(self, scope: dict, receive: Callable, send: Callable) -> None:
        """A page of the inspector about one user: here if this node holds the user's
        partition, else a 307 to the same page on the owner (the current copy; its login and
        CSRF checks are the owner's own, which a forwarded form would fail)."""
        user = _ID.convert(routed_path(scope)[len(_UI_USERS):].split("/", 1)[0])
        p = partition_of(user, self.node.config.partitions) if user else None
        if p is None or self.node.owns(p):
            await self.app(scope, receive, send)
            return
        url = await self._holder(p, send)
        if url is None:
            return
        self.counts["redirected"] += 1
        await send({"type": "http.response.start", "status": 307,
                    "headers": [(b"location", _target(url, scope).encode("latin-1")),
                                (b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})

    async def _holder(self, p: int, send: Callable) -> str | None:
        """Where partition ``p``'s holder answers; None after answering 503 NoOwner (saying
        which node gave it and why) when there is none to send to."""
        leases = self.node.leases
        owner = leases.owner(p)
        url = None if owner is None else leases.url_of(owner.node)
        if url is None or owner.node == self.node.node_id:
            # The view is a tick old at most: a partition that moved since has no owner in
            # it, or one without a heartbeat yet. Read the lease itself before saying so.
            self.counts["looked_up"] += 1
            owner, url = await leases.lookup(p)
        if owner is not None and url is not None and owner.node != self.node.node_id:
            return url
        self.counts["unavailable"] += 1
        if owner is None:
            why = f"no lease on partition {p} in the bucket {self.node.node_id} read"
        elif owner.node == self.node.node_id:
            why = f"{self.node.node_id} holds partition {p} but has not confirmed it"
        else:
            why = f"partition {p}'s owner {owner.node} has no heartbeat"
        await _respond(send, 503, {"error": "NoOwner", "message": f"{why}; retry"}, retry=True)
        return None

    async def _metrics(self, scope: dict, receive: Callable, send: Callable) -> None:
        """The app's ``/metrics`` with the node's cluster families after them."""
        start: dict = {}
        chunks: list[bytes] = []

        async def keep(message: dict) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
            else:
                chunks.append(message.get("body", b""))

        await self.app(scope, receive, keep)
        body = b"".join(chunks)
        if start.get("status") == 200:
            body += render_metrics(self.node.stats(self.counts))
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": start.get("status", 500),
                    "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _forward(self, scope: dict, url: str, body: bytes, send: Callable
                       ) -> httpx.Response | None:
        """The owner's answer to the request, for the caller to relay; None when the owner
        did not answer (a 503 has been sent then)."""
        self.counts["forwarded"] += 1
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]
                   if k.lower() not in (b"host", b"content-length", b"connection",
                                        b"origin")]  # checked here (LocalOnly), not there
        headers.append((FORWARDED, self.node.node_id))
        try:
            return await self.client.request(scope["method"], _target(url, scope), content=body,
                                             headers=headers)
        except httpx.HTTPError as exc:
            self.counts["unavailable"] += 1
            await _respond(send, 503, {"error": "OwnerUnreachable", "message":
                                       f"the partition's owner did not answer ({exc!r}); retry"},
                           retry=True)
            return None


def _target(url: str, scope: dict) -> str:
    """The request's path and query, as it came, on the node at ``url``."""
    target = url.rstrip("/") + (scope.get("raw_path") or scope["path"].encode()).decode(
        "latin-1")
    if scope.get("query_string"):
        target += "?" + scope["query_string"].decode("latin-1")
    return target


def _moved_away(answer: httpx.Response) -> bool:
    """Whether a forwarded request's answer says the node no longer holds the partition."""
    if answer.status_code != 503:
        return False
    try:
        return msgspec.json.decode(answer.content).get("error") == "NoOwner"
    except (msgspec.DecodeError, AttributeError):
        return False


def _timed(send: Callable, waited_ms: float) -> Callable:
    """``send`` with a ``Server-Timing: min-seq;dur=<ms>`` header on the response."""
    entry = f"min-seq;dur={waited_ms:.2f}".encode()

    async def timed(message: dict) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()),
                                              (b"server-timing", entry)]}
        await send(message)

    return timed


async def _relay(answer: httpx.Response, send: Callable) -> None:
    out = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in answer.headers.items()
           if k.lower() not in ("content-length", "transfer-encoding", "connection",
                                "content-encoding")]
    out.append((b"content-length", str(len(answer.content)).encode()))
    await send({"type": "http.response.start", "status": answer.status_code, "headers": out})
    await send({"type": "http.response.body", "body": answer.content})


def _path_user(path: str) -> str | None:
    if not path.startswith("/v1/users/"):
        return None
    return _ID.convert(path[len("/v1/users/"):].split("/", 1)[0]) or None


def _is_log_write(method: str, path: str, user: str) -> bool:
    rest = path[len("/v1/users/"):].split("/", 1)
    tail = "/" + rest[1] if len(rest) > 1 else ""
    if method == "POST" and (tail == "/turns" or (tail.startswith("/sessions/")
                                                  and tail.endswith("/turns"))):
        return True
    return method == "DELETE" and (tail == "" or (tail.startswith("/sessions/")
                                                  and tail.count("/") == 2))


class _BodyRefused(Exception):
    """A request body the router will not read on: (status, error, message) to answer."""


async def _read_body(receive: Callable, limit: int = MAX_REQUEST_BYTES) -> bytes:
    """The request's body, held to the app's edge's rules (it reads a body forwarded or
    routed by its user here first): at most ``limit`` bytes, and no wait of BODY_WAIT for
    its next part.

    Raises:
        _BodyRefused: 413 past the limit, 408 for a body that stalls.
    """
    chunks, seen = [], 0
    while True:
        message = None
        with trio.move_on_after(BODY_WAIT):
            message = await receive()
        if message is None:
            raise _BodyRefused(408, "RequestTimeout", "expected the rest of the request's "
                                                      f"body, found none for {BODY_WAIT:g} s")
        chunk = message.get("body", b"")
        seen += len(chunk)
        if seen > limit:
            raise _BodyRefused(413, "TooLarge", f"expected a body of at most {limit} bytes, "
                                                "found more")
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


def _user_in(body: bytes) -> object:
    """The ``user_id`` of a JSON object body, or None. Read as the app reads it: a byte order
    mark, or UTF-16 or UTF-32, is JSON still (RFC 8259 lets a parser take them, and the
    app's does), and a body naming a user must go where that user is."""
    try:
        return msgspec.json.decode(body).get("user_id")
    except (msgspec.DecodeError, AttributeError, RecursionError):
        pass
    try:
        found = json.loads(body)
    except (ValueError, RecursionError):
        return None  # the app answers it (422), as on a single node
    user = found.get("user_id") if isinstance(found, dict) else None
    # A lone surrogate (which msgspec refused) names no partition: the app answers it (422).
    return user if isinstance(user, str) and encodable(user) else None


def _replay(body: bytes, receive: Callable) -> Callable:
    sent = False

    async def again() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


async def _respond(send: Callable, status: int, body: dict, retry: bool = False) -> None:
    data = msgspec.json.encode(body)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    if retry:
        headers.append((b"retry-after", RETRY_AFTER.encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})
