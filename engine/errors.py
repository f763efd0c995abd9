"""The errors Engram raises, split by who caused them: the public home of the error types.

They are defined in the bottom layer (:mod:`actors.base.errors`) so that the actors can raise
them without importing the engine; this module re-exports them under the path callers use::

    from engine.errors import InvalidInput
"""

from actors.base.errors import (
    EngineBroken,
    EngineClosed,
    EngineError,
    InvalidInput,
    ModelMismatch,
    ModelMissing,
    RecordRefused,
    StoreCorrupt,
    StoreIncompatible,
    StoreInUse,
    StoreTampered,
)

__all__ = [
    "EngineError",
    "InvalidInput",
    "RecordRefused",
    "EngineClosed",
    "EngineBroken",
    "StoreIncompatible",
    "ModelMismatch",
    "ModelMissing",
    "StoreCorrupt",
    "StoreTampered",
    "StoreInUse",
]
