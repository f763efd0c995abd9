"""The errors Engram raises, split by who caused them: the public home of the error types.

They are defined in the bottom layer (:mod:`actors.base.errors`) so that the actors can raise
them without importing the engine; this module re-exports them under the path callers use::

    from engine.errors import InvalidInput
"""

from actors.base.errors import *  # noqa: F403  (every public name; the list is __all__ there)
from actors.base.errors import __all__
