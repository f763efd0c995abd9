"""Input checks for the public API: each says what was expected, what was found and the fix.

They run before anything is written, so a rejected call leaves the store untouched. They are on
the hot ingest path, so each is a few type and length tests; the expensive checks (meta) only
run on what the caller actually passed.
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Mapping
from datetime import datetime, timezone
from operator import attrgetter
from typing import Any

import msgspec

from .errors import InvalidInput
from .keys import LEGACY_ID_BYTES, MAX_ID_BYTES
from .records import ROLES

_ROLES = frozenset(ROLES)
# The dates the text index holds (tantivy keeps nanoseconds in an i64: 1677-09-21 to
# 2262-04-11), with a margin so that times derived from them (decay, review intervals,
# focus windows) stay inside too.
MIN_AT = datetime(1700, 1, 1, tzinfo=timezone.utc)
MAX_AT = datetime(2199, 12, 31, 23, 59, 59, 999999, tzinfo=timezone.utc)
MIN_INT, MAX_INT = -(2**63), 2**63 - 1  # what msgpack (and every index) round-trips as an int
MAX_WORDS = 64  # tags or keywords on one call
# Folders in a path the engine makes or opens: far past any real one. pathlib makes missing
# parents (and resolves) one recursion a level, and ~1,000 levels raised RecursionError.
MAX_DEPTH = 256
_JSON_SCALARS = (str, int, float, bool, type(None))
_json_encode = msgspec.json.Encoder().encode
_json_decode = msgspec.json.Decoder().decode


# What an error message shows of a value: a few levels and characters of its repr, so a
# list nested 50,000 deep is shown rather than raising RecursionError, and a million items
# are not all written out to be cut.
_SHOWN = reprlib.Repr()
_SHOWN.maxstring = _SHOWN.maxother = 60


def shown(value: Any) -> str:
    """A value as an error message shows it: a few levels and characters of its repr."""
    return _SHOWN.repr(value)


def found(value: Any) -> str:
    """What was found, for an error message: its type and :func:`shown`, cut to 60 chars."""
    text = _SHOWN.repr(value)
    return f"{type(value).__name__} {text[:57] + '...' if len(text) > 60 else text}"



def _check_string(field: str, value: Any, max_chars: int, fix: str) -> str:
    """A non-empty, non-blank str of at most ``max_chars`` that UTF-8 can encode."""
    if type(value) is not str:
        raise InvalidInput(field, f"expected a non-empty string, found {found(value)}")
    if not value or value.isspace():
        raise InvalidInput(field, f"expected a non-empty string, found {value!r}")
    if len(value) > max_chars:
        raise InvalidInput(
            field, f"expected at most {max_chars} characters, found {len(value)}; {fix}"
        )
    if not value.isascii():
        check_utf8(field, value)
    return value


def encodable(text: str) -> bool:
    """Whether UTF-8 can encode ``text`` (it holds no lone surrogate)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def check_utf8(field: str, value: str) -> None:
    """Text every store and index can hold: encodable as UTF-8 (no lone surrogate)."""
    try:
        value.encode()
    except UnicodeEncodeError as exc:
        raise InvalidInput(
            field, f"expected text encodable as UTF-8, found {exc.reason} at {exc.start} "
                   "(a lone surrogate)"
        ) from None


def check_id(field: str, value: Any, max_chars: int, what: str = "id",
             lookup: bool = False) -> str:
    """An id: at most ``max_chars`` characters and MAX_ID_BYTES bytes of UTF-8, no NUL (the
    key separator): two ids and a sequence number must fit in one LMDB key.

    Args:
        lookup: the call only reads or forgets what is stored: ids up to LEGACY_ID_BYTES,
            which stores written before the byte limit may hold, are accepted too.
    """
    _check_string(field, value, max_chars,
                  f"use a shorter {what} (a hash of a long one works) or raise "
                  "Config.max_id_chars")
    size = len(value) if value.isascii() else len(value.encode())
    if size > MAX_ID_BYTES and not (lookup and size <= LEGACY_ID_BYTES):
        fix = (f"ids of up to {LEGACY_ID_BYTES} bytes, which stores written before this limit "
               "may hold, can still be read and forgotten" if lookup
               else f"use a shorter {what} (a hash of a long one works)")
        raise InvalidInput(field, f"expected at most {MAX_ID_BYTES} bytes in UTF-8, found "
                                  f"{size}; {fix}")
    if "\x00" in value:
        raise InvalidInput(field, f"expected no NUL character, found one in {value!r}")
    return value


