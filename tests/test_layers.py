"""The floor plan, checked from the source: layers import only downwards.

Every module is parsed (never imported), and every import statement counts, including those
inside functions, so that a lazy import cannot hide an upward dependency. The layers, bottom up:

- ``actors/base/``: records, messages, errors, config, validation, key limits. Standard library
  and third-party packages only, plus each other.
- ``actors/``: one module per actor, over ``actors.base``; never the engine, and never another
  actor's private (``_x``) names.
- ``engine/``: the facade, retrieval, snapshots, maintenance, tools and the faces.
- ``bench/`` and ``examples/``: the public API only (``engine``'s exported names and its public
  modules), and never a private attribute (``obj._x``) of anything, a running engine's least of
  all: what a bench needs to see or wait for is public (``stats()``, ``flush()``, ``recall``'s
  ``legs``, an embedding backend of its own). One exception, for bench only: a bench that
  measures one actor stage in isolation (the Embedder against bare onnxruntime, the text
  index's footer check, hnswlib with the vector index's parameters) may import it from
  ``actors``, by public names only (no ``_x`` module or name), and constructs it itself; it
  never reaches into the actors a running engine holds. Inside its own classes a bench uses
  ``self._x`` freely.
- ``tests/actors/``: the tests of one actor use only ``actors.base``, that actor, and
  ``actors.store``: the log every other actor follows, run bare under it as under the engine
  (``tests/actors/ground.py``).

A new rule is one more test function over :func:`imports_of` (or :func:`all_imports`).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import engine

ROOT = Path(__file__).resolve().parent.parent
FIRST_PARTY = ("actors", "engine", "bench", "examples", "tests")
PUBLIC_ENGINE_MODULES = frozenset({"engine", "engine.errors", "engine.aio", "engine.sync",
                                   "engine.cluster"})


@dataclass(frozen=True)
class Import:
    """One import statement, resolved to absolute module names.

    Attributes:
        path: the importing file, relative to the repository root.
        line: its line number.
        target: the module imported, or imported from (``engine.errors``).
        names: the names taken from it (``from X import a, b``); empty for ``import X``.
    """

    path: str
    line: int
    target: str
    names: tuple[str, ...]

    def within(self, package: str) -> bool:
        """Whether the imported module is ``package`` or inside it."""
        return self.target == package or self.target.startswith(package + ".")


def module_name(path: Path) -> str:
    """The dotted name of a source file (``actors/base/__init__.py`` -> ``actors.base``)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def sources(*packages: str) -> list[Path]:
    """Every .py file under the given top-level directories, sorted."""
    return sorted(p for package in packages for p in (ROOT / package).rglob("*.py"))


def imports_of(path: Path) -> Iterator[Import]:
    """Every import in a file, at any depth, with relative imports made absolute."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    rel = str(path.relative_to(ROOT))
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), rel)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(rel, node.lineno, alias.name, ())
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            yield Import(rel, node.lineno, target, tuple(a.name for a in node.names))


def all_imports(*packages: str) -> list[Import]:
    """Every import of every file under the given top-level directories."""
    return [imp for path in sources(*packages) for imp in imports_of(path)]


def test_the_rules_see_the_tree() -> None:
    """The walk finds the layers' files and their imports (a rule over nothing proves nothing)."""
    found = {str(p.relative_to(ROOT)) for p in sources("actors", "engine", "bench")}
    assert {"actors/base/records.py", "actors/session_buffer.py", "engine/__init__.py",
            "bench/ingest.py"} <= found
    assert any(i.target == "actors.base.records" for i in all_imports("actors"))


def test_actors_never_import_the_engine() -> None:
    """No module under actors/ imports engine, not even lazily inside a function."""
    bad = [i for i in all_imports("actors") if i.within("engine")]
    assert bad == []


def test_the_bottom_layer_imports_only_itself_and_outside_packages() -> None:
    """actors/base/ imports the standard library, third-party packages and actors.base only."""
    bad = [i for i in all_imports("actors/base")
           if i.target.split(".")[0] in FIRST_PARTY and not i.within("actors.base")]
    assert bad == []


def actor_of(module: str) -> str:
    """The actor (or the bottom layer) a module belongs to: ``actors.store.writer`` ->
    ``actors.store``; the modules of one package share their private names."""
    return ".".join(module.split(".")[:2])


def test_actors_do_not_reach_into_each_others_privates() -> None:
    """An actor takes only public names from another: its internals stay its own."""
    bad = []
    for path in sources("actors"):
        own = actor_of(module_name(path))
        aliases = set()
        for imp in imports_of(path):
            if not imp.within("actors") or actor_of(imp.target) == own:
                continue
            bad += [imp for n in imp.names if n.startswith("_")]
            if not imp.names:
                aliases.add(imp.target)
        # ``import actors.x as x`` then ``x._y``: the same reach, spelt as an attribute.
        tree = ast.parse(path.read_text(encoding="utf-8"))
        bound = {a.asname: a.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                 for a in node.names if a.asname and a.name in aliases}
        bad += [Import(str(path.relative_to(ROOT)), n.lineno, bound[n.value.id], (n.attr,))
                for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                and isinstance(n.value, ast.Name) and n.value.id in bound
                and n.attr.startswith("_")]
    assert bad == []


def _engine_imports_outside_the_public_api(package: str) -> list[Import]:
    public_names = set(engine.__all__) | {"errors", "aio", "sync"}
    bad = []
    for imp in all_imports(package):
        if not imp.within("engine"):
            continue
        if imp.target not in PUBLIC_ENGINE_MODULES:
            bad.append(imp)
        elif imp.target == "engine" and not set(imp.names) <= public_names:
            bad.append(imp)
        elif any(n.startswith("_") for n in imp.names):
            bad.append(imp)
    return bad


