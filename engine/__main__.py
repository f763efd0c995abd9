"""The ``engram-trio`` command (also ``python -m engine``).

Exit codes: 0 done; 1 the engine refused or failed (the message says why and what to do), or
``verify`` found the store broken; 2 the command line was wrong; 130 interrupted (Ctrl-C);
141 the reader of stdout went away (``| head``), without a traceback.

A store sealed with an integrity key is opened with the key in the environment variable
ENGRAM_INTEGRITY_KEY (never on the command line, where other users see it).
"""

from __future__ import annotations

import signal
import threading


def _exit_quietly(signum: int, frame: object) -> None:
    raise SystemExit(130)


# Ctrl-C while the imports below run (about a second: numpy, onnxruntime, tantivy, trio) exits
# 130 without a traceback, as it does once a command runs; the handler before them comes back
# after them (None: one set outside Python, so Python's own).
_BEFORE_IMPORTS = (signal.signal(signal.SIGINT, _exit_quietly)
                   if threading.current_thread() is threading.main_thread() else False)

import argparse
import errno
import io
import json
import os
import runpy
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import trio

from actors.base.config import Config
from actors.base.errors import EngineError, InvalidInput, StoreInUse

from ._engine import Engine
from ._owner import OwnerLock

if _BEFORE_IMPORTS is not False:
    signal.signal(signal.SIGINT, _BEFORE_IMPORTS or signal.default_int_handler)

MODELS = ("minilm-l6-v2", "minilm-l6-v2-q8", "minilm-l6-v2-i8")  # a new store: the fastest here
BENCHES = ("ingest", "embed", "recall", "snapshot", "crash", "forget", "bridges", "http",
           "cluster")
REPO = Path(__file__).resolve().parent.parent
KEY_ENV = "ENGRAM_INTEGRITY_KEY"  # where commands take a store's integrity key from


def _key() -> str | None:
    key = os.environ.get(KEY_ENV) or None
    if key is not None:
        try:
            Config.checked({"integrity_key": key})
        except InvalidInput as exc:
            raise InvalidInput(KEY_ENV, f"expected a store's integrity key, found one the "
                                        f"engine refuses ({exc}); set it to the key the store "
                                        "was sealed with") from None
    return key
PROG = "engram-trio"


def _store_path(value: str) -> str:
    """A store's or a snapshot's path from the command line: LMDB and the text index take
    UTF-8 names only, so undecodable bytes (which Python keeps as surrogates) are a wrong
    command line, refused before a folder is made there."""
    try:
        value.encode()
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError(
            f"expected a path of UTF-8 text, found undecodable bytes in "
            f"{os.fsencode(value)!r}; rename the folder or choose another") from None
    return value


def _port(value: str) -> int:
    """A TCP port: 0 (any free one) to 65535, checked before the store is opened."""
    try:
        port = int(value)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port from 0 to 65535 (0: any free "
                                         f"one), found {value!r}")
    return port


