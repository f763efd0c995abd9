"""The bottom layer: the types every actor and the engine share, and nothing else.

- :mod:`.records`: the persisted records and the public value types built on them.
- :mod:`.messages`: every message that crosses an actor boundary (one union per actor).
- :mod:`.errors`: the error types (re-exported publicly as ``engine.errors``).
- :mod:`.config`: the engine's configuration Struct.
- :mod:`.validate`: the input checks of the public API.
- :mod:`.keys`: the byte limits of LMDB keys.
- :mod:`.where`: recall's metadata filters (checked, compiled, judged on a record).

Modules here import only the standard library, third-party packages and each other: never an
actor, never the engine.
"""
