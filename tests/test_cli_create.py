"""`bankml create NAME -f Modelfile [--registry DIR]`: status lines, the manifest, exit 0 or 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gateway_helpers import tiny_model

from bankml.cli import main
from gateway.serving.derived import read_manifest

HERE = Path(__file__).resolve().parent
BASE = "Cli-Base.Q8_0.gguf"


@pytest.fixture
def reg_dir(tmp_path) -> Path:
    d = tmp_path / "forks"
    tiny_model(d, BASE)  # the file and its FORK.json, in the registry directory
    return d


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_create_prints_the_status_lines_and_writes_the_manifest(reg_dir, tmp_path):
    # FROM ./x is relative to the Modelfile, not to the working directory
    modelfile = write(tmp_path / "mf" / "Modelfile", f"FROM ../forks/{BASE}\nSYSTEM be brief\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)])}
    r = subprocess.run([sys.executable, "-m", "bankml.cli", "create", "Brief", "-f", str(modelfile),
                        "--registry", str(reg_dir)], capture_output=True, text=True, cwd=tmp_path, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    d = read_manifest(str(reg_dir / "brief.MODEL.json"))
    assert lines[0] == "parsing modelfile"
    assert lines[1] == f"verifying {BASE} (the guard, then its sha256 against {BASE}.FORK.json)"
    assert lines[2] == f"using existing layer sha256:{d.base_sha256}"
    assert lines[3:] == ["creating system layer", f"writing manifest brief.MODEL.json (digest {d.digest})",
                         "success"]
    assert d.layer.system == "be brief" and d.base_file == BASE


def test_a_bare_or_absent_registry_is_bankml_forks(reg_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("BANKML_FORKS", str(reg_dir))
    modelfile = write(tmp_path / "Modelfile", "FROM cli-base.q8_0\nPARAMETER temperature 0.3\n")
    assert main(["create", "warm", "-f", str(modelfile), "--registry"]) == 0
    assert main(["create", "warm2", "-f", str(modelfile)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "success"
    assert read_manifest(str(reg_dir / "warm.MODEL.json")).digest == read_manifest(
        str(reg_dir / "warm2.MODEL.json")).digest


def test_refusals_exit_2(reg_dir, tmp_path, capsys):
    cases = {
        "FROM nobody\n": "bankml create: refuse: FROM nobody: model 'nobody' not found",
        "FROM cli-base.q8_0\nPARAMETER num_gpu 1\n": "bankml create: refuse: Modelfile line 2: PARAMETER num_gpu: "
                                                     "a resource option",
        "FROM cli-base.q8_0\nADAPTER ./lora\n": "ADAPTER: bankml has no adapters",
    }
    for text, why in cases.items():
        modelfile = write(tmp_path / "Modelfile", text)
        assert main(["create", "x", "-f", str(modelfile), "--registry", str(reg_dir)]) == 2
        assert why in capsys.readouterr().err, text
    assert main(["create", "x", "-f", str(tmp_path / "absent"), "--registry", str(reg_dir)]) == 2
    assert "bankml create: refuse: cannot read" in capsys.readouterr().err
    modelfile = write(tmp_path / "Modelfile", "FROM cli-base.q8_0\n")
    assert main(["create", "cli-base.q8_0", "-f", str(modelfile), "--registry", str(reg_dir)]) == 2
    assert "is a pinned model's name" in capsys.readouterr().err
    assert not list(reg_dir.glob("*.MODEL.json"))


def test_the_modelfile_flag_is_required(capsys):
    assert main(["create", "x"]) == 1
    assert "-f" in capsys.readouterr().err


def test_the_manifest_is_json_a_reader_can_check(reg_dir, tmp_path):
    modelfile = write(tmp_path / "Modelfile", 'FROM cli-base.q8_0\nMESSAGE user "hi"\n')
    assert main(["create", "m", "-f", str(modelfile), "--registry", str(reg_dir)]) == 0
    doc = json.loads((reg_dir / "m.MODEL.json").read_text())
    assert doc["layer"]["messages"] == [{"role": "user", "content": "hi"}]
    assert doc["base"]["fork"] == f"{BASE}.FORK.json" and doc["kind"].startswith("bankml derived model")
