"""The daemon's configuration: one typed dataclass whose fields are also the ``peerd join`` flags.

``DaemonConfig`` is the single list of daemon options. YAML/JSON files fill it
through ``peerd.loading`` (unknown keys, wrong types and bad values are
``ConfigError``s naming the field, all reported at once), and the CLI derives its flags from the same fields
(``option_specs``), so an option is declared exactly once: here, with its doc.
Precedence: field defaults < config file < command-line flags.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints

from peerd.errors import ConfigError
from peerd.loading import Range, from_mapping, load_mapping
from peerd.swarm.host import available_cores
from peerd.swarm.keys import DEFAULT_SWARM, check_swarm_name
from peerd.swarm.records import PEER_RECORD_MAX_TTL_S
from peerd.swarm.secret import load_swarm_secret

HOME_ENV = "PEERD_HOME"
DEFAULT_HOME = Path("~/.peerd")
# sockaddr_un.sun_path is 108 bytes on Linux (104 on macOS); keep room for the NUL.
MAX_SOCKET_PATH = 103
_MADDR = re.compile(r"^(/[^/\s]+)+$")
_PEER_ID = re.compile(r"^[1-9A-HJ-NP-Za-km-z]{16,128}$")  # base58, as peerd.wire.types.PeerId
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")

LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]
Seconds = Annotated[float, Range(gt=0)]


def _meta(*, doc: str, cli: bool = True, metavar: str | None = None) -> dict[str, Any]:
    """Field metadata: the field's documentation (shown in ``--help``) and whether it is a CLI flag."""
    return {"doc": doc, "cli": cli, "metavar": metavar}


