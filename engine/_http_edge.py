"""The HTTP API's edge: who may call (api keys, the users each may act for) and what every
request passes through before a route (the body size limit, the Prometheus metrics).
"""

# No `from __future__ import annotations`: as in _server.py, FastAPI may read these at run time.
import hashlib
import hmac
import ipaddress
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import unquote, unquote_to_bytes, urlsplit

import msgspec
import trio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.convertors import Convertor, register_url_convertor
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.routing import Match

from actors.base.errors import InvalidInput

from ._engine import Engine
from ._http_wire import error_response

ADMIN = "*"  # the scope of a key that may act for every user
# Seconds a request's body may go without a byte before it is a 408: a stalled upload (or a
# slow-body attack) would otherwise hold its request and the task serving it for ever. Only
# the request's own bytes are waited for under it, never a long response.
BODY_WAIT = 30.0
# Bodies over BIG_BODY_BYTES let into the app at once, the others waiting once theirs are
# whole. JSON near the 8 MiB limit parses into up to ~200 MB of objects (millions of empty
# ones) before the engine's checks can refuse it, and they live until the request ends: four
# at once took a server from 220 to 840 MB. A batch of turns at ordinary sizes is far smaller.
BIG_BODY_BYTES = 1 << 20
BIG_BODIES = 2


# -- auth ---------------------------------------------------------------------------------------


class ApiKeys:
    """Keys by their sha256, each with the users it may act for (``None``: every user).

    Args:
        grants: sha256 hex digest of a key -> frozenset of user ids, or None for an admin key.
    """

    def __init__(self, grants: dict[str, frozenset[str] | None]) -> None:
        self.grants = grants

    def lookup(self, key: str) -> tuple[bool, frozenset[str] | None]:
        """(known, users) for a presented key; compares digests in constant time."""
        digest = hashlib.sha256(key.encode()).hexdigest()
        for known, users in self.grants.items():
            if hmac.compare_digest(known, digest):
                return True, users
        return False, frozenset()


def load_api_keys(path: str | Path) -> ApiKeys:
    """Read an api-keys file: one ``<key> <user_id>[,<user_id>...]`` or ``<key> *`` a line;
    ``sha256:<hex>`` may stand for the key; blank lines and ``#`` comments are skipped.

    Raises:
        InvalidInput: the file is missing, empty, or a line is malformed (the message names it).
    """
    path = Path(path)
    try:
        # utf-8-sig: a byte order mark (a Windows editor writes one) is not part of the key.
        lines = path.read_text(encoding="utf-8-sig").splitlines()
    except OSError as exc:
        raise InvalidInput("api_keys", f"expected a readable keys file, found {exc}") from None
    except UnicodeDecodeError as exc:  # the message names the byte, never the text round it
        raise InvalidInput("api_keys", f"expected a keys file in UTF-8, found byte "
                                       f"0x{exc.object[exc.start]:02x} at offset {exc.start} "
                                       f"of {path}; save it as UTF-8") from None
    grants: dict[str, frozenset[str] | None] = {}
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        where = f"{path}:{number}"
        if len(parts) != 2:
            raise InvalidInput("api_keys", f"expected '<key> <user_id>[,...]' or '<key> *' at "
                                           f"{where}, found {len(parts)} fields")
        key, scope = parts
        if key.startswith("sha256:"):
            digest = key.removeprefix("sha256:").lower()
            if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise InvalidInput("api_keys", f"expected sha256: and 64 hex digits at {where}, "
                                               f"found {len(digest)} characters")
        else:
            if not all("!" <= c <= "~" for c in key):
                # A header's bytes reach the app as Latin-1: a key with any other character
                # hashes to another digest when presented, and would refuse every call.
                raise InvalidInput("api_keys", f"expected a key of printable ASCII characters "
                                               f"(what an Authorization header carries) at "
                                               f"{where}, found another character; use "
                                               f"letters, digits and punctuation only")
            digest = hashlib.sha256(key.encode()).hexdigest()
        users = None if scope == ADMIN else frozenset(u for u in scope.split(",") if u)
        if users is not None and not users:
            raise InvalidInput("api_keys", f"expected user ids after the key at {where}")
        if digest in grants:
            raise InvalidInput("api_keys", f"expected each key once, found it again at {where}")
        grants[digest] = users
    if not grants:
        raise InvalidInput("api_keys", f"expected at least one key in {path}, found none")
    return ApiKeys(grants)


