"""The optional language model: a one-method protocol, the tasks the engine gives it, and an
adapter for OpenAI-compatible chat endpoints.

Nothing here runs on the hot path: episodes are summarised and facts extracted by background
actors, which fall back to their offline defaults when the model fails. Network use is the
caller's choice: the engine never calls a model unless one is passed to ``Engine.open``.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import httpx
import msgspec
import trio

from actors.base.errors import EngineError
from actors.extraction import MIN_CONFIDENCE, MIN_IMPORTANCE, Candidate

__all__ = ["LLM", "OpenAICompatibleLLM", "ModelTasks", "LLMFailed"]

MAX_SUMMARY_CHARS = 1_000
MAX_FACTS_PER_TURN = 10
# Answers worth another attempt: a timeout, too many requests, a server's passing failure.
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
MAX_RETRY_AFTER = 30.0  # seconds: a longer Retry-After is cut to this
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
    facts: list[_Fact] = []


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


def _json_object(text: str) -> bytes:
    """The JSON object in a reply, tolerating code fences and prose around it."""
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end < start:
        raise LLMFailed(f"expected a JSON object in the model's reply, found {text[:200]!r}")
    return text[start: end + 1].encode()


class ModelTasks:
    """The engine's prompts, over any :class:`LLM`; replies are validated before use. It is
    also the :class:`~actors.extraction.Extractor` the engine uses when given an LLM and no
    extractor of its own."""

    name = "llm"  # what facts it extracts carry as their origin

    def __init__(self, llm: LLM) -> None:
        self.llm = llm

    async def summarise(self, messages: list[tuple[str, str]]
                        ) -> tuple[str, str, tuple[str, ...]]:
        transcript = "\n".join(f"{role}: {text}" for role, text in messages)
        reply = await self.llm.complete(_SUMMARY_SYSTEM, transcript)
        try:
            got = msgspec.json.decode(_json_object(reply), type=_Summary)
        except msgspec.ValidationError as exc:
            raise LLMFailed(f"the model's summary does not fit the schema: {exc}") from exc
        if not got.title.strip() or not got.summary.strip():
            raise LLMFailed("the model's summary has an empty title or summary")
        return (got.title.strip()[:120], got.summary.strip()[:MAX_SUMMARY_CHARS],
                tuple(k.strip().lower() for k in got.keywords if k.strip())[:6])

    async def extract_facts(self, text: str) -> list[Candidate]:
        reply = await self.llm.complete(_FACTS_SYSTEM, text)
        try:
            got = msgspec.json.decode(_json_object(reply), type=_Facts)
        except msgspec.ValidationError as exc:
            raise LLMFailed(f"the model's facts do not fit the schema: {exc}") from exc
        out = []
        for f in got.facts[:MAX_FACTS_PER_TURN]:
            confidence = min(1.0, max(0.0, f.confidence))
            importance = min(1.0, max(0.0, f.importance))
            if (confidence < MIN_CONFIDENCE or importance < MIN_IMPORTANCE
                    or not f.category.strip() or not f.key.strip() or not f.value.strip()):
                continue
            out.append(Candidate(f.category.strip().lower()[:64], f.key.strip().lower()[:128],
                                 f.value.strip()[:500], f.fact.strip()[:1000] or f.value,
                                 confidence, importance, tuple(k.lower() for k in f.keywords)[:8]))
        return out

    async def reflect(self, facts: list[str], episodes: list[str]) -> str:
        """A reflection on a user's recent facts and episodes (seed 004's reflection agent)."""
        prompt = ("Facts:\n" + "\n".join(f"- {f}" for f in facts)
                  + "\n\nEpisodes:\n" + "\n".join(f"- {e}" for e in episodes))
        reply = " ".join((await self.llm.complete(_REFLECTION_SYSTEM, prompt)).split())
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
        timeout: seconds per request (connect, read and write each).
        retries: attempts after the first when one fails in a way that may pass: no
            connection, a timeout, or an answer of 408, 429, 500, 502, 503 or 504. They wait
            ``backoff`` seconds, doubling each time, or what the server's ``Retry-After``
            asks (at most :data:`MAX_RETRY_AFTER`). Any other error status fails at once.
        backoff: the first wait before a retry.
        transport: an httpx transport (a proxy's, a test's); by default httpx's own.

    Requests go out with httpx on the engine's trio loop (no worker thread), one client a
    call (its retries share its connections; a model's answer takes seconds, a connection
    a millisecond), and are abandoned on cancellation. Nothing here is on a reply's path: the
    background actors that call it fall back to their offline defaults when it fails.
    """

    def __init__(self, base_url: str, model: str, *, api_key: str | None = None,
                 timeout: float = 60.0, retries: int = 2, backoff: float = 0.5,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.api_key = api_key
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self._transport = transport

    async def complete(self, system: str, prompt: str) -> str:
        async with httpx.AsyncClient(transport=self._transport, timeout=self.timeout) as http:
            return await self._complete(http, system, prompt)

    async def _complete(self, http: httpx.AsyncClient, system: str, prompt: str) -> str:
        body = {"model": self.model, "temperature": 0,
                "messages": [{"role": "system", "content": system},
                             {"role": "user", "content": prompt}]}
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        attempts = max(1, self.retries + 1)
        for attempt in range(attempts):
            wait = self.backoff * 2 ** attempt
            try:
                response = await http.post(self.url, json=body, headers=headers)
            except PASSING as exc:
                failure = f"calling {self.url} failed: {type(exc).__name__}: {exc}"
            except httpx.HTTPError as exc:  # a bad URL, a protocol httpx does not speak
                raise LLMFailed(f"calling {self.url} failed: {type(exc).__name__}: {exc}"
                                ) from exc
            else:
                if response.status_code < 400:
                    return _content(response, self.url)
                failure = (f"{self.url} answered HTTP {response.status_code}: "
                           f"{response.text[:300]}")
                if response.status_code not in RETRY_STATUSES:
                    raise LLMFailed(failure)
                wait = max(wait, _retry_after(response))
            if attempt + 1 < attempts:
                await trio.sleep(wait)
        raise LLMFailed(f"{failure} ({attempts} attempts)")


def _retry_after(response: httpx.Response) -> float:
    """The seconds a ``Retry-After`` header asks for (0 if none or a date), bounded."""
    try:
        return min(float(response.headers.get("retry-after", 0)), MAX_RETRY_AFTER)
    except ValueError:
        return 0.0


def _content(response: httpx.Response, url: str) -> str:
    try:
        return response.json()["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise LLMFailed(f"expected choices[0].message.content from {url}, found "
                        f"{response.text[:200]}") from exc
