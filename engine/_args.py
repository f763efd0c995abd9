"""Argument checks the engine's concerns share, beyond those of the bottom layer
(``actors.base.validate``): counts, fractions, choices and text lists as the public methods
take them. Each raises ``InvalidInput`` naming the argument, what was expected and found.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable, Mapping
from typing import Any

from actors.base import validate as v
from actors.base.errors import InvalidInput
from actors.base.text import composed
from actors.base.validate import shown

__all__ = ["check_count", "check_fraction", "check_label", "check_labels", "check_texts",
           "choices", "reason", "shown", "words"]

MAX_LABEL_CHARS = 64  # a note's emotion: a word or two
_LABEL = re.compile(r"[^\W_][\w -]*\Z")


def check_fraction(field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise InvalidInput(field, f"expected a number from 0 to 1, found {value!r}")
    return float(value)


def check_label(field: str, value: Any) -> str:
    """A free label (a note's emotion): letters, digits, spaces, '-' and '_', at most
    MAX_LABEL_CHARS, returned composed (NFC) and lower-case with its spacing tidied; ""
    stays "" (none)."""
    if type(value) is not str:
        raise InvalidInput(field, f"expected a string, found {type(value).__name__} "
                                  f"{shown(value)}")
    label = " ".join(composed(value).split()).lower()
    if len(label) > MAX_LABEL_CHARS:
        raise InvalidInput(field, f"expected at most {MAX_LABEL_CHARS} characters, found "
                                  f"{len(label)}")
    if label and not (_LABEL.match(label) or _marked_label(label)):
        raise InvalidInput(field, "expected a label of letters, digits, spaces, '-' and '_' "
                                  f"(e.g. 'joy', 'mild worry'), found {value!r}")
    return label


def _marked_label(label: str) -> bool:
    """A label whose words hold combining marks (Devanagari's vowel signs, Thai's, the dot
    'İ' lower-cases into), which a regular expression's word class does not take: the label
    with its marks set aside passes, and every mark follows a letter or another mark."""
    marks = [unicodedata.category(c).startswith("M") for c in label]
    if marks[0] or any(mark and label[i - 1] in " -_" for i, mark in enumerate(marks)):
        return False  # a mark belongs to the letter before it
    bare = "".join(c for c, mark in zip(label, marks) if not mark)
    return bool(bare) and _LABEL.match(bare) is not None


def check_labels(field: str, values: Any) -> tuple[str, ...] | None:
    """One label or a list of them (recall's ``emotion``), none of them empty."""
    if values is None:
        return None
    items = [values] if isinstance(values, str) else values
    if not isinstance(items, list | tuple) or not items:
        raise InvalidInput(field, f"expected a label or a non-empty list of labels, found "
                                  f"{shown(values)}")
    labels = tuple(check_label(field, item) for item in items)
    if not all(labels):
        raise InvalidInput(field, "expected a label (e.g. 'joy'), found an empty one")
    return labels


def check_count(field: str, value: Any, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:
        raise InvalidInput(field, f"expected an integer from {low} to {high}, found {value!r}")
    return value


def choices(field: str, values: Iterable[str] | None,
            allowed: tuple[str, ...]) -> tuple[str, ...] | None:
    """A filter's values among ``allowed``: one, or a non-empty list;
    None (no filter) stays None."""
    if values is None:
        return None
    given = values
    _not_a_mapping(field, values, f"a list of {', '.join(allowed)}")
    if isinstance(values, str):
        values = (values,)
    try:
        values = tuple(values)
    except TypeError:
        raise InvalidInput(field, f"expected a list of {', '.join(allowed)}, found "
                                  f"{type(values).__name__}") from None
    _non_empty(field, values, given, ", ".join(allowed))
    for value in values:
        if value not in allowed:
            raise InvalidInput(field, f"expected values among {', '.join(allowed)}, "
                                      f"found {shown(value)}")
    return values


def words(field: str, values: Iterable[str] | None) -> tuple[str, ...] | None:
    """A filter's tags or link types: one, or a non-empty list of them; None stays None."""
    if values is None:
        return None
    _not_a_mapping(field, values, f"a list of {field.replace('_', ' ')}")
    if isinstance(values, list | tuple):
        for i, value in enumerate(values):
            if type(value) is not str:  # shown here, a few levels deep (validate.shown)
                raise InvalidInput(f"{field}[{i}]", "expected a non-empty string, found "
                                                    f"{type(value).__name__} "
                                                    f"{shown(value)}")
    checked = v.check_words(field, values)
    _non_empty(field, checked, values, field.replace("_", " "))
    return checked


def _not_a_mapping(field: str, values: Any, expected: str) -> None:
    """Refuse a dict for a list filter: iterating it gives its keys, so tags={"in": ["red"]}
    (where's shape in the wrong argument) would filter by the one tag "in"."""
    if isinstance(values, Mapping):
        raise InvalidInput(field, f"expected {expected}, found {type(values).__name__} "
                                  f"{shown(values)}; a filter with operators goes in where=")


def _non_empty(field: str, values: tuple[Any, ...], given: Any, what: str) -> None:
    """Refuse an empty list of a filter's values: some callers mean "match nothing" by it,
    others "no filter", and most often it is a list built from nothing. One rule for every
    filter of recall (category and emotion refused it first); None is no filter."""
    if not values:
        shown = repr(given) if isinstance(given, (list, tuple)) else (
            f"an empty {type(given).__name__}")
        raise InvalidInput(field, f"expected a non-empty list of {what}, found {shown}; leave "
                                  f"{field} out (None) for no filter")


def check_texts(texts: Any) -> list[str]:
    """What ``Engine.embed`` takes: a list (or tuple) of strings, never a lone string."""
    if isinstance(texts, str) or not isinstance(texts, (list, tuple)):
        raise InvalidInput("texts", f"expected a list of strings, found {type(texts).__name__}"
                           + ("; wrap one text in a list: [text]" if isinstance(texts, str)
                              else ""))
    for i, text in enumerate(texts):
        if type(text) is not str:
            raise InvalidInput(f"texts[{i}]", f"expected a string, found {type(text).__name__}")
    return list(texts)


def reason(exc: InvalidInput) -> str:
    """An error's message without its field, to be raised again under another field name."""
    return str(exc).split(": ", 1)[1]
