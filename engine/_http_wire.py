"""What crosses the HTTP API's wire: the request bodies (pydantic, so FastAPI validates and
documents them), the JSON, Markdown and error responses, and the examples its OpenAPI shows.
"""

# No `from __future__ import annotations`: FastAPI reads these models' annotations at run time.
import os
import re
import types
import typing
from datetime import datetime
from typing import Annotated, Any, Literal

import msgspec
from fastapi.responses import Response
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError
from starlette.exceptions import HTTPException

from actors.base.errors import InvalidInput

from ._hits import Hit

# -- request bodies -----------------------------------------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _a_number(value: Any) -> Any:
    """A number field's ``before`` check: pydantic's lax numbers take true for 1 and "0.5"
    for 0.5, so a client's bug was stored as an importance; a JSON number only (5.0 for an
    integer too, as JSON Schema's integer takes it)."""
    if isinstance(value, (bool, str)):
        raise PydanticCustomError("number_type", "Input should be a JSON number")
    return value


# An ISO 8601 time starts with its date and the separator before its hour.
_ISO_TIME = re.compile(r"\d{4}-\d{2}-\d{2}[Tt _]")


def _a_time(value: Any) -> Any:
    """A time field's ``before`` check: pydantic's lax datetime takes a number, or a string
    of digits, for a Unix time in a unit it guesses from its size (2.5e10 was a turn of
    1970); the API speaks ISO 8601 only."""
    if isinstance(value, datetime) or (isinstance(value, str) and _ISO_TIME.match(value)):
        return value
    raise PydanticCustomError("datetime_type", "Input should be an ISO 8601 time with its "
                                               "zone, e.g. 2026-03-01T09:00:00Z")


# What every time field of the API's bodies and queries is.
Time = Annotated[datetime, BeforeValidator(_a_time)]


def _numbers(*fields: str) -> Any:
    """The :func:`_a_number` check on ``fields`` of a body (it runs on those sent only)."""
    return field_validator(*fields, mode="before")(classmethod(lambda cls, v: _a_number(v)))


Role = Literal["user", "assistant", "system", "tool"]


class TurnIn(_Body):
    role: Role = Field(examples=["user"])
    text: str = Field(examples=["I'm moving to Lisbon in January"])
    at: Time | None = Field(None, description="timezone-aware; default: now",
                                examples=["2026-03-01T09:00:00Z"])
    meta: dict[str, Any] | None = Field(None, examples=[{"channel": "web"}])
    # strict: pydantic's lax bool reads "no", "off" and 0 as false, "yes" and 1 as true.
    durable: bool = Field(False, strict=True,
                          description="answer 201 once on disk, not 202 once buffered")
    agent_id: str | None = Field(None, description="the session's scope (its first turn's)")
    run_id: str | None = None


class BatchTurn(_Body):
    session_id: str = Field(examples=["s1"])
    role: Role = Field(examples=["user"])
    text: str = Field(examples=["I'm moving to Lisbon in January"])
    at: Time | None = None
    meta: dict[str, Any] | None = None
    agent_id: str | None = None
    run_id: str | None = None


# Turns in one POST /v1/users/{u}/turns: each is a model built before the handler's first
# await (~8 us), and the byte limit alone lets ~190,000 tiny ones stall every other request
# for seconds. Larger imports go as several batches.
MAX_BATCH_TURNS = 1_000


class BatchIn(_Body):
    turns: list[BatchTurn] = Field(max_length=MAX_BATCH_TURNS)
    durable: bool = Field(False, strict=True)


