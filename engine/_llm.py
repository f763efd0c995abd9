"""The optional language model: a one-method protocol, the tasks the engine gives it, and an
adapter for OpenAI-compatible chat endpoints.

Nothing here runs on the hot path: episodes are summarised and facts extracted by background
actors, which fall back to their offline defaults when the model fails. Network use is the
caller's choice: the engine never calls a model unless one is passed to ``Engine.open``.
"""

from __future__ import annotations

import base64
import json
import logging
import math
from collections.abc import Callable
from contextlib import aclosing
from typing import Any, Protocol, runtime_checkable

import httpx
import msgspec
import trio

from actors.base.errors import EngineError, InvalidInput
from actors.base.validate import check_id, check_words
from actors.extraction import MAX_CATEGORY, MIN_CONFIDENCE, MIN_IMPORTANCE, Candidate

__all__ = ["LLM", "OpenAICompatibleLLM", "ModelTasks", "LLMFailed"]

log = logging.getLogger("engram.llm")

MAX_SUMMARY_CHARS = 1_000
# A transcript summarise sends: ~6k tokens, what a small local model takes, whatever was
# queued (a session's rolling summary after a bulk add covers up to ~1,000 turns of up to
# 32,000 characters). One message in it is cut first: a pasted document is not the chat.
MAX_TRANSCRIPT_CHARS = 24_000
MAX_MESSAGE_CHARS = 4_000
MAX_FACTS_PER_TURN = 10
MAX_KEYWORD_CHARS = 64  # a summary's keyword, as a fact's
CALL_SECONDS = 600.0  # a model call taking longer is abandoned (the adapter's defaults: < 450)
JSON_STARTS = 16  # "{" of a reply tried as the start of its object: prose cannot cost more
# Answers worth another attempt: a timeout, too many requests, a server's passing failure.
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
MAX_RETRY_AFTER = 30.0  # seconds: a longer Retry-After is cut to this
# Answers that refuse the key: no retry helps until someone fixes it, so the adapter stops
# calling for AUTH_PAUSE seconds (every turn would otherwise send the bad key again).
AUTH_STATUSES = frozenset({401, 403})
AUTH_PAUSE = 300.0
# An attempt may take this many timeouts all told (connecting, then the answer): httpx's
# timeouts are per read, so a body that trickles in for ever would pass each of them.
ATTEMPT_TIMEOUTS = 2
MAX_REPLY_BYTES = 4_000_000  # a body past this is not one chat answer: refused, not read on
# Failures of a request that may pass when it is sent again.
PASSING = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)


class LLMFailed(EngineError):
    """The language model could not be reached or answered something unusable."""


@runtime_checkable
class LLM(Protocol):
    """What Engram needs of a language model: one async completion."""

    async def complete(self, system: str, prompt: str) -> str:
        """Answer ``prompt`` under the ``system`` instructions; return the reply text."""
        ...


class _Summary(msgspec.Struct):
    title: str
    summary: str
    keywords: list[str] = []


class _Fact(msgspec.Struct):
    category: str
    key: str
    value: str
    fact: str
    confidence: float = 0.7
    importance: float = 0.5
    keywords: list[str] = []


class _Facts(msgspec.Struct):
    facts: list[_Fact]  # required: an object without it (an error) is no answer, not "none"


_SUMMARY_SYSTEM = (
    "You compress a stretch of conversation into an episodic memory. Reply with JSON only: "
    '{"title": "<= 10 words", "summary": "2-3 sentences, third person, concrete", '
    '"keywords": ["up to 6 keyphrases"]}')
_FACTS_SYSTEM = (
    "You extract durable facts a user states about themselves from one message. Reply with JSON "
    'only: {"facts": [{"category": "identity|preference|constraint|instruction|relationship|'
    'schedule|<other>", "key": "what it is about, e.g. location, likes:jazz, allergy:peanuts", '
    '"value": "...", "fact": "one sentence", "confidence": 0-1, "importance": 0-1, '
    '"keywords": []}]}. Questions, hypotheticals and passing remarks are not facts; reply '
    '{"facts": []} when there are none.')


