"""DaemonConfig: defaults, file + flag precedence, validation naming the field, and CLI flags derived from it."""

from __future__ import annotations

import dataclasses
import os
import socket
from pathlib import Path

import pytest
from click.testing import CliRunner

from peerd.config import MAX_SOCKET_PATH, DaemonConfig, load_config, option_specs
from peerd.errors import ConfigError, ErrorCode
from peerd.loading import from_mapping

PEER = "/ip4/10.0.0.5/tcp/31337/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


def test_defaults_are_valid_and_resolve_under_peerd_home(monkeypatch, tmp_path):
    monkeypatch.setenv("PEERD_HOME", str(tmp_path / "state"))
    cfg = from_mapping(DaemonConfig, {}).resolved()
    assert cfg.home == tmp_path / "state"
    assert cfg.identity == tmp_path / "state" / "identity.key"
    assert cfg.control_socket == tmp_path / "state" / "control.sock"
    assert cfg.profile_cache is None  # profiling's machine-wide cache
    assert cfg.name  # the host name, cleaned
    assert cfg.swarm == "default" and cfg.initial_peers == [] and cfg.host_maddrs == ["/ip4/0.0.0.0/tcp/0"]


def test_home_falls_back_to_dot_peerd(monkeypatch):
    monkeypatch.delenv("PEERD_HOME", raising=False)
    assert DaemonConfig().resolved().home == Path("~/.peerd").expanduser()


def test_explicit_paths_win_over_home(tmp_path):
    cfg = DaemonConfig(home=tmp_path, identity=tmp_path / "elsewhere.key", control_socket=tmp_path / "c.sock")
    resolved = cfg.resolved()
    assert resolved.identity == tmp_path / "elsewhere.key" and resolved.control_socket == tmp_path / "c.sock"


def test_host_name_is_sanitised(monkeypatch):
    monkeypatch.setattr(socket, "gethostname", lambda: "my laptop (2).local")
    assert DaemonConfig().resolved().name == "my-laptop--2"


def test_file_then_flags_precedence(tmp_path):
    path = tmp_path / "peer.yaml"
    path.write_text(f"name: from-file\nrecord_ttl: 30\ninitial_peers: ['{PEER}']\nprobe_budget: 2\n")
    cfg = load_config(path, {"name": "from-flag", "record_ttl": None, "initial_peers": (), "probe_budget": 7})
    assert cfg.name == "from-flag"  # a given flag wins
    assert cfg.record_ttl == 30.0  # an unset flag (None) keeps the file's value
    assert cfg.initial_peers == [PEER]  # an unset repeatable flag (empty tuple) too
    assert cfg.probe_budget == 7
    assert load_config(None, {"host_maddrs": ("/ip4/127.0.0.1/tcp/0",)}).host_maddrs == [
        "/ip4/127.0.0.1/tcp/0"
    ]


def test_json_config_files_work_too(tmp_path):
    path = tmp_path / "peer.json"
    path.write_text('{"swarm": "lab", "device": "cpu"}')
    cfg = load_config(path)
    assert (cfg.swarm, cfg.device) == ("lab", "cpu")


@pytest.mark.parametrize(
    ("data", "field", "words"),
    [
        ({"record_tll": 5}, "record_tll", "unknown key"),
        ({"record_ttl": "fast"}, "record_ttl", "must be a number"),
        ({"probe_budget": 1.5}, "probe_budget", "must be an integer"),
        ({"initial_peers": PEER}, "initial_peers", "must be a list"),
        ({"initial_peers": ["garbage"]}, "initial_peers[0]", "not a multiaddr"),
        ({"initial_peers": ["/ip4/1.2.3.4/tcp/5"]}, "initial_peers[0]", "lacks the peer id"),
        ({"announce_maddrs": ["/ip4/1.2.3.4/tcp/0"]}, "announce_maddrs[0]", "explicit port"),
        ({"host_maddrs": []}, "host_maddrs", "at least one"),
        ({"swarm": "Lab"}, "swarm", "not a valid swarm name"),
        ({"name": "two words"}, "name", "letters, digits"),
        ({"machine": "box/1"}, "machine", "letters, digits"),
        ({"record_ttl": 10, "refresh_interval": 10}, "refresh_interval", "below record_ttl"),
        ({"record_ttl": 3600, "refresh_interval": 60}, "record_ttl", "must be in (0, 600], got 3600.0"),
        ({"probe_interval": 0}, "probe_interval", "must be > 0"),
        ({"probe_budget": -1}, "probe_budget", ">= 0"),
        ({"device": "tpu"}, "device", "expected auto, cpu"),
        ({"log_level": "LOUD"}, "log_level", "must be one of"),
        ({"threads": 0}, "threads", "must be >= 1 or null, got 0"),
        ({"threads": 2.5}, "threads", "must be an integer"),
        ({"leave_grace_s": 0}, "leave_grace_s", "must be > 0"),
    ],
)
def test_bad_values_name_their_field(data, field, words):
    with pytest.raises(ConfigError) as info:
        from_mapping(DaemonConfig, data)
    assert info.value.field == field
    assert words in str(info.value)
    assert info.value.code == ErrorCode.CONFIG_INVALID


