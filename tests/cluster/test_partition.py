"""The partitioner: crc32 of the user id, the same in every process and on every machine."""

from __future__ import annotations

import subprocess
import sys
import zlib

from engine.cluster._partition import partition_of, subject_of, user_digest


def test_partition_is_crc32_of_the_utf8_user_id_mod_partitions() -> None:
    """Known values: a change of formula would move every user of a live cluster."""
    assert partition_of("maya") == zlib.crc32(b"maya") % 64 == 36
    assert partition_of("maya", 8) == zlib.crc32(b"maya") % 8
    assert partition_of("Zoë", 64) == zlib.crc32("Zoë".encode()) % 64
    assert {partition_of(f"user-{i}") for i in range(2000)} == set(range(64))


def test_partition_does_not_depend_on_the_process_hash_seed() -> None:
    """Python's salted hash() would differ between two nodes; crc32 does not."""
    code = ("from engine.cluster._partition import partition_of;"
            "print([partition_of(f'u{i}') for i in range(50)])")
    # Side by side: each child spends its time importing the package.
    children = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                 text=True, env={"PYTHONHASHSEED": seed})
                for seed in ("1", "2", "random")]
    outs = set()
    for child in children:
        out, _ = child.communicate(timeout=120)
        assert child.returncode == 0
        outs.add(out)
    assert len(outs) == 1
    assert outs.pop().strip() == str([partition_of(f"u{i}") for i in range(50)])


def test_a_users_subject_names_its_partition_and_a_digest_not_the_id() -> None:
    """Subjects can be purged per user, and never carry the id (dots, wildcards) in clear."""
    subject = subject_of("a.b*>", 64)
    root, p, digest = subject.split(".")
    assert (root, int(p), digest) == ("turns", partition_of("a.b*>", 64), user_digest("a.b*>"))
    assert len(digest) == 16 and all(c in "0123456789abcdef" for c in digest)
