"""The inspector's pages (engine/ui) over the ASGI app: the API's keys, sign-in by cookie,
cross-site protection of every action, escaping, and what each page shows."""

from __future__ import annotations

import hashlib
import re
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from engine import Engine, InvalidInput
from engine._server import create_app, load_api_keys

from .conftest import open_engine, raw_databases

ANA_KEY, BO_KEY, ADMIN_KEY = "ana-secret", "bo-secret", "admin-secret"
HOSTILE = "<script>alert('boo')</script> & <b>bold</b>"


@pytest.fixture
async def engine(store_path, clock) -> AsyncIterator[Engine]:
    async with open_engine(store_path, clock=clock) as mem:
        yield mem


@pytest.fixture
def keys(tmp_path: Path):
    path = tmp_path / "keys"
    hashed = hashlib.sha256(BO_KEY.encode()).hexdigest()
    path.write_text(f"{ANA_KEY} ana\nsha256:{hashed} bo\n{ADMIN_KEY} *\n")
    return load_api_keys(path)


def browser(app, key: str | None = None, **headers: str) -> httpx.AsyncClient:
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1",
                             headers=headers)


def csrf_of(html: str) -> str:
    return re.search(r'name="csrf" value="([0-9a-f]+)"', html).group(1)


async def seed(mem: Engine) -> dict[str, str]:
    """Two users; ana with a hostile turn, a closed session (an episode), facts, a note."""
    first = await mem.add_turn("ana", "s1", "user", "I live in Lisbon with my dog Pixel")
    await mem.add_turn("ana", "s1", "user", HOSTILE)
    for i in range(6):
        await mem.add_turn("ana", "s2", "user", f"practising the piano, scale {i}")
    await mem.close_session("ana", "s2")
    await mem.add_turn("bo", "b1", "user", "bo's own secret turn")
    note = await mem.store_note("ana", "likes jazz", tags=["music"])
    await mem.link("ana", note.note_id, first.turn_id, "about")
    await mem.remember_fact("ana", "preference", "drink", "tea")
    await mem.correct_fact("ana", "preference", "drink", "coffee")
    await mem.flush()
    return {"turn": first.turn_id, "note": note.note_id}


async def test_no_key_is_401_with_sign_in_another_users_key_403_and_admin_sees_all(
        engine, keys) -> None:
    """Every page needs a key the API would accept: none (or an unknown one) gets 401 and the
    sign-in form; another user's key 403; a user key sees only its users; the operator view
    is the admin key's."""
    await seed(engine)
    app = create_app(engine, keys)
    pages = ["/ui/", "/ui/users/ana", "/ui/users/ana/memory", "/ui/users/ana/why?q=dog",
             "/ui/operator", "/ui/users/ana/do/forget-user"]
    async with browser(app) as anon, browser(app, "nope") as stranger, \
            browser(app, BO_KEY) as bo, browser(app, ANA_KEY) as ana, \
            browser(app, ADMIN_KEY) as admin:
        for url in pages:
            for who in (anon, stranger):
                response = await who.get(url)
                assert response.status_code == 401, url
                assert 'action="/ui/login"' in response.text and "bo&#39;s own" not in response.text
            if url != "/ui/":
                assert (await bo.get(url)).status_code == 403, url
        for url in pages[1:4]:
            page = await ana.get(url)
            assert page.status_code == 200, url
            assert "bo&#39;s own secret" not in page.text
        assert "/ui/users/bo" not in (await ana.get("/ui/")).text
        assert "/ui/users/ana" not in (await bo.get("/ui/")).text
        listing = (await admin.get("/ui/")).text
        assert "/ui/users/ana" in listing and "/ui/users/bo" in listing
        assert (await ana.get("/ui/operator")).status_code == 403
        assert "Failed records held aside" in (await admin.get("/ui/operator")).text
        page = await admin.get("/ui/users/ana")
        assert page.headers["content-security-policy"].startswith("default-src 'none'")
        assert page.headers["cache-control"] == "no-store"