def _parser() -> argparse.ArgumentParser:
    from ._version import __version__

    parser = argparse.ArgumentParser(prog=PROG, description="Engram memory engine")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str, json_out: bool = True) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help, description=help)
        if json_out:
            sub.add_argument("--json", action="store_true", help="print the result as JSON")
        return sub

    demo = command("demo", "replay the bundled conversation: ingest, recall and timings")
    demo.add_argument("--store", type=_store_path,
                      help="store directory (default: a fresh temporary one)")
    snapshot = command("snapshot", "write a point-in-time snapshot of a store (served or not)")
    snapshot.add_argument("store", type=_store_path)
    snapshot.add_argument("dest", type=_store_path, help="a new or empty directory")
    restore = command("restore", "verify a snapshot and install it as a store")
    restore.add_argument("snapshot", type=_store_path)
    restore.add_argument("store", type=_store_path)
    restore.add_argument("--overwrite", action="store_true", help="replace a store already there")
    stats = command("stats", "counts and positions of a store")
    stats.add_argument("store", type=_store_path)
    inspect = command("inspect", "what a store holds about one user, or the records it "
                                 "could not take (--failures)")
    inspect.add_argument("store", type=_store_path)
    inspect.add_argument("--user", help="the user to show (with --failures: only theirs)")
    inspect.add_argument("--failures", action="store_true",
                         help="list the records a part of the engine failed on and skipped")
    inspect.add_argument("--turns", type=int, default=3, help="latest turns per session shown")
    export = command("export", "write every record of one user as JSON Lines (docs/EXPORT.md) "
                               "to stdout or --out; the store may be served meanwhile", False)
    export.add_argument("store", type=_store_path)
    export.add_argument("--user", required=True, help="the user whose memory is exported")
    export.add_argument("--out", metavar="FILE", help="write here (atomically), not to stdout")
    load = command("import", "read a user's export into a store (records it has are skipped)")
    load.add_argument("store", type=_store_path)
    load.add_argument("file", help="an export written by `export` ('-': stdin)")
    load.add_argument("--as", dest="as_user", metavar="USER",
                      help="import under this user id instead of the exported one")
    compact = command("compact", "rewrite a closed store without freed pages or tombstones")
    compact.add_argument("store", type=_store_path)
    reindex = command("reindex", "rebuild the text index and re-embed every record with a model")
    reindex.add_argument("store", type=_store_path)
    reindex.add_argument("--model", choices=MODELS, default=None,
                         help="the model to embed with (default: the one a new store gets "
                              "here, the variant the model's build measured as faster)")
    reindex.add_argument("--force", action="store_true",
                         help="rebuild even when the store is complete with this model")
    verify = command("verify", "check every record, the hash chain and the sessions of a store; "
                               f"exit 1 where it breaks (the MAC too, with {KEY_ENV} set)")
    verify.add_argument("store", type=_store_path)
    verify.add_argument("--seal", action="store_true",
                        help=f"if it verifies, MAC its head with {KEY_ENV} (closed store)")
    serve = command("serve", "serve the HTTP API (FastAPI on Hypercorn's trio worker)", False)
    serve.add_argument("store", type=_store_path)
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default: %(default)s; without --api-keys "
                            "always 127.0.0.1)")
    serve.add_argument("--port", type=_port, default=8080, help="(default: %(default)s)")
    serve.add_argument("--api-keys", metavar="FILE",
                       help="one '<key> <user_id>[,...]' or '<key> *' a line; sha256:<hex> "
                            "may stand for a key")
    mcp = command("mcp", "serve the agent tools over MCP on stdin/stdout", False)
    mcp.add_argument("store", type=_store_path)
    mcp.add_argument("--user", help="act for this user only (tools then take no user_id)")
    model = command("model", "build the embedding model where the engine looks for it", False)
    model.add_argument("action", choices=["build"])
    model.add_argument("--dir", type=Path, default=None,
                       help="where to write (default: $ENGRAM_MODEL_DIR, else the per-user "
                            "data directory)")
    model.add_argument("--force", action="store_true", help="rebuild even if verified")
    from .cluster._cli import add_commands as cluster_commands

    cluster_commands(command)  # node, cluster init|status
    bench = command("bench", "run a benchmark from bench/ (its own options follow)", False)
    bench.add_argument("name", choices=BENCHES)
    bench.add_argument("args", nargs=argparse.REMAINDER, help="passed to the benchmark")
    return parser


