"""Seed 004's agent tools: JSON-schema definitions a model can call, and their dispatcher.

``TOOLS`` is in the OpenAI function-calling shape (``{"type": "function", "function": {...}}``),
which most chat APIs accept; ``Engine.call_tool(name, arguments)`` runs one and returns a
JSON-ready dict. Arguments are validated against the tool's own JSON schema (jsonschema,
every constraint: types, ``minimum``/``maximum``, enums, required, no extra fields) before
anything runs, so the schema a model sees is the rule the engine enforces.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any, Protocol

import jsonschema
import msgspec

from actors.base.errors import InvalidInput, NotFound
from actors.base.records import Fact, Note
from actors.base import validate as v
from actors.base.validate import shown

from ._hits import Hits
from ._memory import EntityInfo

__all__ = ["TOOLS", "ToolHost", "call_tool", "parameters", "MAX_REQUEST_BYTES"]

# The largest request either face reads (an HTTP body, an MCP line): a batch of turns at the
# engine's own limits fits; larger is refused unread.
MAX_REQUEST_BYTES = 8 << 20


class ToolHost(Protocol):
    """What the tools call: these public methods of the facade, and nothing else (``Engine``
    is one; the tools never see its parts)."""

    async def recall(self, user_id: str, query: str, limit: int | None = None, *,
                     kinds: Iterable[str] | None = None,
                     where: Mapping[str, Any] | None = None,
                     category: str | None = None, min_importance: float | None = None,
                     emotion: str | None = None,
                     as_of: datetime | None = None, agent_id: str | None = None,
                     run_id: str | None = None) -> Hits: ...

    async def remember_fact(self, user_id: str, category: str, key: str, value: str, *,
                            text: str | None = None, importance: float = 0.7,
                            valid_at: datetime | None = None) -> Fact: ...

    async def correct_fact(self, user_id: str, category: str, key: str, value: str, *,
                           text: str | None = None, valid_at: datetime | None = None) -> Fact: ...

    async def confirm_fact(self, user_id: str, category: str, key: str) -> Fact: ...

    async def memory_stats(self, user_id: str) -> dict[str, Any]: ...

    async def retrieve_memory(self, user_id: str, query: str,
                              conversation_id: str | None = None, episodic_limit: int = 5, *,
                              detail: str = "auto") -> str: ...

    async def store_note(self, user_id: str, text: str, *,
                         tags: Iterable[str] | None = None, importance: float | None = None,
                         emotion: str | None = None, category: str | None = None,
                         agent_id: str | None = None, run_id: str | None = None) -> Note: ...

    async def delete_note(self, user_id: str, note_id: str) -> bool: ...

    async def list_notes(self, user_id: str) -> list[Note]: ...

    async def entity_info(self, user_id: str, name: str,
                          limit: int = 20) -> EntityInfo | None: ...


def _tool(name: str, description: str, properties: dict[str, Any],
          required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": required,
                       "additionalProperties": False}}}


_USER = {"type": "string", "description": "The user whose memory this is."}
_CATEGORY = {"type": "string", "description": "identity, preference, constraint, instruction, "
                                              "relationship, schedule, or another category."}
_AGENT = {"type": "string", "description": "The agent whose memories these are (a scope "
                                           "within the user)."}
_RUN = {"type": "string", "description": "The run (one conversation or task) whose memories "
                                         "these are."}
_KEY = {"type": "string", "description": "What the fact is about within its category, e.g. "
                                         "location, likes:jazz, allergy:peanuts."}
_VALID_AT = {"type": "string", "description": "Since when it is true, if not now (the user "
             "said when): an ISO 8601 time with its zone, e.g. 2026-01-15T09:00:00Z."}

TOOLS: list[dict[str, Any]] = [
    _tool("search_memory", "Hybrid search (keywords + meaning) over the user's memories: "
          "turns, episodes, facts and notes. The main retrieval tool.",
          {"user_id": _USER, "query": {"type": "string"},
           "limit": {"type": "integer", "minimum": 1, "maximum": 50, "default": 10},
           "kinds": {"type": "array", "minItems": 1, "maxItems": 16,
                     "items": {"enum": ["turn", "episode", "fact", "note"]}},
           "where": {"type": "object", "description": "Only memories passing this filter, e.g. "
                     "{\"channel\": \"web\", \"priority\": {\"gte\": 2}}: operators eq ne "
                     "gt gte lt lte in nin contains; AND / OR / NOT take lists of filters; "
                     "fields are a turn's meta keys and category, key, value, importance, "
                     "tags, kind, role, session_id."},
           "category": {"type": "string", "description": "Only notes and facts of this "
                        "category."},
           "min_importance": {"type": "number", "minimum": 0, "maximum": 1,
                              "description": "Only notes and facts at least this important."},
           "emotion": {"type": "string", "description": "Only notes with this emotion "
                       "label, e.g. joy."},
           "as_of": {"type": "string", "description": "Answer as memory stood then: an ISO "
                     "8601 time with its zone, e.g. 2026-01-15T09:00:00Z."},
           "agent_id": _AGENT, "run_id": _RUN},
          ["user_id", "query"]),
    _tool("remember_fact", "Save a fact the user stated. A new value for the same category "
          "and key replaces the old one (kept in history), unless the user confirmed or "
          "corrected that one: replace it with correct_fact then.",
          {"user_id": _USER, "category": _CATEGORY, "key": _KEY, "value": {"type": "string"},
           "text": {"type": "string", "description": "The fact as one sentence."},
           "importance": {"type": "number", "minimum": 0, "maximum": 1},
           "valid_at": _VALID_AT},
          ["user_id", "category", "key", "value"]),
    _tool("correct_fact", "Replace a wrong fact with the right value; the old one is retired.",
          {"user_id": _USER, "category": _CATEGORY, "key": _KEY, "value": {"type": "string"},
           "text": {"type": "string"}, "valid_at": _VALID_AT},
          ["user_id", "category", "key", "value"]),
    _tool("confirm_fact", "Mark a fact as confirmed by the user: protected, it never decays.",
          {"user_id": _USER, "category": _CATEGORY, "key": _KEY},
          ["user_id", "category", "key"]),
    _tool("memory_stats", "Counts of the user's memories by kind, and the latest one's time.",
          {"user_id": _USER}, ["user_id"]),
    _tool("get_entity_info", "Everything remembered about a person, place or thing: the "
          "entity and the memories that mention it.",
          {"user_id": _USER, "name": {"type": "string"},
           "limit": {"type": "integer", "minimum": 1, "maximum": 100, "default": 20}},
          ["user_id", "name"]),
    # Beyond seed 004's six: the prompt-ready recall and seed 003's notes, so an agent host
    # (MCP) can do everything a bot does through the facade.
    _tool("retrieve_memory", "Prompt-ready Markdown of what matters for a query: the user's "
          "facts, then the relevant past episodes with their key moments.",
          {"user_id": _USER, "query": {"type": "string"},
           "conversation_id": {"type": "string", "description": "The conversation the "
                               "answer goes to."},
           "episodic_limit": {"type": "integer", "minimum": 1, "maximum": 100, "default": 5},
           "detail": {"enum": ["auto", "none", "low", "high"], "default": "auto"}},
          ["user_id", "query"]),
    _tool("store_note", "Keep a note about the user (recall finds it like any memory).",
          {"user_id": _USER, "text": {"type": "string"},
           "tags": {"type": "array", "maxItems": v.MAX_WORDS, "items": {"type": "string"}},
           "importance": {"type": "number", "minimum": 0, "maximum": 1,
                          "description": "How much it matters, 0-1 (default 0.5)."},
           "emotion": {"type": "string", "description": "The feeling it carries, one or two "
                       "words: joy, curiosity, frustration..."},
           "category": {"type": "string", "description": "What it is about: travel, work..."},
           "agent_id": _AGENT, "run_id": _RUN},
          ["user_id", "text"]),
    _tool("delete_note", "Delete one of the user's notes by id.",
          {"user_id": _USER, "note_id": {"type": "string"}}, ["user_id", "note_id"]),
    _tool("list_notes", "The user's notes, most recently updated first, each with the id "
          "that delete_note takes.", {"user_id": _USER}, ["user_id"]),
]

_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
# Levels of lists and objects an argument may hold: a where filter's deepest (AND / OR / NOT
# six deep) is well within it.
MAX_NESTING = 32


def parameters(name: str, *, one_user: bool = False) -> dict[str, Any]:
    """A tool's JSON schema; ``one_user``: for a caller acting for one user (``engram-trio
    mcp --user``), so without ``user_id``. A copy: the caller may change it."""
    schema = copy.deepcopy(_SCHEMAS[name])
    if one_user:
        del schema["properties"]["user_id"]
        schema["required"].remove("user_id")
    return schema


def _rule(name: str, one_user: bool) -> tuple[dict[str, Any], jsonschema.Validator]:
    schema = parameters(name, one_user=one_user)
    return schema, jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


# (tool, acting for one user) -> the schema its arguments must fit, and that schema's validator
_RULES = {(name, one_user): _rule(name, one_user) for name in _SCHEMAS
          for one_user in (False, True)}


def _check_lengths(name: str, args: Mapping[str, Any], one_user: bool) -> None:
    """Raise InvalidInput for a list argument longer than its schema's maxItems, before
    anything reads its items: the schema check finds an error in every wrong item (a
    million wrong tags held the loop for 14 s), and the depth check walks them all."""
    properties = _RULES[name, one_user][0]["properties"]
    for field, value in args.items():
        limit = properties.get(field, {}).get("maxItems") if isinstance(field, str) else None
        if limit is not None and isinstance(value, list) and len(value) > limit:
            raise InvalidInput(f"arguments.{field}", f"expected at most {limit} items, found "
                                                     f"{len(value)}")


def _check_arguments(name: str, args: Mapping[str, Any], one_user: bool) -> None:
    """Raise InvalidInput for the first schema violation, naming the argument's path."""
    schema, validator = _RULES[name, one_user]
    error = jsonschema.exceptions.best_match(validator.iter_errors(args))
    if error is None:
        return
    path = ["arguments", *(str(p) for p in error.absolute_path)]
    match error.validator:
        case "required":
            missing = next(f for f in error.validator_value if f not in error.instance)
            raise InvalidInput(".".join([*path, missing]),
                               f"expected it for tool {name!r}, found it missing")
        case "additionalProperties":
            extra = next(f for f in error.instance if f not in schema["properties"])
            extra = extra if len(extra) <= 60 else extra[:57] + "..."
            if not schema["properties"]:
                raise InvalidInput(".".join([*path, extra]),
                                   f"expected no arguments for tool {name!r}, found one")
            raise InvalidInput(".".join([*path, extra]),
                               f"expected one of {', '.join(schema['properties'])}, found an "
                               "unknown argument")
        case "type":
            kind = error.validator_value
            article = "an" if str(kind)[:1] in "aeiou" else "a"
            raise InvalidInput(".".join(path), f"expected {article} {kind}, found "
                                               f"{type(error.instance).__name__}")
    raise InvalidInput(".".join(path), f"expected {error.validator} {error.validator_value!r}, "
                                       f"found {_shown(error.instance)}")