@dataclass
class DaemonConfig:
    """Everything ``peerd join`` needs to run one peer; see each field's ``doc`` metadata."""

    name: str = field(
        default="",
        metadata=_meta(
            doc="Human-readable peer name shown in `peerd status` (letters, digits, . _ -); default: the host name.",
        ),
    )
    swarm: str = field(
        default=DEFAULT_SWARM,
        metadata=_meta(
            doc="Swarm name (a-z 0-9 . _ -). Peers only see records of their own swarm; one name per community.",
        ),
    )
    initial_peers: list[str] = field(
        default_factory=list,
        metadata=_meta(
            doc="Multiaddr of a running peer to join (…/p2p/<peer id>); repeat for several, any one that "
            "answers is enough. Empty: rejoin through the peers remembered in HOME, or start a new swarm.",
            metavar="MADDR",
        ),
    )
    host_maddrs: list[str] = field(
        default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"],
        metadata=_meta(
            doc="Multiaddr to listen on; repeat for several. tcp/0 picks a free port; "
            "use /ip4/127.0.0.1/tcp/0 for a loopback-only swarm.",
            metavar="MADDR",
        ),
    )
    announce_maddrs: list[str] = field(
        default_factory=list,
        metadata=_meta(
            doc="Multiaddr other peers should dial (e.g. your public IP behind a port forward); needs an explicit port.",
            metavar="MADDR",
        ),
    )
    home: Path | None = field(
        default=None,
        metadata=_meta(
            doc=f"State directory: identity key, control socket, the peers seen last time (a restart rejoins "
            f"through them). Default: ${HOME_ENV} or ~/.peerd.",
            metavar="DIR",
        ),
    )
    identity: Path | None = field(
        default=None,
        metadata=_meta(
            doc="This peer's RSA private key (libp2p format): fixes its peer id and signs its records; "
            "created on first start. Default: HOME/identity.key.",
            metavar="FILE",
        ),
    )
    profile_cache: Path | None = field(
        default=None,
        metadata=_meta(
            doc="JSON file caching the measured device profile (keyed by hardware and software versions). "
            "Default: the machine-wide ~/.cache/peerd/device_profiles.json, shared by all daemons here.",
            metavar="FILE",
        ),
    )
    device: str = field(
        default="auto",
        metadata=_meta(
            doc="Device to profile and train on: auto, cpu, cuda, cuda:N or mps.",
        ),
    )
    record_ttl: Annotated[float, Range(gt=0, le=PEER_RECORD_MAX_TTL_S)] = field(
        default=60.0,
        metadata=_meta(
            doc="Seconds a published peer record stays valid; a crashed peer disappears from the swarm after this.",
            metavar="SECONDS",
        ),
    )
    refresh_interval: Seconds = field(
        default=20.0,
        metadata=_meta(
            doc="Seconds between re-publications of this peer's record (must be below record_ttl).",
            metavar="SECONDS",
        ),
    )
    probe_interval: Seconds = field(
        default=30.0,
        metadata=_meta(
            doc="Seconds between link-probe rounds (while this peer works for a job, a round probes only "
            "links never measured or last seen failing).",
            metavar="SECONDS",
        ),
    )
    probe_budget: Annotated[int, Range(ge=0)] = field(
        default=4,
        metadata=_meta(
            doc="Peers probed per round (RTT and bandwidth); bounds the probe traffic in large swarms.",
            metavar="N",
        ),
    )
    swarm_secret_file: Path | None = field(
        default=None,
        metadata=_meta(
            doc="File holding the swarm's shared secret (at least 16 bytes, e.g. `head -c 32 /dev/urandom | "
            "base64`); members accept records and streams only from peers holding the same secret, so only "
            "they can join and submit. Unset: the swarm is open to anyone who can reach a member.",
            metavar="FILE",
        ),
    )
    allowed_peers: list[str] = field(
        default_factory=list,
        metadata=_meta(
            doc="Peer id of a swarm member (as `peerd status` prints it; the hash of its public key); repeat "
            "for each member, this peer's own id included. Members store and accept only records signed by a "
            "listed peer and take streams only from listed peers, so only they can join, probe and submit. "
            "Empty: no allowlist.",
            metavar="PEER_ID",
        ),
    )
    ban_s: Annotated[float, Range(gt=0, le=3600)] = field(
        default=30.0,
        metadata=_meta(
            doc="Seconds a peer that keeps sending garbage or exceeding its limits on our streams is refused "
            "at first; each further ban of the same peer doubles it (at most an hour).",
            metavar="SECONDS",
        ),
    )
    max_jobs: Annotated[int, Range(ge=1, le=64)] = field(
        default=4,
        metadata=_meta(
            doc="Live jobs this peer runs at once: running that many, it applies to no other job (a stranger "
            "cannot make it load a model per job submitted); it applies again when one ends. Jobs that "
            "are only planning take no slot.",
            metavar="N",
        ),
    )
    startup_timeout: Seconds = field(
        default=30.0,
        metadata=_meta(
            doc="Seconds to wait for the p2p daemon to start and for the initial peers to answer.",
            metavar="SECONDS",
        ),
    )
    shutdown_timeout: Seconds = field(
        default=10.0,
        metadata=_meta(
            doc="Seconds a graceful shutdown may take before the remaining components are killed.",
            metavar="SECONDS",
        ),
    )
    leave_grace_s: Seconds = field(
        default=60.0,
        metadata=_meta(
            doc="Seconds `peerd leave` or SIGTERM may spend handing this peer's tasklets over before the "
            "shutdown starts; a second SIGTERM or Ctrl-C skips what is left.",
            metavar="SECONDS",
        ),
    )
    threads: Annotated[int | None, Range(ge=1)] = field(
        default=None,
        metadata=_meta(
            doc="Compute threads for training (torch.set_num_threads), set once at start. Default: the cores "
            "available to this process; give each daemon its share when several run on one machine.",
            metavar="N",
        ),
    )
    machine: str = field(
        default="",
        metadata=_meta(
            doc="The machine this peer computes on, as the cost models see it: CPU peers on one machine "
            "share its cores. Default: this kernel's boot id, which every daemon here shares. Name "
            "another machine for a daemon pinned to cores that no other daemon here uses (a container "
            "on its own cpuset), or to emulate separate machines on one.",
            metavar="NAME",
        ),
    )
    scenario: Path | None = field(
        default=None,
        metadata=_meta(
            doc="Link-shaping scenario (YAML) imposing per-destination delay and bandwidth on this peer's "
            "outgoing p2p traffic; emulates a geo-distributed swarm on one machine.",
            metavar="FILE",
        ),
    )
    region: str = field(
        default="",
        metadata=_meta(
            doc="Free-form location label (e.g. eu-west, home-lab) shown with allocations; "
            "planning uses it to group peers that are close.",
        ),
    )
    metrics_port: Annotated[int, Range(ge=0, lt=65536)] = field(
        default=0,
        metadata=_meta(
            doc="Serve Prometheus metrics on http://127.0.0.1:PORT/metrics (peers, links, jobs); 0: off.",
            metavar="PORT",
        ),
    )
    control_socket: Path | None = field(
        default=None,
        metadata=_meta(
            doc="Unix socket the local CLI uses to talk to this daemon. Default: HOME/control.sock.",
            metavar="PATH",
        ),
    )
    log_level: LogLevel | None = field(
        default=None,
        metadata=_meta(
            doc="Log verbosity of the daemon; default: the global `peerd --log-level`.",
            cli=False,
        ),
    )

    def problems(self) -> list[ConfigError]:
        out = []
        if self.name and not _NAME.match(self.name):
            out.append(ConfigError("name", f"{self.name!r}: use 1-64 letters, digits, '.', '_' or '-'"))
        try:
            check_swarm_name(self.swarm)
        except ConfigError as exc:
            out.append(exc)
        for key in ("initial_peers", "host_maddrs", "announce_maddrs"):
            for i, maddr in enumerate(getattr(self, key)):
                if not _MADDR.match(maddr):
                    wrong = f"{maddr!r} is not a multiaddr (e.g. /ip4/1.2.3.4/tcp/31337)"
                elif key == "initial_peers" and "/p2p/" not in maddr:
                    wrong = f"{maddr!r} lacks the peer id: expected …/p2p/<peer id>"
                elif key == "announce_maddrs" and (maddr.endswith("/tcp/0") or "/tcp/0/" in maddr):
                    wrong = f"{maddr!r}: announced addresses need an explicit port"
                else:
                    continue
                out.append(ConfigError(f"{key}[{i}]", wrong))
        if self.machine and not _NAME.match(self.machine):
            out.append(ConfigError("machine", f"{self.machine!r}: use 1-64 letters, digits, '.', '_' or '-'"))
        if not self.host_maddrs:
            out.append(ConfigError("host_maddrs", "needs at least one address to listen on"))
        if self.refresh_interval >= self.record_ttl:
            out.append(
                ConfigError(
                    "refresh_interval",
                    f"must be below record_ttl ({self.record_ttl}) or the record expires between refreshes",
                )
            )
        if self.swarm_secret_file is not None:
            try:
                load_swarm_secret(self.swarm_secret_file)
            except ConfigError as exc:
                out.append(exc)
        for i, peer in enumerate(self.allowed_peers):
            if not _PEER_ID.match(peer):
                out.append(
                    ConfigError(f"allowed_peers[{i}]", f"{peer[:80]!r} is not a peer id (base58, e.g. Qm...)")
                )
        if len(self.region) > 64:
            out.append(ConfigError("region", "at most 64 characters"))
        if self.device != "auto" and not re.match(r"^(cpu|mps|cuda(:\d+)?)$", self.device):
            out.append(ConfigError("device", f"{self.device!r}: expected auto, cpu, cuda, cuda:N or mps"))
        return out

    # -- derived values -------------------------------------------------------------------------

    def resolved(self) -> DaemonConfig:
        """A copy with every defaulted path filled in (home from $PEERD_HOME or ~/.peerd) and name set."""
        home = self.home or Path(os.environ.get(HOME_ENV) or DEFAULT_HOME)
        home = home.expanduser().absolute()
        name = self.name or _host_name()
        cfg = dataclasses.replace(
            self,
            name=name,
            home=home,
            identity=_under(home, self.identity, "identity.key"),
            profile_cache=self.profile_cache.expanduser().absolute() if self.profile_cache else None,
            control_socket=_under(home, self.control_socket, "control.sock"),
            scenario=self.scenario.expanduser().absolute() if self.scenario else None,
            swarm_secret_file=self.swarm_secret_file.expanduser().absolute()
            if self.swarm_secret_file
            else None,
            threads=self.threads or available_cores(),
        )
        if len(os.fsencode(str(cfg.control_socket))) > MAX_SOCKET_PATH:
            raise ConfigError(
                "control_socket",
                f"{cfg.control_socket} is longer than {MAX_SOCKET_PATH} bytes (a unix-socket limit); "
                "choose a shorter home or control_socket",
            )
        return cfg