class Caller:
    """Who is calling: the users this request may touch (``None``: all)."""

    def __init__(self, users: frozenset[str] | None) -> None:
        self.users = users

    def check(self, user_id: str) -> None:
        if self.users is not None and user_id not in self.users:
            raise HTTPException(403, f"this key may not act for user {user_id!r}")

    def check_admin(self) -> None:
        if self.users is not None:
            raise HTTPException(403, "this route needs an admin key ('<key> *')")


CALLER = "engram_caller"  # where the Edge leaves who calls, in the request's state
_REFUSALS = {401: "Unauthorized", 403: "Forbidden"}


def authorize(keys: ApiKeys, header: str) -> Caller:
    """The caller an ``Authorization`` header names.

    Raises:
        HTTPException: 401, no ``Bearer <key>`` or a key the file does not hold (the header
            itself is never echoed: a key sent without its scheme would be in the answer).
    """
    scheme, _, key = header.partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        found = ("none" if not header else "'Bearer' and no key" if scheme.lower() == "bearer"
                 else "a header with no 'Bearer ' scheme")
        raise HTTPException(401, f"expected 'Authorization: Bearer <key>', found {found}",
                            headers={"WWW-Authenticate": "Bearer"})
    known, users = keys.lookup(key)
    if not known:
        raise HTTPException(401, "expected a key from the server's api-keys file, found an "
                                 "unknown key", headers={"WWW-Authenticate": "Bearer"})
    return Caller(users)


def keyed(path: str) -> bool:
    """Whether a path's routes need a key: the API (``/v1``) and ``/metrics``; not the probes,
    the OpenAPI document or the inspector (``/ui``, which checks its own)."""
    return path.startswith("/v1/") or path == "/metrics"


def path_user(path: str) -> str | None:
    """The user a routed ``/v1/users/{user_id}...`` path names (None for any other path)."""
    if not path.startswith("/v1/users/"):
        return None
    segment = path[len("/v1/users/"):].partition("/")[0]
    return IdConvertor().convert(segment) if segment else None


def key_refusal(keys: ApiKeys, scope: dict, path: str
                ) -> tuple[Caller | None, Response | None]:
    """For a request to a routed ``path`` that needs a key (:func:`keyed`): (who calls,
    None), or (None, the 401 or 403 to answer) when the ``Authorization`` header holds no key
    of ``keys`` or a key that may not act for the user the path names. Reads no body: a
    caller with no key must not make the server hold and parse one."""
    header = next((v.decode("latin-1") for n, v in scope.get("headers", ())
                   if n == b"authorization"), "")
    try:
        caller = authorize(keys, header)
        user = path_user(path)
        if user is not None:
            caller.check(user)
    except HTTPException as exc:
        return None, error_response(exc.status_code, _REFUSALS[exc.status_code], exc.detail,
                                    headers=exc.headers)
    return caller, None


class KeysFirst:
    """Pure ASGI: what the Edge refuses for want of a key, refused in front of ``app``: a
    cluster node's router, which reads a body to find its user and forwards requests before
    the owner's Edge would check them."""

    def __init__(self, app: Callable[..., Awaitable[None]], keys: ApiKeys) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http":
            path = routed_path(scope)
            if keyed(path):
                refusal = key_refusal(self.keys, scope, path)[1]
                if refusal is not None:
                    await refusal(scope, receive, send)
                    return
        await self.app(scope, receive, send)