_REFLECTION_SYSTEM = (
    "You keep a short reflection about a user for an assistant's next conversations: what "
    "matters to them lately, what changed, what recurs. Given their recent facts and the "
    "episodes of their recent conversations, reply with 2-4 sentences of plain text, third "
    "person, concrete, nothing invented.")


_scan = json.JSONDecoder().raw_decode


def _clean(text: str) -> str:
    """Text the store and every index take: no NUL, no lone surrogate (JSON's ``\\ud800``
    decodes to one; it becomes ``?``)."""
    return text.replace("\x00", "").encode("utf-8", "replace").decode()


def _json_object(reply: object, schema: type[msgspec.Struct]) -> Any:
    """The first complete JSON object in a reply, tolerating code fences, prose around it
    (braces included) and further objects after it, as ``schema``.

    Raises:
        LLMFailed: no object, or the first one does not fit ``schema``.
    """
    if not isinstance(reply, str):
        raise LLMFailed(f"expected the model's reply as str, found {type(reply).__name__}")
    start = reply.find("{")
    for _ in range(JSON_STARTS):
        if start < 0:
            break
        try:
            found, _ = _scan(reply, start)
        except (ValueError, RecursionError):  # not an object here: prose, or cut short
            start = reply.find("{", start + 1)
            continue
        try:
            return msgspec.convert(found, type=schema)
        except (msgspec.ValidationError, UnicodeEncodeError) as exc:  # a lone surrogate
            raise LLMFailed(f"the model's reply does not fit the schema: {exc}") from exc
    raise LLMFailed(f"expected a JSON object in the model's reply, found {reply[:200]!r}")


async def _ask(llm: LLM, system: str, prompt: str) -> object:
    """The model's reply, abandoned after CALL_SECONDS whatever the LLM object does."""
    with trio.move_on_after(CALL_SECONDS):
        return await llm.complete(system, prompt)
    raise LLMFailed(f"the model did not answer within {CALL_SECONDS:.0f} s")


def _score(value: float) -> float | None:
    """A 0-1 score as given, or None: a model's 5 or 70 is not full confidence."""
    return value if 0.0 <= value <= 1.0 else None  # NaN fails both


def _addressable(category: str, key: str, value: str, keywords: tuple[str, ...]) -> bool:
    """Whether the API would take this fact from a caller (and can confirm or forget it)."""
    try:
        check_id("category", category, MAX_CATEGORY)
        check_id("key", key, 128)
        check_words("keywords", keywords)
    except InvalidInput:
        return False
    return bool(value)


def _transcript(messages: list[tuple[str, str]]) -> str:
    """``role: text`` lines of the messages, at most MAX_TRANSCRIPT_CHARS: each message cut
    to MAX_MESSAGE_CHARS, then the newest that fit, after a leading "summary so far" (which
    stands for what came before), and a line saying how many were left out."""
    lines = [f"{role}: {text[:MAX_MESSAGE_CHARS]}"
             + (" [...]" if len(text) > MAX_MESSAGE_CHARS else "") for role, text in messages]
    head = lines[:1] if messages and messages[0][0] == "summary so far" else []
    size = sum(len(line) + 1 for line in head)
    kept: list[str] = []
    for line in reversed(lines[len(head):]):
        if size + len(line) + 1 > MAX_TRANSCRIPT_CHARS:
            break
        kept.append(line)
        size += len(line) + 1
    left_out = len(lines) - len(head) - len(kept)
    gap = [f"[{left_out} earlier messages left out]"] if left_out else []
    return "\n".join([*head, *gap, *reversed(kept)])