async def test_sign_in_keeps_the_key_in_an_httponly_samesite_cookie(engine, keys) -> None:
    """The sign-in form sets an HttpOnly, SameSite=Strict cookie scoped to /ui that opens the
    pages; an unknown key is refused; signing out clears it."""
    await seed(engine)
    app = create_app(engine, keys)
    async with browser(app, origin="http://127.0.0.1") as http:
        refused = await http.post("/ui/login", data={"key": "nope"})
        assert refused.status_code == 401 and "not in the server" in refused.text
        signed = await http.post("/ui/login", data={"key": ANA_KEY})
        assert signed.status_code == 303 and signed.headers["location"] == "/ui/"
        cookie = signed.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie and "path=/ui" in cookie
        timeline = await http.get("/ui/users/ana")
        assert timeline.status_code == 200
        assert (await http.get("/ui/users/bo")).status_code == 403
        out = await http.post("/ui/logout", data={"csrf": csrf_of(timeline.text)})
        assert out.status_code == 303
        assert (await http.get("/ui/users/ana")).status_code == 401
    async with browser(app, origin="http://evil.example") as evil:
        assert (await evil.post("/ui/login", data={"key": ANA_KEY})).status_code == 403


async def test_actions_need_a_confirmation_the_forms_token_and_this_origin(engine, keys) -> None:
    """A cookie-authenticated POST without the form's token, or from another origin, changes
    nothing (403); with both it forgets the session, which then is gone from every page."""
    await seed(engine)
    app = create_app(engine, keys)
    async with browser(app, origin="http://127.0.0.1") as http:
        await http.post("/ui/login", data={"key": ANA_KEY})
        confirm = await http.get("/ui/users/ana/do/forget-session", params={"session": "s1"})
        assert confirm.status_code == 200 and "Forget session &#39;s1&#39;" in confirm.text
        token = csrf_of(confirm.text)
        url = "/ui/users/ana/do/forget-session"
        assert (await http.post(url, data={"session": "s1"})).status_code == 403
        assert (await http.post(url, data={"session": "s1", "csrf": "0" * 64})).status_code == 403
        cross = await http.post(url, data={"session": "s1", "csrf": token},
                                headers={"origin": "http://evil.example"})
        assert cross.status_code == 403 and "Cross-site" in cross.text
        assert [s.session_id for s in await engine.list_sessions("ana")] == ["s2", "s1"]
        done = await http.post(url, data={"session": "s1", "csrf": token})
        assert done.status_code == 303 and done.headers["location"].startswith("/ui/users/ana?")
        assert [s.session_id for s in await engine.list_sessions("ana")] == ["s2"]
        page = await http.get(done.headers["location"])
        assert "forgot session s1" in page.text and "dog Pixel" not in page.text
    async with browser(app, BO_KEY) as bo:  # a Bearer key needs no token, but its own user
        assert (await bo.post("/ui/users/ana/do/forget-user")).status_code == 403
        assert await engine.list_sessions("ana")


async def test_correct_confirm_and_delete_through_the_pages(engine, keys) -> None:
    """Correcting and confirming a fact and deleting a note go through the engine: the old
    value shows struck through with what changed it; the note is gone."""
    ids = await seed(engine)
    app = create_app(engine, keys)
    async with browser(app, ADMIN_KEY) as admin:
        memory = (await admin.get("/ui/users/ana/memory")).text
        assert "<s>tea</s>" in memory and "<strong>coffee</strong>" in memory
        fields = {"category": "preference", "key": "drink", "value": "matcha"}
        asked = await admin.get("/ui/users/ana/do/correct-fact", params=fields)
        assert "from &#39;coffee&#39; to &#39;matcha&#39;" in asked.text
        assert (await admin.post("/ui/users/ana/do/correct-fact", data=fields)).status_code == 303
        assert (await admin.post("/ui/users/ana/do/confirm-fact",
                                 data={"category": "preference", "key": "drink"})
                ).status_code == 303
        [fact] = [f for f in await engine.profile("ana") if f.key == "drink"]
        assert (fact.value, fact.protected) == ("matcha", True)
        memory = (await admin.get("/ui/users/ana/memory")).text
        assert "<s>coffee</s>" in memory and "confirmed" in memory
        graph = (await admin.get("/ui/users/ana/memory",
                                 params={"node": ids["note"], "depth": 1})).text
        assert "<svg" in graph and ">about<" in graph and ids["turn"] in graph
        assert "I live in Lisbon with my dog Pixel" in graph  # the turn's text labels it
        assert (await admin.post("/ui/users/ana/do/delete-note",
                                 data={"note": ids["note"]})).status_code == 303
        assert await engine.get_note("ana", ids["note"]) is None
        missing = await admin.get("/ui/users/ana/do/delete-note", params={"note": ids["note"]})
        assert missing.status_code == 404


