"""Which partition a user belongs to, and the log subject of a user's entries.

A user's partition is ``crc32(user_id) % partitions``: stable across processes, machines and
Python versions (Python's ``hash()`` of a str is salted per process, so two nodes would
disagree). The subject names the partition and a digest of the user, so one user's entries
can be purged from the stream by subject (a forget) without naming the user in clear.
"""

from __future__ import annotations

import functools
import hashlib
import zlib

__all__ = ["partition_of", "subject_of", "partition_subjects", "DEFAULT_PARTITIONS",
           "SUBJECT_ROOT"]

DEFAULT_PARTITIONS = 64  # fixed for the life of a cluster: changing it moves every user
SUBJECT_ROOT = "turns"  # the stream takes "turns.>"
SUBJECTS_CACHED = 65_536  # users whose subject is kept: a digest per write costs ~1 us


def partition_of(user_id: str, partitions: int = DEFAULT_PARTITIONS) -> int:
    """The user's partition, in ``range(partitions)``.

    Args:
        user_id: the tenant.
        partitions: the cluster's partition count.

    Returns:
        ``crc32(user_id as UTF-8) % partitions``.
    """
    return zlib.crc32(user_id.encode()) % partitions


def user_digest(user_id: str) -> str:
    """A subject token for the user: 16 hex digits of blake2b (subjects hold no ids in clear,
    and an id may contain the dots and wildcards a subject cannot)."""
    return hashlib.blake2b(user_id.encode(), digest_size=8).hexdigest()


@functools.lru_cache(maxsize=SUBJECTS_CACHED)
def subject_of(user_id: str, partitions: int = DEFAULT_PARTITIONS) -> str:
    """``turns.<partition>.<user digest>``: where the user's entries are published."""
    return f"{SUBJECT_ROOT}.{partition_of(user_id, partitions)}.{user_digest(user_id)}"


def partition_subjects(partition: int) -> str:
    """The filter subject of one partition's entries."""
    return f"{SUBJECT_ROOT}.{partition}.*"
