"""Input checks for the public API: each says what was expected, what was found and the fix.

They run before anything is written, so a rejected call leaves the store untouched. They are on
the hot ingest path, so each is a few type and length tests; the expensive checks (meta) only
run on what the caller actually passed.
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Any

import msgspec

from ._records import ROLES
from .errors import InvalidInput

_ROLES = frozenset(ROLES)
_JSON_SCALARS = (str, int, float, bool, type(None))
_json_encode = msgspec.json.Encoder().encode


def _found(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def _check_string(field: str, value: Any, max_chars: int, fix: str) -> str:
    """A non-empty, non-blank str of at most ``max_chars`` that UTF-8 can encode."""
    if type(value) is not str:
        raise InvalidInput(field, f"expected a non-empty string, found {_found(value)}")
    if not value or value.isspace():
        raise InvalidInput(field, f"expected a non-empty string, found {value!r}")
    if len(value) > max_chars:
        raise InvalidInput(
            field, f"expected at most {max_chars} characters, found {len(value)}; {fix}"
        )
    if not value.isascii():
        try:
            value.encode()
        except UnicodeEncodeError as exc:
            raise InvalidInput(
                field, f"expected text encodable as UTF-8, found {exc.reason} at {exc.start}"
            ) from None
    return value


def check_id(field: str, value: Any, max_chars: int) -> str:
    _check_string(field, value, max_chars,
                  "use a shorter id (a hash of a long one works) or raise Config.max_id_chars")
    if "\x00" in value:
        raise InvalidInput(field, f"expected no NUL character, found one in {value!r}")
    return value


def check_role(value: Any) -> str:
    if value not in _ROLES or type(value) is not str:
        expected = ", ".join(repr(r) for r in ROLES)
        raise InvalidInput("role", f"expected one of {expected}, found {_found(value)}")
    return value


def check_text(field: str, value: Any, max_chars: int) -> str:
    return _check_string(field, value, max_chars,
                         "split it into several turns or raise Config.max_text_chars")


def check_at(value: Any) -> datetime:
    if not isinstance(value, datetime):
        raise InvalidInput("at", f"expected a timezone-aware datetime, found {_found(value)}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise InvalidInput(
            "at",
            f"expected a timezone-aware datetime, found a naive datetime {value.isoformat()}; "
            "pass tzinfo=timezone.utc (or the user's zone)",
        )
    return value


def _check_json(value: Any, path: str, depth: int) -> None:
    if depth > 32:
        raise InvalidInput(path, "expected JSON nested at most 32 levels deep, found deeper")
    if isinstance(value, _JSON_SCALARS):
        if isinstance(value, float) and not math.isfinite(value):
            raise InvalidInput(path, f"expected a JSON value, found {value!r} (not valid JSON)")
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_json(item, f"{path}[{i}]", depth + 1)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if type(key) is not str:
                raise InvalidInput(path, f"expected string keys, found key {_found(key)}")
            _check_json(item, f"{path}[{key!r}]", depth + 1)
        return
    raise InvalidInput(path, f"expected a JSON-serialisable value, found {_found(value)}")


def check_meta(value: Any, max_bytes: int) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidInput("meta", f"expected a JSON-serialisable dict, found {_found(value)}")
    if not value:
        return {}
    _check_json(value, "meta", 0)
    try:
        size = len(_json_encode(value))
    except (msgspec.EncodeError, UnicodeEncodeError) as exc:
        raise InvalidInput("meta", f"expected a JSON-serialisable dict, found {exc}") from None
    if size > max_bytes:
        raise InvalidInput(
            "meta",
            f"expected at most {max_bytes} bytes as JSON, found {size}; "
            "keep large payloads elsewhere and store a reference, or raise Config.max_meta_bytes",
        )
    return value