class RecallIn(_Body):
    query: str = Field(examples=["where is she moving?"])
    limit: int | None = Field(None, ge=1, le=1000, examples=[5])
    focus: int | None = Field(None, ge=0, le=5)
    session_id: str | None = None
    since: Time | None = None
    until: Time | None = None
    roles: list[str] | None = None
    kinds: list[str] | None = Field(None, examples=[["turn", "fact"]])
    tags: list[str] | None = None
    link_depth: int | None = Field(None, ge=0)
    link_types: list[str] | None = Field(
        None, description="follow only links of these types (with link_depth)",
        examples=[["relates_to"]])
    budget_tokens: int | None = Field(None, ge=1)
    legs: list[Literal["vector", "bm25", "entity", "window"]] | None = Field(
        None, description="the search legs that run (default: all)", examples=[["bm25"]])
    where: dict[str, Any] | None = Field(
        None, description="metadata filter (mem0's shape): operators eq ne gt gte lt lte in nin "
                          "contains, AND / OR / NOT nesting, over turn meta and record fields",
        examples=[{"channel": "web", "priority": {"gte": 2}}])
    category: str | list[str] | None = Field(None, description="notes' and facts' category")
    min_importance: float | None = Field(None, ge=0, le=1)
    emotion: str | list[str] | None = Field(None, description="notes' emotion label")
    as_of: Time | None = Field(
        None, description="answer as the store knew it then (a time with its zone)",
        examples=["2026-01-15T09:00:00Z"])
    agent_id: str | None = Field(None, description="only turns and notes of this agent")
    run_id: str | None = Field(None, description="only turns and notes of this run")

    _check_numbers = _numbers("limit", "focus", "link_depth", "budget_tokens", "min_importance")


class RetrieveIn(_Body):
    """seed 001's body, with the user it is for."""

    user_id: str = Field(examples=["maya"])
    query: str = Field(examples=["what did the user say about Rust"])
    conversation_id: str | None = Field(None, examples=["550e8400-e29b-41d4-a716-446655440001"])
    episodic_limit: int = 5
    semantic_limit: int = 20
    detail: Literal["auto", "none", "low", "high"] = "auto"
    category: str | None = None
    min_importance: float = 0.0
    legs: list[Literal["vector", "bm25", "entity", "window"]] | None = Field(
        None, description="the search legs that run (default: all), as recall's",
        examples=[["vector", "bm25"]])

    _check_numbers = _numbers("episodic_limit", "semantic_limit", "min_importance")


class PreRetrieveIn(_Body):
    user_id: str = Field(examples=["maya"])
    query: str = Field(examples=["User is asking about career decisions"])
    conversation_id: str | None = None
    semantic_limit: int = 20
    category: str | None = None
    min_importance: float = 0.0

    _check_numbers = _numbers("semantic_limit", "min_importance")


class NoteIn(_Body):
    text: str = Field(examples=["Prefers answers in Portuguese"])
    tags: list[str] | None = Field(None, examples=[["language"]])
    note_id: str | None = None
    importance: float | None = Field(None, ge=0, le=1, description="default 0.5")
    emotion: str | None = Field(None, examples=["joy"])
    category: str | None = Field(None, examples=["language"])
    agent_id: str | None = None
    run_id: str | None = None

    _check_numbers = _numbers("importance")


class NoteUpdate(_Body):
    text: str
    tags: list[str] | None = None
    importance: float | None = Field(None, ge=0, le=1, description="default: kept")
    emotion: str | None = Field(None, description="default: kept; \"\" clears it")
    category: str | None = Field(None, description="default: kept; \"\" clears it")

    _check_numbers = _numbers("importance")


class FactIn(_Body):
    category: str = Field(examples=["identity"])
    key: str = Field(examples=["location"])
    value: str = Field(examples=["Lisbon"])
    text: str | None = Field(None, examples=["Lives in Lisbon"])
    confidence: float = 0.9
    importance: float = 0.7
    keywords: list[str] = []
    valid_at: Time | None = Field(None, description="since when it is true (a time with "
                                      "its zone; default: now)", examples=["2026-01-15T09:00:00Z"])

    _check_numbers = _numbers("confidence", "importance")


class FactCorrection(_Body):
    value: str = Field(examples=["Porto"])
    text: str | None = None
    importance: float = 0.7
    keywords: list[str] = []
    valid_at: Time | None = Field(None, description="since when the new value is true (a "
                                      "time with its zone; default: now): the old one is true "
                                      "until then", examples=["2026-01-15T09:00:00Z"])

    _check_numbers = _numbers("importance")


class LinkIn(_Body):
    from_id: str
    to_id: str
    type: str = "relates_to"