def _under(home: Path, value: Path | None, default_name: str) -> Path:
    return (value.expanduser() if value else home / default_name).absolute()


def _host_name() -> str:
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname().split(".")[0])[:64].strip("-._")
    return cleaned or "peer"


# -- building a config from sources ----------------------------------------------------------------


@dataclass(frozen=True)
class OptionSpec:
    """One config field as the CLI sees it."""

    name: str  # field name, e.g. "initial_peers"
    flag: str  # "--initial-peers"
    kind: str  # "str" | "int" | "float" | "path" | "list" | "choice"
    doc: str
    default: Any
    metavar: str | None = None
    choices: tuple[str, ...] = ()


def option_specs(cls: type = DaemonConfig) -> list[OptionSpec]:
    """The fields of ``cls`` exposed as CLI flags, in declaration order."""
    hints = get_type_hints(cls)
    specs = []
    for f in dataclasses.fields(cls):
        if not f.metadata.get("cli", False):
            continue
        tp = hints[f.name]
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        specs.append(
            OptionSpec(
                name=f.name,
                flag="--" + f.name.replace("_", "-"),
                kind=_kind(tp),
                doc=f.metadata["doc"],
                default=default,
                metavar=f.metadata.get("metavar"),
            )
        )
    return specs


def _kind(tp: Any) -> str:
    if get_origin(tp) in (Union, types.UnionType):  # X | None: a flag of kind X that may be left unset
        options = [a for a in get_args(tp) if a is not type(None)]
        if len(options) == 1:
            return _kind(options[0])
    text = str(tp)
    if tp is str:
        return "str"
    if tp is int:
        return "int"
    if tp is float:
        return "float"
    if "Path" in text:
        return "path"
    if text.startswith("list["):
        return "list"
    raise TypeError(f"config: no CLI mapping for field type {tp!r}")


def load_config(file: str | Path | None = None, overrides: dict[str, Any] | None = None) -> DaemonConfig:
    """Build a ``DaemonConfig`` from an optional YAML/JSON file and then explicit overrides (CLI flags).

    ``overrides`` holds only the values the user gave: ``None`` and empty tuples are ignored,
    so an unset flag never clobbers the file.
    """
    data: dict[str, Any] = dict(load_mapping(file)) if file else {}
    for key, value in (overrides or {}).items():
        if value is None or (isinstance(value, tuple | list) and len(value) == 0):
            continue
        data[key] = list(value) if isinstance(value, tuple) else value
    return from_mapping(DaemonConfig, data)
