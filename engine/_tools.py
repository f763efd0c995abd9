"""Seed 004's agent tools: JSON-schema definitions a model can call, and their dispatcher.

``TOOLS`` is in the OpenAI function-calling shape (``{"type": "function", "function": {...}}``),
which most chat APIs accept; ``Engine.call_tool(name, arguments)`` runs one and returns a
JSON-ready dict. Arguments are validated against the schema's types before anything runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import msgspec

from .errors import InvalidInput

if TYPE_CHECKING:
    from ._engine import Engine

__all__ = ["TOOLS", "call_tool"]


def _tool(name: str, description: str, properties: dict[str, Any],
          required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": required,
                       "additionalProperties": False}}}


_USER = {"type": "string", "description": "The user whose memory this is."}
_CATEGORY = {"type": "string", "description": "identity, preference, constraint, instruction, "
                                              "relationship, schedule, or another category."}
_KEY = {"type": "string", "description": "What the fact is about within its category, e.g. "
                                         "location, likes:jazz, allergy:peanuts."}

TOOLS: list[dict[str, Any]] = [
    _tool("search_memory", "Hybrid search (keywords + meaning) over the user's memories: "
          "turns, episodes, facts and notes. The main retrieval tool.",
          {"user_id": _USER, "query": {"type": "string"},
           "limit": {"type": "integer", "minimum": 1, "maximum": 50, "default": 10},
           "kinds": {"type": "array", "items": {"enum": ["turn", "episode", "fact", "note"]}}},
          ["user_id", "query"]),
    _tool("remember_fact", "Save a fact the user stated. A new value for the same category "
          "and key replaces the old one (kept in history).",
          {"user_id": _USER, "category": _CATEGORY, "key": _KEY, "value": {"type": "string"},
           "text": {"type": "string", "description": "The fact as one sentence."},
           "importance": {"type": "number", "minimum": 0, "maximum": 1}},
          ["user_id", "category", "key", "value"]),
    _tool("correct_fact", "Replace a wrong fact with the right value; the old one is retired.",
          {"user_id": _USER, "category": _CATEGORY, "key": _KEY, "value": {"type": "string"},
           "text": {"type": "string"}},
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
]

_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
_TYPES = {"string": str, "integer": int, "number": (int, float), "array": list}


def _check_arguments(name: str, schema: dict[str, Any], args: Mapping[str, Any]) -> None:
    for field in schema["required"]:
        if field not in args:
            raise InvalidInput(f"arguments.{field}", f"expected it for tool {name!r}, found "
                                                     "it missing")
    for field, value in args.items():
        spec = schema["properties"].get(field)
        if spec is None:
            raise InvalidInput(f"arguments.{field}", f"expected one of "
                                                     f"{', '.join(schema['properties'])}, found "
                                                     f"an unknown argument")
        expected = _TYPES.get(spec.get("type", "array"))
        if expected is not None and (not isinstance(value, expected)
                                     or isinstance(value, bool)):
            raise InvalidInput(f"arguments.{field}", f"expected a {spec.get('type')}, found "
                                                     f"{type(value).__name__}")


def _plain(value: msgspec.Struct) -> dict[str, Any]:
    """A record as a JSON-ready dict (stored records encode as arrays, so go by field)."""
    return msgspec.to_builtins(msgspec.structs.asdict(value))


async def call_tool(engine: Engine, name: str, arguments: Mapping[str, Any] | str
                    ) -> dict[str, Any]:
    schema = _SCHEMAS.get(name)
    if schema is None:
        raise InvalidInput("name", f"expected one of {', '.join(_SCHEMAS)}, found {name!r}")
    if isinstance(arguments, str):
        try:
            arguments = msgspec.json.decode(arguments)
        except msgspec.DecodeError as exc:
            raise InvalidInput("arguments", f"expected a JSON object, found {exc}") from None
    if not isinstance(arguments, Mapping):
        raise InvalidInput("arguments", f"expected an object, found {type(arguments).__name__}")
    args = dict(arguments)
    _check_arguments(name, schema, args)
    user_id = args.pop("user_id")
    if name == "search_memory":
        hits = await engine.recall(user_id, args["query"], args.get("limit", 10),
                                   kinds=args.get("kinds"))
        return {"results": [_plain(h) for h in hits]}
    if name == "remember_fact":
        fact = await engine.remember_fact(user_id, args["category"], args["key"], args["value"],
                                          text=args.get("text"),
                                          importance=args.get("importance", 0.7))
        return {"fact": _plain(fact)}
    if name == "correct_fact":
        fact = await engine.correct_fact(user_id, args["category"], args["key"], args["value"],
                                         text=args.get("text"))
        return {"fact": _plain(fact)}
    if name == "confirm_fact":
        return {"fact": _plain(await engine.confirm_fact(user_id, args["category"],
                                                         args["key"]))}
    if name == "memory_stats":
        return await engine.memory_stats(user_id)
    info = await engine.entity_info(user_id, args["name"], args.get("limit", 20))
    return {"entity": None if info is None else _plain(info.entity),
            "memories": [] if info is None else [_plain(h) for h in info.memories]}