# -- ids in paths -------------------------------------------------------------------------------
#
# Any id may hold '/' (validation refuses only NUL), so an id in a path is one percent-encoded
# segment: "team/alice" is /v1/users/team%2Falice. The server decodes the whole path before
# routing (ASGI's `path`), which would split that segment in two; the Edge therefore routes on
# the path as sent (`raw_path`) with each segment decoded but its '%' and '/' still escaped, and
# the "id" convertor of the routes' `{name:id}` undoes those two escapes. Only these two escapes
# remain in what the router sees, so undoing them is exact.


def routed_path(scope: dict) -> str:
    """The path the routes match: each segment decoded, with '%' and '/' in it kept escaped
    (escapes that are not UTF-8 as U+FFFD: :func:`check_escapes` refuses those first)."""
    raw = scope.get("raw_path")
    if raw is None:  # a server without raw_path: its decoded path, every '%' kept literal
        return scope["path"].replace("%", "%25")
    if b"%" not in raw:
        return scope["path"]  # nothing was escaped: the decoded path is the path as sent
    return "/".join(unquote(part).replace("%", "%25").replace("/", "%2F")
                    for part in raw.decode("utf-8", "replace").split("/"))


def check_escapes(scope: dict) -> None:
    """Refuse a path or query string that is not UTF-8 once unescaped (``%FF``): decoded
    leniently, as servers and frameworks do, it would hold U+FFFD, and distinct ids ("x%FE",
    "x%FF") would name one user.

    Raises:
        InvalidInput: ``path`` or ``query``, with where the bad byte is.
    """
    for where, raw in (("path", scope.get("raw_path")), ("query", scope.get("query_string"))):
        if raw and (b"%" in raw or not raw.isascii()):
            try:
                unquote_to_bytes(raw).decode()
            except UnicodeDecodeError as exc:
                raise InvalidInput(where, f"expected UTF-8 once unescaped, found {exc.reason} "
                                          f"at byte {exc.start}; encode ids as UTF-8, then "
                                          "percent-escape them") from None


def is_loopback(host: str) -> bool:
    """A host name or address that only this machine reaches (``localhost``, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "CONNECT",
                      "TRACE"})  # what /metrics labels by name


def cross_site(scope: dict) -> str | None:
    """Why a request to a server with no api keys must be refused, or None.

    Such a server binds to a loopback address and trusts whoever reaches it, which a web
    page in the same machine's browser can do two ways: a form or ``no-cors`` POST (the body
    is read as JSON whatever its label, so a "simple" request goes through and is never
    preflighted), and a name of its own rebound to 127.0.0.1 (then its scripts are same-origin
    and read the answers). So: a loopback ``Host`` only, and a write that a browser marked with
    an ``Origin`` only from that same host. Non-browser clients send no ``Origin``.
    """
    host = ""
    origin = None
    for name, value in scope.get("headers", ()):
        if name == b"host":
            host = value.decode("latin-1").lower()
        elif name == b"origin":
            origin = value.decode("latin-1").lower()
    hostname = urlsplit(f"//{host}").hostname or ""
    if not is_loopback(hostname):
        return (f"this server has no api keys, so it answers only at a loopback address "
                f"(127.0.0.1, localhost), not at {host!r}; give it --api-keys to serve others")
    if origin is not None and scope.get("method") not in _SAFE_METHODS:
        if origin == "null" or urlsplit(origin).netloc != host:
            return (f"this server has no api keys, so it takes writes from its own pages and "
                    f"from clients that send no Origin, not from the web page at {origin!r}")
    return None


class LocalOnly:
    """Pure ASGI: what :func:`cross_site` refuses, refused in front of ``app``: a cluster
    node's router, which forwards a request before the Edge behind it would see it."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        refusal = cross_site(scope) if scope["type"] == "http" else None
        if refusal is not None:
            await error_response(403, "Forbidden", refusal)(scope, receive, send)
            return
        await self.app(scope, receive, send)


