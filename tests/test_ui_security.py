"""The inspector (engine/ui) against a hostile browser or web page: forged form tokens, links
from other sites, status messages a link could plant, and pages open without keys reached
under another site's name (DNS rebinding)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from engine import Engine
from engine._server import ApiKeys, create_app, load_api_keys

from .test_ui import ADMIN_KEY, ANA_KEY, browser, csrf_of, seed

SPOOF = "Your key expired: sign in again at https://evil.example"


@pytest.fixture
def keys(tmp_path: Path) -> ApiKeys:
    path = tmp_path / "keys"
    path.write_text(f"{ANA_KEY} ana\n{ADMIN_KEY} *\n")
    return load_api_keys(path)


async def test_a_form_token_that_is_not_ascii_is_refused_not_a_crash(mem, keys) -> None:
    """A signed-in POST whose token holds a non-ASCII character gets the 403 page, as any
    wrong token does, and forgets nothing (comparing it must not raise)."""
    await seed(mem)
    app = create_app(mem, keys)
    async with browser(app, origin="http://127.0.0.1") as http:
        await http.post("/ui/login", data={"key": ANA_KEY})
        response = await http.post("/ui/users/ana/do/forget-session",
                                   data={"session": "s1", "csrf": "é" * 64})
        assert response.status_code == 403 and "token does not match" in response.text
    assert [s.session_id for s in await mem.list_sessions("ana")] == ["s2", "s1"]


async def test_a_page_opened_without_the_cookie_keeps_the_sign_in(mem, keys) -> None:
    """A link from another site arrives without the SameSite=Strict cookie: its 401 page must
    not clear that cookie (any site could sign the operator out); an unknown cookie is
    cleared."""
    app = create_app(mem, keys)
    async with browser(app) as anon:
        response = await anon.get("/ui/users/ana")
        assert response.status_code == 401 and "set-cookie" not in response.headers
    async with browser(app, cookie="engram_key=stale-key") as stale:
        response = await stale.get("/ui/users/ana")
        assert response.status_code == 401
        assert 'engram_key=""' in response.headers["set-cookie"]
        assert "max-age=0" in response.headers["set-cookie"].lower()


async def test_a_status_message_shows_only_when_this_server_wrote_it(mem, keys) -> None:
    """The green "done" line after an action is shown from the redirect this server made; a
    link carrying its own ``done=`` text (a phishing line above the sign-in form) shows
    nothing."""
    await seed(mem)
    app = create_app(mem, keys)
    async with browser(app) as anon, browser(app, ADMIN_KEY) as admin:
        for url in ("/ui/login", "/ui/users/ana"):
            page = await anon.get(url, params={"done": SPOOF})
            assert "evil.example" not in page.text, url
        page = await admin.get("/ui/users/ana", params={"done": SPOOF, "sig": "0" * 64})
        assert page.status_code == 200 and "evil.example" not in page.text
        done = await admin.post("/ui/users/ana/do/forget-session", data={"session": "s1"})
        assert done.status_code == 303
        page = await admin.get(done.headers["location"])
        assert 'class="done"' in page.text and "forgot session s1" in page.text


@pytest.mark.parametrize("host", ["127.0.0.1:8080", "localhost:8080", "[::1]:8080"])
async def test_open_pages_answer_at_a_loopback_host(mem: Engine, host: str) -> None:
    """Without an api-keys file the pages are open to the loopback host they are served on."""
    await mem.add_turn("ana", "s1", "user", "I live in Lisbon with my dog Pixel")
    async with browser(create_app(mem)) as http:
        page = await http.get("/ui/users/ana", headers={"host": host})
        assert page.status_code == 200 and "dog Pixel" in page.text


async def test_open_pages_refuse_another_host_name(mem: Engine) -> None:
    """Without an api-keys file a page reached under another name (a web page whose domain
    was rebound to 127.0.0.1, so its scripts are same-origin with the inspector) is refused:
    it can neither read a user's memories nor take the form token and forget them."""
    await seed(mem)
    rebound = "http://rebound.evil.example:8080"
    app = create_app(mem)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=rebound,
                                 headers={"origin": rebound}) as evil:
        for url in ("/ui/", "/ui/users/bo", "/ui/users/ana/memory", "/ui/operator",
                    "/ui/users/bo/do/forget-user"):
            page = await evil.get(url)
            assert page.status_code == 403 and "bo&#39;s own" not in page.text, url
            assert "loopback" in page.text
        forged = await evil.post("/ui/users/bo/do/forget-user", data={"csrf": "0" * 64})
        assert forged.status_code == 403
    assert await mem.list_sessions("bo")
    async with browser(app, host="127.0.0.1:8080") as local:
        assert csrf_of((await local.get("/ui/users/bo/do/forget-user")).text)


async def test_a_sign_in_behind_a_tls_proxy_can_act(mem, keys) -> None:
    """Behind a proxy that ends TLS the browser's Origin says https while the server sees
    http: the same host is the same site, so a signed-in operator's forms work there; a page
    of another host still cannot post them."""
    await seed(mem)
    app = create_app(mem, keys)
    async with browser(app, origin="https://127.0.0.1") as http:
        signed_in = await http.post("/ui/login", data={"key": ANA_KEY})
        assert signed_in.status_code == 303
        assert "secure" in signed_in.headers["set-cookie"].lower()  # the browser is on https
    # The browser sends the cookie back over https; the server behind the proxy sees http.
    async with browser(app, origin="https://127.0.0.1", cookie=f"engram_key={ANA_KEY}") as http:
        csrf = csrf_of((await http.get("/ui/users/ana/do/forget-session",
                                       params={"session": "s1"})).text)
        done = await http.post("/ui/users/ana/do/forget-session",
                               data={"session": "s1", "csrf": csrf})
        assert done.status_code == 303, done.text
        forged = await http.post("/ui/users/ana/do/forget-session",
                                 data={"session": "s2", "csrf": csrf},
                                 headers={"origin": "https://evil.example"})
        assert forged.status_code == 403
        # An origin or referer that is no URL at all is another site too, not a 500.
        for header in ({"origin": "http://[::1"}, {"origin": "null", "referer": "http://[x/"}):
            malformed = await http.post("/ui/users/ana/do/forget-session",
                                        data={"session": "s2", "csrf": csrf}, headers=header)
            assert malformed.status_code == 403, header
    async with browser(app, origin="http://[::1") as http:
        assert (await http.post("/ui/login", data={"key": ANA_KEY})).status_code == 403
    assert [s.session_id for s in await mem.list_sessions("ana")] == ["s2"]
