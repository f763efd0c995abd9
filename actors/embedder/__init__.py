"""The Embedder: the actor that serves model calls to the engine's callers and embeds what the
store commits (``embedder.py``), and the models it runs: which one a store uses, where its files
live, and the backends (``models.py``). The names below are the package's public ones."""

from .embedder import (
    BACKGROUND_BATCH,
    BATCH_TOKENS,
    QUERY_BATCH,
    Embedder,
)
from .models import (
    BUILD_COMMAND,
    MAX_TOKENS,
    MODEL_ENV,
    MODELS,
    REFERENCE_MODEL,
    AbsentModel,
    EmbeddingBackend,
    HashEmbedder,
    OnnxEmbedder,
    build_target,
    default_model,
    default_model_dir,
    model_for_store,
    user_model_dir,
)

__all__ = ["Embedder", "EmbeddingBackend", "OnnxEmbedder", "HashEmbedder", "AbsentModel",
           "MODELS", "REFERENCE_MODEL", "default_model", "model_for_store", "default_model_dir",
           "build_target", "user_model_dir", "MODEL_ENV", "BUILD_COMMAND", "QUERY_BATCH",
           "BACKGROUND_BATCH", "BATCH_TOKENS", "MAX_TOKENS"]
