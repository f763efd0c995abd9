"""The inspector in a real headless Chromium against a live ``engram-trio serve`` process on
a loopback socket: the timeline, why-this-hit, forgetting a session, another user's key, a
hostile turn. Screenshots of each page go to tests/output/browser/ (not committed).

Debian's ``chromium`` and ``chromium-driver`` (one source package, so the driver always
matches the browser), driven by Selenium; nothing is downloaded at test time. Without them
the module skips with the line that installs them.
"""

from __future__ import annotations

import hashlib
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
if CHROMIUM is None or DRIVER is None:
    pytest.skip("browser tests need Debian's chromium: "
                "apt-get install -y chromium chromium-driver", allow_module_level=True)

from selenium import webdriver  # noqa: E402 (only once the browser is known to be there)
from selenium.common.exceptions import NoAlertPresentException  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support import expected_conditions as ec  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

ANA_KEY, BO_KEY, ADMIN_KEY = "ana-browser-key", "bo-browser-key", "admin-browser-key"
HOSTILE = "<script>document.title='pwned'</script><img src=x onerror=alert(1)> hi"
OUTPUT = Path(__file__).parent / "output" / "browser"
WAIT = 20  # seconds a page may take on a loaded 2-core machine before a test fails
START = 90  # seconds `serve` may take to load the model and answer /healthz


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[str]:
    """A live `engram-trio serve` process with three keys and two users' memories."""
    root = tmp_path_factory.mktemp("served")
    keys = root / "keys"
    hashed = hashlib.sha256(BO_KEY.encode()).hexdigest()
    keys.write_text(f"{ANA_KEY} ana\nsha256:{hashed} bo\n{ADMIN_KEY} *\n")
    port = _free_port()
    log = (root / "serve.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "engine", "serve", str(root / "store"), "--port", str(port),
         "--api-keys", str(keys)], stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START
        while True:
            try:
                if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"serve did not start: {(root / 'serve.log').read_text()}")
            time.sleep(0.2)
        _seed(base)
        yield base
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def _seed(base: str) -> None:
    """ana: a session about her dog, a closed session (an episode), facts from her turns and
    one corrected, a note linked to a turn, a session with a hostile turn; bo: one turn."""
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                      timeout=30) as http:
        def turn(user: str, session: str, role: str, text: str) -> str:
            response = http.post(f"/v1/users/{user}/sessions/{session}/turns",
                                 json={"role": role, "text": text, "durable": True})
            response.raise_for_status()
            return response.json()["turn_id"]

        first = turn("ana", "walks", "user", "My dog Pixel loves the beach at Cascais")
        turn("ana", "walks", "assistant", "Pixel sounds like a happy dog!")
        for i, text in enumerate(["I started piano lessons with Marta",
                                  "Marta says my scales are improving",
                                  "We practise Chopin nocturnes on Tuesdays",
                                  "I live in Lisbon now", "The recital is in June"]):
            turn("ana", "piano", "user", text)
            turn("ana", "piano", "assistant", f"Noted ({i}).")
        http.post("/v1/users/ana/sessions/piano/close").raise_for_status()
        http.post("/v1/users/ana/facts", json={"category": "preference", "key": "drink",
                                               "value": "tea"}).raise_for_status()
        http.put("/v1/users/ana/facts/preference/drink",
                 json={"value": "coffee"}).raise_for_status()
        note = http.post("/v1/users/ana/notes", json={
            "text": "Pixel is a border collie", "tags": ["pets"], "importance": 0.8,
            "emotion": "joy", "category": "animals"}).json()
        http.post("/v1/users/ana/links", json={"from_id": note["note_id"], "to_id": first,
                                               "type": "about"}).raise_for_status()
        turn("ana", "odd", "user", HOSTILE)
        turn("bo", "b1", "user", "bo's private turn about Madrid")
        deadline = time.monotonic() + START
        while http.get("/readyz").status_code != 200:  # both indexes caught up
            if time.monotonic() > deadline:
                raise RuntimeError("the indexes never caught up")
            time.sleep(0.2)