def test_bench_uses_only_the_public_engine_api() -> None:
    """bench/ imports only engine's exported names and public modules, no exception."""
    assert _engine_imports_outside_the_public_api("bench") == []


def test_examples_use_only_the_public_engine_api() -> None:
    """examples/ are what users copy: public names only, no exception."""
    assert _engine_imports_outside_the_public_api("examples") == []


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_attributes(path: Path, root: Path = ROOT) -> list[tuple[str, int, str]]:
    """Every ``x._y`` in a file (not dunders), but ``self._y`` inside a class the file
    defines: (path from ``root``, line, the expression)."""
    rel = str(path.relative_to(root))
    tree = ast.parse(path.read_text(encoding="utf-8"), rel)
    own = {id(node) for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef)
           for node in ast.walk(cls)
           if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
           and node.value.id == "self"}
    return [(rel, node.lineno, ast.unparse(node)) for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and _private(node.attr) and id(node) not in own]


def test_the_private_attribute_check_finds_one(tmp_path) -> None:
    """The check itself: a reach into an engine's private is found; a class's own is not."""
    planted = tmp_path / "planted.py"
    planted.write_text("class Mine:\n    def f(self):\n        return self._own\n\n"
                       "async def g(mem):\n    return mem._store, mem.__class__\n")
    assert private_attributes(planted, tmp_path) == [("planted.py", 6, "mem._store")]


def test_bench_and_examples_touch_no_private_attribute() -> None:
    """No ``obj._x`` in bench/ or examples/: a running engine's parts are not theirs to read."""
    assert [hit for path in sources("bench", "examples")
            for hit in private_attributes(path)] == []


ENGINE_NAMES = {"engine", "mem", "self.engine", "self._engine"}


def test_the_cluster_and_the_demo_use_only_the_public_engine_api() -> None:
    """The cluster's node and engine wrapper, and the demo, stand on an Engine's public
    members (as docs/ARCHITECTURE.md says), never on its parts: no ``engine._x``."""
    faces = [*sorted((ROOT / "engine" / "cluster").glob("*.py")), ROOT / "engine" / "_demo.py"]
    assert [(rel, line, text) for path in faces for rel, line, text in private_attributes(path)
            if text.rsplit(".", 1)[0] in ENGINE_NAMES] == []


def test_bench_takes_only_public_names_from_actors_and_examples_none() -> None:
    """A bench measuring an actor stage alone imports it by public name; examples, what users
    copy, import no actor at all."""
    bad = [i for i in all_imports("bench") if i.within("actors")
           and (any(_private(part) for part in i.target.split("."))
                or any(_private(n) for n in i.names))]
    bad += [i for i in all_imports("examples") if i.within("actors")]
    assert bad == []


def test_actor_tests_use_only_the_bottom_layer_and_their_actor() -> None:
    """tests/actors/test_X.py imports actors.base, actors.X and the store it stands on only: no
    engine, no other actor; what is the engine's goes in tests/test_X_in_engine.py."""
    through_the_engine = set()
    for path in sources("tests/actors"):
        actor = "actors." + path.stem.removeprefix("test_")
        for imp in imports_of(path):
            if (imp.within("engine") or imp.within("tests.conftest") and "open_engine" in imp.names
                    or imp.within("actors") and not (imp.within("actors.base")
                                                     or imp.within("actors.store")
                                                     or imp.within(actor))):
                through_the_engine.add(imp.path)
    assert through_the_engine == set()


def _module_graph(*packages: str) -> dict[str, set[str]]:
    """Module -> the first-party modules it imports, from every import statement at any depth
    (``from pkg import sub`` names the submodule ``pkg.sub`` when there is one)."""
    files = {module_name(p): p for p in sources(*packages)}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        for imp in imports_of(path):
            subs = [f"{imp.target}.{n}" for n in imp.names if f"{imp.target}.{n}" in files]
            targets = subs or ([imp.target] if imp.target in files else [])
            # A submodule taken from a package still runs the package's __init__ first, but
            # that is not an edge of this module: the package imports its own modules.
            graph[name].update(t for t in targets if t != name)
    return graph


def _a_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle, as the modules along it (first repeated at the end); [] if none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done, no cycle through it
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return []

    for start in sorted(graph):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return []


def test_the_cycle_check_finds_a_cycle() -> None:
    """The check itself: a planted circle is found, a straight line is not."""
    assert _a_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _a_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) == []


# Imports for annotations only (under ``if TYPE_CHECKING:``) that close a circle, each named
# with its reason; each is checked to still exist, so the list cannot go stale. A new one fails.
KNOWN_TYPE_ONLY_CIRCLES: dict[tuple[str, str], str] = {}


def test_no_import_cycle_among_the_engine_and_the_actors() -> None:
    """No module of engine/ or actors/ imports, at any depth or lazily, a module that imports
    it back (the package ``engine`` counts: its ``__init__`` imports every public module)."""
    graph = _module_graph("engine", "actors")
    assert len(graph) > 30 and "engine._engine" in graph["engine"]
    for module, target in KNOWN_TYPE_ONLY_CIRCLES:
        assert target in graph[module], f"{module} no longer imports {target}: drop it above"
        graph[module].discard(target)
    assert _a_cycle(graph) == []


def test_the_engine_imports_the_actors_and_never_the_reverse() -> None:
    """Edges between the two layers only run downwards: engine -> actors (and actors.base)."""
    graph = _module_graph("engine", "actors")
    up = sorted((m, t) for m, targets in graph.items() for t in targets
                if m.startswith("actors") and t.split(".")[0] == "engine")
    assert up == []
    assert any(t.startswith("actors.base") for t in graph["engine._engine"])
