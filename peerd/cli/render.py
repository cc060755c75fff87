"""How the CLI shows things: rich tables of peers, links and jobs, a job's progress, and refresh loops.

On a terminal, tables fit its width and progress redraws in place. Off a terminal (a pipe,
a file, a CI log) nothing is cut or redrawn: tables come out at their full width, progress
is one plain line per change, and ``--watch`` prints a whole new frame per refresh.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from typing import Any

import click
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from peerd.errors import PeerdError

# Peer states (online ...) and job states (pending ...) do not share names.
STATE_STYLE = {
    "online": "green",
    "joining": "yellow",
    "offline": "red",
    "pending": "yellow",
    "planning": "cyan",
    "running": "blue",
    "recovering": "yellow",
    "done": "green",
    "failed": "red",
    "cancelled": "magenta",
}
FINAL = ("done", "failed", "cancelled")
SPARK = "▁▂▃▄▅▆▇█"
# Off a terminal no line is cut: rich lays tables out in this many columns (a table is only as
# wide as its cells need).
UNCUT_WIDTH = 10_000


def console(*, stderr: bool = False, quiet: bool = False) -> Console:
    """A rich console for stdout (or stderr) that cuts nothing when that stream is not a terminal."""
    out = Console(stderr=stderr, quiet=quiet)
    if not out.is_terminal:
        out.width = UNCUT_WIDTH
    return out


# -- cells ----------------------------------------------------------------------------------------


def _ago(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.0f}s"
    return f"{seconds / 60:.0f}m" if seconds < 3600 else f"{seconds / 3600:.1f}h"


def _gib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**30:.1f}"


def _tflops(tflops: dict[str, float]) -> str:
    """fp32, then the fastest half-precision dtype: "0.076/0.42"."""
    if not tflops:
        return "-"
    fp32 = f"{tflops['fp32']:.2g}" if "fp32" in tflops else "-"
    half = [tflops[k] for k in ("bf16", "fp16") if k in tflops]
    return f"{fp32}/{max(half):.2g}" if half else fp32


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _steps(progress: dict[str, Any]) -> str:
    step = progress.get("step", 0)  # None: no tasklet record says how far the job got
    return f"{'?' if step is None else step}/{progress.get('steps', '?')}"


def _loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _rate(tokens_per_s: float | None) -> str:
    return f"{tokens_per_s:,.0f}" if tokens_per_s else "-"


def _cell(rtt_ms: float | None, mbps: float | None) -> str:
    rtt = "-" if rtt_ms is None else f"{rtt_ms:.1f}"
    return f"{rtt} / " + ("-" if mbps is None else f"{mbps:.0f}")


def _state(state: str, upper: bool = False) -> Text:
    return Text(state.upper() if upper else state, style=STATE_STYLE.get(state, ""))


def _table(title: str, columns: tuple[str, ...], caption: str | None = None) -> Table:
    """A table whose columns never wrap; a name ending in ">" is right-justified (numbers)."""
    table = Table(title=title, title_justify="left", caption=caption, caption_justify="left")
    for name in columns:
        right = name.endswith(">")
        table.add_column(name.rstrip(">"), justify="right" if right else "left", no_wrap=True)
    return table


def _kl_max(rl: dict[str, Any]) -> str:
    """`` (max 0.1234)`` when the trainer's record says its run's largest KL (older peers' do not)."""
    return f" (max {rl['kl_max']:.4f})" if rl.get("kl_max") is not None else ""


def sparkline(values: list[float], width: int = 40) -> str:
    """Unicode block sparkline of ``values`` (downsampled to ``width`` by averaging buckets)."""
    if not values:
        return ""
    if len(values) > width:
        size = len(values) / width
        buckets = (values[int(i * size) : max(int((i + 1) * size), int(i * size) + 1)] for i in range(width))
        values = [sum(b) / len(b) for b in buckets]
    lo, hi = min(values), max(values)
    span = hi - lo or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int((v - lo) / span * len(SPARK)))] for v in values)


