"""Reliability: no input, crash or second process can break a store (issue 11)."""
