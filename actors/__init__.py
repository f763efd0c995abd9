"""Engram's actors: one module per concern, each owning its state and its native handle.

They sit above the bottom layer, :mod:`actors.base` (records, messages, errors, config,
validation, key limits), and below the engine: nothing here imports ``engine``.
"""