class ModelTasks:
    """The engine's prompts, over any :class:`LLM`; replies are validated before use. It is
    also the :class:`~actors.extraction.Extractor` the engine uses when given an LLM and no
    extractor of its own."""

    name = "llm"  # what facts it extracts carry as their origin

    def __init__(self, llm: LLM) -> None:
        self.llm = llm

    async def summarise(self, messages: list[tuple[str, str]]
                        ) -> tuple[str, str, tuple[str, ...]]:
        got = _json_object(await _ask(self.llm, _SUMMARY_SYSTEM, _transcript(messages)),
                           _Summary)
        title, summary = _clean(got.title).strip(), _clean(got.summary).strip()
        if not title or not summary:
            raise LLMFailed("the model's summary has an empty title or summary")
        keywords = (_clean(k).strip().lower()[:MAX_KEYWORD_CHARS] for k in got.keywords)
        return (title[:120], summary[:MAX_SUMMARY_CHARS],
                tuple(dict.fromkeys(k for k in keywords if k))[:6])

    async def extract_facts(self, text: str) -> list[Candidate]:
        got = _json_object(await _ask(self.llm, _FACTS_SYSTEM, text), _Facts)
        out = []
        for f in got.facts[:MAX_FACTS_PER_TURN]:
            confidence, importance = _score(f.confidence), _score(f.importance)
            if (confidence is None or importance is None or confidence < MIN_CONFIDENCE
                    or importance < MIN_IMPORTANCE):
                continue
            category = _clean(f.category).strip().lower()[:MAX_CATEGORY]
            key = _clean(f.key).strip().lower()[:128]
            value = _clean(f.value).strip()[:500]
            keywords = tuple(k for k in (_clean(k).strip().lower()[:MAX_KEYWORD_CHARS]
                                         for k in f.keywords) if k)[:8]
            if _addressable(category, key, value, keywords):
                out.append(Candidate(category, key, value, _clean(f.fact).strip()[:1000] or value,
                                     confidence, importance, keywords))
        return out

    async def reflect(self, facts: list[str], episodes: list[str]) -> str:
        """A reflection on a user's recent facts and episodes (seed 004's reflection agent)."""
        prompt = ("Facts:\n" + "\n".join(f"- {f}" for f in facts)
                  + "\n\nEpisodes:\n" + "\n".join(f"- {e}" for e in episodes))
        reply = await _ask(self.llm, _REFLECTION_SYSTEM, prompt)
        if not isinstance(reply, str):
            raise LLMFailed(f"expected the model's reflection as str, found "
                            f"{type(reply).__name__}")
        reply = " ".join(_clean(reply).split())
        if not reply:
            raise LLMFailed("the model's reflection is empty")
        return reply[:MAX_SUMMARY_CHARS]

    async def extract(self, text: str) -> list[Candidate]:
        """The :class:`~actors.extraction.Extractor` method: the model's facts of one turn."""
        return await self.extract_facts(text)


