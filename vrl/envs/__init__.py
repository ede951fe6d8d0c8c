"""Environments that ship with the core (registered through the same hooks as plugins)."""
