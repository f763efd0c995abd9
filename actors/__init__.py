"""Engram's actors: one module per concern, each owning its state and its native handle.

They are the engine's internals and share its record and error types, so the engine package
is loaded first whichever of the two is imported first.
"""

import engine  # noqa: F401  (engine's types must exist before any actor module is loaded)