class ReviewIn(_Body):
    rating: Literal["again", "hard", "good", "easy", 1, 2, 3, 4] = Field(examples=["good"])

    @field_validator("rating", mode="before")
    @classmethod
    def _exactly(cls, value: Any) -> Any:
        # pydantic's Literal takes true for 1 and 3.0 for 3 (a review recorded from a
        # client's bug); the schema and the engine take a word or an integer only.
        if type(value) not in (str, int):
            raise PydanticCustomError("literal_error", "Input should be {expected}",
                                      {"expected": "'again', 'hard', 'good', 'easy', 1, 2, 3 "
                                                   "or 4"})
        return value


class SnapshotIn(_Body):
    dest: str = Field(description="a new or empty directory on the server",
                      examples=["/backups/2026-11-22"])


def server_path(field: str, path: str) -> str:
    """``path`` if absolute; a relative one would land in the server's working directory,
    which no client knows: refused, naming ``field``."""
    if not os.path.isabs(path):
        raise InvalidInput(field, f"expected an absolute path on the server, found {path!r}")
    return path


# -- responses ----------------------------------------------------------------------------------


def _objects_all_the_way(cls: type) -> bool:
    """Whether msgspec encodes a Struct type by field name at every depth: no array_like
    Struct (a stored record) and nothing typed ``Any`` that could hold one is reachable."""
    seen: set[int] = set()

    def walk(info: msgspec.inspect.Type) -> bool:
        if isinstance(info, msgspec.inspect.StructType) and info.array_like:
            return False
        if isinstance(info, (msgspec.inspect.AnyType, msgspec.inspect.CustomType)):
            return False
        if id(info) in seen:
            return True
        seen.add(id(info))
        for name in info.__struct_fields__:
            value = getattr(info, name)
            for part in value if isinstance(value, tuple) else (value,):
                if isinstance(part, msgspec.inspect.Field):
                    part = part.type
                if isinstance(part, msgspec.inspect.Type) and not walk(part):
                    return False
        return True

    try:
        info = msgspec.inspect.type_info(cls)
    except Exception:  # annotations it cannot resolve (a class local to a function): walk it
        return False
    return walk(info)


# Struct type -> whether msgspec may encode it as it is (see _objects_all_the_way). Hits and
# the other answers of reads are: walking them field by field cost a recall ~0.1-0.2 ms of the
# loop here.
_AS_IS: dict[type, bool] = {}


def plain(value: Any) -> Any:
    """Records as JSON-ready values by field name (stored records are array_like Structs)."""
    if isinstance(value, msgspec.Struct):
        cls = type(value)
        as_is = _AS_IS.get(cls)
        if as_is is None:
            as_is = _AS_IS[cls] = _objects_all_the_way(cls)
        if as_is:
            return value
        return {f: plain(getattr(value, f)) for f in value.__struct_fields__}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


def json_response(value: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(plain(value)), status, media_type="application/json")


def markdown_response(text: str) -> Response:
    return Response(text, media_type="text/markdown; charset=utf-8")


def error_response(status: int, error: str, message: str, field: str | None = None,
                   headers: dict[str, str] | None = None, log_seq: int | None = None
                   ) -> Response:
    body: dict[str, Any] = {"error": error, "message": message}
    if field is not None:
        body["field"] = field
    if log_seq is not None:  # a call in the cluster's log (CallLogged): where to read it
        body["log_seq"] = log_seq
    return Response(msgspec.json.encode(body), status, headers=headers,
                    media_type="application/json")


def not_found(what: str) -> HTTPException:
    return HTTPException(404, f"no {what}")


def example(value: Any, media: str = "application/json") -> dict[str, Any]:
    return {"content": {media: {"example": value}}}


def error_example(error: str, message: str, field: str | None = None) -> dict[str, Any]:
    body = {"error": error, "message": message} | ({"field": field} if field else {})
    return {"description": error, **example(body)}


