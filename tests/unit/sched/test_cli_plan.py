"""``peerd plan``: through click's runner, through ``main`` for errors, and once as the console script."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from peerd.cli import cli, main

SCENARIO = {
    "name": "two-sites",
    "regions": {
        "names": ["east", "west"],
        "delay_ms": [[1, 20], [20, 1]],
        "bandwidth_mbps": [[10000, 500], [500, 10000]],
    },
    "devices": [
        {"id": f"{r}{i}", "region": r, "tflops": 100, "memory_gb": 40}
        for r in ("east", "west")
        for i in range(4)
    ],
    "model": {"layers": 8, "hidden": 1024, "seq": 512},
    "training": {"global_batch": 16, "d_pp": 4, "d_dp": 2},
}


@pytest.fixture
def scenario_file(tmp_path: Path) -> Path:
    path = tmp_path / "two-sites.yaml"
    path.write_text(yaml.safe_dump(SCENARIO))
    return path


def test_plan_json(scenario_file):
    result = CliRunner().invoke(
        cli, ["plan", str(scenario_file), "--json", "--seed", "3", "--generations", "2"]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert len(data["allocation"]) == 4 and all(len(stage) == 2 for stage in data["allocation"])
    assert sorted(d for stage in data["allocation"] for d in stage) == sorted(
        d["id"] for d in SCENARIO["devices"]
    )
    assert data["total"] == pytest.approx(data["dp"] + 2 * data["pp"])
    assert data["seconds"] > 0 and len(data["hash"]) == 64
    # Gradients (100 MB per stage) dwarf activations (8 MB): groups stay inside a site and
    # every pipeline crosses the 500 Mbit/s link exactly once.
    assert sorted(data["regions"]) in (["east x2 > west x2"] * 2, ["west x2 > east x2"] * 2)


def test_plan_text_and_peerd_objective(scenario_file):
    result = CliRunner().invoke(
        cli, ["plan", str(scenario_file), "--objective", "peerd", "--generations", "1"]
    )
    assert result.exit_code == 0, result.output
    assert "objective  peerd" in result.output and "layers]" in result.output and "pipelines" in result.output


def test_bad_input_exits_2_naming_the_field(tmp_path, capsys):
    bad = dict(SCENARIO, training={"global_batch": 16, "d_pp": 3, "d_dp": 2})
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    with pytest.raises(SystemExit) as info:
        main(["plan", str(path)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "training.d_dp" in err and "8 devices" in err and "Traceback" not in err


def test_a_shared_machine_is_priced_by_the_peerd_objective_and_refused_by_the_others(tmp_path, capsys):
    """The dtfm objective prices no compute, so a scenario with a shared machine is refused there;
    the peerd objective slows the compute of the tasklets that oversubscribe its cores."""
    devices = [dict(d, host={"host": "box", "cores": 2}) for d in SCENARIO["devices"]]
    path = tmp_path / "shared.yaml"
    path.write_text(yaml.safe_dump(dict(SCENARIO, devices=devices)))
    with pytest.raises(SystemExit) as info:
        main(["plan", str(path)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "devices[0].host" in err and "--objective peerd" in err

    def cost(scenario: Path) -> dict:
        out = CliRunner().invoke(
            cli,
            ["plan", str(scenario), "--objective", "peerd", "--generations", "1", "--json", "--seed", "1"],
        )
        assert out.exit_code == 0, out.output
        return json.loads(out.output)

    own = tmp_path / "own.yaml"
    own.write_text(yaml.safe_dump(SCENARIO))
    alone, shared = cost(own), cost(path)
    # eight tasklets on one 2-core machine: 4x the compute per micro-batch, the links unchanged
    assert shared["parts"]["compute_per_micro_batch"] == pytest.approx(
        4 * alone["parts"]["compute_per_micro_batch"]
    )
    assert shared["total"] > alone["total"]


def test_layer_work_is_priced_by_the_peerd_objective_and_refused_by_the_others(tmp_path, capsys):
    """``model.layer_work`` at the devices' measured costs adds to the peerd objective's compute; the
    dtfm objective prices no compute and refuses it."""
    work = [{"ops": 100, "traffic_bytes": 1e7, "elements": {"gelu": 1e5}}] * 8
    devices = [
        dict(d, launch_us=3.0, memory_bandwidth_gb_s=30.0, element_ns={"gelu": 1.3})
        for d in SCENARIO["devices"]
    ]
    path = tmp_path / "work.yaml"
    path.write_text(
        yaml.safe_dump(dict(SCENARIO, devices=devices, model=dict(SCENARIO["model"], layer_work=work)))
    )
    with pytest.raises(SystemExit) as info:
        main(["plan", str(path)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "model.layer_work" in err and "--objective peerd" in err
    args = ["--objective", "peerd", "--generations", "1", "--json", "--seed", "1"]
    plain = json.loads(CliRunner().invoke(cli, ["plan", str(tmp_path / "work.yaml"), *args]).output)
    bare = tmp_path / "bare.yaml"
    bare.write_text(yaml.safe_dump(SCENARIO))
    flops = json.loads(CliRunner().invoke(cli, ["plan", str(bare), *args]).output)
    per_layer = 100 * 3e-6 + 1e7 / 30e9 + 1e5 * 1.3e-9
    assert plain["parts"]["compute_per_micro_batch"] == pytest.approx(  # four stages of two layers
        flops["parts"]["compute_per_micro_batch"] + 4 * 2 * per_layer
    )


def test_averaging_work_adds_to_the_peerd_objectives_exchange_and_is_refused_by_the_others(tmp_path, capsys):
    work = {"ops": 100, "ops_per_partner": 50, "bytes_per_value": 100, "bytes_per_value_partners": 60}
    devices = [dict(d, launch_us=3.0, memory_bandwidth_gb_s=30.0) for d in SCENARIO["devices"]]
    path = tmp_path / "averaging.yaml"
    path.write_text(
        yaml.safe_dump(
            dict(SCENARIO, devices=devices, training=dict(SCENARIO["training"], averaging_work=work))
        )
    )
    with pytest.raises(SystemExit) as info:
        main(["plan", str(path)])
    assert info.value.code == 2
    assert "training.averaging_work" in capsys.readouterr().err
    args = ["--objective", "peerd", "--generations", "1", "--json", "--seed", "1"]
    priced = json.loads(CliRunner().invoke(cli, ["plan", str(path), *args]).output)
    bare = tmp_path / "bare.yaml"
    bare.write_text(yaml.safe_dump(dict(SCENARIO, devices=devices)))
    plain = json.loads(CliRunner().invoke(cli, ["plan", str(bare), *args]).output)
    assert priced["parts"]["dp"] > plain["parts"]["dp"]


def test_console_script(scenario_file):
    exe = shutil.which("peerd") or str(Path(sys.executable).parent / "peerd")
    out = subprocess.run(
        [exe, "plan", str(scenario_file), "--json", "--generations", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["shape"] == {"d_pp": 4, "d_dp": 2}
