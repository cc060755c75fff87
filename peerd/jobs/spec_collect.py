"""Kept for importers of ``bare_message``; ``ConfigError.detail`` is the same text (collecting moved to ``peerd.loading``)."""

from __future__ import annotations


def bare_message(exc: Exception) -> str:
    """A ConfigError's message without its ``field: `` prefix: its ``detail``."""
    return str(getattr(exc, "detail", exc))
