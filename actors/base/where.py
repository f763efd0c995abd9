"""Metadata filters with operators (mem0's shape), as recall's ``where=`` takes them.

A filter is a dict: each key a field, each value either a plain value (equality) or a dict of
operators (``eq ne gt gte lt lte in nin contains``, several ANDed), and the keys ``AND`` /
``OR`` (lists of filters) and ``NOT`` (a filter, or a list of filters ANDed) nest::

    {"channel": "web", "priority": {"gte": 2}, "lang": {"in": ["en", "pt"]},
     "OR": [{"title": {"contains": "trip"}}, {"NOT": {"kind": "turn"}}]}

:func:`parse` checks a filter and compiles it into a tree (every mistake is an
``InvalidInput`` naming its place, e.g. ``where.priority.gte``); :func:`attributes` gives what
a filter sees of a stored record, and :meth:`Node.matches` decides a record in Python. The text
index evaluates the same tree as a tantivy query over the same attributes (``actors.fulltext``),
so each search leg applies the filter inside its search and the two agree by construction.

Fields. A record's own fields go by their names (:data:`RECORD_FIELDS`): ``kind``, ``role``,
``session_id``, ``tags``, ``category``, ``key``, ``value``, ``importance``, ``confidence``,
``emotion``, ``origin``, ``agent_id`` and ``run_id``, each on the kinds that have it. Any other
name is a key of a turn's ``meta``; dots go into nested objects (``"trip.city"``), and
``meta.NAME`` names a meta key that a record field shadows. A field a record lacks matches no
comparison except ``ne`` and ``nin`` (as in MongoDB: ``NOT`` of ``eq`` and ``in``). A field
holding a list matches when any element does. Numbers compare as numbers (``2`` equals
``2.0``), never with booleans or strings; ``gt``/``gte``/``lt``/``lte`` take numbers only,
strictly between -2**53 and 2**53; ``kind`` and ``role`` take only the values records have
(``turn``, ``episode``, ``fact``, ``note``; ``user``, ``assistant``, ``system``, ``tool``);
``contains`` is a case-sensitive substring (at most 200 bytes of UTF-8, at most 4 contains
in a filter) of a string (of any string in a list). ``category`` compares as the engine tells
categories apart everywhere else (a fact under " identity" supersedes one under "Identity"):
case, spacing and composed or decomposed accents aside, ``contains`` too (:func:`folded`).
"""

from __future__ import annotations

import math
import re
from typing import Any

from .errors import InvalidInput
from .records import ROLES
from .text import composed, folded
from .validate import check_int, check_utf8
from .validate import found as _found

__all__ = ["OPERATORS", "RECORD_FIELDS", "Node", "attributes", "category_in", "conjunction",
           "parse", "regex_escape", "string_leaves", "turn_tags"]

OPERATORS = ("eq", "ne", "gt", "gte", "lt", "lte", "in", "nin", "contains")
LOGICAL = ("AND", "OR", "NOT")
MAX_DEPTH = 6  # AND / OR / NOT nested inside each other at most this deep
MAX_CONDITIONS = 64  # comparisons in one filter: each is a term or range in every text search
MAX_VALUES = 256  # values of one in / nin
# contains in one filter: each scans every distinct string attribute of the whole text index
# (0.3-0.5 s per 200,000 on a 2-core machine) in each of a recall's three searches.
MAX_CONTAINS = 4
MAX_VALUE_CHARS = 1_000  # characters of one string a filter compares with
# A contains value's bytes of UTF-8: the text index runs contains as a regular expression, and
# tantivy stops at 1,000 states, which 219 bytes reach under the longest field name.
MAX_CONTAINS_BYTES = 200
# gt / gte / lt / lte bounds lie strictly inside +-2**53: the text index compares a range's
# numbers as 64-bit floats, which tell every integer apart only below that.
MAX_RANGE = 2**53
# String attributes longer than this are not filterable (the text index keeps a term of at
# most 65,530 bytes; 4,096 characters are at most 16 KiB of UTF-8).
MAX_ATTR_CHARS = 4_096
# Field names: letters, digits, "_" and "-", dots between levels (the text index's query
# grammar reads such a path as one field name).
_SEGMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,63}\Z")
MAX_SEGMENTS = 8
# A record's own fields, and whether a filter compares them with numbers or with strings.
RECORD_FIELDS = {"kind": str, "role": str, "session_id": str, "tags": str, "category": str,
                 "key": str, "value": str, "importance": float, "confidence": float,
                 "emotion": str, "origin": str, "agent_id": str, "run_id": str}