def _progress(label: str) -> Callable[[int, int], None]:
    """A progress bar with an ETA on stderr (rich): live on a terminal, and on anything else
    (a pipe, a CI log) no redrawn lines, just the final state. Call ``show(done, total)``; it
    ends when done reaches total."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        Progress,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    bar = Progress(TextColumn(label), BarColumn(), TaskProgressColumn(), TimeElapsedColumn(),
                   TimeRemainingColumn(), console=Console(stderr=True), transient=False)
    task = None

    def show(done: int, total: int) -> None:
        nonlocal task
        if task is None:
            bar.start()
            task = bar.add_task(label, total=max(total, 1))
        bar.update(task, completed=done, total=max(total, 1))
        if done >= total:
            bar.stop()

    return show


def human_duration(seconds: float) -> str:
    """``0.0042`` -> ``4.2 ms``, ``83`` -> ``1 min 23 s``, ``7260`` -> ``2 h 01 min``."""
    if seconds < 1:
        return f"{seconds * 1e3:.3g} ms"
    if seconds < 60:
        return f"{seconds:.3g} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def _open(store: str, embeds: bool = True, **kwargs: Any):
    """Open an existing store with the embedding backend its vectors came from, without
    starting background work; for a command that embeds nothing (``embeds=False``), with the
    store's model named and not loaded (AbsentModel), so it runs without the model's files."""
    from ._verify import require_store

    path = Path(store)
    require_store(path)  # opened to write, another program's LMDB file would become a store
    from actors.embedder import MODELS as BUILT
    from actors.embedder import AbsentModel, HashEmbedder, OnnxEmbedder, default_model
    from actors.store import ModelInfo, stored_model

    model = stored_model(path)
    config: dict[str, Any] = {"background_embedding": False, "long_term": False,
                              "integrity_key": _key()}
    if not embeds:
        recorded = model or ModelInfo(BUILT[default_model()][1], OnnxEmbedder.dim)
        return Engine.open(path, config=config, embedder=AbsentModel(
            recorded.id, recorded.dim, "this command embeds nothing and loads no model"),
            **kwargs)
    embedder = None
    names = {model_id: name for name, (_, model_id) in BUILT.items()}
    if model is None or model.id in names:
        config["model"] = names[model.id] if model else default_model()
    elif model.id == HashEmbedder().model_id:
        embedder = HashEmbedder(dim=model.dim)
    else:
        raise InvalidInput("store", f"expected vectors from a model this build has, found "
                                    f"{model.id}; re-embed with `engram-trio reindex {path}`")
    return Engine.open(path, config=config, embedder=embedder, **kwargs)


# stats, inspect and snapshot read the store without owning it (Engine.open read_only): a bot
# may be serving it, and one that starts meanwhile must not find it taken by a report.


async def _stats(store: str) -> dict[str, Any]:
    async with _open(store, embeds=False, read_only=True) as mem:
        return msgspec.structs.asdict(await mem.stats())


async def _inspect(store: str, user: str, turns: int) -> dict[str, Any]:
    async with _open(store, embeds=False, read_only=True) as mem:
        sessions = []
        for info in await mem.list_sessions(user):
            latest = await mem.session_history(user, info.session_id, limit=turns)
            sessions.append({**msgspec.structs.asdict(info),
                             "latest": [{"seq": t.seq, "role": t.role, "text": t.text,
                                         "at": t.at.isoformat()} for t in latest]})
        facts = [{"category": f.category, "key": f.key, "value": f.value, "text": f.text,
                  "confidence": round(f.confidence, 3), "importance": f.importance,
                  "protected": f.protected, "origin": f.origin,
                  "valid_at": f.valid_at.isoformat()} for f in await mem.profile(user)]
        episodes = [{"episode_id": e.episode_id, "session_id": e.session_id,
                     "turns": [e.first_seq, e.last_seq], "title": e.title,
                     "summary": e.summary, "keywords": list(e.keywords),
                     "surprise": e.surprise, "end_at": e.end_at.isoformat()}
                    for e in await mem.episodes(user)]
        return {"user_id": user, "counts": await mem.memory_stats(user), "sessions": sessions,
                "facts": facts, "episodes": episodes}


async def _failures(store: str, user: str | None) -> dict[str, Any]:
    try:
        async with _open(store) as mem:
            await mem.flush()  # replayed on open: the text index's failures are found by now
            found = await mem.failures(user)
    except StoreInUse:
        # Served: its engine records what it meets, so they are read without owning it.
        async with _open(store, read_only=True) as mem:
            found = await mem.failures(user)
    return {"failures": [{"lsn": f.lsn, "actor": f.actor, "user_id": f.user_id,
                          "memory_id": f.memory_id, "error": f.error,
                          "at": f.at.isoformat()} for f in found]}


async def _snapshot(store: str, dest: str) -> dict[str, Any]:
    async with _open(store, embeds=False, read_only=True) as mem:
        return msgspec.to_builtins(await mem.snapshot(dest))


class _WholeWrites:
    """stdout for an export: every byte written or an error. A buffered write into a pipe
    whose reader went away returns how much the pipe took and raises nothing, so an export
    cut short after 64 KiB would report every record exported and exit 0."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        while view:
            view = view[self.stream.write(view):]
        self.stream.flush()
        return len(data)


