"""The store actor: LMDB, the single source of truth, as a package of small rooms.

- :mod:`.layout`: the key schema and byte layout (every database, prefix, log tag, meta key).
- :mod:`.codecs`: the record encoder and decoders.
- :mod:`.integrity` and :mod:`.chain`: value checksums, and the log's hash chain.
- :mod:`.store`: :class:`Store`, its lifecycle, opening (schema, model, chain checks), reads.
- :mod:`.writer`: the op queue and group commit; :mod:`.apply` and :mod:`.forget`: what each
  op does to the databases (:mod:`.forget` also scrubs what deletions leave in free pages).
- :mod:`.replay`: the log read back in order, and :class:`LogFollower` for derived views.
- :mod:`.reads`: the read functions run by :meth:`Store.read`.
- :mod:`.vectors`: the vectors and the model they come from; :mod:`.migrate`: schema
  migrations; :mod:`.compact`: the clean copy behind snapshots and compaction.

This module re-exports what the engine and the other actors use.
"""

from .chain import check_chain
from .codecs import (
                     decode_entity,
                     decode_episode,
                     decode_fact,
                     decode_failure,
                     decode_pending,
                     decode_review,
                     failure_put,
)
from .compact import clean_copy
from .layout import (
                     LOG_EPISODE,
                     LOG_FACT,
                     LOG_NOTE,
                     LOG_TOMBSTONE,
                     LOG_TURN,
                     MAX_DBS,
                     entity_key,
                     episode_key,
                     fact_key,
                     lsn_key,
                     open_databases,
                     session_prefix,
                     user_prefix,
)
from .migrate import MIGRATIONS
from .reads import (
                     Memory,
                     count_failures,
                     holds_memories,
                     read_entities,
                     read_derived_id,
                     read_entity_keys,
                     read_episodes,
                     read_fact_versions,
                     read_facts,
                     read_failures,
                     read_last_episode_seqs,
                     read_links,
                     read_memories_by_id,
                     read_meta_lsn,
                     read_pending,
                     read_records,
                     read_review_states,
                     read_session_tail,
                     read_session_turns,
                     read_sessions,
                     read_summary,
                     read_turn_contexts,
                     read_user_counts,
)
from .replay import (
                     Damaged,
                     LogFollower,
                     damage_puts,
                     paced,
                     read_log_range,
                     read_searchables,
                     searchable_at,
                     turn_tags,
)
from .store import Store
from .vectors import ModelInfo, read_user_vector_values, read_user_vectors, stored_model

__all__ = [
    "LOG_EPISODE", "LOG_FACT", "LOG_NOTE", "LOG_TOMBSTONE", "LOG_TURN", "MAX_DBS", "MIGRATIONS",
    "Damaged", "LogFollower", "damage_puts", "Memory", "ModelInfo", "Store", "check_chain", "clean_copy", "count_failures",
    "decode_entity", "decode_episode", "decode_fact", "decode_failure", "decode_pending",
    "decode_review", "entity_key", "episode_key", "fact_key", "failure_put", "holds_memories",
    "lsn_key",
    "open_databases", "read_derived_id", "read_entities", "read_entity_keys", "read_episodes",
    "read_fact_versions", "read_facts", "read_failures", "read_last_episode_seqs", "read_links", "read_log_range",
    "read_memories_by_id", "read_meta_lsn", "read_pending", "read_records",
    "read_review_states", "read_searchables", "read_session_tail", "read_session_turns",
    "read_sessions", "read_summary", "read_turn_contexts", "read_user_counts",
    "read_user_vector_values", "read_user_vectors", "searchable_at", "session_prefix",
    "stored_model", "turn_tags", "user_prefix",
]