def test_threads_default_to_the_cores_this_process_may_use(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 2, 5}, raising=False)
    assert DaemonConfig(home=tmp_path).threads is None  # unset until resolved: the file keeps no guess
    assert DaemonConfig(home=tmp_path).resolved().threads == 3
    assert DaemonConfig(home=tmp_path, threads=1).resolved().threads == 1
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)  # macOS: no affinity call
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert DaemonConfig(home=tmp_path).resolved().threads == 8


def test_several_initial_peers_from_a_file_list_and_from_repeated_flags(tmp_path):
    other = PEER.replace("10.0.0.5", "10.0.0.6")
    path = tmp_path / "peer.yaml"
    path.write_text(f"initial_peers:\n  - {PEER}\n  - {other}\n")
    assert load_config(path).initial_peers == [PEER, other]
    assert load_config(path, {"initial_peers": (other,)}).initial_peers == [other]  # flags replace the list


def test_bad_file_is_a_config_error(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("name: [unclosed\n")
    with pytest.raises(ConfigError):
        load_config(path)
    with pytest.raises(ConfigError):
        load_config(tmp_path / "missing.yaml")


def test_too_long_control_socket_is_refused_when_resolving(tmp_path):
    deep = tmp_path / ("d" * (MAX_SOCKET_PATH + 10))
    with pytest.raises(ConfigError) as info:
        DaemonConfig(home=deep).resolved()
    assert info.value.field == "control_socket"


def test_every_cli_option_is_a_documented_config_field():
    fields = {f.name: f for f in dataclasses.fields(DaemonConfig)}
    specs = {s.name: s for s in option_specs()}
    assert set(specs) == {name for name, f in fields.items() if f.metadata["cli"]}
    assert "log_level" not in specs  # the global --log-level covers it on the command line
    for name, field in fields.items():
        assert len(field.metadata["doc"]) > 20, f"{name} needs a real docstring"
    assert specs["initial_peers"].kind == "list" and specs["initial_peers"].flag == "--initial-peers"
    assert specs["record_ttl"].kind == "float" and specs["record_ttl"].default == 60.0
    assert specs["home"].kind == "path"
    assert specs["threads"].kind == "int" and specs["threads"].default is None  # optional: unset means auto


def test_join_flags_are_generated_from_the_config():
    from peerd.cli.swarm import join

    result = CliRunner().invoke(join, ["--help"])
    assert result.exit_code == 0
    for spec in option_specs():
        assert spec.flag in result.output
    assert "Examples:" in result.output


def test_join_flags_reach_the_config(monkeypatch, tmp_path):
    """The generated flags parse into exactly the config fields (run_daemon is replaced to capture it)."""
    import peerd.daemon
    from peerd.cli.swarm import join

    seen = {}
    monkeypatch.setattr(
        peerd.daemon, "run_daemon", lambda config, on_ready=None: seen.setdefault("cfg", config)
    )
    config_file = tmp_path / "peer.yaml"
    config_file.write_text("record_ttl: 30\nname: filed\n")
    args = [
        "--config",
        str(config_file),
        "--name",
        "flagged",
        "--initial-peers",
        PEER,
        "--initial-peers",
        PEER,
    ]
    args += ["--probe-budget", "2", "--home", str(tmp_path), "--threads", "3", "--leave-grace-s", "5"]
    result = CliRunner().invoke(join, args)
    assert result.exit_code == 0, result.output
    cfg = seen["cfg"]
    assert (cfg.name, cfg.record_ttl, cfg.probe_budget) == ("flagged", 30.0, 2)
    assert (cfg.threads, cfg.leave_grace_s) == (3, 5.0)
    assert cfg.initial_peers == [PEER, PEER] and cfg.home == tmp_path
