"""The inspector's routes: one FastAPI app, mounted at ``/ui`` by the HTTP server.

Auth is the HTTP API's: an api key, from ``Authorization: Bearer`` (scripts, tests) or from the
sign-in form, which keeps it in an HttpOnly, SameSite=Strict cookie scoped to ``/ui``. A page
about a user needs a key for that user (403 otherwise); the operator view needs an admin key;
without a key every page answers 401 with the sign-in form. With no api-keys file (a server
bound to 127.0.0.1 only) every page is open, as the API is, and like the API answers only
under a loopback host name and takes writes from no other site (``_http_edge.cross_site``): a
site whose name was rebound to 127.0.0.1 would otherwise be same-origin with the pages.

Every memory-changing action is a POST behind a confirmation page. A POST authenticated by
the cookie must carry the form's token (an HMAC of the key under a secret of this process) and
come from this origin (``Origin``, else ``Referer``): a cross-site form can neither read the
token nor forge the origin. A POST with a Bearer header needs neither: browsers never add one.
The line saying what an action did travels in the redirect with its own HMAC, so a link cannot
plant a message on these pages.

Pages are Jinja2 templates with autoescaping on, so every text a user wrote is shown as text;
the Content-Security-Policy allows no script at all.
"""

import functools
import hashlib
import hmac
import json
import math
import secrets
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode, urlsplit

import jinja2
import trio
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, Response
from starlette.exceptions import HTTPException

from actors.base.text import composed, folded

from .. import Engine, EngineError, Fact, InvalidInput, Manifest
from .._hits import estimate_tokens
from .._http_wire import server_path
from .._retrieval import LEGS
from ._graph import Graph, neighbourhood

__all__ = ["create_ui", "Journal"]

HERE = Path(__file__).parent
COOKIE = "engram_key"
TURNS_SHOWN = 200  # turns per session on the timeline (the latest; the page says so)
SESSIONS_SHOWN = 30  # sessions on the timeline, most recent first (?session= shows any one)
USERS_SHOWN = 500  # users on the first page, each with its counts (one read per user)
NOTES_SHOWN = 200  # notes on the memory page, each with its link count
ENTITIES_SHOWN = 100  # entities on the memory page, most mentioned first
FAILURES_SHOWN = 100  # failed records on the operator view
SNAPSHOTS_KEPT = 20  # snapshots the operator view lists
MAX_DEPTH = 3  # BFS depth of the link graph a page may ask for
KINDS = ("turn", "episode", "fact", "note")
ROLES = ("user", "assistant", "system", "tool")
# An EngineError's status by the first class in its MRO named here (as the API maps them).
STATUS = {"InvalidInput": 422, "NotFound": 404, "StoreInUse": 503, "EngineClosed": 503,
          "EngineBroken": 503, "LLMFailed": 502, "EngineError": 500}
# No script at all; inline style attributes only (episode bands, graph): nothing to inject.
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'self' 'unsafe-inline'; "
                               "img-src 'self' data:; form-action 'self'; base-uri 'none'; "
                               "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",  # pages hold a user's memories
}


class Journal:
    """What this server did that the operator view shows: the snapshots it took (through the
    API or the pages) and the last integrity check, since it started."""

    def __init__(self) -> None:
        self.snapshots: list[tuple[str, Manifest]] = []
        self.integrity: tuple[datetime, dict[str, Any]] | None = None

    def snapshot_taken(self, dest: str, manifest: Manifest) -> None:
        self.snapshots.append((dest, manifest))
        del self.snapshots[:-SNAPSHOTS_KEPT]


class Refused(Exception):
    """A page that cannot be shown: 401 (no key), 403 (not this key's), 404, 422."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Viewer:
    """Who is looking: the key, the users it may see (``None``: all) and how it came."""

    def __init__(self, users: frozenset[str] | None, key: str, via: str) -> None:
        self.users = users
        self.key = key
        self.via = via  # "bearer", "cookie" or "open" (no api-keys file)

    @property
    def admin(self) -> bool:
        return self.users is None

    def may(self, user_id: str) -> bool:
        return self.users is None or user_id in self.users


@functools.cache
def _environment() -> jinja2.Environment:
    """The templates, loaded once per process (each app renders with the same ones)."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"),
                             autoescape=True, undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True)
    env.filters["seg"] = lambda value: quote(str(value), safe="")
    env.filters["when"] = _when
    env.filters["size"] = _size
    env.filters["short"] = lambda text, n=160: text if len(text) <= n else text[: n - 1] + "…"
    return env