class OpenAICompatibleLLM:
    """An :class:`LLM` over an OpenAI-compatible ``/chat/completions`` endpoint (OpenAI,
    vLLM, llama.cpp's server, Ollama, ...).

    Args:
        base_url: e.g. ``http://localhost:8000/v1``.
        model: the model name the server expects.
        api_key: sent as a bearer token if given.
        timeout: seconds for each connect, read and write of a request; one taking more
            than :data:`ATTEMPT_TIMEOUTS` times this all told (a body that trickles in for
            ever) is abandoned and counts as a timeout.
        retries: attempts after the first when one fails in a way that may pass: no
            connection, a timeout, or an answer of 408, 429, 500, 502, 503 or 504. They wait
            ``backoff`` seconds, doubling each time, or what the server's ``Retry-After``
            asks, at most :data:`MAX_RETRY_AFTER` either way. Any other error status, and a
            body over :data:`MAX_REPLY_BYTES`, fail at once.
        backoff: the first wait before a retry.
        transport: an httpx transport (a proxy's, a test's); by default httpx's own.
        auth_pause: after a 401 or 403 (a bad or revoked key will not get better), the
            seconds every call fails at once, without a request, saying so; the refusal is
            logged once. The first call after the pause tries the endpoint again: another
            401 or 403 starts a new pause, any other answer ends it.
        clock: the seconds ``auth_pause`` is measured in (default: trio's clock).

    Requests go out with httpx on the engine's trio loop (no worker thread), one client a
    call (its retries share its connections; a model's answer takes seconds, a connection
    a millisecond), and are abandoned on cancellation. Nothing here is on a reply's path: the
    background actors that call it fall back to their offline defaults when it fails.
    """

    def __init__(self, base_url: str, model: str, *, api_key: str | None = None,
                 timeout: float = 60.0, retries: int = 2, backoff: float = 0.5,
                 transport: httpx.AsyncBaseTransport | None = None,
                 auth_pause: float = AUTH_PAUSE,
                 clock: Callable[[], float] = trio.current_time) -> None:
        if api_key == "":  # os.environ.get("KEY", "") for a local server that wants none
            api_key = None
        if api_key is not None:
            _check_key(api_key)
        for name, value, least in (("timeout", timeout, 0.0), ("backoff", backoff, 0.0),
                                   ("auth_pause", auth_pause, 0.0)):
            if (isinstance(value, bool) or not isinstance(value, int | float)
                    or not least <= value < math.inf or (name == "timeout" and value == 0)):
                raise InvalidInput(name, f"expected a finite number of seconds"
                                         f"{' above 0' if name == 'timeout' else ' from 0'}, "
                                         f"found {value!r}")
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise InvalidInput("retries", f"expected an integer from 0, found {retries!r}")
        try:
            url = httpx.URL(base_url.rstrip("/") + "/chat/completions")
        except (httpx.InvalidURL, TypeError, AttributeError) as exc:
            raise InvalidInput("base_url", f"expected an http(s) URL, found one httpx cannot "
                                           f"read ({exc}); a URL read from a file keeps its "
                                           "line feed") from None
        # Credentials in the URL (user:password@) go as Basic auth, out of the URL that
        # messages and httpx's own log lines name.
        self._basic = (url.username, url.password) if url.userinfo else None
        self.url = str(url.copy_with(username=None, password=None))
        self.model = model
        self.api_key = api_key
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self.auth_pause = auth_pause
        self._transport = transport
        self._clock = clock
        # Never in a message, whatever a server or httpx puts there (a server may echo the
        # Authorization header: the key, or Basic auth's base64).
        self._secrets = [api_key] if api_key else []
        if self._basic:  # user:password@, or a token alone as the user (TOKEN@)
            pair = f"{self._basic[0]}:{self._basic[1]}".encode()
            self._secrets += [part for part in self._basic if part]
            self._secrets.append(base64.b64encode(pair).decode())
        # After a 401/403: (when calls may reach the endpoint again, what it answered).
        self._refused: tuple[float, str] | None = None

    def _clean(self, text: str) -> str:
        """``text`` with the URL's credentials and the API key taken out."""
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def _body(self, data: bytes, chars: int) -> str:
        """A reply's body for a message: its secrets taken out, then cut (cut first, an
        echoed key crossing the cut would show its first part)."""
        return self._clean(data[:MAX_REPLY_BYTES].decode("utf-8", "replace"))[:chars]

    async def complete(self, system: str, prompt: str) -> str:
        trying = None
        if self._refused is not None:
            until, answered = self._refused
            now = self._clock()
            if now < until:
                raise LLMFailed(f"not calling {self.url} for {until - now:.0f} s more: "
                                f"it {answered}; expected a valid API key")
            # This call tries again; the others keep failing at once meanwhile.
            self._refused = trying = (now + self.auth_pause, answered)
        try:
            async with httpx.AsyncClient(transport=self._transport,
                                         timeout=self.timeout) as http:
                return await self._complete(http, system, prompt)
        except LLMFailed as exc:
            raise LLMFailed(self._clean(str(exc))) from None
        finally:
            if trying is not None and self._refused is trying:
                # No 401 or 403 came back (no answer at all): the next call tries again.
                self._refused = None

    async def _complete(self, http: httpx.AsyncClient, system: str, prompt: str) -> str:
        body = {"model": self.model, "temperature": 0,
                "messages": [{"role": "system", "content": system},
                             {"role": "user", "content": prompt}]}
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        attempts = max(1, self.retries + 1)
        for attempt in range(attempts):
            wait = min(self.backoff * 2.0 ** min(attempt, 64), MAX_RETRY_AFTER)
            try:
                with trio.fail_after(self.timeout * ATTEMPT_TIMEOUTS):
                    status, retry_after, data = await self._post(http, body, headers)
            except trio.TooSlowError:
                failure = (f"calling {self.url} took more than "
                           f"{self.timeout * ATTEMPT_TIMEOUTS:g} s")
            except PASSING as exc:
                failure = f"calling {self.url} failed: {type(exc).__name__}: {exc}"
            except httpx.HTTPError as exc:  # a bad URL, a protocol httpx does not speak
                raise LLMFailed(f"calling {self.url} failed: {type(exc).__name__}: {exc}"
                                ) from exc
            else:
                if status in AUTH_STATUSES:
                    self._refuse(f"answered HTTP {status}: {self._body(data, 300)}")
                elif self._refused is not None:
                    log.info("%s took the API key again (HTTP %d)", self.url, status)
                    self._refused = None
                if status < 400:
                    return _content(data, self.url, self._body)
                failure = f"{self.url} answered HTTP {status}: {self._body(data, 300)}"
                if status not in RETRY_STATUSES:
                    raise LLMFailed(failure)
                wait = max(wait, retry_after)
            if attempt + 1 < attempts:
                await trio.sleep(wait)
        raise LLMFailed(f"{failure} ({attempts} attempts)")

    def _refuse(self, answered: str) -> None:
        """Stop calling for ``auth_pause`` seconds; logged when the pause begins, not when a
        retry after it is refused again."""
        answered = self._clean(answered)  # a server may echo the request's header
        if self._refused is None:
            log.error("%s %s: a bad or revoked API key; the model is not called for %g s "
                      "(the offline summaries and rules stand in)", self.url, answered,
                      self.auth_pause)
        self._refused = (self._clock() + self.auth_pause, answered)

    async def _post(self, http: httpx.AsyncClient, body: dict, headers: dict
                    ) -> tuple[int, float, bytes]:
        """One request: the status, the seconds its Retry-After asks and the body, read up
        to MAX_REPLY_BYTES (a provider in trouble may send megabytes, or never stop)."""
        async with http.stream("POST", self.url, json=body, headers=headers,
                               auth=self._basic) as response:
            data = bytearray()
            async with aclosing(response.aiter_bytes()) as chunks:
                async for chunk in chunks:
                    data += chunk
                    if len(data) > MAX_REPLY_BYTES:
                        raise LLMFailed(f"{self.url} answered more than {MAX_REPLY_BYTES} "
                                        "bytes; expected one chat completion")
            return response.status_code, _retry_after(response), bytes(data)