async def test_pages_escape_user_text_and_show_why_a_memory_was_recalled(engine, keys) -> None:
    """A turn holding markup is shown as text on every page; the query page shows each hit's
    rank per leg, fused score, FSRS factor and the Markdown a bot gets with its token count;
    switching a leg off changes the ranks shown."""
    await seed(engine)
    app = create_app(engine, keys)
    async with browser(app, ANA_KEY) as ana:
        for url in ("/ui/users/ana", "/ui/users/ana/why?q=script+alert+boo"):
            html = (await ana.get(url)).text
            assert "<script>" not in html and "<b>bold</b>" not in html
            assert "&lt;script&gt;alert(&#39;boo&#39;)&lt;/script&gt; &amp; &lt;b&gt;" in html
        timeline = (await ana.get("/ui/users/ana")).text
        assert 'class="band"' in timeline and "grid-row: 1 / 7" in timeline
        why = (await ana.get("/ui/users/ana/why", params={"q": "where is the dog Pixel",
                                                          "kinds": "turn"})).text
        row = why.split("dog Pixel</a>")[1].split("</tr>")[0]
        ranks = re.findall(r'data-leg="(\w+)">([^<]*)<', row)
        assert dict(ranks)["bm25"] == "1" and dict(ranks)["vector"].isdigit()
        assert re.search(r"(\d+) tokens", why) and "## " in why
        bm25_only = (await ana.get("/ui/users/ana/why", params=[
            ("q", "where is the dog Pixel"), ("run", "1"), ("legs", "bm25"), ("kinds", "turn")])).text
        row = bm25_only.split("dog Pixel</a>")[1].split("</tr>")[0]
        assert dict(re.findall(r'data-leg="(\w+)">([^<]*)<', row))["vector"] == "—"
        # The Markdown follows the legs too: BM25 alone cannot find a turn by its meaning.
        pages = {leg: (await ana.get("/ui/users/ana/why", params=[
            ("q", "my pet"), ("run", "1"), ("legs", leg)])).text for leg in ("vector", "bm25")}
        markdown = {leg: re.search(r'<pre class="markdown">(.*?)</pre>', page, re.S).group(1)
                    for leg, page in pages.items()}
        assert "dog Pixel" in markdown["vector"] and "dog Pixel" not in markdown["bm25"]
        assert "(bm25 only" in pages["bm25"]
        bad = await ana.get("/ui/users/ana/why", params={"q": "dog", "limit": "lots"})
        assert bad.status_code == 422 and "limit: expected an integer" in bad.text


async def test_looking_at_why_a_memory_was_recalled_is_not_a_use(store_path, clock, keys) -> None:
    """The query page shows the Markdown a bot would get, but an operator looking is not the
    bot using it: the facts shown keep their decay (no access counted) and no pending review
    is recorded, so nothing a later turn rates comes from the inspector."""
    async with open_engine(store_path, clock=clock) as mem:
        await seed(mem)
        before = {f.fact_id: f.access_count for f in await mem.profile("ana")}
        app = create_app(mem, keys)
        async with browser(app, ANA_KEY) as ana:
            why = await ana.get("/ui/users/ana/why", params={"q": "what does ana drink, piano"})
        assert why.status_code == 200 and "coffee" in why.text and "piano" in why.text
        assert "Looking is not using" in why.text  # the page says so, not the opposite
        await mem.flush()
        assert {f.fact_id: f.access_count for f in await mem.profile("ana")} == before
        with pytest.raises(InvalidInput, match="record: expected True or False, found 'no'"):
            await mem.retrieve_memory("ana", "piano", record="no")
    assert raw_databases(store_path)["pending"] == []


