"""Engram: an async, in-process memory engine for conversational agents, on trio.

Everything public is re-exported here; the modules behind it are private.
"""

from ._config import Config
from ._engine import Engine, Stats
from ._records import Link, NewTurn, Note, Role, SessionInfo, SummaryState, Turn
from ._snapshot import Manifest
from ._retrieval import FOCUS_LEVELS, EpisodicItem, Hit, Message, RetrieveResult, SemanticItem
from .errors import (
    EngineBroken,
    EngineClosed,
    EngineError,
    InvalidInput,
    ModelMismatch,
    ModelMissing,
    StoreIncompatible,
)
from actors.embedder import EmbeddingBackend, HashEmbedder, OnnxEmbedder
from actors.session_buffer import Receipt

__all__ = [
    "FOCUS_LEVELS",
    "Config",
    "EmbeddingBackend",
    "Engine",
    "EngineBroken",
    "EngineClosed",
    "EngineError",
    "EpisodicItem",
    "HashEmbedder",
    "Hit",
    "InvalidInput",
    "Link",
    "Manifest",
    "Message",
    "ModelMismatch",
    "ModelMissing",
    "NewTurn",
    "Note",
    "OnnxEmbedder",
    "Receipt",
    "RetrieveResult",
    "Role",
    "SemanticItem",
    "SessionInfo",
    "Stats",
    "StoreIncompatible",
    "SummaryState",
    "Turn",
]

__version__ = "0.1.0"