async def _export(store: str, user: str, out: str | None) -> dict[str, int]:
    async with _open(store, embeds=False, read_only=True) as mem:
        return await mem.export_user(user, out if out is not None
                                     else _WholeWrites(sys.stdout.buffer))


async def _import(store: str, source: str, as_user: str | None) -> dict[str, int]:
    if source == "-" and sys.stdin is None:  # started with stdin closed (`<&-`)
        raise InvalidInput("file", "expected an export on stdin, found stdin closed; pipe "
                                   "the export in, or name its file")
    async with _open(store) as mem:
        return await mem.import_user(sys.stdin.buffer if source == "-" else source,
                                     as_user=as_user)


async def _restore(snapshot: str, store: str, overwrite: bool) -> dict[str, Any]:
    from ._snapshot import read_manifest

    store = str(Path(store).resolve())  # ".": the folder the new store takes the place of
    key = _key()
    if key is None and read_manifest(Path(snapshot)).mac:
        # Installed, it would open with the key only: refused before it replaces anything.
        raise InvalidInput(KEY_ENV, f"expected the integrity key of the sealed store "
                                    f"{snapshot} was taken from, found {KEY_ENV} unset; set "
                                    "it and restore again")
    manifest = await Engine.restore(snapshot, store, overwrite=overwrite,
                                    progress=_progress("restoring"), integrity_key=key)
    start = time.perf_counter()
    async with _open(store, embeds=False) as mem:  # the snapshot carries the vectors
        ready = time.perf_counter() - start
        stats = await mem.stats()
    return {"lsn": manifest.lsn, "turns": stats.turns, "open_s": round(ready, 3)}


async def _reindex(store: str, model: str | None, progress: Callable[..., None] = print,
                   force: bool = False) -> dict:
    """Rebuild a closed store's indexes: the text index from the store, and every vector with
    ``model`` (adopting it; None: the one a new store gets here); returns once both cover
    everything. When the store already has every vector from ``model`` and a complete text
    index, does nothing unless ``force``."""
    start = time.perf_counter()
    from ._verify import require_store

    path = Path(store)
    require_store(path)  # before its text index goes: another program's folder keeps its own
    from actors.embedder import MODELS as BUILT
    from actors.embedder import default_model
    from actors.store import stored_model

    model = model or default_model()

    current = stored_model(path)
    if not force and current is not None and current.id == BUILT[model][1]:
        async with _open(store) as mem:  # owns the store: StoreInUse while it is served
            stats = await mem.stats()
        if stats.embedded_lsn >= stats.committed_lsn and stats.indexed_lsn >= stats.committed_lsn:
            progress(f"nothing to do: every record of {path} already has its vector from "
                     f"{stats.model} and is in the text index (--force rebuilds anyway)")
            return {"model": stats.model, "turns": stats.turns, "reindexed": False,
                    "embedded_lsn": stats.embedded_lsn, "indexed_lsn": stats.indexed_lsn,
                    "fulltext_rebuilt": False}
    with OwnerLock(path, "reindex"):  # a served store's index is not pulled from its engine
        await trio.to_thread.run_sync(shutil.rmtree, path / "fulltext", True)
    async with Engine.open(store, config=Config(model=model, integrity_key=_key()),
                           reembed=True) as mem:
        show = _progress("re-embedding")

        async def report() -> None:
            while True:
                stats = await mem.stats()
                show(stats.embedded_lsn, max(stats.committed_lsn, 1))
                await trio.sleep(0.5)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(report)
            await mem.flush()
            nursery.cancel_scope.cancel()
        stats = await mem.stats()
        show(1, 1)
    seconds = time.perf_counter() - start
    before = "no model" if current is None else current.id
    progress(f"reindexed {path}: rebuilt the text index and re-embedded every record "
             f"({stats.turns:,} turns, log up to {stats.embedded_lsn:,}) with {stats.model} "
             f"(was {before}) in {human_duration(seconds)}")
    return {"model": stats.model, "previous_model": before, "turns": stats.turns,
            "reindexed": True, "embedded_lsn": stats.embedded_lsn,
            "indexed_lsn": stats.indexed_lsn, "fulltext_rebuilt": True,
            "seconds": round(seconds, 3)}


