"""The HTTP face: a FastAPI app over an open :class:`Engine`, served by Hypercorn's trio worker
inside the engine's own ``async with`` (one process, one trio loop, no thread hops).

``engram-trio serve STORE`` runs :func:`serve`; :func:`create_app` builds the app around an
engine you already opened (tests drive it with httpx's ASGI transport). The inspector's pages
(``engine/ui``) are mounted at ``/ui`` on the same engine and keys.

Auth: with an api-keys file every ``/v1`` route needs ``Authorization: Bearer <key>``; a key
lists the users it may read and write (``*``: all, the admin key). Without a file there is no
auth and the server binds to 127.0.0.1 only. Errors are JSON ``{"error", "message", "field"}``
with the status the cause deserves (:data:`STATUS_BY_ERROR`); no traceback reaches a client.

Here: the app's error handlers, its routes (by concern: probes, turns, forgetting, retrieval,
notes, facts, long-term, tools, admin) and serving. The keys and what every request passes
through are ``_http_edge.py``; the request bodies and responses ``_http_wire.py``.
"""

# No `from __future__ import annotations`: FastAPI reads the route signatures at run time, and
# the dependency aliases (User, Who) are local to create_app.
import gc
import logging
import re
import resource
import signal
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import msgspec
import trio
from fastapi import Body, Depends, FastAPI, Query, Request
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from actors.base.errors import EngineError, InvalidInput, disk_full
from actors.base.records import Episode, Fact, Link, Note, ReviewState, SessionInfo, Turn

from ._engine import Engine
from ._http_edge import (CALLER, ApiKeys, Caller, Edge, Metrics, authorize, is_loopback,
                         load_api_keys)
from ._http_wire import (
    ERROR_RESPONSES,
    HIT_EXAMPLE,
    TURN_EXAMPLE,
    BatchAnswer,
    BatchIn,
    Consolidated,
    Deleted,
    FactCorrection,
    FactIn,
    Forgotten,
    LinkIn,
    NoteIn,
    NoteUpdate,
    PreRetrieveIn,
    RecallAnswer,
    RecallIn,
    RetrieveIn,
    ReviewIn,
    SnapshotIn,
    Time,
    TurnAnswer,
    TurnIn,
    error_response,
    example,
    json_response,
    markdown_response,
    not_found,
    response_schemas,
    server_path,
)
from ._hits import RetrieveResult
from ._memory import EntityInfo
from ._snapshot import Manifest
from ._stats import Stats
from ._tools import MAX_REQUEST_BYTES, TOOLS
from .ui import create_ui

__all__ = ["create_app", "serve", "load_api_keys", "ApiKeys", "STATUS_BY_ERROR"]

log = logging.getLogger("engine.server")

LOOPBACK = "127.0.0.1"
# An EngineError's status by the first class in its MRO named here, so errors other modules add
# (subclasses, or new names like StoreInUse) map without this module importing them.
STATUS_BY_ERROR = {
    "InvalidInput": 422,
    "NotFound": 404,
    "StoreInUse": 503,
    "EngineClosed": 503,
    "EngineBroken": 503,
    "LLMFailed": 502,
    "NotInCluster": 501,
    "LogUnavailable": 503,
    "CallLogged": 202,  # in the log, applied by the partition's owner: not to be retried
    "EngineError": 500,
}

# -- the app ------------------------------------------------------------------------------------


def _forgotten(what: str, log_seq: int | None) -> dict[str, Any]:
    """A forget's answer: what went, and on a cluster node the tombstone's log sequence."""
    return {"forgotten": what} if log_seq is None else {"forgotten": what, "log_seq": log_seq}


