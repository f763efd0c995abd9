"""Engine configuration: one frozen Struct, validated when the engine opens."""

from __future__ import annotations

import os
from typing import Annotated, Literal, TypeVar

import msgspec

from .errors import InvalidInput
from .validate import MAX_DEPTH, encodable

S = TypeVar("S", bound=msgspec.Struct)


def converted(cls: type[S], config: S | dict | None, field: str) -> S:
    """``cls`` from an instance, a dict of overrides or None (the defaults), its fields' types
    and constraints checked by msgspec.

    Raises:
        InvalidInput: about ``field``, when a field is unknown or has the wrong type or range.
    """
    if config is None:
        return cls()
    raw = msgspec.structs.asdict(config) if isinstance(config, cls) else config
    try:
        return msgspec.convert(raw, cls)
    except msgspec.ValidationError as exc:
        raise InvalidInput(field, f"{exc}") from None

__all__ = ["Config"]

# Counts and sizes: at most what a C int holds, so no later deque, array or LMDB call
# overflows on one that passed here.
MAX_COUNT = 2 ** 31 - 1
MAX_IDLE_SECONDS = 100 * 365 * 86_400  # session_idle_seconds: "idle since" stays after year 1
Positive = Annotated[int, msgspec.Meta(ge=1, le=MAX_COUNT)]
NAME_MAX = 255  # bytes of one name in a path, on the file systems Linux mounts


