"""Fact extraction: the ``Extractor`` protocol, the proposed fact it returns, and the offline
rules that are the default extractor.

An extractor turns one user turn into :class:`Candidate` facts; the Facts actor then decides
what each becomes (new, duplicate, superseding) by its own rules. The engine's extraction
follower calls the configured extractor for every committed user turn, in log order:
``Engine.open(extractor=...)`` plugs in any object with a ``name`` and an async ``extract``
(an LLM prompt, spaCy, a service), ``Engine.open(llm=...)`` uses the model's prompt, and
without either the rules below run. When a plugged-in extractor raises, the rules stand in
for that turn (and a warning is logged), so a failing model never costs the facts the rules
would have found.

The rules (seeds 002 and 004) cover English phrasings of identity (name, location, job,
languages, time zone, age, birthday), preferences ("I love / I prefer / I'd rather / I can't
stand / I'm a fan of"), constraints ("I'm allergic to / intolerant to / vegetarian / I can't
eat"), standing instructions ("always / never / from now on / don't / I want you to"),
relationships ("my sister Ana", "Ana is my sister", "my wife is called Ines") with pets kept
apart from people, schedules and routines, and a few other languages' ways of saying one's
name and home. Text no rule matches is still stored and searchable: extraction only adds facts.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from .base.keys import MAX_ID_BYTES
from .base.validate import encodable
from .base.messages import Candidate
from .base.text import composed

__all__ = ["Candidate", "Extractor", "RuleExtractor", "extract_facts", "checked_candidates",
           "MIN_CONFIDENCE", "MIN_IMPORTANCE", "MAX_CANDIDATES", "STOPWORDS", "jaccard", "words"]

MIN_CONFIDENCE = 0.4  # extracted candidates below this are dropped (seed 002)
MIN_IMPORTANCE = 0.2  # ... and below this importance
MAX_CANDIDATES = 20  # facts taken from one turn: a runaway extractor cannot flood the profile
MAX_CATEGORY = 64  # characters of a candidate's category, key, value and text kept
MAX_KEY = 128
MAX_VALUE = 500
MAX_TEXT = 1_000

_WORD = re.compile(r"[\w']+")
STOPWORDS = frozenset("a an the i i'm my me is am are was be to of in on at for and or but it this "
                      "that with as so do does really very now user".split())


def words(text: str) -> set[str]:
    """The lower-cased words of a text (any script), composed (:func:`composed`): a word's
    combining accent would cut it in two."""
    return set(_WORD.findall(composed(text).lower()))


def jaccard(a: set[str], b: set[str]) -> float:
    return len(a & b) / len(a | b) if a or b else 0.0


@runtime_checkable
class Extractor(Protocol):
    """What Engram needs of a fact extractor (``Engine.open(extractor=...)``).

    ``name`` is what the facts it finds carry as ``Fact.origin`` (``"rules"``, ``"llm"``,
    ``"spacy"``...). ``extract`` gets the text of one user turn and returns the facts it
    states, or an empty sequence; questions and hypotheticals state none. It runs in the
    engine's background follower on the trio loop, never on the hot path, one turn at a time
    in log order: CPU-heavy work (a spaCy pipeline) belongs in ``trio.to_thread.run_sync``
    so the loop stays responsive. What it returns is checked (types, 0-1 scores, lengths
    cut to the stored limits, keys a store key can hold, at most ``MAX_CANDIDATES``: see
    :func:`checked_candidates`); if it raises, the rules stand in for that turn.
    """

    name: str

    async def extract(self, text: str) -> Sequence[Candidate]:
        """The facts a user turn states."""
        ...


class RuleExtractor:
    """The offline default: regular-expression rules over the turn (see the module's doc).

    About 30-50 µs a turn; the follower yields to the loop every few turns.
    """

    name = "rules"

    async def extract(self, text: str) -> Sequence[Candidate]:
        return extract_facts(text)


def checked_candidates(found: object) -> list[Candidate]:
    """What an extractor returned, as candidates the Facts actor can take.

    Anything that is not a :class:`Candidate` with string fields and 0-1 scores is dropped,
    fields are stripped and cut to the stored limits, categories and keys lower-cased, and
    candidates under the confidence or importance floor are left out. The rules a caller's
    own facts meet hold too: a key or category is cut to what a store key holds
    (MAX_ID_BYTES of UTF-8), one with a NUL (the key separator) or any field without UTF-8
    (a lone surrogate) drops its candidate, and such keywords are left out; otherwise the
    store would refuse the fact, and every caller's ``flush`` would report a write it never
    made.

    Raises:
        TypeError: ``found`` is not a sequence (the extractor broke its contract; the
            follower lets the rules stand in).
    """
    if isinstance(found, (str, bytes)) or not isinstance(found, Sequence):
        raise TypeError(f"expected a sequence of Candidate, found {type(found).__name__}")
    out: list[Candidate] = []
    for c in found[:MAX_CANDIDATES]:
        if not isinstance(c, Candidate):
            continue
        fields = (c.category, c.key, c.value, c.text)
        if not all(isinstance(f, str) and f.strip() for f in fields):
            continue
        scores = (c.confidence, c.importance)
        if not all(isinstance(s, (int, float)) and not isinstance(s, bool) and 0 <= s <= 1
                   for s in scores):
            continue
        if c.confidence < MIN_CONFIDENCE or c.importance < MIN_IMPORTANCE:
            continue
        category = _fitted(c.category.strip().lower()[:MAX_CATEGORY])
        key = _fitted(c.key.strip().lower()[:MAX_KEY])
        value, text = c.value.strip()[:MAX_VALUE], c.text.strip()[:MAX_TEXT]
        if not (category and key and encodable(value) and encodable(text)):
            continue
        keywords = tuple(k for k in (_fitted(k.strip().lower()[:MAX_CATEGORY])
                                     for k in c.keywords if isinstance(k, str)) if k)[:8]
        out.append(Candidate(category, key, value, text, float(c.confidence),
                             float(c.importance), keywords))
    return out


def _fitted(word: str) -> str:
    """``word`` cut to MAX_ID_BYTES of UTF-8 on a character boundary, or "" when it cannot be
    part of a store key (a NUL, a lone surrogate, nothing left)."""
    if "\x00" in word or not encodable(word):
        return ""
    data = word.encode()
    if len(data) > MAX_ID_BYTES:
        word = data[:MAX_ID_BYTES].decode(errors="ignore").rstrip()
    return word if word.strip() else ""


# -- the offline rules ----------------------------------------------------------------------------

_UPPER = "A-ZÀ-ÖØ-ÞĀ-Ž"  # capitals, Latin-1 and Latin Extended-A: Élodie, Łukasz, Ørjan
# A name is capitalised; not "I", "I'm", nor a pronoun or filler that starts a sentence.
_NOT_A_NAME = (r"(?!(?:I|I'm|I've|I'd|I'll|This|That|It|It's|He|She|They|There|Here|Who|What|"
               r"Which|And|But|So|Today|Yesterday|Tomorrow|We|You|My|Our)\b)")
_NAME = rf"{_NOT_A_NAME}([{_UPPER}][\w'-]+(?: [{_UPPER}][\w'-]+)?)"
_ONE_NAME = rf"{_NOT_A_NAME}(?P<name>[{_UPPER}][\w'-]+)"
_PLACE = rf"([{_UPPER}][\w'.-]+(?: [{_UPPER}][\w'.-]+){{0,2}})"
_THING = r"([\w' -]{2,40}?)"
_END = r"(?=\s*(?:[,.!?;]|$|\band\b|\bbut\b|\bnow\b|\bthese days\b|\blately\b|\btoo\b))"

# People someone has one of at a time (a new name supersedes the old), people they may have
# several of (the name is part of the key), and animals (category ``pet``, not people).
_PEOPLE_ONE = ("wife", "husband", "partner", "girlfriend", "boyfriend", "fiancée", "fiancee",
               "fiancé", "fiance", "mother", "mum", "mom", "father", "dad", "boss", "manager",
               "best friend")
_PEOPLE_MANY = ("sister", "brother", "son", "daughter", "friend", "cousin", "aunt", "uncle",
                "niece", "nephew", "grandmother", "grandfather", "grandma", "grandpa",
                "colleague", "coworker", "co-worker", "roommate", "flatmate", "neighbour",
                "neighbor", "teammate", "kid", "child")
_PETS = {"dog": "dog", "puppy": "dog", "cat": "cat", "kitten": "cat", "parrot": "parrot",
         "bird": "bird", "hamster": "hamster", "rabbit": "rabbit", "bunny": "rabbit",
         "horse": "horse", "fish": "fish", "turtle": "turtle", "tortoise": "tortoise",
         "guinea pig": "guinea pig", "snake": "snake", "lizard": "lizard", "ferret": "ferret"}
_WHO = "|".join(sorted((*_PEOPLE_ONE, *_PEOPLE_MANY, *_PETS), key=len, reverse=True))


@dataclass(frozen=True)
class _Rule:
    """A pattern, what a match of it says, and ``needs``: lowercase text of which every match
    holds one at least. ~40 patterns over every sentence of every user turn were most of
    the extraction follower's time (~120 µs a sentence on the trio thread, half of it in
    the patterns with case-insensitive parts, which the regex engine cannot start by a
    literal); a rule none of whose needs an ASCII sentence holds cannot match it and is
    skipped, which leaves what is extracted exactly as it was (tests/actors/test_extraction.py
    holds each rule's needs to random matches of its pattern)."""

    pattern: re.Pattern[str]
    build: Callable[[re.Match[str]], Candidate | None]
    needs: tuple[str, ...]


def _slug(text: str) -> str:
    return " ".join(w for w in _WORD.findall(text.lower()) if w not in STOPWORDS)[:60] or "general"


def _rule(pattern: str, build: Callable[[re.Match[str]], Candidate | None],
          flags: int = re.IGNORECASE, *, needs: tuple[str, ...]) -> _Rule:
    return _Rule(re.compile(pattern, flags), build, needs)


def _identity(key: str, phrase: str, confidence: float = 0.85, importance: float = 0.8
              ) -> Callable[[re.Match[str]], Candidate]:
    def build(m: re.Match[str]) -> Candidate:
        # A place may contain dots ("St. Louis"), but the one ending the sentence is not its.
        value = m.group(1).strip().rstrip(".")
        return Candidate("identity", key, value, phrase.format(value), confidence, importance,
                         (key, value.lower()))
    return build


# Verbs that lead a preference's object without being what is preferred: "I'd rather *have*
# tea" is about tea.
_LEADING_VERB = re.compile(r"^(?:have|get|eat|drink|use|go with|take|do|be|stick with)\s+",
                           re.IGNORECASE)


def _preferred(thing: str, polarity: str, text: str, confidence: float = 0.7
               ) -> Candidate | None:
    slug = _slug(_LEADING_VERB.sub("", thing))
    if slug == "general" or len(slug.split()) > 5:
        return None
    return Candidate("preference", f"likes:{slug}", polarity, text, confidence, 0.5,
                     tuple(slug.split()))


def _preference(polarity: str) -> Callable[[re.Match[str]], Candidate | None]:
    def build(m: re.Match[str]) -> Candidate | None:
        thing = m.group(1).strip()
        return _preferred(thing, polarity,
                          f"{'Likes' if polarity == 'likes' else 'Dislikes'} {thing}")
    return build


def _prefers(m: re.Match[str]) -> Candidate | None:
    thing, other = m.group("thing").strip(), (m.group("other") or "").strip()
    if m.group("neg"):
        return _preferred(thing, "dislikes", f"Prefers not to {thing}", 0.75)
    if m.group("verb").lower().endswith("rather"):
        text = f"Would rather {thing}" + (f" than {other}" if other else "")
    else:
        text = f"Prefers {thing}" + (f" over {other}" if other else "")
    return _preferred(thing, "likes", text, 0.75)


_FILLER = re.compile(r"^(?:(?:honestly|actually|really|well|so|ok|okay|now|lately|these days|"
                     r"i think|i guess|i'd say),?\s+)+", re.IGNORECASE)


def _favourite(m: re.Match[str]) -> Candidate:
    what = m.group("what").strip().lower()
    value = _FILLER.sub("", m.group("value").strip())
    return Candidate("preference", f"favourite {what}", value, f"Favourite {what}: {value}",
                     0.8, 0.6, (what, value.lower()))


def _relation(m: re.Match[str]) -> Candidate:
    who, name = " ".join(m.group("who").lower().split()), m.group("name").strip()
    if who in _PETS:
        species = _PETS[who]
        return Candidate("pet", f"{species}:{name.lower()}", name,
                         f"Has a {who} called {name}", 0.85, 0.6, ("pet", who, name.lower()))
    key = who if who in _PEOPLE_ONE else f"{who}:{name.lower()}"
    return Candidate("relationship", key, name, f"Their {who} is called {name}", 0.85, 0.7,
                     (who, name.lower()))


def _allergy(m: re.Match[str]) -> Candidate | None:
    thing = m.group(1).strip()
    slug = _slug(thing)
    if slug == "general":
        return None
    return Candidate("constraint", f"allergy:{slug}", "allergic", f"Allergic to {thing}",
                     0.9, 1.0, ("allergy", "allergic", *slug.split()))


def _intolerance(m: re.Match[str]) -> Candidate | None:
    thing = m.group(1).strip()
    slug = _slug(thing)
    if slug == "general":
        return None
    return Candidate("constraint", f"intolerance:{slug}", "intolerant",
                     f"Intolerant to {thing}", 0.85, 0.9, ("intolerance", "diet", *slug.split()))


def _diet(m: re.Match[str]) -> Candidate:
    diet = m.group(1).lower().replace(" ", "-")
    return Candidate("constraint", "diet", diet, f"Diet: {diet}", 0.85, 0.9, ("diet", diet))


def _avoids(m: re.Match[str]) -> Candidate | None:
    thing = m.group("thing").strip()
    slug = _slug(thing)
    if slug == "general":
        return None
    verb = (m.group("verb") or "eat").lower()
    text = f"Avoids {thing}" if verb == "avoid" else f"Does not {verb} {thing}"
    return Candidate("constraint", f"avoids:{slug}", "avoids", text, 0.7, 0.8,
                     ("diet", *slug.split()))


def _schedule(m: re.Match[str]) -> Candidate:
    when, what = m.group("when").lower().rstrip("s"), m.group("what").strip()
    return Candidate("schedule", when, what, f"Every {when}: {what}", 0.7, 0.5,
                     (when, *_slug(what).split()[:4]))


def _routine(m: re.Match[str]) -> Candidate:
    what, time = m.group("what").lower(), m.group("time").strip()
    return Candidate("schedule", what, time, f"Usually {what} at {time}", 0.7, 0.5,
                     (what, time))


def _instruction(m: re.Match[str]) -> Candidate | None:
    lead = " ".join(m.group("lead").lower().split())
    said = m.group("body") or m.groupdict().get("manner") or ""
    body = re.sub(r"[,\s]+please$", "", said.strip(), flags=re.IGNORECASE)
    found = _WORD.findall(body.lower())
    if len(found) < 2:
        return None
    if lead not in ("always", "never", "please") and _ONE_OFF.search(body):
        return None  # "don't book it yet": a request for now, not a standing instruction
    polarity = "never" if lead in ("never", "don't", "do not", "please don't",
                                   "please do not") else "always"
    if lead not in ("always", "never"):
        body = body[0].lower() + body[1:]
    text = f"{'Never' if polarity == 'never' else 'Always'} {body}"
    # The key is the instruction's first two words ("answer in", "call me"), so a later
    # instruction about the same thing supersedes an earlier one.
    return Candidate("instruction", " ".join(found[:2]), f"{polarity} {body}", text, 0.8, 0.9,
                     tuple(w for w in found if w not in STOPWORDS)[:6])


# What "don't ..." at the start of a sentence must go on with to be an instruction to the
# assistant rather than a remark ("don't worry", "don't know").
_TOLD = (r"use|send|call|mention|say|give|write|reply|respond|answer|tell|remind|suggest|"
         r"recommend|include|add|ask|bring up|talk|share|post|schedule|book|email|text|"
         r"message|ping|show|put|assume|correct|translate|explain|apologi[sz]e|summari[sz]e|"
         r"repeat|wake|disturb|contact|sign|list|quote|swear|curse|spoil|guess")

# Words that make "don't ..." or "I want you to ..." a request for now.
_ONE_OFF = re.compile(r"\b(?:yet|today|tonight|tomorrow|right now|for now|this (?:time|week|"
                      r"morning|afternoon|evening)|until|before)\b", re.IGNORECASE)

_JOBS = r"(?:an? )?(?P<job>[a-z][a-z -]{2,40}?)"
_JOB_END = r"(?=\s*(?:[,.!?;]|$|\band\b|\bbut\b|\b(?:at|for|in|with|from|there)\b))"
_RULES: tuple[_Rule, ...] = (
    _rule(r"\b(?i:my name is) " + _NAME, _identity("name", "Name: {}", 0.9, 0.9), 0,
          needs=("my name is",)),
    _rule(r"(?<![Nn]ever )(?<!not )(?<!n't )\b(?i:i'm called|i am called|call me) " + _NAME,
          _identity("name", "Name: {}", 0.85, 0.9), 0,
          needs=("call",)),
    # Other languages' "my name is" and "I live in": the common ways, not a grammar.
    _rule(r"(?:^|\b)(?i:me llamo|mi nombre es|je m'appelle|mon nom est|ich heiße|ich heisse|"
          r"mein name ist|mi chiamo|il mio nome è|(?:o )?meu nome é|eu me chamo|me chamo) "
          + _NAME, _identity("name", "Name: {}", 0.85, 0.9), 0,
          needs=("me llamo", "mi nombre es", "je m'appelle", "mon nom est", "ich heisse",
                 "mein name ist", "mi chiamo", "meu nome", "me chamo")),
    _rule(r"(?:^|\b)(?i:vivo en|vivo em|moro em|moro no|moro na|j'habite à|j'habite a|"
          r"j'habite en|ich wohne in|ich lebe in|abito a|vivo a) " + _PLACE,
          _identity("location", "Lives in {}", 0.8, 0.8), 0,
          needs=("vivo e", "vivo a", "moro ", "j'habite", "ich wohne in", "ich lebe in",
                 "abito a")),
    _rule(r"\b(?i:i (?:live|am living|'m living|'m based|am based) in) " + _PLACE,
          _identity("location", "Lives in {}", 0.8, 0.8), 0,
          needs=("live in", "living in", "based in")),
    _rule(r"\b(?i:i(?:'ve| have)? (?:just |recently |finally )?(?:moved|relocated) to) "
          + _PLACE, _identity("location", "Lives in {}", 0.85, 0.8), 0,
          needs=("moved to", "relocated to")),
    _rule(r"\b(?i:i(?:'m| am) (?:moving|relocating)(?: from [A-Z][\w'.-]+(?: [A-Z][\w'.-]+)?)? "
          r"to) " + _PLACE,
          _identity("location", "Lives in {}", 0.85, 0.8), 0,
          needs=("moving", "relocating")),
    _rule(r"\b(?i:i(?:'m| am) (?:originally )?from) " + _PLACE,
          _identity("hometown", "Comes from {}", 0.75, 0.6), 0,
          needs=("from",)),
    _rule(r"\bi (?:work|am working|'m working|(?:'ll|will) be(?: working)?)"
          r"(?: remotely| full[- ]time| part[- ]time| freelance)? as " + _JOBS
          + r"(?: (?:at|for) (?P<org>[A-Z][\w&.' -]+?))?" + _JOB_END,
          lambda m: Candidate("identity", "job", m.group("job").strip(),
                              f"Works as a {m.group('job').strip()}"
                              + (f" at {m.group('org')}" if m.group("org") else ""),
                              0.8, 0.7, ("job", "work", *m.group("job").split())),
          needs=(" as ",)),
    _rule(r"\b(?i:i work (?:at|for)) (?P<org>[A-Z][\w&.'-]+(?: [A-Z][\w&.'-]+){0,3})",
          lambda m: Candidate("identity", "employer", m.group("org").rstrip("."),
                              f"Works at {m.group('org').rstrip('.')}", 0.75, 0.6,
                              ("work", "employer")), 0,
          needs=("i work",)),
    _rule(r"\b(?i:i speak) (?P<langs>[A-Z][a-z]+(?:(?:, | and | & )[A-Z][a-z]+)*)",
          lambda m: Candidate("identity", "languages", m.group("langs"),
                              f"Speaks {m.group('langs')}", 0.8, 0.6,
                              ("language", *m.group("langs").lower().replace(",", "").split())),
          0,
          needs=("i speak",)),
    _rule(r"\bmy (?:native|first|mother) (?:language|tongue) is ([A-Z][a-z]+)",
          _identity("native_language", "Native language: {}", 0.85, 0.6),
          needs=("language is", "tongue is")),
    _rule(r"\bmy time ?zone is ([\w/+:-]+)", _identity("timezone", "Time zone: {}", 0.85, 0.6),
          needs=("zone is",)),
    _rule(r"\bi(?:'m| am) (?:in|on) ((?:UTC|GMT)[+-]\d{1,2}(?::\d\d)?|[A-Z]{2,4}T) time",
          _identity("timezone", "Time zone: {}", 0.8, 0.6),
          needs=(" time",)),
    _rule(r"\bi(?:'m| am) (\d{1,3}) years old", _identity("age", "Is {} years old", 0.8, 0.5),
          needs=("years old",)),
    _rule(r"\bmy birthday is (?:on )?([\w ]+?)" + _END,
          _identity("birthday", "Birthday: {}", 0.8, 0.6),
          needs=("my birthday is",)),
    _rule(r"\bmy favou?rite (?P<what>[a-z]+(?: [a-z]+)?) is (?:still )?(?P<value>[\w' -]+?)" + _END,
          _favourite,
          needs=("my favo",)),
    # The value starts where its run of words does (its first letter): tried from each word
    # of the run instead, the rule read the rest of the sentence once per word.
    _rule(r"(?<![\w' -])[' -]*(?P<value>\b[\w' -]+?) (?:has|have) become my favou?rite "
          r"(?P<what>[a-z]+)\b", _favourite,
          needs=("become my favo",)),
    # Relationships and pets. The names are capitalised, so these rules match case-sensitively
    # outside their (?i:...) parts: "my dog is tired" names no dog.
    _rule(rf"\b(?i:my) (?P<who>(?i:{_WHO}))(?:'s name)? (?i:is) (?:(?i:called|named) )?"
          + _ONE_NAME, _relation, 0,
          needs=("my ",)),
    _rule(rf"\b(?i:i have an?) (?P<who>(?i:{_WHO})) (?i:called|named) " + _ONE_NAME,
          _relation, 0,
          needs=("i have a",)),
    _rule(rf"\b(?i:my) (?P<who>(?i:{_WHO})),? " + _ONE_NAME + r"\b", _relation, 0,
          needs=("my ",)),
    # The name starts a word: tried from each capital, "AAAA..." cost a pass per letter.
    _rule(r"(?<![\w'-])" + _ONE_NAME + rf",? (?:is|'s) (?i:my) (?P<who>(?i:{_WHO}))\b",
          _relation, 0,
          needs=(" my ",)),
    _rule(r"\bi(?:'m| am) (?:severely |very |really |deathly |mildly |a bit )?allergic to "
          + _THING + _END, _allergy,
          needs=("allergic to",)),
    _rule(r"\bi have an? ([\w -]{2,30}?) allergy", _allergy,
          needs=("allergy",)),
    _rule(r"\bi(?:'m| am) (?:\w+ )?intolerant (?:to|of) " + _THING + _END, _intolerance,
          needs=("intolerant",)),
    _rule(r"\bi(?:'m| am|'m now| am now| went| became| have become|'ve become|'ve gone) "
          r"(?:a |an |fully )?(vegetarian|vegan|pescatarian|gluten[- ]free|"
          r"lactose[- ]intolerant|coeliac|celiac|keto|halal|kosher)\b", _diet,
          needs=("vegetarian", "vegan", "pescatarian", "gluten", "lactose", "coeliac", "celiac",
                 "keto", "halal", "kosher")),
    _rule(r"\bi (?:don't|do not|never|no longer|can't|cannot|must not|mustn't|shouldn't) "
          r"(?P<verb>eat|drink|have) (?P<thing>[\w' -]{2,40}?)" + _END, _avoids,
          needs=("eat ", "drink ", "have ")),
    _rule(r"\bi (?:must|have to|need to|should|try to) (?P<verb>avoid) (?P<thing>[\w' -]{2,40}?)"
          + _END, _avoids,
          needs=("avoid ",)),
    _rule(r"\bi (?:really |absolutely |totally )?(?:love|like|enjoy|adore) " + _THING + _END,
          _preference("likes"),
          needs=("love ", "like ", "enjoy ", "adore ")),
    _rule(r"\bi(?:'ve| have) taken up " + _THING + _END, _preference("likes"),
          needs=("taken up ",)),
    _rule(r"\bi(?:'m| am) (?:a (?:big |huge |great )?fan of|really into|into) " + _THING + _END,
          _preference("likes"),
          needs=("fan of ", "into ")),
    _rule(r"\bi (?:really |absolutely )?(?:hate|dislike|can't stand|cannot stand|can't bear|"
          r"cannot bear|detest|loathe|don't like|do not like|no longer like) " + _THING + _END,
          _preference("dislikes"),
          needs=("hate ", "dislike ", "stand ", "bear ", "detest ", "loathe ", "like ")),
    _rule(r"\bi(?:'m| am) not (?:a (?:big )?fan of|into) " + _THING + _END,
          _preference("dislikes"),
          needs=(" not ",)),
    _rule(r"\bi(?P<verb> (?:much |really |strongly |generally |usually |always )?prefer|"
          r"(?:'d| would) (?:much )?rather) (?P<neg>not (?:to )?)?(?P<thing>[\w' -]{2,40}?)"
          r"(?: (?:to|over|than|rather than|instead of) (?P<other>[\w' -]{2,40}?))?" + _END,
          _prefers,
          needs=("prefer", "rather")),
    _rule(r"\b(?:every|each|on) (?P<when>monday|tuesday|wednesday|thursday|friday|saturday|"
          r"sunday|weekday|weekend|morning|evening)s?,? i (?P<what>[^.!?]{3,60})", _schedule,
          needs=("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday",
                 "weekday", "weekend", "morning", "evening")),
    _rule(r"\bi (?:usually |always |normally )?(?P<what>wake up|get up|go to bed|start work|"
          r"finish work|go to the gym) (?:at|around) (?P<time>\d{1,2}(?:[:.]\d\d)?\s*(?:am|pm)?)",
          _routine,
          needs=("wake up", "get up", "go to bed", "start work", "finish work", "go to the gym")),
    _rule(r"(?:^|[.!?]\s+|,\s*|please\s+)(?P<lead>always|never|from now on|going forward|"
          r"in future|in the future),?\s+(?:please\s+)?(?P<body>[^.!?]{4,120})", _instruction,
          needs=("always", "never", "from now on", "going forward", "in future", "in the future")),
    _rule(r"^\s*(?P<lead>please) (?P<body>(?:keep|make) (?:your |the )?(?:answers|replies|"
          r"responses|messages) [^.!?,]{2,60})", _instruction,
          needs=("please ",)),
    _rule(r"^\s*(?P<lead>(?:please )?(?:don't|do not))(?: ever)? (?P<body>(?:" + _TOLD
          + r")\b[^.!?]{2,120})", _instruction,
          needs=("don't", "do not")),
    _rule(r"\bi(?P<lead> want| need| would like|'d like) you to (?:always (?P<body>[^.!?]{4,120})|"
          r"(?P<manner>(?:keep|be|speak|answer in|reply in|respond in|write in|call me|"
          r"address me as|use)\b[^.!?]{2,120}))", _instruction,
          needs=("you to ",)),
)

_QUESTION = re.compile(r"\?\s*$")
# "Hi! I'm Maya.": a lone "I'm <Name>" is a name only right after a greeting.
_GREETING_NAME = re.compile(r"\b(?i:hi|hello|hey|good (?:morning|afternoon|evening))\b[!,.]*\s+"
                            rf"(?i:i'm|i am|this is|it's) ([{_UPPER}][a-zà-ÿ]+)\b(?! [a-z])")
_GREETING_NEEDS = ("hi", "hey", "hello", "good ")  # as a rule's needs (see _Rule)
# Every rule's needs, each looked for once a sentence.
_NEEDS = tuple(sorted({need for rule in _RULES for need in rule.needs}))
_HYPOTHETICAL = re.compile(r"\s*(?:if|what if|suppose|maybe|do you|can you|could you|would you"
                           r"|should i|shall i)\b", re.IGNORECASE)


def extract_facts(text: str) -> list[Candidate]:
    """The facts a user turn states, by rule, at most MAX_CANDIDATES of them; questions and
    hypotheticals are skipped."""
    found: dict[tuple[str, str], Candidate] = {}
    folded = text.lower() if text.isascii() else None  # once, for the greeting's needs
    greeting = (None if folded is not None and not any(word in folded
                                                       for word in _GREETING_NEEDS)
                else _GREETING_NAME.search(text))
    if greeting:
        found[("identity", "name")] = Candidate("identity", "name", greeting.group(1),
                                                f"Name: {greeting.group(1)}", 0.8, 0.9,
                                                ("name", greeting.group(1).lower()))
    for sentence in re.split(r"(?<=[.!?])\s+|\n+", text):
        if not sentence or _QUESTION.search(sentence) or _HYPOTHETICAL.match(sentence):
            continue
        # Lowercased, an ASCII sentence holds a rule's needs exactly when the pattern's own
        # case-insensitive reading could (beyond ASCII, "K" or "ſ" match "k" and "s").
        present = None
        if sentence.isascii():
            lowered = sentence.lower()
            present = {need for need in _NEEDS if need in lowered}
        for rule in _RULES:
            if present is not None and present.isdisjoint(rule.needs):
                continue
            for m in rule.pattern.finditer(sentence):
                candidate = rule.build(m)
                if candidate is None:
                    continue
                key = (candidate.category, candidate.key)
                # A turn of thousands of "I like ..." must not flood the profile (and have
                # each fact compared with all the others): the first keys said are kept, and
                # a later value of one of them still wins.
                if key in found or len(found) < MAX_CANDIDATES:
                    found[key] = candidate
    return [c for c in found.values()
            if c.confidence >= MIN_CONFIDENCE and c.importance >= MIN_IMPORTANCE]