def _bench(name: str, args: list[str]) -> dict[str, Any]:
    # http_load.py: a bench/http.py would shadow the standard library's http package.
    script = REPO / "bench" / f"{'http_load' if name == 'http' else name}.py"
    if not script.exists():
        raise InvalidInput("bench", f"expected {script} (bench/ ships with the repository, "
                                    "not the installed package); run from a checkout")
    sys.path.insert(0, str(script.parent))
    saved, sys.argv = sys.argv, [str(script), *args]
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = saved
    return {}


def _stderr_line(line: str) -> None:
    print(line, file=sys.stderr)


def _is_duration(key: str) -> bool:
    return key == "seconds" or key.endswith(("_s", "_seconds"))


def human_bytes(n: float) -> str:
    """``323584`` -> ``316 KiB``, ``10485760`` -> ``10 MiB``: binary units, 3 digits."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            # .3g turns 1000-1023 into 1e+03: whole numbers from 100 up.
            return f"{int(n)} B" if unit == "B" else f"{n:.0f} {unit}" if n >= 100 else (
                f"{n:.3g} {unit}")
        n /= 1024
    raise AssertionError("unreachable")


def _human(key: str, value: Any) -> str:
    """A value of a report as a person reads it: durations and sizes in units, lists as
    comma-separated items, nothing as ``-``."""
    if value is None:
        return "-"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if _is_duration(key):
            return human_duration(value)
        if key.endswith("_bytes"):
            return human_bytes(value)
    if isinstance(value, (list, tuple)) and all(isinstance(v, (str, int, float)) for v in value):
        return ", ".join(map(str, value)) or "-"
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, default=str) if value else "-"
    return str(value)


def _print(result: Any, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result, indent=2, default=str))
        return
    if isinstance(result, dict):
        width = max(map(len, result), default=0)
        for key, value in result.items():
            print(f"{key:>{width}}: {_human(key, value)}")


def _console():
    """A rich console on stdout whose closed pipe (`| head`) raises BrokenPipeError, for
    main's exit 141: rich's own answer to it is exit 1."""
    from rich.console import Console

    def reader_gone() -> None:
        raise BrokenPipeError(errno.EPIPE, "the reader of stdout went away")

    console = Console()
    console.on_broken_pipe = reader_gone  # type: ignore[method-assign]
    return console


def _print_inspect(report: dict[str, Any], as_json: bool) -> None:
    """``inspect``: tables for people; with ``--json``, JSON lines for scripts: one object per
    line, ``{"type": "user", ...}`` first, then one per session, fact, episode (and any other
    list the report holds), each tagged with its ``type``."""
    lists = {key: value for key, value in report.items() if isinstance(value, list)}
    head = {key: value for key, value in report.items() if key not in lists}
    if as_json:
        print(json.dumps({"type": "user", **head}, default=str))
        for key, items in lists.items():
            kind = key[:-1] if key.endswith("s") else key
            for item in items:
                print(json.dumps({"type": kind, **item} if isinstance(item, dict)
                                 else {"type": kind, "value": item}, default=str))
        return
    from rich.table import Table
    from rich.text import Text

    console = _console()
    if not console.is_terminal:
        console.width = max(console.width, 120)  # a pager or a file: wrap less than at 80
    counts = head.get("counts") or {}
    print(f"{head.get('user_id')}  " + "  ".join(f"{key} {value}"
                                                 for key, value in counts.items()))
    columns = {
        "sessions": ("session_id", "turn_count", "started_at", "last_at", "latest"),
        "facts": ("category", "key", "value", "confidence", "importance", "protected",
                  "origin"),
        "episodes": ("session_id", "turns", "title", "surprise", "end_at"),
    }
    for key, items in lists.items():
        if not items:
            console.print(f"{key}: none", highlight=False)
            continue
        names = columns.get(key) or tuple(items[0]) if isinstance(items[0], dict) else ("value",)
        table = Table(title=key, title_justify="left", show_lines=key == "sessions")
        for name in names:
            table.add_column(name, overflow="fold")
        for item in items:
            row = item if isinstance(item, dict) else {"value": item}
            # Text, not str: a stored "[/]" or "[red]" is what a user said, not rich markup.
            table.add_row(*(Text(_cell(name, row.get(name))) for name in names))
        console.print(table)


def _print_status(status: dict[str, Any]) -> None:
    """``cluster status`` for people: the stream and the nodes, then a table of partitions
    (owner, watermark, lag, lease age); ``--json`` gives the same as one document."""
    from rich.table import Table
    from rich.text import Text

    print(f"stream last seq {status['stream_last_seq']:,}; nodes: "
          + (", ".join(f"{n} {url}" for n, url in status["nodes"].items()) or "none"))
    table = Table(title="partitions", title_justify="left")
    for name in ("partition", "owner", "watermark", "lag", "lease age"):
        table.add_column(name, justify="left" if name == "owner" else "right")
    for p in status["partitions"]:
        age = p["lease_age_seconds"]
        table.add_row(str(p["partition"]), Text(p["owner"] or "-"),
                      "-" if p["watermark"] is None else f"{p['watermark']:,}",
                      "-" if p["lag"] is None else f"{p['lag']:,}",
                      "-" if age is None else human_duration(age))
    _console().print(table)


def _cell(name: str, value: Any) -> str:
    if name == "latest" and isinstance(value, list):
        return "\n".join(_shown(f"#{t['seq']} {t['role']}: {t['text'][:70]}") for t in value)
    if isinstance(value, float):
        return f"{value:.2f}"
    if isinstance(value, (list, tuple)):
        return _shown(", ".join(str(v) for v in value))
    return "" if value is None else _shown(str(value))


_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}  # C0, C1


def _shown(text: str) -> str:
    """Stored text as a terminal shows it safely: its control characters escaped (\\x1b),
    so an escape sequence a user typed (clear the screen, set the title, write the
    clipboard) reaches the operator's terminal as text."""
    return text.translate(_CONTROLS)