# -- peers and links ------------------------------------------------------------------------------


def peers_table(view: dict[str, Any]) -> Table:
    caption = "* this peer · TFLOPS: fp32/16-bit · mem: free/total GiB"
    table = _table("peers", ("id", "name", "device", "TFLOPS>", "mem>", "state", "seen>"), caption)
    for peer in view.get("peers", []):
        table.add_row(
            peer["short_id"],
            peer["name"] + ("*" if peer.get("self") else ""),
            peer.get("device") or "-",
            _tflops(peer.get("tflops") or {}),
            f"{_gib(peer.get('memory_free_bytes'))}/{_gib(peer.get('memory_total_bytes'))}",
            _state(peer["state"], upper=True),
            _ago(peer.get("last_seen_s")),
        )
    return table


def link_cells(view: dict[str, Any]) -> dict[tuple[str, str], str]:
    """Matrix cell text per (src, dst) peer id: "RTT ms / Mbit/s" src -> dst, or the probe's failure."""
    cells: dict[tuple[str, str], str] = {}
    for link in view.get("links", []):
        src, dst = link["src"], link["dst"]
        if link["status"] != "ok":
            cells.setdefault((src, dst), link["status"])
            continue
        rtt, up, down = link.get("rtt_ms"), link.get("bw_up_mbps"), link.get("bw_down_mbps")
        cells[(src, dst)] = _cell(rtt, up)
        if (dst, src) not in cells and down is not None:  # the reverse direction, measured from this side
            cells[(dst, src)] = _cell(rtt, down)
    return cells


def _live_peers(view: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in view.get("peers", []) if p["state"] != "offline"]


def links_table(view: dict[str, Any]) -> Table:
    peers = _live_peers(view)
    table = _table("links: RTT ms / Mbit/s, row -> column", ("from \\ to", *(p["name"] + ">" for p in peers)))
    cells = link_cells(view)
    for src in peers:
        row = ["·" if src is dst else cells.get((src["peer_id"], dst["peer_id"]), "?") for dst in peers]
        table.add_row(src["name"], *row)
    return table


def render_status(view: dict[str, Any]) -> RenderableType:
    """``peerd status``: this peer, the peers table, the link matrix, and the swarm's jobs."""
    parts: list[RenderableType] = []
    if "error" in view:
        parts.append(Text(f"error: {view['error']}", style="red"))
    me = view.get("self")
    if me:
        flags = ""
        if me.get("paused"):
            flags += ", PAUSED" + (f" ({me['pause_reason']})" if me.get("pause_reason") else "")
        if me.get("leaving"):
            flags += ", LEAVING"
        parts.append(Text(f"this peer: {me['name']}, {me['state'].upper()}{flags} in swarm {me['swarm']!r}"))
        if me.get("access") == "open":
            parts.append(
                Text("access:    open (no swarm secret: anyone who reaches a peer can join and submit)")
            )
        elif me.get("access"):
            how = {"secret": "swarm secret", "allowlist": "peer allowlist"}
            means = " and ".join(how.get(m, m) for m in me["access"].split("+"))
            parts.append(Text(f"access:    members only ({means})"))
        parts.append(Text(f"peer id:   {me['peer_id']}"))
    if view.get("refusals") is not None:
        parts.append(Text(f"refused:   {refusals_line(view['refusals'], (me or {}).get('banned') or {})}"))
    if view.get("stale"):
        parts.append(Text("the DHT did not answer; showing the last known table", style="yellow"))
    parts.append(peers_table(view))
    if len(_live_peers(view)) > 1:
        parts.append(links_table(view))
    jobs = view.get("jobs") or []
    if jobs:
        names = {peer["peer_id"]: peer["name"] for peer in view.get("peers", [])}
        parts += [jobs_table(jobs), *(job_panel(v, names) for v in jobs if v["state"] != "pending")]
    return Group(*parts)


