"""The AnnIndex actor: vector search restricted to one user, as a package of three rooms.

- :mod:`.ann_index`: :class:`AnnIndex`, the actor: users loaded from the store and evicted,
  graphs built, saved, checked and reloaded by one writer, searches per partition.
- :mod:`.rows`: one user's vectors in RAM: a partition's rows, the exact scan, the graph search.
- :mod:`.vectors`: a stored vector's bytes (header and float16 vector), and :class:`Filters`
  over the headers.

This module re-exports what the engine, the other actors, the benches and the tests use.
"""

from .ann_index import HNSW_EF_CONSTRUCTION, HNSW_M, HNSW_THRESHOLD, AnnIndex
from .rows import HNSW_EF_SEARCH
from .vectors import (
    HEADER,
    KINDS,
    NO_FILTERS,
    PARTS,
    STORED,
    Filters,
    decode_rows,
    decode_vectors,
    encode_vector,
    part_of,
    session_code,
)

__all__ = ["AnnIndex", "Filters", "NO_FILTERS", "HEADER", "KINDS", "PARTS", "STORED",
           "encode_vector", "decode_vectors", "decode_rows", "part_of", "session_code", "HNSW_THRESHOLD",
           "HNSW_M", "HNSW_EF_CONSTRUCTION", "HNSW_EF_SEARCH"]
