"""``peerd bench NAME``: run a benchmark and print its JSON result (ratios against a baseline run side by side)."""

from __future__ import annotations

from peerd.cli import LazyGroup
from peerd.cli.options import command

# Each is a module peerd.bench.NAME exposing ``command`` (a click.Command), imported when run.
BENCHMARKS = (
    "scheduler",
    "compress",
    "links",
    "transport",
    "pipeline",
    "averaging",
    "consensus",
    "rl-scheduler",
    "statesync",
    "churn",
    "wan",
    "grpo",
    "rl-swarm",
    "fuzz",
)


@command(
    """
  peerd bench scheduler --quick         allocation search vs DT-FM, random and greedy (JSON)
  peerd bench compress --help           the options of one benchmark
  peerd bench links > links.json        probe accuracy on shaped loopback links, kept to compare
  peerd bench rl-scheduler --quick      RL plans vs verl/StreamRL-like, hybrid vs exact MILP (JSON)
  peerd bench churn                     recovery time and steps lost per failure kind (8 daemons)
  peerd bench wan --quick               four arms of one job on a shaped world-wide swarm (JSON, PNG)
  peerd bench grpo --task addition      warm-up then GRPO: pass rate vs the start, KL, phase times
  peerd bench rl-swarm --quick          a GRPO job on local daemons: curve, held-out start/end, predicted vs measured
""",
    cls=LazyGroup,
    lazy={name: f"peerd.bench.{name.replace('-', '_')}:command" for name in BENCHMARKS},
)
def bench() -> None:
    """Measure peerd against a baseline run in the same process; prints JSON.

    Report ratios, not absolute times: machines are shared and noisy.
    """
