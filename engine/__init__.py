"""Engram: an async, in-process memory engine for conversational agents, on trio.

Everything public is re-exported here; the modules behind it are private. Each is imported
when one of its names is first used (PEP 562): ``import engine`` stays cheap, so the command
line has its Ctrl-C handling in place before the heavy imports begin.
"""

import typing as _typing
from importlib import import_module as _import_module

from ._version import __version__

if _typing.TYPE_CHECKING:  # what type checkers see; _HOMES below holds the same, as data
    from actors.base.config import Config
    from actors.base.records import (
        Entity,
        Episode,
        Fact,
        Failure,
        Link,
        NewTurn,
        Note,
        ReviewState,
        Role,
        SessionInfo,
        SummaryState,
        Turn,
    )
    from actors.embedder import (
        EmbeddingBackend,
        HashEmbedder,
        OnnxEmbedder,
    )
    from actors.extraction import (
        Candidate,
        Extractor,
        RuleExtractor,
    )
    from actors.session_buffer import Receipt
    from ._demo import demo_turns
    from ._engine import Engine
    from ._export import UserRecords, UserVectors, VectorRows
    from ._hits import (
        EpisodicItem,
        Hit,
        Hits,
        Message,
        RetrieveResult,
        SemanticItem,
    )
    from ._llm import (
        LLM,
        LLMFailed,
        OpenAICompatibleLLM,
    )
    from ._maintenance import MaintenanceReport
    from ._memory import EntityInfo
    from ._retrieval import FOCUS_LEVELS
    from ._snapshot import Manifest
    from ._stats import Stats
    from ._tools import TOOLS
    from .errors import (
        ClockFailed,
        EngineBroken,
        EngineClosed,
        EngineError,
        InvalidInput,
        ModelMismatch,
        ModelMissing,
        NotFound,
        RecordRefused,
        StoreCorrupt,
        StoreIncompatible,
        StoreInUse,
        StoreTampered,
    )

# Where each name lives, for the first use of it at run time: the imports above, as data.
_HOMES = {
    "actors.base.config": ("Config",),
    "actors.base.records": (
        "Entity", "Episode", "Fact", "Failure", "Link", "NewTurn", "Note", "ReviewState", "Role",
        "SessionInfo", "SummaryState", "Turn",
    ),
    "actors.embedder": ("EmbeddingBackend", "HashEmbedder", "OnnxEmbedder"),
    "actors.extraction": ("Candidate", "Extractor", "RuleExtractor"),
    "actors.session_buffer": ("Receipt",),
    "._demo": ("demo_turns",),
    "._engine": ("Engine",),
    "._export": ("UserRecords", "UserVectors", "VectorRows"),
    "._hits": ("EpisodicItem", "Hit", "Hits", "Message", "RetrieveResult", "SemanticItem"),
    "._llm": ("LLM", "LLMFailed", "OpenAICompatibleLLM"),
    "._maintenance": ("MaintenanceReport",),
    "._memory": ("EntityInfo",),
    "._retrieval": ("FOCUS_LEVELS",),
    "._snapshot": ("Manifest",),
    "._stats": ("Stats",),
    "._tools": ("TOOLS",),
    ".errors": (
        "ClockFailed", "EngineBroken", "EngineClosed", "EngineError", "InvalidInput",
        "ModelMismatch", "ModelMissing", "NotFound", "RecordRefused", "StoreCorrupt",
        "StoreIncompatible", "StoreInUse", "StoreTampered",
    ),
}
_HOME_OF = {name: home for home, names in _HOMES.items() for name in names}

__all__ = [
    "FOCUS_LEVELS",
    "LLM",
    "TOOLS",
    "Candidate",
    "ClockFailed",
    "Config",
    "EmbeddingBackend",
    "Engine",
    "EngineBroken",
    "EngineClosed",
    "EngineError",
    "Entity",
    "EntityInfo",
    "Episode",
    "EpisodicItem",
    "Extractor",
    "Fact",
    "Failure",
    "HashEmbedder",
    "Hit",
    "Hits",
    "InvalidInput",
    "LLMFailed",
    "Link",
    "MaintenanceReport",
    "Manifest",
    "Message",
    "ModelMismatch",
    "ModelMissing",
    "NewTurn",
    "NotFound",
    "Note",
    "OnnxEmbedder",
    "OpenAICompatibleLLM",
    "Receipt",
    "RecordRefused",
    "RetrieveResult",
    "RuleExtractor",
    "ReviewState",
    "Role",
    "SemanticItem",
    "SessionInfo",
    "Stats",
    "StoreCorrupt",
    "StoreIncompatible",
    "StoreTampered",
    "StoreInUse",
    "SummaryState",
    "Turn",
    "UserRecords",
    "UserVectors",
    "VectorRows",
    "demo_turns",
]


def __getattr__(name: str) -> object:
    home = _HOME_OF.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_import_module(home, __name__), name)
    globals()[name] = value  # later uses are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
