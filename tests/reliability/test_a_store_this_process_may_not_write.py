"""A store this process may not write to is the caller's permissions, not damage: the
engine's own InvalidInput says so, and nothing advises restoring a healthy store from a
snapshot (which `restore --overwrite` would have done, replacing it with an older copy)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import trio

from engine import Engine, HashEmbedder

# Root with every capability dropped: file permissions apply to it.
NO_CAPABILITIES = ["setpriv", "--inh-caps=-all", "--ambient-caps=-all", "--bounding-set=-all",
                   "--"]
OPENS = textwrap.dedent("""
    import sys, trio
    from engine import Engine, EngineError, HashEmbedder

    async def main(path):
        for how in ({}, {"read_only": True}):
            try:
                async with Engine.open(path, embedder=HashEmbedder(), **how):
                    print(how, "opened")
            except EngineError as exc:
                print(how, type(exc).__name__, exc)

    trio.run(main, sys.argv[1])
""")


@pytest.mark.parametrize("taken", ["write", "read"])
def test_a_store_without_access_is_invalid_input_not_damage(tmp_path: Path, taken) -> None:
    """Without write access (LMDB's readers write lock.mdb) or read access (another user's
    files at 0600: a bare PermissionError came out of the length check of data.mdb)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and util-linux's setpriv, to take permissions away")
    store = tmp_path / "store"

    async def build() -> None:
        async with Engine.open(store, embedder=HashEmbedder()) as mem:
            await mem.add_turn("ana", "s", "user", "a first walk in Lisbon", durable=True)

    trio.run(build)
    for path in [store, *store.rglob("*")]:
        path.chmod(path.stat().st_mode & ~(0o222 if taken == "write" else 0o444))
    (store).chmod(0o755)  # the folder stays listable: the files are what is refused
    try:
        said = {}
        for verb in ("stats", "verify", "inspect"):
            extra = ["--user", "ana"] if verb == "inspect" else []
            done = subprocess.run([*NO_CAPABILITIES, sys.executable, "-m", "engine", verb,
                                   str(store), *extra], capture_output=True, text=True,
                                  timeout=120)
            said[verb] = (done.returncode, done.stdout + done.stderr)
        opened = subprocess.run([*NO_CAPABILITIES, sys.executable, "-c", OPENS, str(store)],
                                capture_output=True, text=True, timeout=120)
    finally:
        for path in [store, *store.rglob("*")]:
            path.chmod(path.stat().st_mode | 0o600)
    for verb, (code, text) in said.items():
        assert code == 1, (verb, text)
        assert "InvalidInput" in text and "Permission denied" in text, (verb, text)
        assert "snapshot" not in text and "Corrupt" not in text, (verb, text)
    for line in opened.stdout.splitlines():
        assert "InvalidInput" in line and "Permission denied" in line, opened.stdout
    assert len(opened.stdout.splitlines()) == 2, opened.stdout + opened.stderr


READS_ON_A_READ_ONLY_MOUNT = textwrap.dedent("""
    import logging, subprocess, sys, trio
    from engine import Engine, HashEmbedder

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    subprocess.run(["mount", "--bind", "-o", "ro", sys.argv[1], sys.argv[1]], check=True)

    async def main(path):
        async with Engine.open(path, embedder=HashEmbedder(), read_only=True) as mem:
            hits = await mem.recall("ana", "ferry to Porto")
            print("found", [h.text for h in hits], "degraded", list(hits.degraded))

    trio.run(main, sys.argv[1])
""")


def test_a_store_on_a_read_only_file_system_is_read_and_not_called_damaged(
        tmp_path: Path) -> None:
    """tantivy's reader takes a lock file it must be able to write, so on a read-only file
    system (a backup, a container's image) the keyword leg cannot run: the log called the
    index damaged ("its owner rebuilds it"). It says why now; recall answers from the other
    legs and names the keyword leg in degraded."""
    if shutil.which("unshare") is None:
        pytest.skip("needs util-linux's unshare to mount a file system read-only")
    store = tmp_path / "store"

    async def build() -> None:
        async with Engine.open(store, embedder=HashEmbedder()) as mem:
            await mem.add_turn("ana", "s", "user", "then a ferry to Porto", durable=True)
            await mem.flush()

    trio.run(build)
    done = subprocess.run(["unshare", "-rm", sys.executable, "-c", READS_ON_A_READ_ONLY_MOUNT,
                           str(store)], capture_output=True, text=True, timeout=120)
    if done.returncode and done.stderr.startswith(("unshare:", "mount:")):
        pytest.skip(f"cannot mount read-only here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == "found ['then a ferry to Porto'] degraded ['bm25']\n", done.stdout
    assert "damaged" not in done.stderr and "cannot be read by this process" in done.stderr, \
        done.stderr


UNREADABLE_MODEL = textwrap.dedent("""
    import sys, trio
    from engine import Engine, ModelMissing

    async def main(path, model_dir):
        try:
            async with Engine.open(path, config={"model_dir": model_dir,
                                                 "model": "minilm-l6-v2"}):
                print("opened")
        except ModelMissing as exc:
            print("ModelMissing", exc)

    trio.run(main, sys.argv[1], sys.argv[2])
""")


def test_a_model_file_this_process_may_not_read_says_so(tmp_path: Path) -> None:
    """onnxruntime's failure to read it was reported as a damaged model, to be rebuilt with
    --force, which would not help."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and util-linux's setpriv, to take permissions away")
    from actors.embedder import default_model_dir

    where = tmp_path / "model"
    where.mkdir()
    for name in ("tokenizer.json", "model.onnx"):
        (where / name).write_bytes((default_model_dir() / name).read_bytes())
    (where / "model.onnx").chmod(0)
    done = subprocess.run([*NO_CAPABILITIES, sys.executable, "-c", UNREADABLE_MODEL,
                           str(tmp_path / "store"), str(where)],
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.startswith("ModelMissing cannot read"), done.stdout + done.stderr[-2000:]
    assert "permission denied" in done.stdout and "--force" not in done.stdout
