"""The public surface is exactly what engine/__init__.py re-exports."""

import ast
import subprocess
import sys
from pathlib import Path

import engine


def test_public_names_are_exported_and_nothing_private_leaks() -> None:
    """Every name in __all__ exists, and every public attribute is in __all__."""
    assert set(engine.__all__) == {
        "Config", "EmbeddingBackend", "Engine", "EngineBroken", "EngineClosed", "EngineError",
        "EpisodicItem", "FOCUS_LEVELS", "HashEmbedder", "Hit", "InvalidInput", "Link", "Manifest",
        "Message", "ModelMismatch", "ModelMissing", "NewTurn", "Note", "OnnxEmbedder", "Receipt",
        "RetrieveResult", "Role", "SemanticItem", "SessionInfo", "Stats", "StoreIncompatible",
        "SummaryState", "Turn", "Entity", "EntityInfo", "Episode", "Fact", "LLM", "LLMFailed",
        "MaintenanceReport", "OpenAICompatibleLLM", "ReviewState", "TOOLS", "StoreCorrupt",
        "StoreTampered", "Failure", "RecordRefused", "Hits", "StoreInUse", "demo_turns",
        "Candidate", "Extractor", "RuleExtractor", "UserVectors", "NotFound", "UserRecords",
        "VectorRows", "ClockFailed",
    }
    for name in engine.__all__:
        assert getattr(engine, name) is not None
    # Public modules, not names: errors, the asyncio and blocking facades, the inspector's
    # pages (ui) and the cluster layer, once imported.
    public = {n for n in vars(engine) if not n.startswith("_")} - {"errors", "aio", "sync", "ui",
                                                                  "cluster"}
    assert public <= set(engine.__all__)


def test_errors_share_one_base() -> None:
    """Callers can catch every engine error with EngineError; InvalidInput is a ValueError."""
    for name in ("InvalidInput", "EngineClosed", "EngineBroken", "StoreIncompatible",
                 "ModelMismatch", "ModelMissing", "LLMFailed", "StoreCorrupt",
                 "StoreTampered", "RecordRefused", "StoreInUse", "NotFound"):
        assert issubclass(getattr(engine, name), engine.EngineError)
    assert issubclass(engine.InvalidInput, ValueError)
    assert issubclass(engine.NotFound, engine.InvalidInput)  # caught where InvalidInput is


def test_importing_the_package_imports_nothing_heavy_and_types_see_every_name() -> None:
    """``import engine`` loads a name's module on first use (the command line's Ctrl-C handling
    is in place before numpy, trio and the model runtime load); what type checkers read under
    TYPE_CHECKING names the same homes as the lazy table."""
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, engine; print(sorted({'numpy', 'trio', 'lmdb', "
         "'onnxruntime', 'tantivy', 'engine._engine'} & set(sys.modules)))"],
        capture_output=True, text=True, timeout=60, check=True).stdout
    assert loaded.strip() == "[]"
    tree = ast.parse(Path(engine.__file__).read_text())
    checked = next(node for node in tree.body if isinstance(node, ast.If)
                   and ast.unparse(node.test) == "_typing.TYPE_CHECKING")
    seen = {alias.name: "." * node.level + (node.module or "")
            for node in checked.body for alias in node.names}
    assert seen == engine._HOME_OF and set(engine.__all__) == set(seen)