def check_words(field: str, values: Any) -> tuple[str, ...]:
    """Tags or keywords: a string or an iterable of non-empty strings, each at most
    MAX_ID_BYTES bytes of UTF-8, at most MAX_WORDS of them."""
    if values is None:
        return ()
    if isinstance(values, str):
        values = (values,)
    if isinstance(values, Mapping):  # its keys are not what a caller with a dict meant
        raise InvalidInput(field, f"expected a list of strings, found {found(values)}")
    try:
        values = tuple(values)
    except TypeError:
        raise InvalidInput(field, f"expected a list of strings, found {found(values)}") from None
    if len(values) > MAX_WORDS:
        raise InvalidInput(field, f"expected at most {MAX_WORDS} {field}, found {len(values)}")
    for i, value in enumerate(values):
        check_id(f"{field}[{i}]", value, 4 * MAX_ID_BYTES, what=field.rstrip("s"))
    return values


def check_role(value: Any) -> str:
    if type(value) is not str or value not in _ROLES:  # the type first: a list is unhashable
        expected = ", ".join(repr(r) for r in ROLES)
        raise InvalidInput("role", f"expected one of {expected}, found {found(value)}")
    return value


def check_flag(field: str, value: Any) -> bool:
    """True or False itself: a flag taken by its truth would read "no" (or "false") as True."""
    if type(value) is not bool:
        raise InvalidInput(field, f"expected True or False, found {found(value)}")
    return value


def check_text(field: str, value: Any, max_chars: int) -> str:
    return _check_string(field, value, max_chars,
                         "split it into several turns or raise Config.max_text_chars")


def check_at(value: Any, field: str = "at") -> datetime:
    """A timezone-aware datetime from MIN_AT to MAX_AT (what the text index can hold), as
    ``datetime`` itself: a subclass's (pandas' Timestamp, pendulum's, arrow's), which the
    record encoder refuses, comes back as the plain UTC datetime of the same instant."""
    if not isinstance(value, datetime):
        raise InvalidInput(field, f"expected a timezone-aware datetime, found {found(value)}")
    try:
        offset = value.utcoffset()
    except Exception as exc:  # a tzinfo of the caller's that fails
        raise InvalidInput(field, f"expected a timezone-aware datetime, found one whose "
                                  f"utcoffset() raised {exc!r}") from None
    if value.tzinfo is None or offset is None:
        raise InvalidInput(
            field,
            f"expected a timezone-aware datetime, found a naive datetime {value.isoformat()}; "
            "pass tzinfo=timezone.utc (or the user's zone)",
        )
    try:
        inside = MIN_AT <= value <= MAX_AT
    except OverflowError:  # datetime.max/min in a zone that moves it past year 1 or 9999
        inside = False
    if not inside:
        raise InvalidInput(field, f"expected a date from {MIN_AT:%Y-%m-%d} to {MAX_AT:%Y-%m-%d} "
                                  f"(UTC), the text index's range, found {value.isoformat()}")
    if type(value) is not datetime:
        # From the wall time and its offset: astimezone may keep the subclass, and a pytz
        # zone passed as tzinfo= would take its first offset (LMT).
        return datetime(value.year, value.month, value.day, value.hour, value.minute,
                        value.second, value.microsecond, _UTC) - offset
    return value


def check_int(field: str, value: int, advice: str = "") -> None:
    """An int metadata can hold: what msgpack and every index round-trip."""
    if not MIN_INT <= value <= MAX_INT:
        # Past a few thousand digits Python refuses to print an int: say its size instead.
        shown = value if value.bit_length() <= 256 else f"one of {value.bit_length()} bits"
        raise InvalidInput(field, f"expected an integer from -2**63 to 2**63-1, found "
                                  f"{shown}{advice}")


