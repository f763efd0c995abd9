"""The engine's version, in a module of its own so that any module can name it without
importing the package (whose ``__init__`` imports every module: a circle)."""

__version__ = "0.1.0"
