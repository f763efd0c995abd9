"""Entities actor: the named things a user's memories mention, in a per-user registry.

It follows the store's log. For each committed record it extracts mentions (@handles, #hashtags,
emails, URLs, dates, capitalised names), merges them into the registry (canonical name, aliases,
mention count, the memories that mention it) and links the record to the previous memory that
mentioned the same entity; registry, links and its watermark are written in one transaction.

Aliases: a single capitalised word that is the first word of a known multi-word person name
("Maya" for "Maya Lindqvist") is filed under that entity; spellings differing only in case are
one entity.
"""

from __future__ import annotations

import re
from bisect import bisect_left
from datetime import datetime, timezone

import msgspec
import trio

from .base.messages import Searchable
from .base.records import Entity, Link
from .base.text import composed
from .imported import Imported
from .store import LogFollower, Store, entity_key, read_entities, read_entity_keys

__all__ = ["Entities", "extract_entities", "MEMORIES_PER_ENTITY", "MAX_ENTITIES", "MAX_ALIASES"]

MEMORIES_PER_ENTITY = 256  # newest memories kept per entity: entity_info and the entity leg
# Other spellings kept per entity (a first name it was mentioned by, a short form folded in);
# one differing only in case is not another spelling, and a user cannot grow the record for ever.
MAX_ALIASES = 16
CACHED_USERS = 4096  # users whose registry keys stay in RAM for the entity leg
CACHED_RECORDS = 1024  # registry records kept per user for the entity leg (its queries' names)
FOLLOW_CHUNK = 512  # log records per step: ~1 ms of regex work between checkpoints
WATERMARK = b"entities_lsn"
# Distinct entities taken from one text (the first found: addresses, handles and dates, then
# names): a pasted list of thousands of capitalised words must not make thousands of registry
# records in one step.
MAX_ENTITIES = 128
LINKED_TYPES = frozenset({"person", "pet", "place", "email", "url", "hashtag", "mention"})

_encode = msgspec.msgpack.Encoder().encode

# An address starts at the first letter or digit of its run of word characters, dots, pluses
# and dashes (``lead`` is what comes before it): tried from every word of a long run without
# an "@", the run was read to its end once per word.
_EMAIL = re.compile(r"(?<![\w.+-])(?P<lead>[.+-]*+)"
                    r"(?P<address>\b[\w.+-]+@[\w-]+(?:\.[\w-]+)+\b)")
_URL = re.compile(r"\bhttps?://[^\s<>()\"']+", re.IGNORECASE)
_MENTION = re.compile(r"(?<![\w@])@([A-Za-z_]\w{1,30})")
_HASHTAG = re.compile(r"(?<![\w#])#([A-Za-z]\w{1,40})")
_MONTHS = ("january|february|march|april|may|june|july|august|september|october|november|"
           "december|jan|feb|mar|apr|jun|jul|aug|sep|sept|oct|nov|dec")
_DATE = re.compile(r"\b(?:\d{4}-\d{2}-\d{2}|\d{1,2}/\d{1,2}/\d{2,4}|"
                   rf"(?:{_MONTHS})\.? \d{{1,2}}(?:st|nd|rd|th)?(?:,? \d{{4}})?|"
                   rf"\d{{1,2}}(?:st|nd|rd|th)? (?:of )?(?:{_MONTHS})(?: \d{{4}})?)\b",
                   re.IGNORECASE)
_DIGIT = re.compile(r"\d")  # what every date _DATE finds holds
_NAME = re.compile(r"\b[A-ZÀ-ÖØ-Þ][a-zà-öø-ÿ]+(?:[ -][A-ZÀ-ÖØ-Þ][a-zà-öø-ÿ]+)*\b")
# Where a cue ends, a name starting there is a place ("in Lisbon") or a pet: one the animal
# is said to be someone's ("my dog Pixel", "our cat, Miso") or called ("a horse named
# Storm"); "the dog Emma's", "the cat Sarah brought" name people. Found in one pass.
_ANIMALS = ("dog|cat|puppy|kitten|pet|parrot|budgie|hamster|rabbit|bunny|horse|pony|tortoise|"
            "turtle|ferret|goldfish")
_CUE = re.compile(rf"\b(?:(?P<place>in|to|from|at|near|visit|visited|visiting)|"
                  rf"(?P<pet>(?:my|our|his|her|their)\s+(?:{_ANIMALS})(?:,?\s+(?:called|named))?,?"
                  rf"|(?:{_ANIMALS}),?\s+(?:called|named)))\s+", re.IGNORECASE)