def create_app(engine: Engine, keys: ApiKeys | None = None, *,
               max_body_bytes: int = MAX_REQUEST_BYTES) -> FastAPI:
    """The HTTP API over an open engine.

    Args:
        engine: an open :class:`Engine`; the app never closes it.
        keys: the api keys (:func:`load_api_keys`); None for no auth (loopback only!).
        max_body_bytes: larger request bodies get 413.

    Returns:
        A FastAPI (ASGI) app; serve it with Hypercorn's trio worker on the engine's loop.
    """
    from ._version import __version__

    app = FastAPI(
        title="Engram", version=__version__, responses=ERROR_RESPONSES,
        description="An in-process memory engine for chat bots and agents, over HTTP. "
                    "Send `Authorization: Bearer <key>` when the server has an api-keys file.")
    metrics = Metrics()
    app.add_middleware(Edge, metrics=metrics, max_body=max_body_bytes, keys=keys,
                       routes=app.router.routes)
    # The inspector's pages, on the same engine and keys (engine/ui).
    ui = create_ui(engine, keys)
    app.mount("/ui", ui)

    async def caller(request: Request) -> Caller:
        if keys is None:
            return Caller(None)
        # The Edge checked the key before the body was read (every keyed route).
        checked = request.scope.get("state", {}).get(CALLER)
        return checked if checked is not None else authorize(
            keys, request.headers.get("authorization", ""))

    Who = Annotated[Caller, Depends(caller)]

    async def for_user(user_id: Annotated[str, PathParam()], who: Who) -> str:
        who.check(user_id)
        return user_id

    User = Annotated[str, Depends(for_user)]

    # The hottest routes (a turn in, a recall) read their key, path and body themselves rather
    # than through FastAPI's parameter solving, which cost them more than the engine's call:
    # the same checks and errors, the same OpenAPI document (`lean`).
    async def user_of(request: Request) -> str:
        user_id = request.path_params["user_id"]
        (await caller(request)).check(user_id)
        return user_id

    async def body_of(request: Request, model: type[BodyModel]) -> BodyModel:
        try:
            return model.model_validate_json(await request.body())
        except ValidationError as exc:
            raise RequestValidationError([{**e, "loc": ("body", *e["loc"])}
                                          for e in exc.errors()]) from None

    # -- errors: JSON, the status by cause, never a traceback ------------------------------

    @app.exception_handler(EngineError)
    async def engine_error(request: Request, exc: EngineError) -> Response:
        for cls in type(exc).__mro__:
            status = STATUS_BY_ERROR.get(cls.__name__)
            if status is not None:
                break
        if status >= 500:
            log.warning("%s %s: %s: %s", request.method, request.url.path,
                        type(exc).__name__, exc)
        return error_response(status, type(exc).__name__, str(exc), getattr(exc, "field", None),
                              log_seq=getattr(exc, "log_seq", None))

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0]
        loc = tuple(first.get("loc", ()))
        if first.get("type") == "json_invalid":  # FastAPI puts the offset in loc, pydantic not
            at = "".join(f" at character {p}" for p in loc[1:2] if isinstance(p, int))
            detail = first.get("ctx", {}).get("error") or first.get("msg", "")
            return error_response(422, "InvalidInput", f"body: expected a JSON object, found "
                                                       f"invalid JSON ({detail}{at})", "body")
        # The first place says where the value came from; a field may be *named* query or path.
        if loc and loc[0] in ("body", "query", "path", "header", "cookie"):
            loc = loc[1:]
        field = ".".join(str(p) for p in loc) or "body"
        found = first.get("input")
        message = f"{field}: {first.get('msg', 'invalid')}"
        if not isinstance(found, (dict, list)) and found is not None:
            message += f", found {str(found)[:80]!r}"
        return error_response(422, "InvalidInput", message, field)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        if exc.status_code == 400:
            # No route raises 400: it is FastAPI's for a body it could not read, the body's
            # fault like any other bad JSON; the parser's error is its cause.
            if isinstance(exc.__cause__, RecursionError):
                message = "a JSON object, found one nested deeper than the parser goes"
            elif isinstance(exc.__cause__, UnicodeDecodeError):
                message = "a JSON object in UTF-8, found bytes that are not"
            else:
                message = "a JSON object, found a body the server could not read"
            return error_response(422, "InvalidInput", f"body: expected {message}", "body")
        names = {401: "Unauthorized", 403: "Forbidden", 404: "NotFound", 405: "MethodNotAllowed"}
        return error_response(exc.status_code, names.get(exc.status_code, "HTTPError"),
                              str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(ClientDisconnect)
    async def gone(request: Request, exc: ClientDisconnect) -> Response:
        # The client went away before its request was read: nothing failed here, nothing
        # was done, and nobody reads the answer. Counted as 499 (the client closed it).
        log.info("%s %s: the client went away before its request was read", request.method,
                 request.url.path)
        return Response(status_code=499)

    @app.exception_handler(OSError)
    async def disk(request: Request, exc: OSError) -> Response:
        # A snapshot's or an export's destination disk (the engine raises OSError for what
        # the disk under a caller's path does): an operator frees it, nothing is broken.
        if disk_full(exc):
            log.warning("%s %s: %s", request.method, request.url.path, exc)
            return error_response(507, "DiskFull", f"the disk is full ({exc.strerror}): "
                                                   "nothing of the copy is left; free space "
                                                   "and try again")
        return await internal(request, exc)

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> Response:
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return error_response(500, "InternalError", "the server failed answering this request; its "
                                                    "log has the details")

    # -- probes ------------------------------------------------------------------------------

    @app.get("/healthz", tags=["probes"])
    async def healthz() -> Response:
        """The process answers and the engine is open."""
        await engine.stats()
        return json_response({"status": "ok"})

    @app.get("/readyz", tags=["probes"])
    async def readyz() -> Response:
        """200 once both indexes cover everything committed, else 503 with the lag."""
        stats = await engine.stats()
        lag = {"embedding": max(0, stats.committed_lsn - stats.embedded_lsn),
               "fulltext": max(0, stats.committed_lsn - stats.indexed_lsn)}
        ready = not any(lag.values())
        return json_response({"status": "ready" if ready else "catching up", "lag": lag},
                             200 if ready else 503)

    @app.get("/metrics", tags=["probes"])
    async def prometheus(who: Who) -> Response:
        """Prometheus text: request counts and latency histograms by route, queue depth,
        index lag and store size. Any valid key may read it (no user data)."""
        return Response(await metrics.render(engine), media_type=CONTENT_TYPE_LATEST)

    # -- turns and sessions ------------------------------------------------------------------

    @app.post("/v1/users/{user_id:id}/sessions/{session_id:id}/turns", status_code=202,
              tags=["turns"], openapi_extra=lean(TurnIn, "user_id", "session_id"), responses={
                  201: {"description": "durable: on disk",
                        **example({"turn_id": TURN_EXAMPLE["turn_id"], "seq": 3, "durable": True})},
                  202: {"description": "buffered: in the window",
                        **example({"turn_id": TURN_EXAMPLE["turn_id"], "seq": 3,
                                   "durable": False})}})
    async def add_turn(request: Request) -> Response:
        """Add a turn; 201 once it is on disk (``durable``), else 202 once it is buffered."""
        user_id = await user_of(request)
        session_id = request.path_params["session_id"]
        body = await body_of(request, TurnIn)
        receipt = await engine.add_turn(user_id, session_id, body.role, body.text, at=body.at,
                                        meta=body.meta, durable=body.durable,
                                        **body.model_dump(include={"agent_id", "run_id"},
                                                          exclude_none=True))
        answer = {"turn_id": receipt.turn_id, "seq": receipt.seq, "durable": body.durable}
        if getattr(receipt, "log_seq", None) is not None:
            # A cluster node's receipt: the log's sequence, for a later read's ?min_seq=.
            answer["log_seq"] = receipt.log_seq
        return json_response(answer, 201 if body.durable else 202)

    @app.get("/v1/users/{user_id:id}/sessions/{session_id:id}/turns", tags=["turns"],
             responses={200: example([TURN_EXAMPLE])})
    async def session_history(user_id: User, session_id: str,
                              limit: Annotated[int, Query(ge=1, le=10_000)] = 50) -> Response:
        """The session's latest ``limit`` turns, oldest first."""
        return json_response(await engine.session_history(user_id, session_id, limit))

    @app.post("/v1/users/{user_id:id}/turns", status_code=202, tags=["turns"])
    async def add_turns(user_id: User, body: BatchIn) -> Response:
        """Add many turns at once (all validated before any is written)."""
        try:
            receipts = await engine.add_turns(
                [{"user_id": user_id, **t.model_dump(exclude_none=True)} for t in body.turns],
                durable=body.durable)
        except InvalidInput as exc:
            # The engine names an item as its call does (items[3].at); the body, turns.3.at.
            named = re.match(r"items\[(\d+)\]", exc.field)
            if named is None:
                raise
            field = f"turns.{named[1]}{exc.field[named.end():]}"
            raise type(exc)(field, str(exc).removeprefix(f"{exc.field}: ")) from None
        return json_response({"turns": [{"turn_id": r.turn_id, "seq": r.seq}
                                        | ({"log_seq": r.log_seq}
                                           if getattr(r, "log_seq", None) is not None else {})
                                        for r in receipts],
                              "durable": body.durable}, 201 if body.durable else 202)

    @app.get("/v1/users/{user_id:id}/turns/{turn_id:id}", tags=["turns"])
    async def get_turn(user_id: User, turn_id: str) -> Response:
        turn = await engine.get_turn(user_id, turn_id)
        if turn is None:
            raise not_found(f"turn {turn_id!r} for this user")
        return json_response(turn)

    @app.get("/v1/users/{user_id:id}/sessions", tags=["turns"])
    async def list_sessions(user_id: User) -> Response:
        """The user's sessions, most recent first."""
        return json_response(await engine.list_sessions(user_id))

    @app.post("/v1/users/{user_id:id}/sessions/{session_id:id}/close", tags=["turns"])
    async def close_session(user_id: User, session_id: str) -> Response:
        """The session is over: its remaining turns become an episode now."""
        return json_response({"consolidated": await engine.close_session(user_id, session_id)})

    @app.delete("/v1/users/{user_id:id}/sessions/{session_id:id}", tags=["forget"])
    async def forget_session(user_id: User, session_id: str) -> Response:
        """Delete the session; on a cluster node, once its tombstone is in the log (the
        answer's ``log_seq`` is a later read's ``min_seq``)."""
        return json_response(_forgotten(session_id,
                                        await engine.forget_session(user_id, session_id)))

    @app.delete("/v1/users/{user_id:id}/scopes", tags=["forget"])
    async def forget_scope(user_id: User, agent_id: str | None = None,
                           run_id: str | None = None) -> Response:
        """Delete the user's sessions and notes of one scope (``?agent_id=``, ``?run_id=``,
        or both); answers the counts once the deletion is on disk."""
        return json_response(await engine.forget_scope(user_id, agent_id=agent_id,
                                                       run_id=run_id))

    @app.delete("/v1/users/{user_id:id}", tags=["forget"])
    async def forget_user(user_id: User) -> Response:
        """Delete everything of the user; answers once the deletion is on disk (on a cluster
        node, once its tombstone is in the log: the answer's ``log_seq`` is a later read's
        ``min_seq``)."""
        return json_response(_forgotten(user_id, await engine.forget_user(user_id)))

    # -- retrieval ---------------------------------------------------------------------------

    @app.post("/v1/users/{user_id:id}/recall", tags=["retrieval"],
              openapi_extra=lean(RecallIn, "user_id"),
              responses={200: example({"hits": [HIT_EXAMPLE]})})
    async def recall(request: Request) -> Response:
        """Hits (the engine's ``Hit`` fields), best first; ``degraded`` names the search legs
        whose index was being rebuilt (empty when the answer is complete)."""
        user_id = await user_of(request)
        body = await body_of(request, RecallIn)
        hits = await engine.recall(user_id, body.query, body.limit,
                                   **body.model_dump(exclude={"query", "limit"},
                                                     exclude_none=True))
        return json_response({"hits": hits, "degraded": hits.degraded})

    @app.post("/v1/retrieve_memory", tags=["retrieval"], responses={200: example(
        "## Semantic Memory\n- [identity] Lives in Lisbon (sources: 1 conversation)\n\n"
        "## Episodic Memories\n\n### Moving to Lisbon in January [rank: 1, score: 0.03]\n"
        "**When:** 2 weeks ago\n**Summary:** Maya is moving to Lisbon in January.\n",
        "text/markdown")})
    async def retrieve_memory(body: RetrieveIn, who: Who) -> Response:
        """seed 001's ``retrieve_memory``: prompt-ready Markdown."""
        who.check(body.user_id)
        return markdown_response(await engine.retrieve_memory(**body.model_dump()))

    @app.post("/v1/retrieve_memory/raw", tags=["retrieval"])
    async def retrieve_memory_raw(body: RetrieveIn, who: Who) -> Response:
        """seed 001's raw endpoint: typed ``semantic`` and ``episodic`` lists."""
        who.check(body.user_id)
        return Response(msgspec.json.encode(await engine.retrieve_memory_raw(**body.model_dump())),
                        media_type="application/json")

    @app.post("/v1/context_pre_retrieve", tags=["retrieval"],
              responses={200: {"content": {"text/markdown": {}}}})
    async def context_pre_retrieve(body: PreRetrieveIn, who: Who) -> Response:
        """seed 001's semantic-only Markdown for a system prompt."""
        who.check(body.user_id)
        return markdown_response(await engine.context_pre_retrieve(**body.model_dump()))

    # -- notes -------------------------------------------------------------------------------

    @app.post("/v1/users/{user_id:id}/notes", status_code=201, tags=["notes"])
    async def store_note(user_id: User, body: NoteIn) -> Response:
        return json_response(await engine.store_note(
            user_id, body.text, **body.model_dump(exclude={"text"}, exclude_none=True)), 201)

    @app.get("/v1/users/{user_id:id}/notes", tags=["notes"])
    async def list_notes(user_id: User) -> Response:
        """The user's notes (current versions), most recently updated first."""
        return json_response(await engine.list_notes(user_id))

    @app.get("/v1/users/{user_id:id}/notes/{note_id:id}", tags=["notes"])
    async def get_note(user_id: User, note_id: str) -> Response:
        note = await engine.get_note(user_id, note_id)
        if note is None:
            raise not_found(f"note {note_id!r} for this user")
        return json_response(note)

    @app.put("/v1/users/{user_id:id}/notes/{note_id:id}", tags=["notes"])
    async def update_note(user_id: User, note_id: str, body: NoteUpdate) -> Response:
        if await engine.get_note(user_id, note_id) is None:
            raise not_found(f"note {note_id!r} for this user")
        return json_response(await engine.update_note(
            user_id, note_id, body.text, **body.model_dump(exclude={"text"}, exclude_none=True)))

    @app.delete("/v1/users/{user_id:id}/notes/{note_id:id}", tags=["notes"])
    async def delete_note(user_id: User, note_id: str) -> Response:
        if not await engine.delete_note(user_id, note_id):
            raise not_found(f"note {note_id!r} for this user")
        return json_response({"deleted": note_id})

    # -- facts -------------------------------------------------------------------------------

    @app.get("/v1/users/{user_id:id}/facts", tags=["facts"])
    async def profile(user_id: User, category: str | None = None,
                      min_importance: Annotated[float, Query(ge=0, le=1)] = 0.0,
                      as_of: Time | None = None) -> Response:
        """Active facts, most important first; with ``as_of`` (a time with its zone), the
        versions the store held as true then."""
        return json_response(await engine.profile(user_id, category=category,
                                                  min_importance=min_importance, as_of=as_of))

    @app.post("/v1/users/{user_id:id}/facts", status_code=201, tags=["facts"])
    async def remember_fact(user_id: User, body: FactIn) -> Response:
        return json_response(await engine.remember_fact(
            user_id, body.category, body.key, body.value, text=body.text,
            confidence=body.confidence, importance=body.importance, keywords=body.keywords,
            valid_at=body.valid_at), 201)

    @app.put("/v1/users/{user_id:id}/facts/{category:id}/{key:id}", tags=["facts"])
    async def correct_fact(user_id: User, category: str, key: str,
                           body: FactCorrection) -> Response:
        return json_response(await engine.correct_fact(user_id, category, key, body.value,
                                                       text=body.text, importance=body.importance,
                                                       keywords=body.keywords,
                                                       valid_at=body.valid_at))

    @app.post("/v1/users/{user_id:id}/facts/{category:id}/{key:id}/confirm", tags=["facts"])
    async def confirm_fact(user_id: User, category: str, key: str) -> Response:
        return json_response(await engine.confirm_fact(user_id, category, key))

    @app.delete("/v1/users/{user_id:id}/facts/{category:id}/{key:id}", tags=["facts"])
    async def forget_fact(user_id: User, category: str, key: str) -> Response:
        if not await engine.forget_fact(user_id, category, key):
            raise not_found(f"active fact {category}/{key} for this user")
        return json_response({"forgotten": f"{category}/{key}"})

    @app.get("/v1/users/{user_id:id}/facts/{category:id}/{key:id}/history", tags=["facts"])
    async def fact_history(user_id: User, category: str, key: str) -> Response:
        return json_response(await engine.fact_history(user_id, category, key))

    # -- episodes, entities, links, review ---------------------------------------------------

    @app.get("/v1/users/{user_id:id}/episodes", tags=["long-term"])
    async def episodes(user_id: User, session_id: str | None = None) -> Response:
        return json_response(await engine.episodes(user_id, session_id))

    @app.get("/v1/users/{user_id:id}/entities/{name:id}", tags=["long-term"])
    async def entity_info(user_id: User, name: str,
                          limit: Annotated[int, Query(ge=1, le=1000)] = 20) -> Response:
        info = await engine.entity_info(user_id, name, limit)
        if info is None:
            raise not_found(f"entity {name!r} in this user's memories")
        return json_response(info)

    @app.post("/v1/users/{user_id:id}/links", status_code=201, tags=["long-term"])
    async def link(user_id: User, body: LinkIn) -> Response:
        return json_response(await engine.link(user_id, body.from_id, body.to_id, body.type), 201)

    @app.get("/v1/users/{user_id:id}/memories/{memory_id:id}/links", tags=["long-term"])
    async def links(user_id: User, memory_id: str) -> Response:
        return json_response(await engine.links(user_id, memory_id))

    @app.post("/v1/users/{user_id:id}/memories/{memory_id:id}/review", tags=["long-term"])
    async def review(user_id: User, memory_id: str, body: ReviewIn) -> Response:
        """Rate how well a shown memory served (FSRS)."""
        return json_response(await engine.review(user_id, memory_id, body.rating))

    @app.get("/v1/users/{user_id:id}/stats", tags=["long-term"])
    async def memory_stats(user_id: User) -> Response:
        return json_response(await engine.memory_stats(user_id))

    # -- tools -------------------------------------------------------------------------------

    @app.get("/v1/tools", tags=["tools"])
    async def tools(who: Who) -> Response:
        """The agent tools as JSON-schema function definitions (OpenAI's shape)."""
        return json_response(TOOLS)

    @app.post("/v1/tools/{name}", tags=["tools"])
    async def call_tool(name: str, who: Who,
                        arguments: Annotated[dict[str, Any], Body(
                            examples=[{"user_id": "maya", "query": "dog"}])]) -> Response:
        """Run one agent tool; ``arguments`` as the tool's schema says (``user_id`` included)."""
        try:
            msgspec.json.encode(arguments)
        except UnicodeEncodeError:
            # FastAPI's JSON parser keeps "\ud800" escapes, which no store or index can hold
            # (the other routes' parser refuses them).
            raise InvalidInput("arguments", "expected text encodable as UTF-8, found a lone "
                                            "surrogate escape (\\ud800-\\udfff)") from None
        user_id = arguments.get("user_id")
        if isinstance(user_id, str):
            who.check(user_id)
        elif who.users is not None:
            raise InvalidInput("arguments.user_id", "expected a string user id, found "
                                                    f"{type(user_id).__name__}")
        return json_response(await engine.call_tool(name, arguments))

    # -- the whole store: admin keys only ----------------------------------------------------

    @app.get("/v1/stats", tags=["admin"])
    async def stats(who: Who) -> Response:
        who.check_admin()
        return json_response(await engine.stats())

    @app.post("/v1/snapshot", tags=["admin"])
    async def snapshot(body: SnapshotIn, who: Who) -> Response:
        """A point-in-time snapshot to a directory on the server, taken while serving."""
        who.check_admin()
        manifest = await engine.snapshot(server_path("dest", body.dest))  # it checks the path as the engine takes it
        ui.state.journal.snapshot_taken(body.dest, manifest)  # the operator view lists it
        return Response(msgspec.json.encode(manifest), media_type="application/json")

    generate_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = generate_openapi()  # kept by FastAPI as app.openapi_schema
            try:
                _declare_answers(spec)
            except BaseException:
                app.openapi_schema = None  # never a half-made document served later
                raise
        return app.openapi_schema

    app.openapi = openapi
    return app


BodyModel = TypeVar("BodyModel", bound=BaseModel)

def _declare_answers(spec: dict[str, Any]) -> None:
    """Complete FastAPI's document: the lean routes' bodies, and every JSON route's answer
    schema (:data:`ANSWERS`) with the components it refers to."""
    schemas = spec.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(LEAN_SCHEMAS)
    found, components = response_schemas(ANSWERS)
    clash = set(components) & set(schemas)
    if clash:
        raise AssertionError(f"answer schemas named like request bodies: {clash}")
    schemas.update(components)
    for (method, path), schema in found.items():
        responses = spec["paths"][path][method]["responses"]
        for status in ANSWERS[method, path][0]:
            answer = responses.setdefault(str(status), {"description": "Success"})
            answer.setdefault("content", {}).setdefault("application/json", {})["schema"] = schema
            if status in (201, 202):
                responses.pop("200", None)  # FastAPI's default, for a route that never says it

_U, _S = "/v1/users/{user_id}", "/v1/users/{user_id}/sessions/{session_id}"
_NOTE, _FACT = _U + "/notes/{note_id}", _U + "/facts/{category}/{key}"
# Each JSON route's success answers, (method, path) -> (statuses, type), for the OpenAPI: the
# engine's records as they cross the wire (see _http_wire.wire_type); checked against real
# answers by the tests.
ANSWERS: dict[tuple[str, str], tuple[tuple[int, ...], Any]] = {
    ("post", _S + "/turns"): ((201, 202), TurnAnswer),
    ("get", _S + "/turns"): ((200,), list[Turn]),
    ("post", _U + "/turns"): ((201, 202), BatchAnswer),
    ("get", _U + "/turns/{turn_id}"): ((200,), Turn),
    ("get", _U + "/sessions"): ((200,), list[SessionInfo]),
    ("post", _S + "/close"): ((200,), Consolidated),
    ("delete", _S): ((200,), Forgotten),
    ("delete", _U + "/scopes"): ((200,), dict[str, int]),
    ("delete", _U): ((200,), Forgotten),
    ("post", _U + "/recall"): ((200,), RecallAnswer),
    ("post", "/v1/retrieve_memory/raw"): ((200,), RetrieveResult),
    ("post", _U + "/notes"): ((201,), Note),
    ("get", _U + "/notes"): ((200,), list[Note]),
    ("get", _NOTE): ((200,), Note),
    ("put", _NOTE): ((200,), Note),
    ("delete", _NOTE): ((200,), Deleted),
    ("get", _U + "/facts"): ((200,), list[Fact]),
    ("post", _U + "/facts"): ((201,), Fact),
    ("put", _FACT): ((200,), Fact),
    ("post", _FACT + "/confirm"): ((200,), Fact),
    ("delete", _FACT): ((200,), Forgotten),
    ("get", _FACT + "/history"): ((200,), list[Fact]),
    ("get", _U + "/episodes"): ((200,), list[Episode]),
    ("get", _U + "/entities/{name}"): ((200,), EntityInfo),
    ("post", _U + "/links"): ((201,), Link),
    ("get", _U + "/memories/{memory_id}/links"): ((200,), list[Link]),
    ("post", _U + "/memories/{memory_id}/review"): ((200,), ReviewState),
    ("get", _U + "/stats"): ((200,), dict[str, Any]),
    ("get", "/v1/tools"): ((200,), list[dict[str, Any]]),
    ("post", "/v1/tools/{name}"): ((200,), dict[str, Any]),
    ("get", "/v1/stats"): ((200,), Stats),
    ("post", "/v1/snapshot"): ((200,), Manifest),
}


# The body schemas of the routes that read their own bodies, for the OpenAPI's components.
LEAN_SCHEMAS: dict[str, dict[str, Any]] = {}


def lean(body: type[BaseModel], *path: str) -> dict[str, Any]:
    """The OpenAPI of a route that reads its path and body itself (``openapi_extra``): what
    FastAPI would have written from the parameters. ``body`` must be flat (no nested
    models), so its JSON schema stands alone in the document's components."""
    schema = body.model_json_schema()
    if "$defs" in schema:
        raise TypeError(f"lean() takes a flat body model; {body.__name__} nests others")
    LEAN_SCHEMAS[body.__name__] = schema
    return {"parameters": [{"name": name, "in": "path", "required": True,
                            "schema": {"type": "string", "title": name.replace("_", " ")
                                       .title()}} for name in path],
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{body.__name__}"}}}}}


# -- serving ------------------------------------------------------------------------------------


# Seconds an answer may sit in the kernel untaken by its client (no window, or no ack)
# before the connection is dropped (TCP_USER_TIMEOUT on the listening sockets, which their
# connections inherit). Hypercorn writes an answer in a shielded send that nothing else ends:
# a client that never reads would hold its connection, and a graceful stop, for ever.
SEND_WAIT = 30.0


def hypercorn_config(host: str, port: int | str) -> Any:
    """Hypercorn's config as every server here runs it: bound to ``host:port`` (an IPv6
    address in brackets), no access log, a 5 s graceful stop, and connections whose
    answers a client leaves untaken for SEND_WAIT dropped (Linux)."""
    from hypercorn.config import Config as HypercornConfig

    class Bounded(HypercornConfig):
        def create_sockets(self) -> Any:
            sockets = super().create_sockets()
            option = getattr(socket, "TCP_USER_TIMEOUT", None)
            for sock in (*sockets.secure_sockets, *sockets.insecure_sockets):
                if option is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
                    sock.setsockopt(socket.IPPROTO_TCP, option, int(SEND_WAIT * 1000))
            return sockets

    hc = Bounded()
    hc.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    hc.accesslog = None
    hc.graceful_timeout = 5.0
    return hc


def spare_descriptors() -> None:
    """Raise the process's soft limit on open files to its hard limit: every connection
    holds a descriptor, and the engine's own files need theirs (a commit of the text index
    that finds none waits until one is free). Where the limit cannot move, it stays."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 1 << 20 if hard == resource.RLIM_INFINITY else hard  # Linux's fs.nr_open
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError):
            pass


class Shutdown:
    """What stops a server: ``event``, set by the first SIGINT/SIGTERM received while
    :meth:`hold_signals` holds them (kept as ``signal``) or by anyone who sets it."""

    def __init__(self) -> None:
        self.event = trio.Event()  # set: stop accepting, finish what is in flight, close
        self.signal: int | None = None
        self._found: dict[int, Any] = {}  # the handlers hold_signals replaced

    def hold_signals(self) -> None:
        """From now (the server serves) until :meth:`release_signals`, which comes after
        the engine's drain: the first SIGINT or SIGTERM sets ``event``, later ones are
        absorbed. A second SIGTERM from a process manager or an impatient ``kill`` must not
        kill the process (its default action, which trio's receiver gave back once it
        closed) before the engine has written the turns it acknowledged. Only SIGKILL stops
        a drain at once; it is bounded (Hypercorn's graceful timeout, then the store's
        queue). Before, while the engine opens, Ctrl-C interrupts at once. Main thread only
        (elsewhere: nothing)."""
        if threading.current_thread() is not threading.main_thread():
            return
        token = trio.lowlevel.current_trio_token()

        def received(signum: int, frame: object) -> None:
            # trio's own signal handlers do this: run_sync_soon is safe in a signal handler.
            token.run_sync_soon(self._received, signum, idempotent=True)

        self._found = {s: signal.signal(s, received) for s in (signal.SIGINT, signal.SIGTERM)}

    def release_signals(self) -> None:
        """Give back the handlers :meth:`hold_signals` found."""
        for signum, handler in self._found.items():
            signal.signal(signum, handler)
        self._found = {}

    def _received(self, signum: int) -> None:
        if self.signal is None:
            self.signal = signum
        self.event.set()


async def serve(store: str | Path, *, host: str = LOOPBACK, port: int = 8080,
                api_keys: str | Path | None = None, config: Any = None,
                say: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
                handle_signals: bool = True,
                task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED
                ) -> int | None:
    """Open the store and serve the HTTP API until SIGINT or SIGTERM (or cancellation).

    Hypercorn's trio worker runs in a nursery inside the engine's ``async with``: one trio
    loop, and an engine failure cancels the server with it.

    Args:
        store: the store directory (created if missing).
        host / port: where to listen; port 0 takes a free one (``task_status`` reports it).
        api_keys: the api-keys file; without one the server binds to 127.0.0.1 only.
        config: the engine's :class:`Config` or overrides.
        say: where the start-up lines go (stderr).
        handle_signals: stop gracefully on SIGINT / SIGTERM (main thread only).

    Returns:
        The signal that stopped the server, or None if it stopped otherwise.

    Raises:
        InvalidInput: a bad keys file or config.
    """
    from hypercorn.trio import serve as hypercorn_serve

    keys = load_api_keys(api_keys) if api_keys is not None else None
    if keys is None:
        if not is_loopback(host):
            say(f"warning: no --api-keys file, so no auth: binding to {LOOPBACK} instead of "
                f"{host}")
        else:
            say("warning: no --api-keys file: every local process may read and write every user")
        host = LOOPBACK
    hc = hypercorn_config(host, port)
    spare_descriptors()
    shutdown = Shutdown()
    try:
        async with Engine.open(store, config=config) as mem:
            app = create_app(mem, keys)
            # What exists now (modules, the app, the engine's long-lived state: ~95k objects)
            # lives as long as the server: out of the collector's generations, so each full
            # collection walks only what serving made (each took ~55 ms of the loop under HTTP
            # load here).
            gc.collect()
            gc.freeze()
            try:
                async with trio.open_nursery() as nursery:
                    binds = await nursery.start(
                        lambda task_status: hypercorn_serve(
                            app, hc, shutdown_trigger=shutdown.event.wait,
                            task_status=task_status))
                    say(f"engram-trio serving {store} on {', '.join(binds)} "
                        f"({'api keys' if keys else 'no auth'})")
                    task_status.started(binds)
                    if handle_signals:
                        shutdown.hold_signals()
                    await shutdown.event.wait()
                    nursery.cancel_scope.deadline = (trio.current_time() + hc.graceful_timeout
                                                     + 1)
            finally:
                gc.unfreeze()
    finally:
        shutdown.release_signals()
    # The engine closed after Hypercorn's graceful stop (its drain is shielded and bounded).
    return shutdown.signal