def _retry_after(response: httpx.Response) -> float:
    """The seconds a ``Retry-After`` header asks for (0 if none, a date or not a number),
    at most MAX_RETRY_AFTER."""
    try:
        seconds = float(response.headers.get("retry-after", 0))
    except ValueError:
        return 0.0
    return min(seconds, MAX_RETRY_AFTER) if seconds >= 0 else 0.0  # NaN: 0


def _check_key(key: object) -> None:
    """An API key a header can carry: printable ASCII without spaces. The error says what is
    wrong, never what the key is."""
    if not isinstance(key, str):
        raise InvalidInput("api_key", f"expected text, found {type(key).__name__}")
    if not key:
        raise InvalidInput("api_key", "expected a key, found an empty key")
    for at, char in enumerate(key):
        if not "!" <= char <= "~":
            what = {"\n": "a line feed", "\r": "a carriage return", " ": "a space",
                    "\t": "a tab"}.get(char, "a character beyond ASCII" if ord(char) > 127
                                        else "a control character")
            raise InvalidInput("api_key", f"expected printable ASCII without spaces, found "
                                          f"{what} at {at} (a key read from a file keeps its "
                                          "line feed: strip it)")


def _content(data: bytes, url: str, shown: Callable[[bytes, int], str]) -> str:
    try:
        content = json.loads(data)["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError, RecursionError) as exc:
        content = exc
    if not isinstance(content, str):
        raise LLMFailed(f"expected choices[0].message.content from {url}, found "
                        f"{shown(data, 200)!r}")
    return content