def main(argv: list[str] | None = None) -> int:
    """Run one command; return its exit code (see the module docstring)."""
    if isinstance(sys.stdout, io.TextIOWrapper):
        # LANG=C (stdout that takes ASCII only): stored text beyond it is shown escaped
        # (Z\xfcrich), not a UnicodeEncodeError; JSON escapes it anyway, exports are bytes.
        sys.stdout.reconfigure(errors="backslashreplace")
    try:
        code = _run(argv)
        sys.stdout.flush()  # a closed pipe shows here, not in Python's flush at exit
        return code
    except KeyboardInterrupt:
        return 130  # before a command runs: the parser's imports (the cluster's) take a while
    except BrokenPipeError:
        # The reader went away (`| head`): say nothing more, and keep Python's own flush at
        # exit from failing on the closed pipe as well.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except OSError as exc:
        # stdout took not all of the output (`> file` on a full disk): the same, and say so.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        print(f"{PROG}: its output was cut short: writing stdout failed: {exc}",
              file=sys.stderr)
        return 1


def _failed(args: argparse.Namespace, kind: str, message: str) -> int:
    """Say why a command failed: a line on stderr, and with ``--json`` one document on stdout
    (``ok`` false, the error's kind and message), so a script's parse does not fail too."""
    print(f"{PROG} {args.command}: {kind}: {message}", file=sys.stderr)
    if getattr(args, "json", False):
        print(json.dumps({"ok": False, "error": kind, "message": message}))
    return 1


