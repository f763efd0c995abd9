"""Engram's actors: one module per concern, each owning its state and its native handle."""
