"""The public surface is exactly what engine/__init__.py re-exports."""

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
        "Candidate", "Extractor", "RuleExtractor", "UserVectors", "NotFound",
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
