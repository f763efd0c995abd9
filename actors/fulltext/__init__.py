"""The FullText actor: BM25 over every searchable record, as a package of three rooms.

- :mod:`.fulltext`: :class:`FullText`, the actor: it follows the store's log with the only
  ``IndexWriter``, commits in batches, replays or rebuilds on open, purges deleted documents,
  copies the committed index and runs searches on worker threads.
- :mod:`.query`: :class:`QueryBuilder`, what a search asks tantivy: the user's text cut into
  terms by the index's analyser (never parsed as query syntax), the stopwords a query drops,
  :class:`TextFilters` and recall's ``where`` filters as tantivy queries.
- :mod:`.index`: the index on disk: its schema and analyser, how a record becomes a document
  (:func:`write_records`), each segment file checked against tantivy's footer checksum
  (:func:`check_index`), consistent copies, and :func:`build_index` from a store offline.

This module re-exports what the engine, the benches and the tests use.
"""

from .fulltext import FullText
from .index import (
    COLUMNS,
    FOOTER_MAGIC,
    SCHEMA_FIELDS,
    SEGMENT_FILES,
    IndexDamaged,
    build_index,
    check_index,
    write_records,
)
from .query import QUERY_STOPWORDS, QueryBuilder, TextFilters

__all__ = ["FullText", "TextFilters", "QueryBuilder", "QUERY_STOPWORDS", "IndexDamaged",
           "check_index", "build_index", "write_records", "SEGMENT_FILES", "SCHEMA_FIELDS",
           "COLUMNS", "FOOTER_MAGIC"]
