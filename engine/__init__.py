"""Engram: an async, in-process memory engine for conversational agents, on trio.

Everything public is re-exported here; the modules behind it are private.
"""

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
from actors.embedder import EmbeddingBackend, HashEmbedder, OnnxEmbedder
from actors.extraction import Candidate, Extractor, RuleExtractor
from actors.session_buffer import Receipt

from ._demo import demo_turns
from ._engine import Engine
from ._export import UserVectors
from ._hits import (
    EpisodicItem,
    Hit,
    Hits,
    Message,
    RetrieveResult,
    SemanticItem,
)
from ._llm import LLM, LLMFailed, OpenAICompatibleLLM
from ._maintenance import MaintenanceReport
from ._memory import EntityInfo
from ._retrieval import FOCUS_LEVELS
from ._snapshot import Manifest
from ._stats import Stats
from ._tools import TOOLS
from ._version import __version__
from .errors import (
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

__all__ = [
    "FOCUS_LEVELS",
    "LLM",
    "TOOLS",
    "Candidate",
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
    "UserVectors",
    "demo_turns",
]
