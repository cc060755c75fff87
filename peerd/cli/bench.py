"""``peerd bench NAME``: run a benchmark and print its JSON result (ratios against a baseline run side by side)."""

from __future__ import annotations

import importlib

import click

# benchmark name -> module under peerd.bench exposing ``command`` (a click.Command)
BENCHMARKS = {
    "scheduler": "peerd.bench.scheduler",
    "compress": "peerd.bench.compress",
    "links": "peerd.bench.links",
    "transport": "peerd.bench.transport",
    "pipeline": "peerd.bench.pipeline",
    "averaging": "peerd.bench.averaging",
    "consensus": "peerd.bench.consensus",
}


class _BenchGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(BENCHMARKS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in BENCHMARKS:
            return None
        return importlib.import_module(BENCHMARKS[name]).command


@click.group(cls=_BenchGroup)
def bench() -> None:
    """Measure peerd against a baseline run in the same process; prints JSON.

    Report ratios, not absolute times: machines are shared and noisy.
    """
