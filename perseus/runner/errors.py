"""What perseusrun reports a usage problem with: its program name and :class:`LaunchError`.

A module of its own so that :mod:`perseus.runner.launch` and the modules it calls
(:mod:`perseus.runner.elastic_run`) raise the same error without importing each other.
"""

from __future__ import annotations

__all__ = ["PROG", "LaunchError"]

PROG = "perseusrun"


class LaunchError(Exception):
    """A problem with the request that perseusrun reports as one line and exit status 2."""
