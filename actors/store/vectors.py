"""The vectors a store holds and the embedding model they come from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lmdb
import msgspec

from .integrity import check_file, grown_along, open_reader
from .layout import _MODEL_KEY, MAX_DBS, user_prefix


class ModelInfo(msgspec.Struct, frozen=True, array_like=True):
    """The embedding model whose vectors a store holds."""

    id: str
    dim: int


_decode_model = msgspec.msgpack.Decoder(ModelInfo).decode


def read_user_vectors(
    txn: lmdb.Transaction, dbs: dict[bytes, Any], user_id: str
) -> tuple[list[int], bytes]:
    """A user's vector lsns in order, and their values concatenated (parsed by the ANN)."""
    lsns, values = read_user_vector_values(txn, dbs, user_id)
    return lsns, b"".join(values)


def read_user_vector_values(
    txn: lmdb.Transaction, dbs: dict[bytes, Any], user_id: str
) -> tuple[list[int], list[bytes]]:
    """A user's vector lsns in order, and each one's stored value (header, then vectors)."""
    prefix = user_prefix(user_id)
    cursor = txn.cursor(dbs[b"vectors"])
    lsns: list[int] = []
    values: list[bytes] = []
    if cursor.set_range(prefix):
        for key, value in cursor:
            if not key.startswith(prefix):
                break
            lsns.append(int.from_bytes(key[len(prefix):], "big"))
            values.append(value)
    return lsns, values


def stored_model(path: Path) -> ModelInfo | None:
    """The embedding model recorded in a store on disk (None: none recorded yet).

    Raises:
        StoreCorrupt: its data.mdb is shorter than LMDB's header says.
    """
    check_file(path)
    # lock=True: another process may be serving the store, and only a reader in LMDB's
    # reader table is safe from its writer reusing the pages being read.
    env = open_reader(path, readonly=True, max_dbs=MAX_DBS)

    def look() -> bytes | None:
        with env.begin() as txn:
            meta = env.open_db(b"meta", txn=txn, create=False)
            return txn.get(_MODEL_KEY, db=meta)

    try:
        raw = grown_along(env, look)  # its owner may have grown it since
        return None if raw is None else _decode_model(raw)
    except lmdb.NotFoundError:
        return None
    finally:
        env.close()
