"""RL scenario files (the shipped ones and bad ones) and ``peerd plan --kind rl``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from peerd.cli import cli, main
from peerd.errors import ConfigError
from peerd.sched.rl.cluster import Cluster, load_rl_scenario

RL_DIR = Path(__file__).resolve().parents[4] / "configs" / "scenarios" / "rl"

TINY = {
    "name": "tiny-rl",
    "regions": {"names": ["dc", "edge"], "delay_ms": [[0.01, 10], [10, 0.01]], "bandwidth_mbps": [[1e5, 1e3], [1e3, 1e5]]},
    "devices": [
        {"id": "a0", "region": "dc", "tflops": 312, "memory_gb": 80, "memory_bandwidth_gb_s": 2039},
        {"id": "a1", "region": "dc", "tflops": 312, "memory_gb": 80, "memory_bandwidth_gb_s": 2039},
        {"id": "l0", "region": "edge", "tflops": 121, "memory_gb": 24, "memory_bandwidth_gb_s": 300},
        {"id": "l1", "region": "edge", "tflops": 121, "memory_gb": 24, "memory_bandwidth_gb_s": 300},
    ],
    "workload": {
        "name": "qwen-1.5b",
        "actor": {"params": 1.5e9, "layers": 28, "hidden": 1536, "heads": 12, "kv_heads": 2, "head_dim": 128},
        "prompts": 32,
    },
}  # fmt: skip


def write(tmp_path: Path, data: dict, name: str = "tiny.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("network", ["single-region", "multi-region", "multi-country", "multi-continent"])
def test_shipped_scenarios_load(network):
    rl = load_rl_scenario(RL_DIR / f"{network}.yaml")
    models = [d.id.split("-")[0] for d in rl.scenario.devices]
    assert (models.count("a100"), models.count("l40s"), models.count("l4")) == (24, 24, 16)
    assert rl.workload.name == "qwen-8b" and rl.workload.sequences == 8192
    cl = Cluster.of(rl)
    assert cl.n == 64 and cl.n_classes <= 8  # devices of one node are interchangeable
    for size, params in (("qwen-4b", 4.02e9), ("qwen-14b", 14.8e9)):
        assert load_rl_scenario(RL_DIR / f"{network}.yaml", size).workload.actor.params == params


def test_bad_input_names_the_field(tmp_path):
    data = json.loads(json.dumps(TINY))
    del data["devices"][1]["memory_bandwidth_gb_s"]
    with pytest.raises(ConfigError) as err:
        load_rl_scenario(write(tmp_path, data))
    assert [e.field for e in err.value.errors] == ["devices[1].memory_bandwidth_gb_s"]
    data = json.loads(json.dumps(TINY))
    data["workload"]["staleness"] = -1
    with pytest.raises(ConfigError) as err:
        load_rl_scenario(write(tmp_path, data))
    assert [e.field for e in err.value.errors] == ["workload.staleness"]
    data["workload"] = "qwen-99b"
    (tmp_path / "workloads.yaml").write_text(yaml.safe_dump({"qwen-8b": TINY["workload"]}))
    with pytest.raises(ConfigError, match=r"no workload 'qwen-99b'.*known: qwen-8b"):
        load_rl_scenario(write(tmp_path, data))


def test_plan_rl_json_and_text(tmp_path):
    path = write(tmp_path, TINY)
    result = CliRunner().invoke(cli, ["plan", "--kind", "rl", str(path), "--json", "--budget", "40"])
    assert result.exit_code == 0, result.output
    d = json.loads(result.output)
    assert d["scenario"] == "tiny-rl" and d["mode"] == "hybrid" and d["algo"] == "grpo"
    assert d["iteration_seconds"] > 0 and set(d["baselines"]) == {"verl_like", "streamrl_like"}
    assert sorted(t for g in d["groups"] for t in g["tasks"]) == ["actor_train", "generate", "reference"]
    text = CliRunner().invoke(
        cli, ["plan", "--kind", "rl", str(path), "--mode", "exact", "--algo", "ppo", "--async", "1"]
    )
    assert text.exit_code == 0, text.output
    assert "exact MILP" in text.output and "async k=1" in text.output and "critic_train" in text.output
    assert "verl_like" in text.output and "memory" in text.output


def test_plan_rl_usage_errors_exit_2(tmp_path, capsys):
    path = write(tmp_path, TINY)
    with pytest.raises(SystemExit) as info:
        main(["plan", "--kind", "rl", str(path), "--async", "-1"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "staleness" in err and ">= 0" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as info:
        main(["plan", str(path), "--mode", "exact"])
    assert info.value.code == 2 and "--mode needs --kind rl" in capsys.readouterr().err


def test_exact_mode_refuses_a_swarm_with_too_many_columns(capsys):
    # 8 classes of 8 devices: 9^8 - 1 class-count vectors per task set, far past the column limit
    with pytest.raises(SystemExit) as info:
        main(["plan", "--kind", "rl", str(RL_DIR / "single-region.yaml"), "--mode", "exact"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "mode: exact needs" in err and "hybrid" in err