async def test_operator_view_runs_the_integrity_check_and_lists_snapshots(
        engine, keys, tmp_path, monkeypatch) -> None:
    """The operator view shows counts and lag, runs the integrity check on the served store,
    and lists snapshots taken through the pages and through the API."""
    await seed(engine)
    app = create_app(engine, keys)
    async with browser(app, ADMIN_KEY) as admin:
        page = (await admin.get("/ui/operator")).text
        assert "Not run since this server started" in page and "text index lag" in page
        checked = await admin.post("/ui/operator/verify")
        assert checked.status_code == 303 and "integrity+check%3A+ok" in checked.headers[
            "location"]
        assert await admin.post("/v1/snapshot", json={"dest": str(tmp_path / "api")})
        assert (await admin.post("/ui/operator/snapshot",
                                 data={"dest": str(tmp_path / "ui")})).status_code == 303
        page = (await admin.get("/ui/operator")).text
        assert "<strong>ok</strong>" in page
        assert str(tmp_path / "api") in page and str(tmp_path / "ui") in page
        # A relative path would land in the server's working directory: refused by the page
        # as by the API, and nothing written.
        monkeypatch.chdir(tmp_path)
        for refused in (await admin.post("/ui/operator/snapshot", data={"dest": "rel"}),
                        await admin.post("/v1/snapshot", json={"dest": "rel"})):
            assert refused.status_code == 422 and "absolute path" in refused.text
        assert not (tmp_path / "rel").exists()


async def test_ids_holding_slashes_open_every_page_and_action(engine, tmp_path) -> None:
    """A user, session and note whose ids hold '/' (and '%') are linked as one encoded segment
    and open: the users list links the timeline, the memory and query pages show the user's
    own memories, and forgetting the session and deleting the note act on those ids only."""
    user, session, note_id = "team/alice", "chat/1%", "n/1"
    path = tmp_path / "keys"
    path.write_text(f"alice-key {user}\n{ADMIN_KEY} *\n")
    app = create_app(engine, load_api_keys(path))
    await engine.add_turn(user, session, "user", "my dog Pixel loves the beach")
    await engine.add_turn(user, "other", "user", "the other session stays")
    await engine.add_turn("team", "s1", "user", "team's own turn")
    await engine.store_note(user, "likes jazz", note_id=note_id)
    await engine.flush()
    home = "/ui/users/team%2Falice"
    async with browser(app, ADMIN_KEY) as admin, browser(app, "alice-key") as alice:
        assert f'href="{home}"' in (await admin.get("/ui/")).text
        timeline = await alice.get(home)
        assert timeline.status_code == 200, timeline.text
        assert "my dog Pixel" in timeline.text and "team&#39;s own" not in timeline.text
        assert "/do/forget-session?session=chat%2F1%25" in timeline.text
        assert (await alice.get("/ui/users/team")).status_code == 403
        memory = (await alice.get(f"{home}/memory")).text
        assert "likes jazz" in memory and "?note=n%2F1" in memory
        why = await alice.get(f"{home}/why", params={"q": "dog Pixel"})
        assert why.status_code == 200 and "my dog Pixel" in why.text
        asked = await alice.get(f"{home}/do/forget-session", params={"session": session})
        assert f'action="{home}/do/forget-session"' in asked.text
        done = await alice.post(f"{home}/do/forget-session", data={"session": session})
        assert done.status_code == 303 and done.headers["location"].startswith(f"{home}?")
        assert [s.session_id for s in await engine.list_sessions(user)] == ["other"]
        assert (await alice.post(f"{home}/do/delete-note", data={"note": note_id})
                ).status_code == 303
        assert await engine.get_note(user, note_id) is None
        assert [s.session_id for s in await engine.list_sessions("team")] == ["s1"]


def submitted(html: str) -> dict[str, str]:
    """The confirmation form's fields as a browser submits them: HTML unescaped, and line
    breaks in values turned into CR LF (the form's data set normalises them)."""
    import html as markup

    fields = re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">', html)
    return {name: re.sub(r"\r\n|\r|\n", "\r\n", markup.unescape(value))
            for name, value in fields}