@pytest.fixture
def browser() -> Iterator[webdriver.Chrome]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                     "--disable-gpu", "--window-size=1280,1000", "--lang=en-US"):
        options.add_argument(argument)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=DRIVER))
    driver.set_page_load_timeout(WAIT)
    try:
        yield driver
    finally:
        driver.quit()


def shot(driver: webdriver.Chrome, name: str, width: int = 1280) -> Path:
    """A screenshot of the whole page (as tall as it is) at this width."""
    OUTPUT.mkdir(parents=True, exist_ok=True)
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(width, min(max(height + 140, 600), 6000))
    path = OUTPUT / f"{name}.png"
    driver.save_screenshot(str(path))
    driver.set_window_size(1280, 1000)
    return path


def sign_in(driver: webdriver.Chrome, base: str, key: str) -> None:
    driver.get(f"{base}/ui/login")
    field = driver.find_element(By.ID, "key")
    field.send_keys(key)
    field.submit()
    WebDriverWait(driver, WAIT).until(ec.title_contains("Engram inspector"))
    WebDriverWait(driver, WAIT).until(lambda d: d.current_url.endswith("/ui/"))


def test_the_timeline_shows_sessions_turns_episode_bands_and_facts(served, browser) -> None:
    """Signed in through the form, ana's timeline shows her sessions and turns, the closed
    session's episode as a band over its turns, and facts linked to their turns."""
    sign_in(browser, served, ANA_KEY)
    browser.find_element(By.LINK_TEXT, "ana").click()
    WebDriverWait(browser, WAIT).until(ec.presence_of_element_located((By.CLASS_NAME, "band")))
    sessions = [e.get_attribute("id") for e in browser.find_elements(By.CSS_SELECTOR,
                                                                      "section.session")]
    assert set(sessions) == {"session-walks", "session-piano", "session-odd"}
    band = browser.find_element(By.CSS_SELECTOR, "#session-piano .band")
    turns = browser.find_elements(By.CSS_SELECTOR, "#session-piano .turn")
    assert len(turns) == 10
    # The band spans the turns it covers: from the first turn's top to the last one's bottom.
    assert band.rect["y"] <= turns[0].rect["y"] + 4
    assert band.rect["y"] + band.rect["height"] >= turns[-1].rect["y"] + turns[-1].rect[
        "height"] - 4
    assert "bo's private" not in browser.page_source
    shot(browser, "timeline")
    shot(browser, "timeline-phone", width=390)
    browser.get(f"{served}/ui/users/ana/memory")
    assert browser.find_element(By.CSS_SELECTOR, "table.facts s").text == "tea"
    shot(browser, "memory")
    browser.find_element(By.LINK_TEXT, "Graph").click()
    WebDriverWait(browser, WAIT).until(ec.presence_of_element_located((By.CSS_SELECTOR,
                                                                       "svg.graph")))
    edges = [e.text for e in browser.find_elements(By.CSS_SELECTOR, "svg.graph text.edge")]
    assert "about" in edges  # the note's link to the turn (the engine links by entity too)
    shot(browser, "memory-graph")