def refusals_line(refusals: dict[str, Any], banned: dict[str, Any]) -> str:
    """``3 (streams: BANNED 2, NOT_ALLOWED 1; dht records: BAD_SIGNATURE 1); 1 ban, 1 peer banned now``."""
    layers = [
        f"{layer.replace('_', ' ')}: {', '.join(f'{code} {n}' for code, n in counts.items())}"
        for layer, counts in refusals.items()
        if isinstance(counts, dict) and counts
    ]
    line = f"{refusals.get('total', 0)}" + (f" ({'; '.join(layers)})" if layers else "")
    bans = refusals.get("bans", 0)
    if bans or banned:
        line += f"; {bans} ban{'s' * (bans != 1)}, {len(banned)} peer{'s' * (len(banned) != 1)} banned now"
    return line


# -- jobs -----------------------------------------------------------------------------------------


def jobs_table(views: list[dict[str, Any]]) -> Table:
    columns = ("id", "name", "state", "step>", "loss>", "tok/s>", "allocation", "reason")
    table = _table("jobs", columns, "* owned by this peer")
    for v in views:
        p = v.get("progress") or {}
        alloc = v.get("allocation")
        shape = (
            f"{len(alloc['stages'])}x{len(alloc['stages'][0])} {alloc['allocation_hash'][:8]}"
            if alloc
            else "-"
        )
        table.add_row(
            v["short_id"] + ("*" if v.get("owner_is_me") else ""),
            v.get("name") or "-",
            _state(v["state"]),
            _steps(p),
            _loss(p.get("loss")),
            _rate(p.get("tokens_per_s")),
            shape,
            "; ".join(r for r in (v.get("reason"), v.get("not_applying") and "not applying here") if r),
        )
    return table


def job_panel(view: dict[str, Any], names: dict[str, str]) -> RenderableType:
    """One job: header, pipelines (stage -> peer, with regions), loss sparkline, throughput, bytes by kind."""
    p = view.get("progress") or {}
    head = Text(f"job {view['job_id']}  ")
    head.append_text(_state(view["state"], upper=True))
    head.append(f"  {view.get('name') or ''}  step {_steps(p)}")
    lines: list[str] = []
    alloc = view.get("allocation")
    if alloc:
        regions = alloc.get("regions") or {}
        lines.append(
            f"allocation {alloc['allocation_hash'][:12]} (epoch {alloc['epoch']}, cost {alloc['cost']:.4g} s/step, "
            f"layers {alloc.get('layers') or 'even'})"
        )
        for j, pipe in enumerate(alloc["pipelines"]):
            hops = [
                f"s{s}:{names.get(peer, peer[-8:])}" + (f"({regions[peer]})" if regions.get(peer) else "")
                for s, peer in enumerate(pipe)
            ]
            lines.append(f"replica {j}: " + " → ".join(hops))
        if alloc.get("spares"):
            lines.append("spares: " + ", ".join(names.get(peer, peer[-8:]) for peer in alloc["spares"]))
    if view.get("reason"):
        lines.append(f"reason: {view['reason']}")
    if view.get("not_applying"):
        lines.append(f"not applying here: {view['not_applying']}")
    churn = view.get("churn") or {}
    if churn.get("replans"):
        last = churn["replans"][-1]
        lines.append(f"re-plans: {len(churn['replans'])} (latest in epoch {last['epoch']}: {last['cause']})")
    if churn.get("suspects"):
        lines.append("suspected: " + ", ".join(names.get(peer, peer[-8:]) for peer in churn["suspects"]))
    recoveries = (view.get("tasklet") or {}).get("recoveries") or []
    if len(recoveries) > 1:  # the first is the start, not a recovery
        r = recoveries[-1]
        lines.append(
            f"this tasklet resumed at step {r['resume_step']} in {r['seconds']:.1f} s "
            f"(state from {r['source']}, {r['steps_redone']} step(s) redone)"
        )
    losses = [v for _, v in p.get("losses") or []]
    if losses:
        lines.append(f"loss {losses[0]:.3f} {sparkline(losses)} {losses[-1]:.3f}")
    held_out = p.get("val_losses") or []
    if held_out:
        values = [v for _, v in held_out]
        lines.append(
            f"held-out loss {values[0]:.3f} {sparkline(values)} {values[-1]:.3f} (after step {held_out[-1][0]})"
        )
    lines += rl_lines(p.get("rl"))
    if p.get("tokens_per_s"):
        lines.append(f"throughput {p['tokens_per_s']:,.0f} tokens/s")
    phases = (view.get("tasklet") or {}).get("phases_s") or {}
    if phases:
        lines.append("this tasklet's step: " + ", ".join(f"{k} {v * 1e3:,.0f} ms" for k, v in phases.items()))
    wire = [(k, n) for k, n in sorted((p.get("bytes") or {}).items()) if not k.endswith("_raw") and n]
    if wire:
        ratio, by_kind = p.get("compression_ratio"), p.get("compression_by_kind") or {}
        lines.append(
            "on the wire: "
            + ", ".join(
                f"{k} {_human_bytes(n)}" + (f" ({by_kind[k]:.1f}x)" if k in by_kind else "") for k, n in wire
            )
            + (f"; {ratio:.1f}x less than fp32 in all" if ratio else "")
        )
    regime = ((view.get("spec") or {}).get("compression") or {}).get("regime")
    if regime:
        lines.append(f"compression regime: {regime}")
    return Group(head, *(Text(f"  {line}") for line in lines))