def _check_depth(args: dict[str, Any]) -> None:
    """Raise InvalidInput for an argument nested deeper than MAX_NESTING: the schema check
    descends by recursion (a list nested 50,000 deep raised RecursionError in it), and no
    tool takes anything near that deep. Walked without recursion."""
    stack: list[tuple[str, Any, int]] = [(k, v, 1) for k, v in args.items()]
    while stack:
        field, value, depth = stack.pop()
        if isinstance(value, dict | list | tuple):
            if depth > MAX_NESTING:
                name = str(field) if len(str(field)) <= 60 else str(field)[:57] + "..."
                raise InvalidInput(f"arguments.{name}", f"expected a value nested at most "
                                                        f"{MAX_NESTING} levels deep, found one "
                                                        "nested deeper")
            items = value.values() if isinstance(value, dict) else value
            stack.extend((field, item, depth + 1) for item in items)


def _shown(value: Any) -> str:
    """A value for an error, cut to 60 characters: a model may send a megabyte where a word
    goes (or a list nested thousands deep), and the error goes back into its context."""
    found = shown(value)
    return found if len(found) <= 60 else found[:57] + "..."


def _time(args: Mapping[str, Any], name: str) -> datetime | None:
    """An ISO 8601 argument as a datetime with its zone, in the engine's range; a refusal
    names the argument as the caller sent it (``arguments.as_of``), whichever check fails."""
    value = args.get(name)
    if value is None:
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        parsed = None
    if parsed is None or parsed.tzinfo is None:
        raise InvalidInput(f"arguments.{name}", "expected an ISO 8601 time with its zone, "
                                                f"e.g. 2026-01-15T09:00:00Z, found "
                                                f"{_shown(value)}")
    return v.check_at(parsed, f"arguments.{name}")


