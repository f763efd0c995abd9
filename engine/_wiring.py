"""The engine's lifetime: ``Engine.open``'s arguments checked and its embedding model chosen,
its actors started in dependency order inside one nursery, stopped in reverse, and whatever
fails in that nursery raised as one engine error.

Order of start: the store (it replays and recovers the log), the embedder, the vector index,
the text index (both catch up with the log from their watermarks), the session buffer
(loaded from the store), the embedder's log follower, then the long-term layer (entities,
facts, episodes) and the scrubber in the background. Close runs the other way: the background
stops first (its watermarks say where to resume), then the embedder, the vector index and the
store, which drains what is queued.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgspec
import trio

from actors.ann_index import AnnIndex
from actors.base.config import Config
from actors.base.errors import (EngineBroken, EngineClosed, InvalidInput, StoreCorrupt,
                                StoreTampered)
from actors.embedder import (
    Embedder,
    EmbeddingBackend,
    OnnxEmbedder,
    default_model,
    model_for_store,
)
from actors.entities import Entities
from actors.episodic import EpisodicCompressor
from actors.extraction import Extractor, RuleExtractor
from actors.facts import Facts
from actors.fulltext import FullText
from actors.imported import Imported
from actors.session_buffer import SessionBuffer, new_turn_id
from actors.store import Store

from ._forget import Scrubber
from ._llm import LLM, ModelTasks
from ._logbatch import holds_a_log
from ._parts import Clock, Parts, pinnable, pinnable_ids

__all__ = ["Running", "checked_open", "embedding_for", "running"]


class Running:
    """One running engine, as the facade gets it: its parts, its scrubber, and a way to start
    more background work that close stops first."""

    def __init__(self, parts: Parts, scrubber: Scrubber, nursery: trio.Nursery) -> None:
        self.parts = parts
        self.scrubber = scrubber
        self._nursery = nursery
        self.background: list[trio.CancelScope] = []  # stopped first, in close

    async def start_background(self, task: Callable[..., Any], *args: Any) -> None:
        """Start a task that runs until the engine closes (cancelled before the actors stop)."""
        scope = trio.CancelScope()
        self.background.append(scope)
        await self._nursery.start(_in_scope, scope, task, *args)


def _apart_from_store(notes: Path, store: Path) -> None:
    """Refuse a notes folder that holds the store, is it, or lies inside it: the mirror
    removes a forgotten user's files from ``NOTES/<user>``, and a store of that name, or its
    text index's folder, must never be one of them.

    Raises:
        InvalidInput: ``notes_markdown_dir``, naming both paths.
    """
    try:
        notes = Path(os.path.abspath(notes)).resolve()
        store = Path(os.path.abspath(store)).resolve()
    except (OSError, ValueError, RuntimeError):  # no path at all: the open refuses it, naming it
        return
    if store.is_relative_to(notes) or notes.is_relative_to(store):
        where = "holds" if store != notes and store.is_relative_to(notes) else "is or lies in"
        raise InvalidInput("notes_markdown_dir", f"expected a folder apart from the store, "
                                                 f"found {notes}, which {where} the store "
                                                 f"{store}; mirror the notes in a folder of "
                                                 "their own")


def checked_open(path: Any, config: Config | Mapping[str, Any] | None, llm: Any,
                 extractor: Any, read_only: Any, reembed: bool
                 ) -> tuple[Config, ModelTasks | None, Extractor]:
    """``Engine.open``'s arguments checked, before anything is opened.

    Returns:
        The config (a reader's with the background work off), the LLM's tasks (None without
        an LLM) and the fact extractor (the LLM's prompt, or the offline rules).

    Raises:
        InvalidInput: a bad path, config, llm, extractor, read_only or reembed, as
            ``Engine.open`` documents them.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidInput("path", f"expected a directory path, found {type(path).__name__}")
    if os.fspath(path) == "":  # an unset setting, not "." (Path("") is "." already)
        raise InvalidInput("path", "expected a directory path, found an empty one")
    if llm is not None and not isinstance(llm, LLM):
        raise InvalidInput("llm", "expected an object with an async complete(system, prompt) "
                                  f"method, found {type(llm).__name__}")
    if extractor is not None and not (isinstance(extractor, Extractor)
                                      and not isinstance(extractor, type)
                                      and isinstance(extractor.name, str)
                                      and extractor.name.strip()
                                      and inspect.iscoroutinefunction(extractor.extract)):
        raise InvalidInput("extractor", "expected an object with a non-empty str name and "
                                        "an async extract(text) method, found "
                                        + (f"the class {extractor.__name__}: pass an "
                                           "instance" if isinstance(extractor, type)
                                           else type(extractor).__name__))
    config = Config.checked(dict(config) if isinstance(config, Mapping) else config)
    if type(read_only) is not bool:
        raise InvalidInput("read_only", f"expected True or False, found {read_only!r}")
    if read_only and reembed:
        raise InvalidInput("reembed", "expected False with read_only=True (re-embedding "
                                      "rewrites every vector), found True")
    if read_only:  # a reader derives nothing: that is the owner's work
        config = msgspec.structs.replace(config, background_embedding=False,
                                         long_term=False)
    elif config.notes_markdown_dir is not None:
        _apart_from_store(Path(config.notes_markdown_dir), Path(path))
    tasks = None if llm is None else ModelTasks(llm)
    if extractor is None:
        extractor = RuleExtractor() if tasks is None else tasks
    return config, tasks, extractor


async def embedding_for(root: Path, config: Config, embedder: EmbeddingBackend | None,
                        reembed: bool) -> Embedder:
    """The Embedder actor over ``embedder``, or over the ONNX model ``config.model`` names, or
    the one the store at ``root`` was made with (the default model for a new store, or with
    ``reembed``). Nothing is loaded here: the actor reads the model files when it starts
    (``running``), and raises ModelMissing then.
    """
    if embedder is not None and (isinstance(embedder, type) or not (
            callable(getattr(embedder, "load", None))
            and callable(getattr(embedder, "encode", None))
            and isinstance(getattr(embedder, "model_id", None), str)
            and type(getattr(embedder, "dim", None)) is int)):
        raise InvalidInput("embedder", "expected an embedding backend (load(), encode(texts), "
                                       "a str model_id and an int dim), found "
                                       + (f"the class {embedder.__name__}: pass an instance"
                                          if isinstance(embedder, type)
                                          else type(embedder).__name__))
    if embedder is None:
        model = config.model
        if model is None and reembed:  # the faster variant on this machine
            model = await trio.to_thread.run_sync(default_model, config.model_dir)
        elif model is None:  # the store's own, so another default never strands a store
            model = await trio.to_thread.run_sync(model_for_store, root, config.model_dir)
        embedder = OnnxEmbedder(model, config.model_dir, config.embed_threads)
    return Embedder(embedder, config.query_cache, config.background_embed_threads)


@asynccontextmanager
async def running(root: Path, config: Config, clock: Clock, embedding: Embedder,
                  reembed: bool, tasks: ModelTasks | None, extractor: Extractor,
                  read_only: bool) -> AsyncIterator[Running]:
    """Start the actors, yield the running engine, stop them in reverse."""
    # A replayed log call reads its writer's time and makes the ids every node makes for it
    # (see _logbatch); everywhere else these are the clock and random ids.
    turn_clock, clock = clock, pinnable(clock)  # turns take it unwrapped (see Parts)
    new_id = pinnable_ids(lambda: new_turn_id()[2:])
    store = Store(root, config, embedding.model, reembed, read_only)
    ann = AnnIndex(store, embedding.model.dim, config.ann_cache_vectors, root / "ann",
                   read_only, embedding.model.id)
    fulltext = FullText(root / "fulltext", store, read_only)
    body_error: BaseException | None = None
    raised: BaseException | None = None
    try:
        async with trio.open_nursery() as nursery:
            run: Running | None = None
            try:
                await nursery.start(store.run)
                await nursery.start(embedding.run)
                probe = getattr(embedding.backend, "probe", None)
                if probe is not None:  # a model loaded from files: are they the store's?
                    await store.check_probe(probe, embedding.backend.model_dir)
                await nursery.start(ann.run)
                await nursery.start(fulltext.run)
                buffer = SessionBuffer(store, config)
                await buffer.load()
                imported = Imported()
                await imported.load(store)
                if config.background_embedding:
                    await nursery.start(embedding.follow, store, ann.added)
                facts = Facts(store, lambda user, lsns: ann.removed(user, lsns, False),
                              clock, new_id)
                compressor = EpisodicCompressor(
                    store, embedding, ann, clock,
                    after_turns=config.episode_after_turns,
                    keep_turns=config.episode_keep_turns, llm=tasks,
                    vectors_follow=config.background_embedding, imported=imported,
                    sessions=buffer.sessions if config.consolidate_on_new_session else None,
                    summary_every=config.summary_every_turns)
                entities = Entities(store, imported, cache_records=not read_only)
                parts = Parts(store, buffer, embedding, ann, fulltext, facts, compressor,
                              entities, config, clock, imported, tasks, turn_clock)
                run = Running(parts, Scrubber(store, fulltext, ann), nursery)
                if parts.notes_md is not None:  # a crash may have left stale files behind
                    await parts.notes_md.sync(store)
                if not read_only:  # a reader writes nothing; the owner scrubs
                    await run.start_background(run.scrubber.run)
                if await store.read(holds_a_log):  # a cluster node's store (see Parts)
                    parts.time_by_log()
                if config.long_term:
                    parts.followers = [entities.follower, facts.follower(extractor, imported),
                                       compressor.follower]
                    for follower in parts.followers:
                        follower.lead = fulltext.keep_behind  # the text index catches up first
                        await run.start_background(follower.run)
                yield run
            except BaseException as exc:
                body_error = exc
                raise
            finally:
                # The store drains what is queued, shielded; the embedder answers what it
                # holds; the follower stops where the watermark on disk says it stopped.
                if run is not None:
                    run.parts.closed = True
                    if run.scrubber.pending and store.usable():
                        # What a forget removed leaves the files before the engine
                        # closes: otherwise the next open scrubs (the marker in the
                        # store names the users). Bounded by work, like the drain.
                        with trio.CancelScope(shield=True):
                            await run.scrubber.wait()
                    # The long-term layer stops first; its watermarks say where to resume.
                    for scope in run.background:
                        scope.cancel()
                embedding.close()
                ann.close()
                store.close()
    except BaseExceptionGroup as group:
        raised = _translate(group, body_error)
    if raised is not None:
        raise raised


async def _in_scope(scope: trio.CancelScope, task: Callable[..., Any], *args: Any,
                    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Run a background task under its own cancel scope, so close can stop it first."""
    with scope:
        await task(*args, task_status=task_status)


def _translate(group: BaseExceptionGroup, body_error: BaseException | None) -> BaseException:
    """One error out of the engine's nursery: the caller's own, or EngineBroken from the group."""
    # A group matching a condition is taken whole: only leaves may match, so groups are
    # looked into.
    real = group.subgroup(lambda e: not isinstance(e, (trio.Cancelled, BaseExceptionGroup)))
    if real is None:
        return group  # pure cancellation: trio's cancel scopes take it from here
    leaves = list(_leaves(real))
    cancelled = group.subgroup(lambda e: isinstance(e, trio.Cancelled))
    if cancelled is not None and all(isinstance(e, EngineClosed) for e in leaves):
        # Cancelled from outside, the engine closed its store while the block still ran; a
        # call there that met the closed store before a checkpoint is that cancellation,
        # which the scope that cancelled takes.
        return cancelled
    if body_error is not None and all(e is body_error for e in leaves):
        return body_error
    if all(not isinstance(e, Exception) and type(e).__name__ != "PanicException"
           for e in leaves):
        # KeyboardInterrupt and the like pass through untouched, one as itself (so that
        # ``except SystemExit`` and sys.exit's status see it); a native library's panic
        # (pyo3's PanicException, a BaseException) is the engine breaking, not the caller.
        return leaves[0] if len(leaves) == 1 else group
    damage = [e for e in leaves if isinstance(e, StoreCorrupt)]
    if damage:
        # A part found the store damaged; the other failures are its fallout (the store
        # closing under them). Say that, naming the first place; the group is the cause.
        first = damage[0]
        damaged = (StoreTampered(str(first), first.database, first.key, first.lsn)
                   if isinstance(first, StoreTampered)
                   else StoreCorrupt(str(first), first.database, first.key))
        damaged.__cause__ = group
        return damaged
    broken = EngineBroken(f"the engine failed: {'; '.join(repr(e) for e in leaves)}")
    broken.__cause__ = group
    return broken


def _leaves(group: BaseExceptionGroup) -> Iterable[BaseException]:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from _leaves(exc)
        else:
            yield exc