def _when(value: datetime | None) -> str:
    return "" if value is None else value.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _int(params: Any, name: str, default: int | None, low: int, high: int) -> int | None:
    raw = params.get(name, "")
    if raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise InvalidInput(name, f"expected an integer from {low} to {high}, found "
                                 f"{raw[:40]!r}") from None
    if not low <= value <= high:
        raise InvalidInput(name, f"expected an integer from {low} to {high}, found {value}")
    return value


def _fraction(params: Any, name: str) -> float | None:
    raw = params.get(name, "").strip()
    if raw == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= 1.0:  # NaN too
        raise InvalidInput(name, f"expected a number from 0 to 1, found {raw[:40]!r}")
    return value


async def _verify(path: Path) -> dict[str, Any]:
    """``engram-trio verify`` of the served store, in a worker process: LMDB refuses a second
    environment on the same store in one process, and checking every record would hold this
    loop's GIL for as long as it takes. Its report, or one problem saying why it failed."""
    done = await trio.run_process([sys.executable, "-m", "engine", "verify", str(path), "--json"],
                                  capture_stdout=True, capture_stderr=True, check=False)
    try:
        return json.loads(done.stdout)
    except ValueError:
        why = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        return {"ok": False, "problem_count": 1, "records": 0, "sessions": 0, "last_lsn": 0,
                "mac": "unchecked", "problems": [{"where": "verify", "what": why[0]}]}


