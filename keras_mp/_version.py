"""The package version (one place: the root re-exports it, the command prints it)."""

__version__ = "0.1.0"