class Config(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Tunables of an engine. Every field has a default that suits a chat bot on 2 cores.

    Attributes:
        window_turns: turns kept per session in the short-term window in RAM.
        live_windows: sessions whose windows stay in RAM (least recently used are dropped and
            reread from the store on demand); bounds memory with many sessions.
        max_text_chars: longest turn text accepted.
        max_meta_bytes: largest ``meta`` accepted, measured as its JSON encoding.
        max_id_chars: longest user or session id accepted.
        fsync: commit with fsync (``True``) or leave flushing to the OS (``False``: a durable
            receipt then survives a process crash but not a power cut).
        receipt_switch_us: while a caller waits for a commit to land (a durable receipt, a
            forget), the interpreter's thread switch interval is at most this many
            microseconds, so each thread on the receipt's way gets the GIL back within it
            instead of CPython's 5 ms; back to what it was once nobody waits. 0: left alone.
        initial_map_bytes: the LMDB map size a new store starts with; it doubles when full.
        model: the embedding model: ``minilm-l6-v2`` (fp32), ``minilm-l6-v2-q8`` (weight-only
            8-bit: cosine >= 0.998 to fp32, the same recall; faster only on processors with
            8-bit dot-product instructions) or ``minilm-l6-v2-i8`` (8-bit integer arithmetic:
            cosine >= 0.97, the same recall, 1.1-1.4x fp32 on AVX2). None (the default): the model
            the store's vectors came from; for a new store, the variant the model's build
            measured as the faster on this machine. A store keeps one model; another needs
            ``engram-trio reindex``.
        model_dir: where the built model is (default: ``$ENGRAM_MODEL_DIR``, else a checkout's
            native_models/all-MiniLM-L6-v2, else the per-user data directory that
            ``engram-trio model build`` writes to).
        embed_threads: onnxruntime intra-op threads: a model call's own thread and the
            helpers it shares its work with (nice 19, never spinning, so they take only a core
            the hot path leaves idle; nice 19 on Linux). None (the default): 1. 2 cut recall's
            p50 by 0.6-1.3 ms here and the background embedding rate by 12-17%.
        background_embed_threads: model threads embedding what the store commits (nice 19;
            every one past the first pauses while a query is in the model), so background
            embedding takes the cores the hot path leaves idle.
        query_cache: query embeddings kept in an LRU cache.
        background_embedding: embed what the store commits as it comes (off: a bulk import
            that leaves embedding to the serving process, which resumes from the watermark).
        ann_cache_vectors: vectors kept in RAM for search across all loaded users (1M at 384
            dimensions is ~1.5 GB as float32 matrices; a partition with a graph keeps its
            matrix as float16 beside the graph's float32 copy, ~2.4 GB for 1M); least
            recently searched users are unloaded first.
        long_term: run the long-term layer in the background: episodes, fact extraction,
            entities, review ratings and maintenance (off: a bare turn store and search).
        episode_after_turns / episode_keep_turns: when a session has this many turns not in
            an episode, all but the newest ``episode_keep_turns`` become one (seed 002: 20/10).
        session_idle_seconds: a session this long without a turn is finished: maintenance
            makes an episode of its remaining turns (at most 100 years: a longer wait would
            reach before year 1, and no pass could run).
        maintenance_seconds: how often maintenance runs (decay and pruning of facts,
            consolidation of finished sessions, weekly reflections), on the engine's trio clock.
        consolidate_on_new_session: when a user's new session starts, consolidate their
            earlier sessions at once (seed 004): their remaining turns become episodes, as
            maintenance makes them once idle, and rewrite the user's session reflection.
            Off by default: on the LoCoMo dev split it lost a little at R@10, R@50 and in
            multi-hop questions (the README has the figures).
        summary_every_turns: keep each session's rolling summary (seed 003) up to date every
            this many turns, in the background (0: only callers write summaries).
        notes_markdown_dir: a directory where every note is mirrored as a Markdown file with
            front matter (seed 000): ``<dir>/<user>/<note>.md``, written atomically when the
            note is stored or updated, removed when it is deleted or its user forgotten, and
            made to match the store when the engine opens. None (the default): no files.
        integrity_key: a secret (16 characters or more) under which the store's hash-chain head
            and its snapshots' manifests carry an HMAC-SHA256, so that an edit by someone
            without the key is detected (None: the chain still catches edits that do not
            recompute it). A store sealed with a key opens only with it.
    """

    window_turns: Positive = 20
    live_windows: Positive = 4096
    max_text_chars: Positive = 32_000
    max_meta_bytes: Positive = 64 * 1024
    max_id_chars: Positive = 256
    fsync: bool = True
    receipt_switch_us: Annotated[int, msgspec.Meta(ge=0, le=5000)] = 250
    # Up to 16 TiB: LMDB reserves the whole map in the address space at open (47 bits).
    initial_map_bytes: Annotated[int, msgspec.Meta(ge=1 << 20, le=1 << 44)] = 256 << 20
    model: Literal["minilm-l6-v2", "minilm-l6-v2-q8", "minilm-l6-v2-i8"] | None = None
    model_dir: str | None = None
    embed_threads: Annotated[int, msgspec.Meta(ge=1, le=64)] | None = None
    background_embed_threads: Annotated[int, msgspec.Meta(ge=1, le=64)] = 2
    query_cache: Positive = 4096
    background_embedding: bool = True
    ann_cache_vectors: Positive = 1_000_000
    long_term: bool = True
    episode_after_turns: Annotated[int, msgspec.Meta(ge=2, le=MAX_COUNT)] = 20
    episode_keep_turns: Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)] = 10
    session_idle_seconds: Annotated[float, msgspec.Meta(gt=0, le=MAX_IDLE_SECONDS)] = 1800.0
    maintenance_seconds: Annotated[float, msgspec.Meta(gt=0)] = 3600.0
    integrity_key: Annotated[str, msgspec.Meta(min_length=16)] | None = None
    notes_markdown_dir: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    consolidate_on_new_session: bool = False
    summary_every_turns: Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)] = 10

    def __repr__(self) -> str:
        # The integrity key is a secret: a Config in a log line or a traceback must not show it.
        fields = msgspec.structs.asdict(self)
        if fields["integrity_key"] is not None:
            fields["integrity_key"] = "<secret>"
        return f"Config({', '.join(f'{k}={v!r}' for k, v in fields.items())})"

    @classmethod
    def checked(cls, config: "Config | dict | None") -> "Config":
        """Return a validated Config from a Config, a dict of overrides, or None (defaults).

        Raises:
            InvalidInput: a field is unknown or out of range.
        """
        config = converted(cls, config, "config")
        if config.integrity_key is not None and not encodable(config.integrity_key):
            raise InvalidInput("integrity_key", "expected text encodable as UTF-8, found a lone "
                                                "surrogate in it")
        for field in ("model_dir", "notes_markdown_dir"):
            path = getattr(config, field)
            if path is not None:
                # The model's libraries (onnxruntime, tokenizers) open UTF-8 paths only.
                _check_path(field, path, utf8=field == "model_dir")
        if config.episode_keep_turns >= config.episode_after_turns:
            raise InvalidInput("config", "expected episode_keep_turns below episode_after_turns, "
                                         f"found {config.episode_keep_turns} and "
                                         f"{config.episode_after_turns}")
        return config


def _check_path(field: str, path: str, utf8: bool) -> None:
    """A directory path the file system can take: no NUL, names of NAME_MAX bytes at most, at
    most MAX_DEPTH folders deep (found after the store's files were made, each failed its
    first use). Bytes that are not UTF-8 are taken as Python hands them over (os.fsdecode), as
    the file system holds them, unless ``utf8``: the path is handed to a library that opens
    UTF-8 paths only."""
    try:
        raw = os.fsencode(path)
        if utf8:
            path.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidInput(field, "expected a path in UTF-8, found bytes that are not (or a "
                                  "lone surrogate)" if utf8 else "expected a path the file "
                                  "system can hold, found a lone surrogate in it") from None
    if b"\x00" in raw:
        raise InvalidInput(field, f"expected a path with no NUL, found {path!r}"[:200])
    longest = max(len(name) for name in raw.split(b"/"))
    if longest > NAME_MAX:
        raise InvalidInput(field, f"expected a path whose names are at most {NAME_MAX} bytes, "
                                  f"found one of {longest}")
    if raw.count(b"/") > MAX_DEPTH:
        raise InvalidInput(field, f"expected a path at most {MAX_DEPTH} folders deep, found "
                                  f"one {raw.count(b'/')} deep")