# Record fields with a few known values: any other is a slip that would match nothing (or,
# with ne / nin, everything), so it is refused as recall's kinds= and roles= refuse it.
_KNOWN = {"kind": ("turn", "episode", "fact", "note"), "role": ROLES}
# Record fields held and compared folded (:func:`folded`), as the engine matches them.
_FOLDED = frozenset({"category"})
_RANGES = {"gt": (lambda a, b: a > b), "gte": (lambda a, b: a >= b),
           "lt": (lambda a, b: a < b), "lte": (lambda a, b: a <= b)}
_REGEX_META = frozenset("\\.+*?()|[]{}^$")


def turn_tags(turn: Any) -> tuple[str, ...]:
    """A turn's tags: the strings in ``meta["tags"]`` (the documented convention)."""
    tags = turn.meta.get("tags") if turn.meta else None
    if isinstance(tags, str):
        return (tags,)
    if isinstance(tags, list):
        return tuple(t for t in tags if isinstance(t, str))
    return ()


def attributes(record: Any) -> dict[str, dict[str, Any]]:
    """What a filter sees of a stored record: ``{"f": its own fields, "m": a turn's meta}``.

    Args:
        record: a Turn, Note, Fact or Episode (anything else has no attributes).
    """
    kind = type(record).__name__
    if kind == "Turn":
        fields: dict[str, Any] = {"kind": "turn", "role": record.role,
                                  "session_id": record.session_id, "tags": turn_tags(record)}
        meta = record.meta or {}
    elif kind == "Note":
        fields = {"kind": "note", "tags": record.tags}
        meta = {}
    elif kind == "Fact":
        # Its category as every record's, folded (below).
        fields = {"kind": "fact", "tags": (record.category,), "key": record.key,
                  "value": record.value, "importance": record.importance,
                  "confidence": record.confidence, "origin": record.origin}
        meta = {}
    elif kind == "Episode":
        fields = {"kind": "episode", "session_id": record.session_id}
        meta = {}
    else:
        return {"f": {}, "m": {}}
    for name in ("category", "importance", "emotion", "agent_id", "run_id"):
        value = getattr(record, name, None)
        if value is not None and value != "" and name not in fields:
            fields[name] = folded(value) if name in _FOLDED else value
    return {"f": fields, "m": _nameable(meta) if meta else meta}


def _nameable(value: Any) -> Any:
    """``value`` without the keys no field name of a filter can reach, at every level: the
    text index would read a key holding its separators ("\x01" between path levels, "\x00"
    before a ``contains`` value) as another path, found under a name the record lacks."""
    if isinstance(value, dict):
        return {k: _nameable(v) for k, v in value.items() if _SEGMENT.match(k)}
    if isinstance(value, list):
        return [_nameable(item) for item in value]
    return value


def _leaves(value: Any, path: tuple[str, ...]) -> list[Any]:
    """The scalar values at ``path`` under ``value``, lists flattened at every level."""
    if isinstance(value, list | tuple):
        return [leaf for item in value for leaf in _leaves(item, path)]
    if not path:
        if value is None or isinstance(value, dict):
            return []
        if isinstance(value, str) and len(value) > MAX_ATTR_CHARS:
            return []
        return [value]
    if isinstance(value, dict) and path[0] in value:
        return _leaves(value[path[0]], path[1:])
    return []