# Capitalised words that are not names: sentence starters, pronouns, days, months, greetings,
# and the first words of the fact rules' own texts.
_NOT_NAMES = frozenset(
    "I A An The This That These Those It Its He She We They You Your My Our Their His Her "
    "Hi Hey Hello Thanks Thank Yes No Ok Okay Sure Sorry Please Good Great Nice Well So And But "
    "Or If When What Why How Where Who Which Also Just Maybe Honestly Big Last Next Today "
    "Tomorrow Yesterday Monday Tuesday Wednesday Thursday Friday Saturday Sunday January "
    "February March April May June July August September October November December Tell Let "
    "Do Did Does Can Could Would Should Will Is Are Was Were Have Has Had Not Any Some Every "
    "All Here There Then Now Oh Ah Wow Cool Fine Right Sounds Understood Want Happy Enjoy "
    "Email Call Send Remind Book Check Find Look Make Take Give Show Get Go Try Keep Remember "
    "Note Add Set Use Answer Reply Write Read Change Always Never From Since After Before "
    "Mondays Tuesdays Wednesdays Thursdays Fridays Saturdays Sundays "
    # The fact rules' texts start with these (actors/extraction.py): "Lives in Lisbon".
    "Lives Works Prefers Speaks Allergic Intolerant Avoids Comes Favourite Usually Native "
    "Time".split())
_LETTER = re.compile(r"[^\W\d_]")
_SENTENCE_END = re.compile(r"[.!?\n]")


class _Sentences:
    """Whether a word is the only one of its sentence ("Noted.", "Done (2)!": an
    acknowledgement or an exclamation, not a mention of someone), in time linear in the text
    however many words are asked about: sentence bounds are found once, and each sentence's
    first letter once."""

    def __init__(self, text: str) -> None:
        self._text = text
        self._ends = [m.start() for m in _SENTENCE_END.finditer(text)]
        self._first_letter: dict[int, int] = {}  # by sentence number

    def alone(self, start: int, end: int) -> bool:
        """Whether ``text[start:end]`` (a word starting with a letter) is alone."""
        text, ends = self._text, self._ends
        n = bisect_left(ends, start)  # a word holds no sentence end: its sentence is n
        first = ends[n - 1] + 1 if n else 0
        last = ends[n] if n < len(ends) else len(text)
        if n not in self._first_letter:
            letter = _LETTER.search(text, first, last)
            self._first_letter[n] = letter.start() if letter else last
        # Looking after the word stops at the next letter: at worst the next word asked about.
        return self._first_letter[n] == start and not _LETTER.search(text, end, last)


def extract_entities(text: str) -> list[tuple[str, str]]:
    """(name, type) for each distinct entity a text mentions, in order of first mention;
    names as composed text (:func:`composed`), however the text came."""
    text = composed(text)
    found: dict[str, tuple[str, str]] = {}

    def add(name: str, kind: str) -> None:
        if len(found) < MAX_ENTITIES:
            found.setdefault(name.lower(), (name, kind))

    # Each pattern below is run only on a text that holds what every match of it holds (an
    # "@", a "://", a "#", a digit): most chat turns hold none, and the date pattern alone
    # was a third of the work.
    scrubbed = text
    if "@" in text:
        for m in _EMAIL.finditer(text):
            add(m.group("address"), "email")
        scrubbed = _EMAIL.sub(r"\g<lead> ", scrubbed)
    if "://" in text:
        for m in _URL.finditer(text):
            add(m.group(0).rstrip(".,;:!?"), "url")
        scrubbed = _URL.sub(" ", scrubbed)
    sentences = _Sentences(scrubbed)
    cues = {m.end(): m.lastgroup for m in _CUE.finditer(scrubbed)}
    if "@" in scrubbed:
        for m in _MENTION.finditer(scrubbed):
            add("@" + m.group(1), "mention")
    if "#" in scrubbed:
        for m in _HASHTAG.finditer(scrubbed):
            add("#" + m.group(1), "hashtag")
    if _DIGIT.search(scrubbed):
        for m in _DATE.finditer(scrubbed):
            add(m.group(0), "date")
    for m in _NAME.finditer(scrubbed):
        # A run of capitalised words is cut at the words that are never names: "Hi Marta We
        # went" (a sentence without its full stop) names Marta, not "Marta We".
        runs: list[list[str]] = [[]]
        for word in re.split(r"[ -]", m.group(0)):
            if word in _NOT_NAMES:
                runs.append([])
            else:
                runs[-1].append(word)
        runs = [words for words in runs if words]
        if len(runs) == 1 and len(runs[0]) == 1 and sentences.alone(m.start(), m.end()):
            continue
        for n, words in enumerate(runs):
            name = " ".join(words)
            if name.lower() in found:
                continue
            cue = cues.get(m.start()) if n == 0 else None
            add(name, cue or ("person" if len(words) <= 3 else "other"))
    return list(found.values())