def rl_lines(rl: dict[str, Any] | None) -> list[str]:
    """An rl job's GRPO figures for the job panel (none for other jobs)."""
    if not rl:
        return []
    rewards = rl.get("rewards") or []
    lines = []
    if rewards:
        values, passes = [r for _, r, _ in rewards], [p for _, _, p in rewards]
        lines.append(
            f"reward {values[0]:.3f} {sparkline(values)} {values[-1]:.3f}, "
            f"pass rate {passes[0]:.2f} → {passes[-1]:.2f} (after iteration {rewards[-1][0]})"
        )
    lines.append(
        f"policy v{rl.get('version', 0)}: KL {rl.get('kl', 0.0):.4f}{_kl_max(rl)}, {rl.get('response_len', 0.0):.1f} "
        f"tokens/completion, {rl.get('rollouts_per_s', 0.0):,.1f} rollouts/s, weights sent "
        f"{_human_bytes(rl.get('weight_sync_bytes', 0))}"
    )
    lags = " ".join(f"{lag}:{n}" for lag, n in rl.get("staleness") or [])
    dropped = rl.get("dropped_stale", 0) + rl.get("dropped_late", 0)
    lines.append(
        f"staleness {lags or '-'}; dropped {dropped} completion(s) "
        f"({rl.get('dropped_stale', 0)} stale, {rl.get('dropped_late', 0)} late), "
        f"{rl.get('shards_missing', 0)} shard(s) missing"
    )
    phases = rl.get("phases_s") or {}
    if phases:
        lines.append("trainer's iteration, median ms: " + _rl_phases(phases))
    return lines


# peerd.jobs.rl.report.PHASES, written out: importing it would load torch into `peerd status`
RL_PHASES = ("wait", "score", "reference", "train", "publish", "checkpoint")


def _rl_phases(phases: dict[str, float]) -> str:
    """The trainer's loop phases in order, with what lies inside them: the slowest shard's sampling
    in ``wait``, the data-parallel averages (and their wait for the other trainers) in ``train``."""

    def ms(key: str) -> str:
        return f"{phases[key] * 1e3:,.1f}"

    parts = []
    for key in (k for k in RL_PHASES if k in phases):
        inner = []
        if key == "wait" and "generate" in phases:
            inner.append(f"sampling {ms('generate')}")
        if key == "train" and "average" in phases:
            inner.append(f"averaging {ms('average')}")
            if "average_wait" in phases:
                inner.append(f"{ms('average_wait')} of it waiting for the other trainers")
        parts.append(f"{key} {ms(key)}" + (f" ({', '.join(inner)})" if inner else ""))
    return ", ".join(parts)