def test_a_query_shows_each_legs_rank_and_the_markdown_a_bot_receives(served, browser) -> None:
    """why-this-hit: the query box runs recall; each hit's row reads its rank in every leg,
    fused score and FSRS factor; the Markdown a bot gets shows with its token count; turning
    the vector leg off empties its column."""
    sign_in(browser, served, ANA_KEY)
    browser.get(f"{served}/ui/users/ana/why")
    box = browser.find_element(By.NAME, "q")
    box.send_keys("where does Pixel the dog like to go")
    browser.find_element(By.CSS_SELECTOR, "input[name=kinds][value=turn]").click()
    box.submit()
    WebDriverWait(browser, WAIT).until(ec.presence_of_element_located((By.ID, "hits")))
    head = [th.text for th in browser.find_elements(By.CSS_SELECTOR, "table.hits th")]
    assert head[3:7] == ["vector", "bm25", "entity", "window"] and "FSRS" in head
    [row] = [tr for tr in browser.find_elements(By.CSS_SELECTOR, "table.hits tbody tr")
             if "Cascais" in tr.text]
    cells = {td.get_attribute("data-leg"): td.text
             for td in row.find_elements(By.CSS_SELECTOR, "td.leg")}
    assert cells["vector"].isdigit() and cells["bm25"].isdigit()
    tokens = browser.find_element(By.CLASS_NAME, "tokens").text
    assert int(tokens.split()[0]) > 0
    assert "Cascais" in browser.find_element(By.CSS_SELECTOR, "pre.markdown").text
    shot(browser, "why")
    shot(browser, "why-phone", width=390)
    # Every kind, a query the closed session's episode answers: it lifts the turns it covers
    # (docs/inspector-why.png is this page).
    browser.get(f"{served}/ui/users/ana/why?q=when+does+she+practise+Chopin+with+Marta")
    lifted = browser.find_elements(By.CSS_SELECTOR, "table.hits a.chip[href*='#e_']")
    assert lifted and "Chopin" in browser.find_element(By.CSS_SELECTOR, "pre.markdown").text
    shot(browser, "why-episodes")

    browser.find_element(By.CSS_SELECTOR, "input[name=legs][value=vector]").click()
    browser.find_element(By.CSS_SELECTOR, "form.query button[type=submit]").click()
    WebDriverWait(browser, WAIT).until(lambda d: "legs=bm25" in d.current_url)
    columns = [td.text for td in browser.find_elements(By.CSS_SELECTOR,
                                                       "td.leg[data-leg=vector]")]
    assert columns and set(columns) == {"—"}


def test_forgetting_a_session_asks_first_and_then_it_is_gone(served, browser) -> None:
    """Forget this session… opens a confirmation; confirming posts the form and the session
    is gone from the timeline and from the API."""
    sign_in(browser, served, ANA_KEY)
    browser.get(f"{served}/ui/users/ana")
    section = browser.find_element(By.ID, "session-walks")
    section.find_element(By.PARTIAL_LINK_TEXT, "Forget this session").click()
    WebDriverWait(browser, WAIT).until(ec.title_contains("Confirm"))
    assert "Forget session 'walks'" in browser.find_element(By.CLASS_NAME, "question").text
    shot(browser, "confirm-forget")
    browser.find_element(By.CSS_SELECTOR, "form.confirm button[type=submit]").click()
    WebDriverWait(browser, WAIT).until(
        ec.text_to_be_present_in_element((By.CLASS_NAME, "done"), "forgot session walks"))
    assert not browser.find_elements(By.ID, "session-walks")
    assert browser.find_elements(By.ID, "session-piano")
    sessions = httpx.get(f"{served}/v1/users/ana/sessions",
                         headers={"Authorization": f"Bearer {ANA_KEY}"}).json()
    assert sorted(s["session_id"] for s in sessions) == ["odd", "piano"]


def test_another_users_key_gets_the_403_page(served, browser) -> None:
    """Signed in as bo, ana's pages answer 403 and show none of her memories."""
    sign_in(browser, served, BO_KEY)
    assert browser.find_elements(By.LINK_TEXT, "bo") and not browser.find_elements(
        By.LINK_TEXT, "ana")
    for url in ("/ui/users/ana", "/ui/users/ana/why?q=dog", "/ui/operator"):
        browser.get(served + url)
        assert browser.find_element(By.TAG_NAME, "h1").text.startswith("403"), url
        assert "Pixel" not in browser.page_source and "piano" not in browser.page_source
    shot(browser, "forbidden")


def test_a_hostile_turn_is_shown_as_text_and_never_runs(served, browser) -> None:
    """A turn holding a script and an onerror image is shown literally; no script runs (no
    alert, the title unchanged) and the page has no script element at all."""
    sign_in(browser, served, ADMIN_KEY)
    browser.get(f"{served}/ui/users/ana?session=odd")
    turns = [e.text for e in browser.find_elements(By.CSS_SELECTOR, ".turn .text")]
    assert HOSTILE in turns
    assert browser.find_elements(By.TAG_NAME, "script") == []
    assert browser.find_elements(By.CSS_SELECTOR, "main img") == []
    assert "pwned" not in browser.title
    with pytest.raises(NoAlertPresentException):
        browser.switch_to.alert.text
    shot(browser, "hostile")
    browser.get(f"{served}/ui/operator")
    assert browser.find_element(By.TAG_NAME, "h1").text == "Operator"
    shot(browser, "operator")