def _better_type(held: str, found: str) -> str:
    """The type to keep when a mention of an entity finds ``found`` and the registry holds
    ``held``: a name taken for a person for want of a cue is the pet a later mention says it
    is ("my dog Pixel"); otherwise the first word stands."""
    return found if held == "person" and found == "pet" else held


class Entities:
    """The actor: a log follower that owns the registry's writes."""

    def __init__(self, store: Store, imported: Imported | None = None,
                 cache_records: bool = True) -> None:
        self._store = store
        # Off in a reader: the store's owner writes the registry, out of this process's sight.
        self._cache_records = cache_records
        # Log positions of imported records: they came with their registry entries.
        self._imported = imported if imported is not None else Imported()
        self.follower = LogFollower(store, WATERMARK, FOLLOW_CHUNK, self._handle,
                                    self._settled)
        # Per user, the registry's keys (names and aliases, lower case): a query that names
        # none of them skips the registry read entirely.
        self._keys: dict[str, set[str]] = {}
        # Keys the current step adds, per user, until the next step (by then they are on disk).
        self._recent: dict[str, set[str]] = {}
        # Per user, registry records the entity leg looked up, by key (None: no record), so
        # a recall naming them again needs no store read. Dropped for a user whose registry
        # a step, a forget or an import may have changed; never filled by a read that such
        # a change overlapped (``_changes`` moved, or a step of that user's in flight).
        self._records: dict[str, dict[str, Entity | None]] = {}
        self._changes = 0  # moves on every change a cached record may miss
        self._forgets = 0  # forgets so far: keys read across one are not cached
        self._writing: set[str] = set()  # users whose registry the step in flight writes

    async def keys(self, user_id: str) -> set[str]:
        """The user's registry keys (read once, then kept up to date by the follower)."""
        known = self._keys.get(user_id)
        if known is None:
            forgets = self._forgets
            found = set(await self._store.read(read_entity_keys, user_id))
            # Keys of the step being committed may have missed the read: add them.
            known = found | self._recent.get(user_id, set())
            if forgets != self._forgets:  # the read overlapped a forget: not kept
                return known
            self._keys[user_id] = known
            while len(self._keys) > CACHED_USERS:
                del self._keys[next(iter(self._keys))]
        else:
            self._keys[user_id] = self._keys.pop(user_id)  # most recently used last
        return known

    async def lookup(self, user_id: str, names: list[str]) -> dict[str, Entity]:
        """The user's registry records under these lower-case keys, and the entity each alias
        among them points to (under its own key): :func:`read_entities`, from RAM for keys
        looked up before and unchanged since."""
        cached = self._records.get(user_id)
        if cached is not None:
            self._records[user_id] = self._records.pop(user_id)  # most recently used last
            found = _from_cache(cached, names)
            if found is not None:
                await trio.lowlevel.checkpoint()
                return found
        changes = self._changes
        found = await self._store.read(read_entities, user_id, names)
        if self._cache_records and changes == self._changes and user_id not in self._writing:
            cached = self._records.setdefault(user_id, {})
            for name in names:
                cached[name] = found.get(name)
            for name in names:
                entity = found.get(name)
                if entity is not None and entity.type == "alias":
                    # read_entities read the target too, in the same transaction.
                    cached[entity.aliases[0]] = found.get(entity.aliases[0])
            while len(cached) > CACHED_RECORDS:
                del cached[next(iter(cached))]
            while len(self._records) > CACHED_USERS:
                del self._records[next(iter(self._records))]
        return found

    def _settled(self) -> None:
        """The follower's step is committed (or failed): what it wrote is readable."""
        for user_id in self._writing:
            self._records.pop(user_id, None)
        self._writing.clear()
        self._changes += 1

    def forget(self, user_id: str) -> None:
        """Drop a user's cached keys and records after a deletion or an import wrote the
        registry; they are read again when needed."""
        self._keys.pop(user_id, None)
        self._records.pop(user_id, None)
        self._changes += 1
        self._forgets += 1

    async def _handle(self, records: list[Searchable], last: int) -> tuple[tuple, tuple]:
        self._recent = {}  # the previous step is committed: its keys are readable
        mentions: dict[str, list[tuple[Searchable, str, str]]] = {}
        for i, record in enumerate(records):
            if i % 16 == 15 or self._store.receipts_waiting:
                # ~30 us of regex a record: ~0.5 ms steps, one record while a receipt waits
                await self._store.yield_to_receipts()
            if record.lsn in self._imported:
                continue
            for name, kind in extract_entities(record.text):
                mentions.setdefault(record.user_id, []).append((record, name, kind))
        puts: list[tuple[bytes, bytes, bytes | None, int]] = []
        links: list[tuple[str, Link, int]] = []
        # The registry records cached for these users go stale when this step commits.
        self._writing.update(mentions)
        self._changes += 1
        for user_id, found in mentions.items():
            wanted = sorted({n.lower() for _, n, _ in found}
                            | {n.split()[0].lower() for _, n, _ in found})
            registry = await self._store.read(read_entities, user_id, wanted)
            changed: dict[str, Entity] = {}
            for record, name, kind in found:
                key = _resolve(registry, changed, name)
                entity = changed.get(key) or registry.get(key)
                at = record.at.astimezone(timezone.utc)
                if entity is None:
                    entity = Entity(name, kind, (), 0, at, at, ())
                elif (entity.last_id and entity.last_id != record.memory_id
                      and kind in LINKED_TYPES and entity.type in LINKED_TYPES
                      and record.memory_id):
                    links.append((user_id, Link(record.memory_id, entity.last_id,
                                                "shares_entity", at), record.lsn))
                aliases = entity.aliases
                if len(aliases) < MAX_ALIASES and _another_spelling(name, entity):
                    aliases = (*aliases, name)
                lsns = entity.lsns if record.lsn in entity.lsns else (
                    *entity.lsns[-(MEMORIES_PER_ENTITY - 1):], record.lsn)
                changed[key] = Entity(entity.name, _better_type(entity.type, kind), aliases,
                                      entity.mentions + 1,
                                      min(entity.first_seen, at), max(entity.last_seen, at), lsns,
                                      record.memory_id or entity.last_id)
            for key, entity in list(changed.items()):
                first = entity.name.split()[0].lower()
                if entity.type != "person" or first == key:
                    continue
                # A first name files under the full name: fold what the short form held into
                # the full entity and point the short form at it.
                short = changed.get(first) or registry.get(first)
                if short is not None and short.type != "alias":
                    aliases = entity.aliases
                    if len(aliases) < MAX_ALIASES and _another_spelling(short.name, entity):
                        aliases = (*aliases, short.name)
                    entity = Entity(entity.name, entity.type, aliases,
                                    entity.mentions + short.mentions,
                                    min(entity.first_seen, short.first_seen),
                                    max(entity.last_seen, short.last_seen),
                                    tuple(sorted(set(entity.lsns) | set(short.lsns)))
                                    [-MEMORIES_PER_ENTITY:], entity.last_id)
                    changed[key] = entity
                changed[first] = _pointer(entity.name.split()[0], key)
            self._recent.setdefault(user_id, set()).update(changed)
            cached = self._keys.get(user_id)
            if cached is not None:
                cached.update(changed)
            for key, entity in changed.items():
                # Guarded by its newest memory: if that was forgotten meanwhile, the registry
                # keeps its state from before this step.
                guard = entity.lsns[-1] if entity.lsns else 0
                puts.append((b"entities", entity_key(user_id, key), _encode(entity), guard))
        return tuple(puts), tuple(links)