def job_line(view: dict[str, Any]) -> str:
    """The job's progress in one line: planning (epoch, islands searched), else step, loss, tokens/s;
    then the view's reason (why it waits, why it failed) in parentheses."""
    if view["state"] in ("pending", "planning"):
        planning = view.get("planning") or {}
        islands = planning.get("islands") or []
        best = [r["best_cost"] for r in islands if r.get("best_cost") is not None]
        line = f"{view['state']} epoch {planning.get('epoch', 0)}: "
        line += f"{len(islands)} island(s) searched" if islands else "roster open"
        line += f", this island's best {best[-1]:.4g} s/step" if best else ""
    else:
        p = view.get("progress") or {}
        line = f"{view['state']} step {_steps(p)} loss {_loss(p.get('loss'))}"
        if p.get("val_loss") is not None:
            line += f" held-out {_loss(p['val_loss'])}"
        rl = p.get("rl")
        if rl and rl.get("reward_mean") is not None:
            line += f" reward {rl['reward_mean']:.3f} pass {rl['pass_rate']:.2f}"
            line += f" KL {rl.get('kl') or 0.0:.3f} {rl.get('rollouts_per_s') or 0.0:,.0f} rollouts/s"
        elif rl:
            line += " warming up"
        else:
            line += f" {_rate(p.get('tokens_per_s'))} tok/s"
    return line + (f" ({view['reason']})" if view.get("reason") else "")


def follow_job(
    poll: Callable[[], dict[str, Any]],
    out: Console,
    *,
    names: dict[str, str] | None = None,
    interval: float = 1.0,
    limit: float | None = None,
) -> dict[str, Any]:
    """Show the job ``poll`` reads until it ends (or ``limit`` seconds pass); returns its last view.

    On a terminal the job's panel redraws in place; elsewhere a ``[  12 s] ...`` line is
    printed each time the job's line (state, step, loss, tokens/s) changes. A read that
    fails with a PeerdError is reported and retried.
    """
    from rich.live import Live

    started = time.monotonic()
    live = Live(console=out, refresh_per_second=2) if out.is_terminal else None
    last = ""
    with live or contextlib.nullcontext():
        view = poll()
        while True:
            line, stamp = job_line(view), f"[{time.monotonic() - started:5.0f} s] "
            if live is not None:
                live.update(Group(Text(stamp + line), job_panel(view, names or {})))
            elif line != last:
                out.print(stamp + line, markup=False, highlight=False)
                last = line
            if view["state"] in FINAL:
                return view
            if limit is not None and time.monotonic() - started > limit:
                out.print(f"the job did not finish within {limit:.0f} s")
                return view
            time.sleep(interval)
            try:
                view = poll()
            except PeerdError as exc:
                out.print(f"status read failed ({exc}); retrying")


# -- refresh loops --------------------------------------------------------------------------------


def show_status(
    read: Callable[[], dict[str, Any]], first: dict[str, Any], *, as_json: bool, watch: bool, interval: float
) -> None:
    """Print ``first``; with ``watch``, read again every ``interval`` s until Ctrl-C.

    JSON is one document per read. Tables redraw in place on a terminal; elsewhere each read
    prints a new frame, headed by the time of the read.
    """
    out = console()
    try:
        if watch and out.is_terminal and not as_json:
            from rich.live import Live

            with Live(render_status(first), console=out, refresh_per_second=4) as live:
                while True:
                    time.sleep(interval)
                    live.update(render_status(_read_or_error(read)))
        view = first
        while True:
            if as_json:
                click.echo(json.dumps(view, sort_keys=True))
            else:
                if watch:
                    out.print(time.strftime("-- %H:%M:%S --"), markup=False)
                out.print(render_status(view))
            if not watch:
                return
            time.sleep(interval)
            view = _read_or_error(read)
    except KeyboardInterrupt:  # the way to leave --watch
        pass


def _read_or_error(read: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return read()
    except (PeerdError, TimeoutError) as exc:
        return {"error": str(exc), "peers": [], "links": []}