def _run(argv: list[str] | None) -> int:
    from lmdb import DiskError as LMDBDiskError
    from lmdb import Error as LMDBError  # its errors out of a damaged file end here
    from lmdb import MapFullError as LMDBMapFullError

    args = _parser().parse_args(argv)
    try:
        match args.command:
            case "demo":
                from ._demo import main as demo

                # With --json the narrative goes to stderr, so stdout is one JSON document.
                result = demo(args.store, _stderr_line if args.json else print)
                if args.json:
                    _print(result, True)
                return 0
            case "snapshot":
                result = trio.run(_snapshot, args.store, args.dest)
                if not args.json:
                    result = {k: result[k] for k in ("lsn", "fulltext", "counts", "seconds")} | {
                        "dest": args.dest}
            case "restore":
                result = trio.run(_restore, args.snapshot, args.store, args.overwrite)
            case "stats":
                result = trio.run(_stats, args.store)
            case "inspect" if args.failures:
                result = trio.run(_failures, args.store, args.user)
            case "inspect":
                if args.user is None:
                    print(f"{PROG} inspect: give --user USER or --failures", file=sys.stderr)
                    return 2
                result = trio.run(_inspect, args.store, args.user, args.turns)
                _print_inspect(result, args.json)
                return 0
            case "export":
                counts = trio.run(_export, args.store, args.user, args.out)
                # stdout carries the export itself: the counts go to stderr.
                print(f"{PROG} export: {args.user}: "
                      + ", ".join(f"{n} {kind}" for kind, n in counts.items()), file=sys.stderr)
                return 0
            case "import":
                result = trio.run(_import, args.store, args.file, args.as_user)
            case "compact":
                result = trio.run(Engine.compact, args.store)
            case "reindex":
                result = trio.run(_reindex, args.store, args.model,
                                  (lambda *a: None) if args.json else print, args.force)
                if not args.json:
                    return 0  # the sentence above said what was done
            case "bench":
                _bench(args.name, args.args)
                return 0
            case "verify":
                result = trio.run(lambda: Engine.verify(args.store, integrity_key=_key(),
                                                        seal=args.seal))
                if args.json:
                    _print(result, True)
                else:
                    _print({k: v for k, v in result.items() if k != "problems"}, False)
                    for problem in result["problems"]:  # one a line: where, then what
                        print(f"  {problem['where']}: {problem['what']}")
                if not result["ok"]:
                    print(f"{PROG} verify: {args.store} is broken: {result['problem_count']} "
                          "problem(s); restore it from a snapshot", file=sys.stderr)
                    return 1
                return 0
            case "serve":
                from ._server import serve

                signum = trio.run(lambda: serve(args.store, host=args.host, port=args.port,
                                                api_keys=args.api_keys))
                return 130 if signum == signal.SIGINT else 0
            case "node" | "cluster":
                from .cluster._cli import run as cluster_run

                code, result = cluster_run(args)
                if result is None:
                    return code
                if "stream_last_seq" in result and not args.json:  # a status, not init
                    _print_status(result)
                    return code
            case "mcp":
                from ._mcp import run_stdio

                trio.run(run_stdio, args.store, args.user)
                return 0
            case "model":
                from actors.embedder import build_target
                from native_models.build import build

                build(args.force, args.dir or build_target())
                return 0
        _print(result, args.json)
    except EngineError as exc:
        return _failed(args, type(exc).__name__, str(exc))
    except (LMDBDiskError, LMDBMapFullError) as exc:
        # A write with no room, not damage: nothing to restore.
        return _failed(args, "EngineBroken", f"{exc}: the disk or the map is full; free "
                                             "space and run the command again")
    except LMDBError as exc:
        # A damaged page that a read met before any checksum could (the engine's own
        # translation of these belongs in actors/store).
        store = getattr(args, "store", None) or "the store"
        return _failed(args, "StoreCorrupt", f"LMDB cannot read {store} ({exc}); run "
                                             f"`{PROG} verify {store}`, and restore it from a "
                                             "snapshot")
    except BrokenPipeError:
        raise  # main's: exit 141
    except OSError as exc:
        # A file or folder the command read or wrote: missing, not allowed, a full disk.
        return _failed(args, type(exc).__name__, str(exc))
    except KeyboardInterrupt:
        return 130
    except BaseExceptionGroup as group:
        # Ctrl-C inside task groups (the MCP SDK's, a server's) comes out grouped, with the
        # cancellations it caused.
        if group.split((KeyboardInterrupt, trio.Cancelled))[1] is None \
                and group.subgroup(KeyboardInterrupt) is not None:
            return 130
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
