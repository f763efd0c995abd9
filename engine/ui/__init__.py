"""The inspector: server-rendered pages under ``/ui`` of ``engram-trio serve`` that show what a
store holds and why a memory was recalled, and let an operator forget, correct and confirm.

It is a face like the HTTP API: it reads and changes memory only through the public
:class:`~engine.Engine` methods, with the same api keys (a user key sees its users, an admin
key all of them, no key no page).
"""

from ._app import create_ui

__all__ = ["create_ui"]