class IdConvertor(Convertor[str]):
    """``{name:id}``: one path segment as routed by the Edge (see :func:`routed_path`)."""

    regex = "[^/]+"

    def convert(self, value: str) -> str:
        return value.replace("%2F", "/").replace("%25", "%") if "%" in value else value

    def to_string(self, value: str) -> str:
        return str(value).replace("%", "%25").replace("/", "%2F")


register_url_convertor("id", IdConvertor())


# -- metrics ------------------------------------------------------------------------------------


class Metrics:
    """Prometheus metrics of one app, in a registry of its own (two apps in one process, as in
    tests, never share counts)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("engram_http_requests", "HTTP requests answered",
                                ["method", "route", "status"], registry=r)
        self.latency = Histogram(
            "engram_http_request_seconds", "time to answer, by route", ["method", "route"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r)
        self.gauges = {name: Gauge(f"engram_{name}", doc, registry=r) for name, doc in (
            ("users", "users in the store"),
            ("sessions", "sessions in the store"),
            ("turns", "turns in the store, buffered ones included"),
            ("queued", "turns and deletions waiting for the disk"),
            ("live_windows", "sessions whose short-term window is in RAM"),
            ("store_bytes", "size of the LMDB data file"),
            ("committed_lsn", "log position on disk"),
            ("embedding_lag", "committed records not yet embedded"),
            ("vector_lag_seconds", "seconds since the oldest committed record not yet embedded "
                                   "was committed (0: every one has its vector)"),
            ("fulltext_lag", "committed records not yet in the text index"),
        )}

    async def render(self, engine: Engine) -> bytes:
        stats = await engine.stats()
        values = msgspec.structs.asdict(stats)
        values["embedding_lag"] = max(0, stats.committed_lsn - stats.embedded_lsn)
        values["fulltext_lag"] = max(0, stats.committed_lsn - stats.indexed_lsn)
        for name, gauge in self.gauges.items():
            gauge.set(values[name])
        return generate_latest(self.registry)


class Edge:
    """Pure ASGI middleware: the key (and the user a path names) checked before the body is
    read, the body size limit, the wait for a body's bytes (BODY_WAIT) and the request
    metrics, around every route."""

    def __init__(self, app: Callable[..., Awaitable[None]], metrics: Metrics,
                 max_body: int, keys: ApiKeys | None = None,
                 routes: list[Any] | None = None) -> None:
        self.app = app
        self.metrics = metrics
        self.max_body = max_body
        self.keys = keys  # None: only this machine's own clients (cross_site), no keys
        # The app's routes (its own list, filled as routes are declared): what the Edge
        # refuses before routing is counted under the template it would have reached.
        self.routes = routes if routes is not None else []
        self._big_bodies = trio.Semaphore(BIG_BODIES)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500
        try:
            check_escapes(scope)
        except InvalidInput as exc:
            response = error_response(422, "InvalidInput", str(exc), exc.field)
            await response(scope, receive, send)
            self._count(scope, 422, started)
            return
        refusal = cross_site(scope) if self.keys is None else None
        if refusal is not None:
            await error_response(403, "Forbidden", refusal)(scope, receive, send)
            self._count(scope, 403, started)
            return
        path = routed_path(scope)
        if path != scope["path"]:
            scope = {**scope, "path": path}
        if self.keys is not None and keyed(path):
            # Who calls, and for which user the path says, before a byte of the body is
            # read: an anonymous client must not make the server hold and parse 8 MiB.
            caller, refusal = key_refusal(self.keys, scope, path)
            if refusal is not None:
                await refusal(scope, receive, send)
                self._count(self._routed(scope), refusal.status_code, started)
                return
            scope = {**scope, "state": {**scope.get("state", {}), CALLER: caller}}
        headers = scope.get("headers", [])
        if scope.get("method") in ("POST", "PUT", "PATCH") and not scope.get(
                "path", "").startswith("/ui/"):
            # Every API body is JSON: read it as JSON whatever it is labelled, so that
            # `curl -d '{...}'` (form-encoded by default) works as written. The inspector's
            # pages (/ui) post real forms.
            headers = [(n, v) for n, v in headers if n != b"content-type"]
            headers.append((b"content-type", b"application/json"))
            scope = {**scope, "headers": headers}
        for name, value in headers:
            if name == b"content-length" and value.isdigit() and int(value) > self.max_body:
                response = error_response(413, "TooLarge", "expected a body of at most "
                                                           f"{self.max_body} bytes, found "
                                                           f"{int(value)}")
                await response(scope, receive, send)
                self._count(scope, 413, started)
                return
        # HEAD is GET without the body (RFC 9110 9.3.2), which every server must answer; the
        # routes declare GET only. watched_send drops the body and keeps its length.
        head = scope["method"] == "HEAD"
        routed = {**scope, "method": "GET"} if head else scope
        seen = 0
        too_large = False  # the body passed the limit while streaming: answer 413 ourselves
        stalled = False  # no byte of the body came for BODY_WAIT: answer 408 ourselves
        body_done = False  # the request's last body message came: later waits are the app's
        gone = False  # the client went away before its body was whole: counted as 499
        started_response = False
        big = False  # holding one of the big bodies' places (BIG_BODIES)

        async def counted_receive() -> dict:
            nonlocal seen, too_large, stalled, body_done, gone, big
            if too_large or stalled:
                return {"type": "http.disconnect"}
            if body_done:
                return await receive()
            message = None
            with trio.move_on_after(BODY_WAIT):
                message = await receive()
            if message is None:
                # Told the app as a client gone (it stops reading), then the 408 below.
                stalled = True
                return {"type": "http.disconnect"}
            body_done = message["type"] != "http.request" or not message.get("more_body")
            gone = message["type"] == "http.disconnect"
            seen += len(message.get("body", b""))
            if seen > self.max_body:
                # Tell the app the client went away (it stops reading and answers something
                # we drop), then send the 413 below.
                too_large = True
                return {"type": "http.disconnect"}
            if body_done and not gone and seen > BIG_BODY_BYTES:
                # Whole: a slow client holds no place while its bytes come, only the parse
                # and the request's work do.
                await self._big_bodies.acquire()
                big = True
            return message

        async def watched_send(message: dict) -> None:
            nonlocal status, started_response
            if too_large or stalled:
                return
            if message["type"] == "http.response.start":
                status = message["status"]
                started_response = True
            elif head and message.get("body"):
                message = {**message, "body": b""}
            await send(message)

        try:
            await self.app(routed, counted_receive, watched_send)
        except Exception:
            if not (too_large or stalled):
                raise
        finally:
            if big:
                self._big_bodies.release()
            if too_large and not started_response:
                status = 413
                response = error_response(413, "TooLarge", f"expected a body of at most "
                                                           f"{self.max_body} bytes, found more")
                await response(scope, receive, send)
            elif stalled and not started_response:
                status = 408
                response = error_response(408, "RequestTimeout", "expected the rest of the "
                                                                 "request's body, found none "
                                                                 f"for {BODY_WAIT:g} s")
                await response(scope, receive, send)
            elif gone:
                # Whatever the app made of a body cut short (a 422 for a body it could not
                # read), the client closed the request and reads no answer.
                status = 499
            self._count({**routed, "method": "HEAD"} if head else routed, status, started)

    def _routed(self, scope: dict) -> dict:
        """``scope`` with the route it would reach, as routing would set it."""
        for route in self.routes:
            if route.matches(scope)[0] == Match.FULL:
                return {**scope, "route": route}
        return scope

    def _count(self, scope: dict, status: int, started: float) -> None:
        route = scope.get("route")
        # Route templates, never raw paths: user ids must not become label values.
        name = getattr(route, "path_format", None) or getattr(route, "path", None) or "unmatched"
        # HTTP's own methods only: any other name a client sends (no key needed) would be a
        # label value, kept for good.
        method = scope.get("method", "")
        if method not in _METHODS:
            method = "other"
        self.metrics.requests.labels(method, name, str(status)).inc()
        self.metrics.latency.labels(method, name).observe(time.perf_counter() - started)