def _check_json(value: Any, path: str, depth: int) -> None:
    if depth > 32:
        raise InvalidInput(path, "expected JSON nested at most 32 levels deep, found deeper")
    if isinstance(value, _JSON_SCALARS):
        if isinstance(value, float) and not math.isfinite(value):
            raise InvalidInput(path, f"expected a JSON value, found {value!r} (not valid JSON)")
        if isinstance(value, int):
            check_int(path, value, "; store a larger number as a string")
        if isinstance(value, str) and not value.isascii():
            check_utf8(path, value)
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_json(item, f"{path}[{i}]", depth + 1)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if type(key) is not str:
                raise InvalidInput(path, f"expected string keys, found key {found(key)}")
            if not key.isascii():
                check_utf8(path, key)
            _check_json(item, f"{path}[{key!r}]", depth + 1)
        return
    raise InvalidInput(path, f"expected a JSON-serialisable value, found {found(value)}")


def check_meta(value: Any, max_bytes: int) -> dict[str, Any]:
    """A copy of ``value`` as the record will hold it (decoded from the JSON its size is
    measured by: tuples as lists, enums as their values), so a caller that goes on changing
    its dict changes no stored turn."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidInput("meta", f"expected a JSON-serialisable dict, found {found(value)}")
    if not value:
        return {}
    _check_json(value, "meta", 0)
    try:
        encoded = _json_encode(value)
    except (msgspec.EncodeError, UnicodeEncodeError, OverflowError, TypeError) as exc:
        # TypeError: a subclass of a JSON type (a str's) that the type checks let through.
        raise InvalidInput("meta", f"expected a dict of plain JSON values (str, int, float, "
                                   f"bool, None, list, dict), found {exc}; convert the value, "
                                   "e.g. str(value)") from None
    size = len(encoded)
    if size > max_bytes:
        raise InvalidInput(
            "meta",
            f"expected at most {max_bytes} bytes as JSON, found {size}; "
            "keep large payloads elsewhere and store a reference, or raise Config.max_meta_bytes",
        )
    return _json_decode(encoded)


# -- columns -------------------------------------------------------------------------------
# The same checks over a whole column of a batch (``add_turns``), each a few loops in C. They
# never raise: True means every value passes the check of one value above; False means one
# may not, and the caller runs the checks one value at a time, whose error names it.

_tzinfo = attrgetter("tzinfo")
_UTC = timezone.utc


def roles_pass(values: list[Any]) -> bool:
    """Whether ``check_role`` passes every value."""
    return set(map(type, values)) == {str} and set(values) <= _ROLES


def ids_pass(values: list[Any], max_chars: int) -> bool:
    """Whether ``check_id`` passes every value (all of them ASCII: any other takes the
    checks one at a time)."""
    if not values:
        return True
    if set(map(type, values)) != {str} or not all(map(str.isascii, values)):
        return False
    if min(map(len, values)) < 1 or max(map(len, values)) > min(max_chars, MAX_ID_BYTES):
        return False
    return not any(map(str.isspace, values)) and "\x00" not in "".join(values)


def texts_pass(values: list[Any], max_chars: int) -> bool:
    """Whether ``check_text`` passes every value."""
    if set(map(type, values)) != {str} or any(map(str.isspace, values)):
        return False
    if min(map(len, values)) < 1 or max(map(len, values)) > max_chars:
        return False
    if not all(map(str.isascii, values)):
        try:
            "".join(value for value in values if not value.isascii()).encode()
        except UnicodeEncodeError:  # a lone surrogate
            return False
    return True


def ats_pass(values: list[Any]) -> bool:
    """Whether ``check_at`` passes every value (all of them UTC datetimes: any other zone
    takes the checks one at a time)."""
    return (set(map(type, values)) == {datetime} and set(map(_tzinfo, values)) == {_UTC}
            and MIN_AT <= min(values) and max(values) <= MAX_AT)