def _plain(value: msgspec.Struct) -> dict[str, Any]:
    """A record as a JSON-ready dict (stored records encode as arrays, so go by field)."""
    return msgspec.to_builtins(msgspec.structs.asdict(value))


async def call_tool(engine: ToolHost, name: str, arguments: Mapping[str, Any] | str, *,
                    user: str | None = None) -> dict[str, Any]:
    """Run one of :data:`TOOLS` on ``engine``.

    Args:
        user: act for this user only: the arguments take no ``user_id`` (the tool's schema
            without it is the rule, and its errors name only what the caller can send).

    Raises:
        InvalidInput: an unknown tool, or arguments that do not fit its schema.
    """
    schema = _SCHEMAS.get(name) if isinstance(name, str) else None
    if schema is None:
        raise NotFound("name", f"expected one of {', '.join(_SCHEMAS)}, found {_shown(name)}")
    if isinstance(arguments, str):
        try:
            arguments = msgspec.json.decode(arguments)
        except msgspec.DecodeError as exc:
            raise InvalidInput("arguments", f"expected a JSON object, found {exc}") from None
        except RecursionError:  # the decoder recurses into each level of nesting
            raise InvalidInput("arguments", "expected a JSON object, found one nested deeper "
                                            "than the decoder descends") from None
    if not isinstance(arguments, Mapping):
        raise InvalidInput("arguments", f"expected an object, found {type(arguments).__name__}")
    args = dict(arguments)
    _check_lengths(name, args, user is not None)
    _check_depth(args)
    _check_arguments(name, args, user is not None)
    for field, rule in schema["properties"].items():
        if rule.get("type") == "integer" and type(args.get(field)) is float:
            args[field] = int(args[field])  # JSON Schema's integer takes 5.0; the engine, 5
    user_id = args.pop("user_id") if user is None else user
    if name == "search_memory":
        hits = await engine.recall(user_id, args["query"], args.get("limit", 10),
                                   kinds=args.get("kinds"), where=args.get("where"),
                                   category=args.get("category"),
                                   min_importance=args.get("min_importance"),
                                   emotion=args.get("emotion"), as_of=_time(args, "as_of"),
                                   agent_id=args.get("agent_id"), run_id=args.get("run_id"))
        found = {"results": [_plain(h) for h in hits]}
        if hits.degraded:  # a model should know the search was partial
            found["degraded"] = list(hits.degraded)
        return found
    if name == "remember_fact":
        fact = await engine.remember_fact(user_id, args["category"], args["key"], args["value"],
                                          text=args.get("text"),
                                          importance=args.get("importance", 0.7),
                                          valid_at=_time(args, "valid_at"))
        return {"fact": _plain(fact)}
    if name == "correct_fact":
        fact = await engine.correct_fact(user_id, args["category"], args["key"], args["value"],
                                         text=args.get("text"), valid_at=_time(args, "valid_at"))
        return {"fact": _plain(fact)}
    if name == "confirm_fact":
        return {"fact": _plain(await engine.confirm_fact(user_id, args["category"],
                                                         args["key"]))}
    if name == "memory_stats":
        return await engine.memory_stats(user_id)
    if name == "retrieve_memory":
        return {"markdown": await engine.retrieve_memory(
            user_id, args["query"], args.get("conversation_id"), args.get("episodic_limit", 5),
            detail=args.get("detail", "auto"))}
    if name == "store_note":
        return {"note": _plain(await engine.store_note(
            user_id, args["text"], tags=args.get("tags"), importance=args.get("importance"),
            emotion=args.get("emotion"), category=args.get("category"),
            agent_id=args.get("agent_id"), run_id=args.get("run_id")))}
    if name == "delete_note":
        return {"deleted": await engine.delete_note(user_id, args["note_id"])}
    if name == "list_notes":
        return {"notes": [_plain(note) for note in await engine.list_notes(user_id)]}
    info = await engine.entity_info(user_id, args["name"], args.get("limit", 20))
    return {"entity": None if info is None else _plain(info.entity),
            "memories": [] if info is None else [_plain(h) for h in info.memories]}
