"""Benchmarks behind ``peerd bench``: each module exposes a click ``command`` printing JSON."""

from __future__ import annotations

import json

import click


def emit_json(result: dict, out: str | None = None) -> None:
    """Print ``result`` as indented, key-sorted JSON; also write it to ``out`` when given."""
    text = json.dumps(result, indent=2, sort_keys=True)
    click.echo(text)
    if out:
        with open(out, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