def create_ui(engine: Engine, keys: Any = None) -> FastAPI:
    """The inspector over an open engine, to mount at ``/ui`` of the HTTP app.

    Args:
        engine: an open :class:`Engine`; the pages never close it.
        keys: the server's :class:`~engine._server.ApiKeys` (anything with ``lookup(key)``
            returning ``(known, users)``), or None for open pages (loopback only).

    Returns:
        A FastAPI app; ``app.state.journal`` is its :class:`Journal`. Mount it inside the HTTP
        app (``create_app`` does): its ``{user_id:id}`` routes take ids holding '/' from the
        path as that app's Edge routes it.
    """
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    journal = app.state.journal = Journal()
    env = _environment()
    secret = secrets.token_bytes(32)  # signs form tokens; new per process, as sign-ins are

    def token(viewer: Viewer) -> str:
        digest = hashlib.sha256(viewer.key.encode()).digest()
        return hmac.new(secret, b"csrf\x00" + digest, "sha256").hexdigest()

    def signature(done: str) -> str:
        return hmac.new(secret, b"done\x00" + done.encode(), "sha256").hexdigest()

    def matches(given: str, expected: str) -> bool:
        # Bytes: compare_digest raises TypeError on a str holding non-ASCII characters.
        return hmac.compare_digest(given.encode(), expected.encode())

    def page(request: Request, name: str, viewer: Viewer | None, code: int = 200,
             **context: Any) -> HTMLResponse:
        done = request.query_params.get("done", "")
        if done and not matches(request.query_params.get("sig", ""), signature(done)):
            done = ""  # not a redirect of ours: a link's own text is never shown as ours
        html = env.get_template(name).render(
            viewer=viewer, csrf=token(viewer) if viewer else "", root="/ui",
            done=done, path=request.url.path, **context)
        return HTMLResponse(html, code, headers=HEADERS)

    def viewer_of(request: Request) -> Viewer:
        if keys is None:  # the Edge let only this machine's own clients in (cross_site)
            return Viewer(None, "", "open")
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if header and scheme.lower() == "bearer" and key.strip():
            via, key = "bearer", key.strip()
        else:
            via, key = "cookie", request.cookies.get(COOKIE, "")
        if not key:
            raise Refused(401, "Sign in with an api key to see this page.")
        known, users = keys.lookup(key)
        if not known:
            raise Refused(401, "That key is not in the server's api-keys file.")
        return Viewer(users, key, via)

    def for_user(request: Request, user_id: str) -> Viewer:
        viewer = viewer_of(request)
        if not viewer.may(user_id):
            raise Refused(403, f"This key may not see user {user_id!r}.")
        return viewer

    def same_origin(request: Request) -> None:
        # The host decides, not the scheme: behind a proxy that ends TLS the browser says
        # https and this server sees http, and no other site can post under this host.
        expected = request.headers.get("host", "").lower()
        origin = request.headers.get("origin")
        if not origin or origin == "null":
            origin = request.headers.get("referer", "")
        try:
            found = urlsplit(origin).netloc.lower()
        except ValueError:  # no URL ("http://[::1"): no site this server can be
            found = ""
        if not found or found != expected:
            raise Refused(403, f"Cross-site request refused: expected it from {expected}, "
                               f"found {found or 'no origin'}.")

    async def posted(request: Request, viewer: Viewer) -> dict[str, str]:
        form = await request.form()
        fields = {k: v for k, v in form.items() if isinstance(v, str)}
        if viewer.via != "bearer":
            same_origin(request)
            if not matches(fields.get("csrf", ""), token(viewer)):
                raise Refused(403, "This form's token does not match your sign-in (it is from "
                                   "another server run or another key): reload the page and "
                                   "try again.")
        return fields

    def back(url: str, done: str) -> RedirectResponse:
        return RedirectResponse(f"{url}?{urlencode({'done': done, 'sig': signature(done)})}",
                                303)

    def need(fields: Any, name: str) -> str:
        value = fields.get(name, "")
        if not value:
            raise InvalidInput(name, f"expected a {name}, found none")
        return value

    # -- errors: a page with the status, never a traceback ---------------------------------

    @app.exception_handler(Refused)
    async def refused(request: Request, exc: Refused) -> Response:
        response = page(request, "error.html", None, exc.status, status=exc.status,
                        message=str(exc), sign_in=exc.status == 401 and keys is not None)
        if exc.status == 401 and COOKIE in request.cookies:
            # Only a cookie that was sent and refused: a link from another site arrives
            # without the SameSite=Strict cookie, and must not sign the browser out.
            response.delete_cookie(COOKIE, path="/ui")
        return response

    @app.exception_handler(EngineError)
    async def engine_error(request: Request, exc: EngineError) -> Response:
        status = next(STATUS[c.__name__] for c in type(exc).__mro__ if c.__name__ in STATUS)
        return page(request, "error.html", None, status, status=status, message=str(exc),
                    sign_in=False)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        return page(request, "error.html", None, exc.status_code, status=exc.status_code,
                    message=str(exc.detail), sign_in=False)

    # -- sign-in ---------------------------------------------------------------------------

    @app.get("/static/style.css")
    async def style() -> Response:
        return FileResponse(HERE / "static" / "style.css", media_type="text/css",
                            headers={"Cache-Control": "max-age=3600"})

    @app.get("/login")
    async def login_form(request: Request) -> Response:
        return page(request, "error.html", None, 200, status=200, sign_in=True,
                    message="Sign in with an api key from the server's api-keys file.")

    @app.post("/login")
    async def login(request: Request) -> Response:
        same_origin(request)
        form = await request.form()
        key = str(form.get("key", "")).strip()
        known, _ = keys.lookup(key) if keys is not None and key else (False, None)
        if keys is not None and not known:
            raise Refused(401, "That key is not in the server's api-keys file.")
        response = RedirectResponse("/ui/", 303)
        if keys is not None:
            # Secure where the browser is on https, behind a proxy that ends TLS too (the
            # login form's Origin says so; same_origin checked it names this host).
            secure = "https" in (request.url.scheme,
                                 urlsplit(request.headers.get("origin", "")).scheme)
            response.set_cookie(COOKIE, key, httponly=True, samesite="strict", path="/ui",
                                secure=secure)
        return response

    @app.post("/logout")
    async def logout(request: Request) -> Response:
        await posted(request, viewer_of(request))
        response = RedirectResponse("/ui/login", 303)
        response.delete_cookie(COOKIE, path="/ui")
        return response

    # -- users -----------------------------------------------------------------------------

    @app.get("/")
    async def users(request: Request) -> Response:
        viewer = viewer_of(request)
        names = await engine.list_users() if viewer.admin else sorted(viewer.users)
        rows = []
        for user_id in names[:USERS_SHOWN]:
            counts = await engine.memory_stats(user_id)
            rows.append((user_id, len(await engine.list_sessions(user_id)), counts))
        return page(request, "users.html", viewer, users=rows, total=len(names))

    @app.get("/users/{user_id:id}")
    async def timeline(request: Request, user_id: str) -> Response:
        viewer = for_user(request, user_id)
        only = request.query_params.get("session")
        sessions = await engine.list_sessions(user_id)
        hidden = 0
        if only:
            sessions = [s for s in sessions if s.session_id == only]
        else:
            hidden = max(0, len(sessions) - SESSIONS_SHOWN)
            sessions = sessions[:SESSIONS_SHOWN]
        episodes = await engine.episodes(user_id)
        facts = await engine.fact_versions(user_id)
        by_turn: dict[str, list[Fact]] = {}
        for fact in facts:
            for turn_id in fact.source_turn_ids:
                by_turn.setdefault(turn_id, []).append(fact)
        shown = []
        for info in sessions:
            turns = await engine.session_history(user_id, info.session_id, TURNS_SHOWN)
            first = turns[0].seq if turns else 0
            bands = []
            for episode in episodes:
                if episode.session_id != info.session_id or episode.last_seq < first:
                    continue
                start = max(episode.first_seq, first) - first + 1
                end = min(episode.last_seq, first + len(turns) - 1) - first + 2
                bands.append((episode, start, end))
            shown.append((info, turns, bands))
        active = [f for f in facts if f.status == "active"]
        return page(request, "timeline.html", viewer, user_id=user_id, sessions=shown,
                    hidden=hidden, by_turn=by_turn, facts=active, turns_shown=TURNS_SHOWN)

    # -- what it believes ------------------------------------------------------------------

    @app.get("/users/{user_id:id}/memory")
    async def memory(request: Request, user_id: str) -> Response:
        viewer = for_user(request, user_id)
        params = request.query_params
        versions = await engine.fact_versions(user_id)
        groups: dict[tuple[str, str], list[Fact]] = {}
        for fact in versions:
            groups.setdefault((fact.category, fact.key), []).append(fact)
        history = []
        for (category, key), facts in groups.items():
            rows = []
            for i, fact in enumerate(facts):
                after = facts[i + 1] if i + 1 < len(facts) else None
                rows.append((fact, after))
            history.append((category, key, rows))
        all_notes = await engine.list_notes(user_id)
        note_filter = {"importance": _fraction(params, "note_importance"),
                       "emotion": " ".join(composed(params.get("note_emotion", "")).split()
                                           ).lower(),
                       "category": folded(params.get("note_category", ""))}
        notes = [n for n in all_notes
                 if (note_filter["importance"] is None or n.importance >= note_filter["importance"])
                 and (not note_filter["emotion"] or n.emotion == note_filter["emotion"])
                 and (not note_filter["category"]
                      or folded(n.category) == note_filter["category"])
                 ][:NOTES_SHOWN]
        note_links = {n.note_id: len(await engine.links(user_id, n.note_id)) for n in notes}
        entities = (await engine.list_entities(user_id))[:ENTITIES_SHOWN]
        node = params.get("node", "")
        depth = _int(params, "depth", 1, 0, MAX_DEPTH)
        graph: Graph | None = None
        if node:
            graph = await neighbourhood(engine, user_id, node, depth)
        entity = params.get("entity", "")
        mentions = await engine.entity_info(user_id, entity) if entity else None
        return page(request, "memory.html", viewer, user_id=user_id, history=history,
                    notes=notes, note_count=len(all_notes), note_filter=note_filter,
                    emotions=sorted({n.emotion for n in all_notes} - {""}),
                    # categories as the engine tells them apart: case and spacing aside
                    categories=sorted({folded(n.category) for n in all_notes} - {""}),
                    note_links=note_links, entities=entities, node=node,
                    depth=depth, max_depth=MAX_DEPTH, graph=graph, entity=entity,
                    mentions=mentions)

    # -- why this hit ----------------------------------------------------------------------

    @app.get("/users/{user_id:id}/why")
    async def why(request: Request, user_id: str) -> Response:
        viewer = for_user(request, user_id)
        params = request.query_params
        query = params.get("q", "")
        asked = params.get("run") == "1"
        legs = [leg for leg in params.getlist("legs") if leg in LEGS] if asked else list(LEGS)
        kinds = [k for k in params.getlist("kinds") if k in KINDS]
        roles = [r for r in params.getlist("roles") if r in ROLES]
        form = {"q": query, "limit": params.get("limit", ""), "session": params.get("session", ""),
                "link_depth": params.get("link_depth", ""), "budget": params.get("budget", ""),
                "episodic": params.get("episodic", "")}
        hits = markdown = None
        tokens = 0
        if query:
            if not legs:
                raise InvalidInput("legs", "expected at least one search leg ticked, found none")
            limit = _int(params, "limit", 10, 1, 1000)
            hits = await engine.recall(
                user_id, query, limit, legs=legs, kinds=kinds or None, roles=roles or None,
                session_id=form["session"] or None,
                link_depth=_int(params, "link_depth", None, 0, 5),
                budget_tokens=_int(params, "budget", None, 1, 1_000_000))
            markdown = await engine.retrieve_memory(
                user_id, query, episodic_limit=_int(params, "episodic", 5, 1, 100), legs=legs,
                record=False)  # looking is not using: no review to rate, no decay restarted
            tokens = estimate_tokens(markdown)
        return page(request, "why.html", viewer, user_id=user_id, form=form, legs=legs,
                    all_legs=LEGS, kinds=kinds, all_kinds=KINDS, roles=roles, all_roles=ROLES,
                    hits=hits, markdown=markdown, tokens=tokens)

    # -- operator view ---------------------------------------------------------------------

    def admin_of(request: Request) -> Viewer:
        viewer = viewer_of(request)
        if not viewer.admin:
            raise Refused(403, "The operator view needs an admin key ('<key> *').")
        return viewer

    @app.get("/operator")
    async def operator(request: Request) -> Response:
        viewer = admin_of(request)
        stats = await engine.stats()
        failures = await engine.failures()
        return page(request, "operator.html", viewer, stats=stats,
                    fulltext_lag=max(0, stats.committed_lsn - stats.indexed_lsn),
                    failures=failures[:FAILURES_SHOWN], failure_count=len(failures),
                    integrity=journal.integrity, snapshots=list(reversed(journal.snapshots)),
                    store=str(engine.path))

    @app.post("/operator/verify")
    async def verify(request: Request) -> Response:
        viewer = admin_of(request)
        await posted(request, viewer)
        report = await _verify(engine.path)
        journal.integrity = (datetime.now(timezone.utc), report)
        return back("/ui/operator", "integrity check: " + ("ok" if report["ok"] else
                                                           f"{report['problem_count']} problems"))

    @app.post("/operator/snapshot")
    async def snapshot(request: Request) -> Response:
        viewer = admin_of(request)
        dest = server_path("dest", need(await posted(request, viewer), "dest"))
        manifest = await engine.snapshot(dest)
        journal.snapshot_taken(dest, manifest)
        return back("/ui/operator", f"snapshot taken at lsn {manifest.lsn} in {dest}")

    # -- actions: a confirmation page (GET), then the POST ---------------------------------

    async def fact_now(user_id: str, category: str, key: str) -> Fact:
        for fact in await engine.profile(user_id):
            if fact.category == category and fact.key == key:
                return fact
        raise Refused(404, f"User {user_id!r} has no active fact {category}/{key}.")

    def action_fields(given: Any) -> dict[str, str]:
        """An action's fields as a page's form sent them: those it carries percent-encoded in
        one ``fields`` field (ids and keys, whose line breaks a browser would send as CR LF,
        naming something else) and the rest as typed."""
        fields = {name: value for name, value in given.items() if name not in ("fields", "csrf")}
        fields.update(parse_qsl(given.get("fields", ""), keep_blank_values=True))
        return fields

    async def describe(user_id: str, action: str, fields: Any) -> tuple[str, str, dict]:
        """(question, button, hidden fields) of an action, or Refused for an unknown one."""
        if action == "forget-session":
            session = need(fields, "session")
            if not await engine.session_history(user_id, session, limit=1):
                raise Refused(404, f"User {user_id!r} has no session {session!r}.")
            return (f"Forget session {session!r} of {user_id!r}: every turn, its episodes and "
                    "the facts taken from it, from the store, the indexes and later snapshots?",
                    "Forget this session", {"session": session})
        if action == "forget-user":
            return (f"Forget user {user_id!r}: every session, fact, note and entity?",
                    "Forget this user", {})
        if action == "correct-fact":
            category, key, value = need(fields, "category"), need(fields, "key"), need(
                fields, "value")
            old = await fact_now(user_id, category, key)
            return (f"Correct {category}/{key} of {user_id!r} from {old.value!r} to {value!r}? "
                    "The old value stays in the history, struck through.",
                    "Correct this fact", {"category": category, "key": key, "value": value})
        if action == "confirm-fact":
            category, key = need(fields, "category"), need(fields, "key")
            old = await fact_now(user_id, category, key)
            return (f"Confirm {category}/{key} = {old.value!r} for {user_id!r}? A confirmed "
                    "fact never decays.", "Confirm this fact", {"category": category, "key": key})
        if action == "delete-note":
            note_id = need(fields, "note")
            note = await engine.get_note(user_id, note_id)
            if note is None:
                raise Refused(404, f"User {user_id!r} has no note {note_id!r}.")
            return (f"Delete note {note_id!r} of {user_id!r} ({note.text[:80]!r})?",
                    "Delete this note", {"note": note_id})
        raise Refused(404, f"There is no action {action!r}.")

    async def act(user_id: str, action: str, fields: dict[str, str]) -> RedirectResponse:
        here = f"/ui/users/{quote(user_id, safe='')}"
        if action == "forget-session":
            await engine.forget_session(user_id, fields["session"])
            return back(here, f"forgot session {fields['session']}")
        if action == "forget-user":
            await engine.forget_user(user_id)
            return back("/ui/", f"forgot user {user_id}")
        if action == "correct-fact":
            await engine.correct_fact(user_id, fields["category"], fields["key"],
                                      fields["value"])
            return back(here + "/memory", f"corrected {fields['category']}/{fields['key']}")
        if action == "confirm-fact":
            await engine.confirm_fact(user_id, fields["category"], fields["key"])
            return back(here + "/memory", f"confirmed {fields['category']}/{fields['key']}")
        if not await engine.delete_note(user_id, fields["note"]):
            raise Refused(404, f"User {user_id!r} has no note {fields['note']!r}.")
        return back(here + "/memory", f"deleted note {fields['note']}")

    @app.get("/users/{user_id:id}/do/{action:id}")
    async def confirm(request: Request, user_id: str, action: str) -> Response:
        viewer = for_user(request, user_id)
        question, button, hidden = await describe(user_id, action,
                                                  action_fields(request.query_params))
        return page(request, "confirm.html", viewer, user_id=user_id, action=action,
                    question=question, button=button, fields=urlencode(hidden))

    @app.post("/users/{user_id:id}/do/{action:id}")
    async def do(request: Request, user_id: str, action: str) -> Response:
        viewer = for_user(request, user_id)
        fields = action_fields(await posted(request, viewer))
        _, _, hidden = await describe(user_id, action, fields)
        return await act(user_id, action, hidden)

    return app

