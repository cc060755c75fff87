"""``peerd submit``, ``peerd cancel``, ``peerd jobs`` and ``peerd fetch``: jobs through the local daemon.

Every command talks to the local daemon through its control socket (``--home`` picks which
daemon): the daemon holds the identity that signs job records, so the job's owner is the
daemon's peer. ``submit`` validates the spec here first and refuses it with one line per bad
field (exit 2) before anything is published.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from peerd.cli.options import DAEMON, CliError, call, client, client_of, command, config_options
from peerd.cli.render import console, follow_job, jobs_table
from peerd.config import load_config
from peerd.errors import PeerdError

# -- submit ---------------------------------------------------------------------------------------


@command("""
  peerd submit configs/jobs/gpt-tiny-demo.yaml            prints the job id
  peerd submit configs/jobs/gpt-small.yaml --wait         follow it to the end
  peerd submit job.yaml --home /tmp/peer2                 submit through another local daemon
""")
@click.argument("spec_file", metavar="SPEC", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--wait", is_flag=True, help="Follow the job (planning, then step, loss, tokens/s) until it ends."
)
@click.option(
    "--json", "as_json", is_flag=True, help="Print the submit result (and with --wait the final job) as JSON."
)
@config_options(only=DAEMON)
def submit(spec_file: str, wait: bool, as_json: bool, config_file: str | None, **overrides: Any) -> None:
    """Validate SPEC, sign it with the local daemon's key and publish it to the swarm; prints the job id.

    A spec with problems is refused before anything is published, with one line per bad
    field (exit code 2). Exit code 1 when the job (with --wait) fails or is cancelled. For an
    AC-SGD job it says its regime: the visits per example (steps x global_batch over the
    corpus's windows, counted here) and how much that lets activations shrink.
    """
    from peerd.jobs.records import normalized_spec
    from peerd.jobs.spec import load_job_spec

    spec = load_job_spec(spec_file)  # JobSpecError (exit 2) lists every bad field
    daemon = client(config_file, overrides)
    result = call(daemon, "submit", spec=normalized_spec(spec), source=spec_file)
    job_id = result["job_id"]
    if as_json and not wait:
        click.echo(json.dumps(result, sort_keys=True))
        return
    for warning in result.get("warnings") or []:
        click.echo(f"warning: {warning}", err=True)
    if result.get("regime"):  # how much AC-SGD can compress this job's activations
        click.echo(f"compression: {result['regime']}", err=True)
    if not as_json:
        click.echo(job_id)
    if wait:
        # progress goes to stderr, so that --json output stays clean
        final = follow_job(lambda: call(daemon, "job_status", job_id=job_id), console(stderr=True))
        if as_json:
            click.echo(json.dumps(final, sort_keys=True))
        if final["state"] != "done":
            reason = final.get("reason") or "see peerd status"
            raise CliError(f"job {job_id} ended {final['state']}: {reason}")


# -- cancel ---------------------------------------------------------------------------------------


@command("""
  peerd cancel 3f9a1c2e                           by a prefix of its id (4 characters at least)
  peerd cancel 3f9a1c2e --reason "wrong lr"       the reason shows in peerd status
  peerd cancel 3f9a --home /tmp/peer2             through the daemon that submitted it
""")
@click.argument("job_id", metavar="ID")
@click.option("--reason", default="", show_default=False, help="Why (shown in peerd status).")
@config_options(only=DAEMON)
def cancel(job_id: str, reason: str, config_file: str | None, **overrides: Any) -> None:
    """Cancel job ID (or a unique prefix of it). Only the job's owner may: exit code 1 with NOT_OWNER otherwise."""
    daemon = client(config_file, overrides)
    result = call(daemon, "cancel", job_id=job_id, reason=reason)
    click.echo(f"job {result['job_id']} is {result['state']}" + ("" if result["changed"] else " (already)"))


# -- jobs -----------------------------------------------------------------------------------------


@command("""
  peerd jobs                                      id, state, step, loss, tokens/s of every job
  peerd jobs --json | jq '.[] | {job_id, state}'
  peerd jobs --home /tmp/peer2                    as another local daemon sees them
""")
@click.option("--json", "as_json", is_flag=True, help="Print the list as JSON.")
@config_options(only=DAEMON)
def jobs(as_json: bool, config_file: str | None, **overrides: Any) -> None:
    """List the jobs of the swarm: id, name, state, owner, step, loss, throughput, allocation."""
    views = call(client(config_file, overrides), "jobs")
    if as_json:
        click.echo(json.dumps(views, sort_keys=True))
        return
    console().print(jobs_table(views) if views else "no jobs in this swarm yet (peerd submit SPEC)")


# -- fetch ----------------------------------------------------------------------------------------


@command("""
  peerd fetch 3f9a1c2e --out model/               model/model.pt and model/job.json
  peerd fetch 3f9a --out m/ --from /tmp/peer2/checkpoints --from /tmp/peer3/checkpoints
                                                  stages checkpointed by other local daemons
  peerd fetch 3f9a --out m/ --p2p                 every stage from the peers that hold it
""")
@click.argument("job_id", metavar="ID")
@click.option(
    "--out",
    "out_dir",
    required=True,
    type=click.Path(file_okay=False),
    help="Directory for model.pt and job.json.",
)
@click.option(
    "--from",
    "roots",
    multiple=True,
    type=click.Path(exists=True, file_okay=False),
    help="Extra checkpoint roots to search (e.g. other local daemons' HOME/checkpoints); repeat for several.",
)
@click.option(
    "--p2p/--local",
    "p2p",
    default=None,
    help="Where the stages come from: --local searches this machine only, --p2p asks the peers "
    "that ran or keep copies of each stage (through the daemon). Default: local, then p2p for "
    "what is missing here.",
)
@config_options(only=DAEMON)
def fetch(
    job_id: str,
    out_dir: str,
    roots: tuple[str, ...],
    p2p: bool | None,
    config_file: str | None,
    **overrides: Any,
) -> None:
    """Assemble the latest checkpoint of every stage of job ID into one model file (OUT/model.pt).

    Searches the local daemon's HOME/checkpoints and every --from directory, or gathers the
    stages over p2p from the peers that hold them (this daemon need not have run a tasklet of
    the job); the result loads with one call, ``peerd.models.load_checkpoint(path)`` (the model
    with its weights), samples with ``peerd generate``, and starts a ``finetune`` job as its
    ``init_checkpoint``.
    """
    from peerd.jobs.fetch import assemble
    from peerd.jobs.spec import parse_job_spec

    config = load_config(config_file, overrides).resolved()
    client = client_of(config)
    view = call(client, "job_status", job_id=job_id)
    spec = parse_job_spec(view["spec_mapping"])
    search = [Path(str(config.home)) / "checkpoints", *(Path(r) for r in roots)]
    if not p2p:
        try:
            result = assemble(view["job_id"], spec, search, Path(out_dir))
        except PeerdError as exc:
            if p2p is False:
                raise CliError(str(exc)) from None
            click.echo(
                f"not on this machine ({exc.message}); asking the peers that hold the stages", err=True
            )
        else:
            click.echo(
                f"wrote {result.path} (step {result.step}, {result.stages} stages, "
                f"{result.parameters:,} parameters)"
            )
            return
    gathering = client_of(config, timeout=600.0)  # a big model's stages take a while to arrive
    got = call(gathering, "fetch", job_id=view["job_id"], out=str(Path(out_dir).absolute()))
    click.echo(
        f"wrote {got['path']} (step {got['step']}, {got['stages']} stages, {got['parameters']:,} parameters, "
        "gathered over p2p)"
    )