async def test_ids_holding_line_breaks_survive_the_confirmation_form(engine, keys) -> None:
    """A session, note or fact key holding a line break reaches the action as it was asked
    about, though a browser sends the form's line breaks as CR LF: the session is forgotten,
    the note deleted, the fact confirmed and corrected from the memory page's form; and an action on a session that is not there says
    so (404) instead of reporting a forget that did nothing."""
    session, note_id, key = "chat\n42", "note\nA", "drink\nat night"
    await engine.add_turn("ana", session, "user", "my secret diary entry")
    await engine.add_turn("ana", "other", "user", "the other session stays")
    await engine.store_note("ana", "a private note", note_id=note_id)
    await engine.remember_fact("ana", "preference", key, "tea")
    await engine.flush()
    app = create_app(engine, keys)
    home = "/ui/users/ana"
    async with browser(app, origin="http://127.0.0.1") as http:
        await http.post("/ui/login", data={"key": ANA_KEY})
        memory = (await http.get(f"{home}/memory")).text
        form = memory.split('/do/correct-fact"')[1].split("</form>")[0]
        asked = await http.get(f"{home}/do/correct-fact", params={**submitted(form),
                                                                   "value": "coffee"})
        assert asked.status_code == 200, asked.text
        done = await http.post(f"{home}/do/correct-fact", data=submitted(asked.text))
        assert done.status_code == 303, done.text
        for action, params in (("forget-session", {"session": session}),
                               ("delete-note", {"note": note_id}),
                               ("confirm-fact", {"category": "preference", "key": key})):
            asked = await http.get(f"{home}/do/{action}", params=params)
            assert asked.status_code == 200, asked.text
            done = await http.post(f"{home}/do/{action}", data=submitted(asked.text))
            assert done.status_code == 303, (action, done.text)
        assert [s.session_id for s in await engine.list_sessions("ana")] == ["other"]
        assert await engine.get_note("ana", note_id) is None
        [fact] = [f for f in await engine.profile("ana") if f.key == key]
        assert fact.protected and fact.value == "coffee"
        missing = await http.get(f"{home}/do/forget-session", params={"session": "no-such"})
        assert missing.status_code == 404 and "no session" in missing.text
        token = csrf_of((await http.get(home)).text)
        gone = await http.post(f"{home}/do/forget-session",
                               data={"session": session, "csrf": token})
        assert gone.status_code == 404 and "forgot" not in gone.text


async def test_notes_show_importance_emotion_and_category_and_filter_by_them(
        engine, keys) -> None:
    """The memory page shows each note's importance, emotion and category, and keeps only the
    notes at or above an importance, with an emotion or in a category when asked; a bad
    importance is a 422 naming the field."""
    await engine.store_note("ana", "loves the sea at Cascais", importance=0.9, emotion="joy",
                            category="travel")
    await engine.store_note("ana", "afraid of flying", importance=0.3, emotion="fear",
                            category=" Travel")
    await engine.store_note("ana", "plays the piano", category="music  lessons")
    app = create_app(engine, keys)
    async with browser(app, ANA_KEY) as ana:
        page = (await ana.get("/ui/users/ana/memory")).text
        notes = page.split('id="notes"')[1].split("</section>")[0]
        row = notes.split("loves the sea")[1].split("</li>")[0]
        assert "importance 0.90" in row and ">joy<" in row and ">travel<" in row
        assert "importance 0.50" in notes.split("plays the piano")[1].split("</li>")[0]

        async def shown(**params: str) -> set[str]:
            html = (await ana.get("/ui/users/ana/memory", params=params)).text
            section = html.split('id="notes"')[1].split("</section>")[0]
            return {text for text in ("loves the sea", "afraid of flying", "plays the piano")
                    if text in section}

        assert await shown() == {"loves the sea", "afraid of flying", "plays the piano"}
        assert await shown(note_importance="0.5") == {"loves the sea", "plays the piano"}
        assert await shown(note_emotion="fear") == {"afraid of flying"}
        assert await shown(note_category="travel", note_importance="0.6") == {"loves the sea"}
        # A category is told apart as the engine tells it everywhere (case and spacing aside):
        # one option for "travel" and " Travel", and what the browser sends finds both.
        options = re.findall(r"<option>([^<]*)</option>",
                             page.split('name="note_category"')[1].split("</select>")[0])
        assert options == ["music lessons", "travel"]
        assert await shown(note_category="travel") == {"loves the sea", "afraid of flying"}
        assert await shown(note_category="Music lessons") == {"plays the piano"}
        bad = await ana.get("/ui/users/ana/memory", params={"note_importance": "lots"})
        assert bad.status_code == 422 and "note_importance" in bad.text
