"""The package version (ranks compare it in phase 1)."""

__version__ = "0.2.0"