def string_leaves(attrs: dict[str, dict[str, Any]], skip: frozenset[str] = frozenset()
                  ) -> list[tuple[str, str]]:
    """Every string attribute as (dotted path, value), for the text index's ``contains``
    (the namespaces ``f`` and ``m`` lead each path; fields in ``skip`` left out)."""
    out: list[tuple[str, str]] = []

    def walk(value: Any, path: str) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                if "." not in key and not (path == "f" and key in skip):
                    walk(item, f"{path}.{key}")
        elif isinstance(value, list | tuple):
            for item in value:
                walk(item, path)
        elif isinstance(value, str) and len(value) <= MAX_ATTR_CHARS:
            out.append((path, value))

    for space in ("f", "m"):
        walk(attrs.get(space, {}), space)
    return out


def regex_escape(text: str) -> str:
    """``text`` as a literal in the text index's regular expressions (Rust's syntax)."""
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


def _same(a: Any, b: Any) -> bool:
    """Equality as the text index sees it: numbers by value, booleans and strings by type."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, str) or isinstance(b, str):
        return type(a) is type(b) and a == b
    return a == b


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class Node:
    """One node of a compiled filter: ``op`` is ``and``, ``or``, ``not``, or an operator
    comparing the attribute at ``path`` (``("f", "importance")``, ``("m", "trip", "city")``)
    with ``value``."""

    __slots__ = ("op", "path", "value", "children")

    def __init__(self, op: str, path: tuple[str, ...] = (), value: Any = None,
                 children: tuple[Node, ...] = ()) -> None:
        self.op, self.path, self.value, self.children = op, path, value, children

    def matches(self, attrs: dict[str, dict[str, Any]]) -> bool:
        """Whether a record with these :func:`attributes` passes the filter."""
        op = self.op
        if op == "and":
            return all(child.matches(attrs) for child in self.children)
        if op == "or":
            return any(child.matches(attrs) for child in self.children)
        if op == "not":
            return not self.children[0].matches(attrs)
        leaves = _leaves(attrs.get(self.path[0], {}), self.path[1:])
        value = self.value
        if op == "eq":
            return any(_same(leaf, value) for leaf in leaves)
        if op == "ne":
            return not any(_same(leaf, value) for leaf in leaves)
        if op == "in":
            return any(_same(leaf, v) for leaf in leaves for v in value)
        if op == "nin":
            return not any(_same(leaf, v) for leaf in leaves for v in value)
        if op == "contains":
            return any(isinstance(leaf, str) and value in leaf for leaf in leaves)
        compare = _RANGES[op]
        return any(_number(leaf) and compare(leaf, value) for leaf in leaves)

    def __repr__(self) -> str:
        if self.children:
            return f"{self.op}({', '.join(map(repr, self.children))})"
        return f"{'.'.join(self.path)} {self.op} {self.value!r}"


def _path(name: Any, where: str) -> tuple[str, ...]:
    if type(name) is not str:
        raise InvalidInput(where, f"expected field names as strings, found {_found(name)}")
    if not name.isascii():
        check_utf8(where, name)
    if name.startswith("meta."):
        space, rest = "m", name[5:]
    elif name in RECORD_FIELDS:
        return ("f", name)
    else:
        space, rest = "m", name
    segments = rest.split(".")
    if len(segments) > MAX_SEGMENTS or not all(_SEGMENT.match(s) for s in segments):
        shown = name if len(name) <= 60 else name[:57] + "..."
        raise InvalidInput(f"{where}.{shown}", "expected a field name of letters, digits, '_' "
                           f"and '-' (dots between at most {MAX_SEGMENTS} levels), found "
                           f"{shown!r}; use AND, OR or NOT (upper case) to combine filters")
    return (space, *segments)


def _in_range(value: int | float, field: str) -> None:
    """A number a stored value can equal: finite, or an int that metadata can hold (past
    that range the index cannot compare it, nor a float hold it)."""
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidInput(field, f"expected a finite number, found {value!r}")
    else:
        check_int(field, value)


def _scalar(value: Any, field: str, kind: type | None) -> Any:
    if _number(value):
        _in_range(value, field)
        if kind is str:
            raise InvalidInput(field, f"expected a string ({field.split('.')[-2]} is text), "
                                      f"found {_found(value)}")
        return value
    if type(value) is str:
        if not value.isascii():
            check_utf8(field, value)
        if len(value) > MAX_VALUE_CHARS:
            raise InvalidInput(field, f"expected at most {MAX_VALUE_CHARS} characters, found "
                                      f"{len(value)}")
        if kind is float:
            raise InvalidInput(field, f"expected a number ({field.split('.')[-2]} is a "
                                      f"number), found {_found(value)}")
        return value
    if type(value) is bool and kind is None:
        return value
    raise InvalidInput(field, "expected a string, a number or a boolean, found "
                              f"{_found(value)}" if kind is None else
                       f"expected a {'number' if kind is float else 'string'}, found "
                       f"{_found(value)}")


def parse(where: Any, field: str = "where") -> Node:
    """Check a filter and compile it.

    Args:
        where: the filter (see the module's docstring).
        field: the argument's name, which error messages start from.

    Returns:
        The filter's tree (an ``and`` of its conditions).

    Raises:
        InvalidInput: not a dict, an unknown operator or field name, a value of the wrong
            type, more than MAX_DEPTH levels of AND / OR / NOT, more than MAX_CONDITIONS
            comparisons; the field names the place (``where.OR[1].priority.gte``).
    """
    count = [0, 0]  # comparisons, contains among them
    node = _parse(where, field, 0, count)
    return node


def _parse(where: Any, field: str, depth: int, count: list[int]) -> Node:
    if depth > MAX_DEPTH:
        raise InvalidInput(field, f"expected AND / OR / NOT nested at most {MAX_DEPTH} levels "
                                  "deep, found deeper")
    if not isinstance(where, dict):
        raise InvalidInput(field, "expected a filter object like {\"channel\": \"web\", "
                                  f"\"priority\": {{\"gte\": 2}}}}, found {_found(where)}")
    if not where:
        raise InvalidInput(field, "expected at least one condition, found an empty filter")
    children: list[Node] = []
    for name, value in where.items():
        if name in ("AND", "OR"):
            items = [value] if isinstance(value, dict) else value
            if not isinstance(items, list) or not items:
                raise InvalidInput(f"{field}.{name}", "expected a non-empty list of filters, "
                                                      f"found {_found(value)}")
            parts = tuple(_parse(item, f"{field}.{name}[{i}]", depth + 1, count)
                          for i, item in enumerate(items))
            children.append(Node(name.lower(), children=parts))
        elif name == "NOT":
            items = [value] if isinstance(value, dict) else value
            if not isinstance(items, list) or not items:
                raise InvalidInput(f"{field}.NOT", "expected a filter or a non-empty list of "
                                                   f"filters, found {_found(value)}")
            parts = tuple(_parse(item, f"{field}.NOT[{i}]", depth + 1, count)
                          for i, item in enumerate(items))
            inner = parts[0] if len(parts) == 1 else Node("and", children=parts)
            children.append(Node("not", children=(inner,)))
        else:
            children.extend(_conditions(name, value, field, count))
    return children[0] if len(children) == 1 else Node("and", children=tuple(children))


def _conditions(name: Any, value: Any, field: str, count: list[int]) -> list[Node]:
    if type(name) is str and name.upper() in LOGICAL:  # "and" is a slip for "AND"
        raise InvalidInput(f"{field}.{name}", f"expected AND, OR or NOT, found {name!r}; use "
                                              "AND, OR or NOT (upper case), or meta."
                                              f"{name} for a meta key of that name")
    path = _path(name, field)
    kind = RECORD_FIELDS.get(path[1]) if path[0] == "f" else None
    place = f"{field}.{name}"
    if isinstance(value, dict):
        if not value:
            raise InvalidInput(place, "expected {operator: value} with an operator among "
                                      f"{', '.join(OPERATORS)}, found {{}}")
        ops = value.items()
    elif isinstance(value, list | tuple):
        raise InvalidInput(place, f"expected a value or {{operator: value}}, found "
                                  f"{_found(value)}; for any of several values use "
                                  "{\"in\": [...]}")
    else:
        ops = (("eq", value),)
    out = []
    for op, operand in ops:
        count[0] += 1
        if count[0] > MAX_CONDITIONS:
            raise InvalidInput(field, f"expected at most {MAX_CONDITIONS} comparisons, found "
                                      "more")
        at = f"{place}.{op}"
        if op not in OPERATORS:
            raise InvalidInput(at, f"expected an operator among {', '.join(OPERATORS)}, "
                                   f"found {_found(op)}")
        if op in ("in", "nin"):
            if not isinstance(operand, list | tuple) or not operand:
                raise InvalidInput(at, f"expected a non-empty list of values, found "
                                       f"{_found(operand)}")
            if len(operand) > MAX_VALUES:
                raise InvalidInput(at, f"expected at most {MAX_VALUES} values, found "
                                       f"{len(operand)}")
            operand = tuple(_scalar(v, f"{at}[{i}]", kind) for i, v in enumerate(operand))
        elif op in _RANGES:
            if not _number(operand):
                raise InvalidInput(at, f"expected a finite number, found {_found(operand)}")
            _in_range(operand, at)
            if not -MAX_RANGE < operand < MAX_RANGE:
                raise InvalidInput(at, "expected a number between -2**53 and 2**53 (a range "
                                       "compares numbers as 64-bit floats, exact only there), "
                                       f"found {operand!r}; compare larger ones with eq or in")
            if kind is str:
                raise InvalidInput(at, f"expected a field holding numbers ({name} is text), "
                                       f"found {op} {operand!r}")
        elif op == "contains":
            count[1] += 1
            if count[1] > MAX_CONTAINS:
                raise InvalidInput(field, f"expected at most {MAX_CONTAINS} contains in one "
                                          "filter, found more")
            if type(operand) is not str or not operand:
                raise InvalidInput(at, f"expected a non-empty string, found {_found(operand)}")
            if kind is float:
                raise InvalidInput(at, f"expected a text field ({name} is a number), found "
                                       f"contains {operand!r}")
            operand = _scalar(operand, at, kind)
            if path[0] == "f" and path[1] in _FOLDED:
                # A part of a folded value: cased and composed as it is, its spaces kept (one
                # space of a run; an edge space is part of what is looked for).
                operand = re.sub(r"\s+", " ", composed(operand).casefold())
            size = len(operand.encode())
            if size > MAX_CONTAINS_BYTES:
                raise InvalidInput(at, f"expected at most {MAX_CONTAINS_BYTES} bytes of UTF-8 "
                                       f"in a contains, found {size}; search for a shorter "
                                       "part of it")
        else:
            operand = _scalar(operand, at, kind)
        if path[0] == "f" and path[1] in _FOLDED and op != "contains":
            operand = (tuple(map(folded, operand)) if op in ("in", "nin") else folded(operand))
        known = _KNOWN.get(path[1]) if path[0] == "f" else None
        if known is not None and op != "contains":
            for i, item in enumerate(operand if op in ("in", "nin") else (operand,)):
                if item not in known:
                    raise InvalidInput(at if op not in ("in", "nin") else f"{at}[{i}]",
                                       f"expected one of {', '.join(known)}, found {item!r}")
        out.append(Node(op, path, operand))
    return out


def category_in(categories: tuple[str, ...]) -> Node:
    """recall's ``category=``: any of these categories, compared as ``where`` compares them
    (folded)."""
    return Node("in", ("f", "category"), tuple(map(folded, categories)))


def conjunction(*nodes: Node | None) -> Node | None:
    """The nodes given (None left out) ANDed; None when there are none."""
    kept = tuple(n for n in nodes if n is not None)
    if not kept:
        return None
    return kept[0] if len(kept) == 1 else Node("and", children=kept)