# Documented on every route (OpenAPI): the JSON error body and when each status comes.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: error_example("Unauthorized", "expected 'Authorization: Bearer <key>', found none"),
    403: error_example("Forbidden", "this key may not act for user 'bo'"),
    404: error_example("NotFound", "no note 'n_1' for this user"),
    413: error_example("TooLarge", "expected a body of at most 8388608 bytes, found 9000000"),
    422: error_example("InvalidInput", "role: expected one of 'user', 'assistant', 'system', "
                                       "'tool', found str 'bot'", "role"),
    503: error_example("EngineClosed", "the engine is closed; open a new one with "
                                       "Engine.open(path)"),
}
TURN_EXAMPLE = {"lsn": 12, "turn_id": "t_4f0c2a9e1b7d3c5a8e21", "user_id": "maya",
                "session_id": "s1", "seq": 3, "role": "user",
                "text": "I'm moving to Lisbon in January", "at": "2026-03-01T09:00:00Z",
                "meta": {"channel": "web"}}
HIT_EXAMPLE = {"id": "t_4f0c2a9e1b7d3c5a8e21", "kind": "turn",
               "text": "I'm moving to Lisbon in January", "score": 0.0328, "session_id": "s1",
               "at": "2026-03-01T09:00:00Z", "turn_ids": ["t_4f0c2a9e1b7d3c5a8e21"],
               "role": "user", "via": ["vector", "bm25"]}


# -- the answers' schemas, for the OpenAPI document --------------------------------------------


class TurnAnswer(msgspec.Struct, kw_only=True):
    """``POST .../turns``: the new turn's id and place; ``log_seq`` on a cluster node."""

    turn_id: str
    seq: int | None
    durable: bool
    log_seq: int | None = None


class BatchItem(msgspec.Struct, kw_only=True):
    turn_id: str
    seq: int | None
    log_seq: int | None = None


class BatchAnswer(msgspec.Struct, kw_only=True):
    """``POST /v1/users/{u}/turns``: each turn's id and place, in order."""

    turns: list[BatchItem]
    durable: bool


class RecallAnswer(msgspec.Struct, kw_only=True):
    """``POST /v1/users/{u}/recall``: the hits, best first, and the legs whose index lagged."""

    hits: list[Hit]
    degraded: list[str]


class Forgotten(msgspec.Struct, kw_only=True):
    """A forget's answer; on a cluster node with its tombstone's ``log_seq``."""

    forgotten: str
    log_seq: int | None = None


class Deleted(msgspec.Struct, kw_only=True):
    deleted: str


class Consolidated(msgspec.Struct, kw_only=True):
    consolidated: bool


_WIRE: dict[type, type] = {}


def wire_type(tp: Any) -> Any:
    """``tp`` as its values are sent (see :func:`plain`): a Struct encoded field by field
    (a stored record: array_like) becomes an object type of the same fields and name, inside
    lists, unions and dicts too; a tuple of items is a list."""
    origin = typing.get_origin(tp)
    if origin is not None:
        args = typing.get_args(tp)
        if origin in (typing.Union, types.UnionType):
            return typing.Union[tuple(wire_type(a) for a in args)]  # noqa: UP007
        if origin in (Literal, typing.Annotated):
            return tp
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            return list[wire_type(args[0])]  # type: ignore[misc]
        mapped = tuple(wire_type(a) for a in args)
        return origin[mapped] if len(mapped) > 1 else origin[mapped[0]]
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct) and not _objects_all_the_way(tp):
        mirror = _WIRE.get(tp)
        if mirror is None:
            mirror = _WIRE[tp] = msgspec.defstruct(
                tp.__name__, [(f.name, wire_type(f.type)) for f in msgspec.structs.fields(tp)],
                kw_only=True)
        return mirror
    return tp


def response_schemas(answers: dict[tuple[str, str], tuple[tuple[int, ...], Any]]
                     ) -> tuple[dict[tuple[str, str], dict[str, Any]], dict[str, Any]]:
    """Each operation's answer schema, and the components they refer to: ``answers`` maps
    (method, path) to (statuses, type)."""
    keys = list(answers)
    found, components = msgspec.json.schema_components(
        [wire_type(answers[k][1]) for k in keys], ref_template="#/components/schemas/{name}")
    return dict(zip(keys, found, strict=True)), components
