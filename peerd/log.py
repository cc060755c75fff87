"""Logging set-up: one logger per module (``get_logger(__name__)``); the CLI configures handlers."""

from __future__ import annotations

import logging
import os

_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(name)


def setup_logging(level: str | int | None = None) -> None:
    """Configure the root logger once; ``PEERD_LOG_LEVEL`` overrides the default level."""
    level = level or os.environ.get("PEERD_LOG_LEVEL", "INFO")
    logging.basicConfig(level=level, format=_FORMAT)
    # hivemind logs every DHT hiccup at INFO/WARNING through its own handler; keep peerd's output readable.
    logging.getLogger("hivemind").setLevel(max(logging.getLogger().level, logging.WARNING))