def _from_cache(cached: dict[str, Entity | None], names: list[str]) -> dict[str, Entity] | None:
    """What :func:`read_entities` gives for ``names``, from a user's cached records; None if
    one of the names, or an alias's target, is not cached."""
    found: dict[str, Entity] = {}
    for name in names:
        if name not in cached:
            return None
        entity = cached[name]
        if entity is not None:
            found[name] = entity
    for entity in list(found.values()):
        target = entity.aliases[0] if entity.type == "alias" else None
        if target is not None and target not in found:
            if target not in cached:
                return None
            if cached[target] is not None:
                found[target] = cached[target]
    return found


def _another_spelling(name: str, entity: Entity) -> bool:
    """Whether ``name`` differs from the entity's name and aliases other than in case."""
    low = name.lower()
    return low != entity.name.lower() and all(low != a.lower() for a in entity.aliases)


def _pointer(name: str, key: str) -> Entity:
    """An alias record: type ``alias``, named by its own spelling (an export files it under
    that name), its target's key as the only alias."""
    epoch = datetime(1970, 1, 1, tzinfo=timezone.utc)
    return Entity(name, "alias", (key,), 0, epoch, epoch, ())


def _resolve(registry: dict[str, Entity], changed: dict[str, Entity], name: str) -> str:
    """The registry key a mention files under: itself, or the entity an alias points to."""
    key = name.lower()
    entity = changed.get(key) or registry.get(key)
    if entity is not None and entity.type == "alias":
        return entity.aliases[0]
    return key
