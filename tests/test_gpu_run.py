"""The GPU run, proven on a CPU: what the device steps may import, which Triton call they lower to, a
synthetic model that appears whole or not at all, and every step end to end in the dry run.

- bench/gpu_preflight.py: under its restriction an installed module that the GPU image lacks is refused
  (ModuleNotFoundError naming bench/gpu_image.txt) while the standard library, the image's packages and
  the project import, `model.engine` included (it once pulled in llguidance); its `main` passes with the
  carried wheels installed (`bench/gpu_run.sh --preflight`) and fails on a refused import.
- kernels/triton/call.py: BANKML_TRITON_CALL picks the target, a CPU jaxlib registers none, and
  `_ffi_rule` turns jax-triton 0.3.1's old custom call into the FFI one with the same kernel bytes and
  aliases. jax writes an FFI call (api_version=4 to `jax.ffi.ffi_lowering`) as a custom call whose
  `mhlo.backend_config` is a dictionary (its attributes, here `opaque`) and whose printed api_version is
  the default one, so that dictionary is what marks the typed form in the text (jax/_src/interpreters/
  mlir.py `custom_call`); the old call keeps `api_version = 2` and a string backend_config.
- bench/synth_gguf.py `write`: no .partial left, the FORK.json pins the file under its final name, a
  writer that dies leaves no file that looks finished, a rewrite is pinned anew.
- `bench/gpu_run.sh OUT --cpu-dry-run`: every step passes, OUT holds run.json and logs.tar.gz only.

The wheels (bench/gpu_wheels.txt) are fetched once into bench/wheels/ when it has none; without a
network that is a skip here and a failure in CI.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from conftest import IN_CI
from jax.core import ShapedArray
from jax.extend.core import Primitive
from jax.interpreters import mlir

from bankml.pin import pinned_sha256, sha256_file
from kernels.triton import call

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
WHEELS = BENCH / "wheels"
KERNEL_BYTES = b'\x00kernel "bytes"\\\xff'  # a NUL, a quote, a backslash and a high byte survive the move


def _load(name: str, path: Path):
    """A bench/ script as a module, without putting bench/ on the path (its gateway.py would hide the
    gateway package)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


preflight = _load("bankml_test_gpu_preflight", BENCH / "gpu_preflight.py")
synth_gguf = _load("bankml_test_synth_gguf", BENCH / "synth_gguf.py")

# installed here (the project's own dependencies), absent from the GPU image and the carried wheels
BLOCKED = next((m for m in ("llguidance", "sanic", "openai") if importlib.util.find_spec(m) is not None), None)


def _python(code: str, *, restrict: bool, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -c code` from the repo root, with bench/preflight_site and the repo on PYTHONPATH, as the
    dry run starts its steps; BANKML_GPU_RESTRICT=1 when `restrict`."""
    env = {k: v for k, v in os.environ.items() if k != "BANKML_GPU_RESTRICT"}
    env["PYTHONPATH"] = os.pathsep.join([str(BENCH / "preflight_site"), str(ROOT)])
    if restrict:
        env["BANKML_GPU_RESTRICT"] = "1"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def wheels() -> Path:
    """bench/wheels/ with the carried wheels, fetched from PyPI only when it has none."""
    if not any(WHEELS.glob("*.whl")):
        got = subprocess.run([str(BENCH / "gpu_run.sh"), "--fetch-wheels"], cwd=ROOT, capture_output=True,
                             text=True, timeout=300)
        if got.returncode != 0 or not any(WHEELS.glob("*.whl")):
            why = f"bench/gpu_run.sh --fetch-wheels failed (no network?): {got.stderr[-600:]}"
            if IN_CI:
                pytest.fail(why)
            pytest.skip(why)
    return WHEELS


# --- the restriction ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def blocked() -> str:
    if BLOCKED is None:
        pytest.fail("none of llguidance, sanic, openai is installed: pip install -e '.[test]'")
    return BLOCKED


def test_restricted_process_refuses_what_the_image_lacks_and_names_the_list(blocked):
    got = _python(f"import {blocked}", restrict=True)
    assert got.returncode != 0
    assert f"ModuleNotFoundError: No module named {blocked!r} on the GPU machine" in got.stderr
    assert "bench/gpu_image.txt" in got.stderr and "bench/gpu_wheels.txt" in got.stderr


def test_without_the_restriction_the_same_import_works(blocked):
    got = _python(f"import {blocked}", restrict=False)
    assert got.returncode == 0, got.stderr


def test_restricted_process_imports_stdlib_image_packages_and_the_engine(blocked):
    """model.engine once imported llguidance at import time (model.host_bias -> model.constraint); the
    GPU image has none. The refusal at the end shows the restriction was on all along."""
    code = f"""
import json, sys
import numpy, jax
import model.engine
try:
    import {blocked}
    refused = None
except ModuleNotFoundError as e:
    refused = str(e)
print(json.dumps({{"engine": "model.engine" in sys.modules, "refused": refused,
                  "loaded": sorted(m for m in sys.modules if m.split(".")[0] in ("llguidance", "sanic", "openai"))}}))
"""
    got = _python(code, restrict=True)
    assert got.returncode == 0, got.stderr[-3000:]
    out = json.loads(got.stdout.strip().splitlines()[-1])
    assert out["engine"] is True
    assert out["refused"] is not None and "bench/gpu_image.txt" in out["refused"]
    assert out["loaded"] == []


def test_restriction_permits_stdlib_project_image_and_wheels_only(blocked):
    finder = preflight.Restriction()  # not installed: only its rule is asked
    for name in ("json", "_thread", "model", "kernels", "bankml", "synth_gguf", "numpy", "jax", "gguf"):
        assert finder.permits(name), name
    assert not finder.permits(blocked)
    assert not finder.permits("a_module_of_no_distribution")


def test_preflight_main_fails_on_a_refused_import(blocked):
    """`main` reports a device module whose import is refused, and exits 1."""
    code = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("pf", "bench/gpu_preflight.py")
pf = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pf)
pf.DEVICE_MODULES, pf.FOUND_ONLY, pf.TEST_FILES = ("json", {blocked!r}), (), ()
sys.exit(pf.main())
"""
    got = _python(code, restrict=False)
    assert got.returncode == 1, got.stderr[-3000:]
    out = json.loads(got.stdout)
    assert out["ok"] is False and out["refused_imports"] == [blocked]
    rows = {r["module"]: r for r in out["modules"]}
    assert rows["json"]["ok"] is True
    assert rows[blocked]["ok"] is False and "bench/gpu_image.txt" in rows[blocked]["reason"]


def test_preflight_passes_with_the_carried_wheels(wheels):
    """Every module the device steps import, and the two test files, import under the restriction;
    jax_triton is found (from the carried wheel where it is not installed here)."""
    got = subprocess.run([str(BENCH / "gpu_run.sh"), "--preflight"], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert got.returncode == 0, (got.stdout[-3000:], got.stderr[-3000:])
    out = json.loads(got.stdout)
    rows = {r["module"]: r for r in out["modules"]}
    assert out["ok"] is True
    assert set(rows) == {*preflight.DEVICE_MODULES, *preflight.FOUND_ONLY,
                         *(f"tests/{t}" for t in preflight.TEST_FILES)}
    assert [m for m, r in rows.items() if not r["ok"]] == []
    assert rows["jax_triton"]["found_only"] is True


# --- kernels/triton/call.py ---------------------------------------------------------------------------


def test_call_target_follows_bankml_triton_call(monkeypatch):
    for asked, want in (("ffi", "ffi"), ("legacy", "legacy"), (" FFI ", "ffi"), ("Legacy", "legacy")):
        monkeypatch.setenv("BANKML_TRITON_CALL", asked)
        assert call.call_target() == want
    monkeypatch.setenv("BANKML_TRITON_CALL", "bogus")
    with pytest.raises(ValueError, match="bogus"):
        call.call_target()


def test_a_cpu_jaxlib_registers_no_triton_target_and_auto_takes_legacy(monkeypatch):
    from jax._src.lib import gpu_triton

    if getattr(gpu_triton, "_cuda_triton", None) is not None or getattr(gpu_triton, "_hip_triton", None) is not None:
        pytest.skip("jaxlib's GPU plugin is installed here: its Triton targets are registered")
    assert call.registered_targets() == {"legacy": False, "ffi": False}
    for asked in ("auto", ""):
        monkeypatch.setenv("BANKML_TRITON_CALL", asked)
        assert call.call_target() == "legacy"
    monkeypatch.delenv("BANKML_TRITON_CALL")
    assert call.call_target() == "legacy"


def test_lowered_targets_lists_custom_calls_in_order():
    text = """
module @jit_f {
  func.func public @main(%arg0: tensor<4xf32>) -> tensor<4xf32> {
    %0 = stablehlo.custom_call @triton_kernel_call(%arg0) {api_version = 2 : i32, backend_config = "x"} : (tensor<4xf32>) -> tensor<4xf32>
    %1 = stablehlo.add %0, %0 : tensor<4xf32>
    %2 = stablehlo.custom_call @triton_kernel_call_ffi(%1) {mhlo.backend_config = {opaque = "y"}} : (tensor<4xf32>) -> tensor<4xf32>
    %3 = stablehlo.custom_call @lapack.sgesdd_ffi(%2) : (tensor<4xf32>) -> tensor<4xf32>
    %4 = stablehlo.custom_call @triton_kernel_call(%3) {api_version = 2 : i32} : (tensor<4xf32>) -> tensor<4xf32>
    return %4 : tensor<4xf32>
  }
}
"""
    assert call.lowered_targets(text) == ["triton_kernel_call", "triton_kernel_call_ffi", "lapack.sgesdd_ffi",
                                          "triton_kernel_call"]
    assert call.lowered_targets(jax.jit(lambda x: x + 1).lower(jnp.zeros(4)).as_text()) == []


def test_ahead_of_time_sets_the_capability_for_the_block_only():
    assert call._ahead["cc"] is None
    with pytest.raises(RuntimeError), call.ahead_of_time(80):
        assert call._ahead["cc"] == 80
        with call.ahead_of_time():
            assert call._ahead["cc"] == 90
        assert call._ahead["cc"] == 80
        raise RuntimeError("the block fails")
    assert call._ahead["cc"] is None


def _legacy(ctx, *operands, **params):
    """What jax-triton 0.3.1's rule emits, less the compile: the old call, the kernel in backend_config;
    it ignores the aliases, so any in the FFI call come from `_ffi_rule`."""
    return jax.ffi.ffi_lowering("triton_kernel_call", api_version=2, backend_config=KERNEL_BYTES,
                                operand_output_aliases={})(ctx, *operands)


def _legacy_aliased(ctx, *operands, **params):
    """The old call with the aliases, as jax-triton 0.3.1 writes them."""
    return jax.ffi.ffi_lowering("triton_kernel_call", api_version=2, backend_config=KERNEL_BYTES,
                                operand_output_aliases=dict(params["input_output_aliases"]))(ctx, *operands)


def _primitive(name: str, rule) -> Primitive:
    prim = Primitive(name)
    prim.def_abstract_eval(lambda x, **params: ShapedArray(x.shape, x.dtype))
    mlir.register_lowering(prim, rule, platform="cpu")
    return prim


FFI_PRIM = _primitive("bankml_test_triton_ffi", call._ffi_rule(_legacy))
LEGACY_PRIM = _primitive("bankml_test_triton_legacy", _legacy)
LEGACY_ALIASED_PRIM = _primitive("bankml_test_triton_legacy_aliased", _legacy_aliased)


def _lowered(prim: Primitive, **params):
    """Lowered only: neither target is registered on a CPU, so nothing here compiles."""
    return jax.jit(lambda x: prim.bind(x, **params)).lower(jnp.zeros(4, jnp.float32))


def _custom_calls(lowered) -> list:
    def walk(op):
        yield op
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    yield from walk(inner)

    return [op for op in walk(lowered.compiler_ir("stablehlo").operation) if op.name == "stablehlo.custom_call"]


def _line(text: str) -> str:
    (line,) = [x for x in text.splitlines() if "stablehlo.custom_call" in x]
    return line


def test_ffi_rule_replaces_the_old_call_with_the_ffi_one_carrying_the_same_kernel_bytes():
    from jax._src.lib.mlir import ir

    ffi, legacy = _lowered(FFI_PRIM), _lowered(LEGACY_PRIM)
    ffi_text, legacy_text = ffi.as_text(), legacy.as_text()
    assert call.lowered_targets(ffi_text) == ["triton_kernel_call_ffi"]
    assert call.lowered_targets(legacy_text) == ["triton_kernel_call"]
    assert "@triton_kernel_call(" not in ffi_text

    # the text: the old call's backend_config string is the new call's opaque attribute, as printed
    legacy_line, ffi_line = _line(legacy_text), _line(ffi_text)
    assert "api_version = 2" in legacy_line and "mhlo.backend_config" not in legacy_line
    printed = legacy_line.split('backend_config = "', 1)[1].split('", operand_layouts', 1)[0]
    assert "kernel" in printed
    assert f'mhlo.backend_config = {{opaque = "{printed}"}}' in ffi_line
    assert "api_version = 2" not in ffi_line and 'backend_config = ""' in ffi_line

    # the attributes: the very bytes, in the FFI's dictionary form (what api_version=4 lowers to)
    (old,), (new,) = _custom_calls(legacy), _custom_calls(ffi)
    assert ir.StringAttr(old.attributes["backend_config"]).value_bytes == KERNEL_BYTES
    config = ir.DictAttr(new.attributes["mhlo.backend_config"])
    assert len(config) == 1 and ir.StringAttr(config["opaque"]).value_bytes == KERNEL_BYTES
    assert ir.IntegerAttr(old.attributes["api_version"]).value == 2
    assert ir.IntegerAttr(new.attributes["api_version"]).value != 2


def test_ffi_rule_passes_the_aliases_through():
    aliases = ((0, 0),)
    ffi_line = _line(_lowered(FFI_PRIM, input_output_aliases=aliases).as_text())
    legacy_line = _line(_lowered(LEGACY_ALIASED_PRIM, input_output_aliases=aliases).as_text())
    alias = "output_operand_aliases = [#stablehlo.output_operand_alias<output_tuple_indices = [], operand_index = 0,"
    assert alias in legacy_line and alias in ffi_line
    assert "output_operand_aliases" not in _line(_lowered(FFI_PRIM).as_text())
    assert "output_operand_aliases" not in _line(_lowered(FFI_PRIM, input_output_aliases=()).as_text())


# --- bench/synth_gguf.py write: whole or not at all ------------------------------------------------------


def _fork(path: Path) -> dict:
    return json.loads(path.with_name(path.name + ".FORK.json").read_text())


def test_synth_write_leaves_no_partial_and_pins_the_final_name(tmp_path):
    path = synth_gguf.write(tmp_path / "tiny.gguf", "tiny")
    assert path == tmp_path / "tiny.gguf"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.gguf", "tiny.gguf.FORK.json"]
    fork = _fork(path)
    assert fork["files"][0]["path"] == "tiny.gguf"
    assert fork["files"][0]["sha256"] == sha256_file(path)
    assert fork["files"][0]["bytes"] == path.stat().st_size
    assert ".partial" not in fork["pinned_from"] and str(path.resolve()) in fork["pinned_from"]
    assert pinned_sha256(path.with_name("tiny.gguf.FORK.json").read_text(), "tiny.gguf") == sha256_file(path)


def test_a_writer_that_dies_part_way_leaves_no_finished_looking_file(tmp_path, monkeypatch):
    def dies(path: Path, *args) -> None:
        path.write_bytes(b"GGUF" + bytes(1000))  # the partial file exists, then the time box strikes
        raise RuntimeError("killed part way")

    monkeypatch.setattr(synth_gguf, "_write_model", dies)
    with pytest.raises(RuntimeError, match="killed part way"):
        synth_gguf.write(tmp_path / "tiny.gguf", "tiny")
    assert not (tmp_path / "tiny.gguf").exists()
    assert not (tmp_path / "tiny.gguf.FORK.json").exists()


def test_a_failed_rewrite_keeps_the_old_pair_and_a_rewrite_is_pinned_anew(tmp_path, monkeypatch):
    path = synth_gguf.write(tmp_path / "tiny.gguf", "tiny", seed=0)
    first = sha256_file(path)
    real = synth_gguf._write_model

    def dies(path: Path, *args) -> None:
        path.write_bytes(b"GGUF")
        raise RuntimeError("killed part way")

    monkeypatch.setattr(synth_gguf, "_write_model", dies)
    with pytest.raises(RuntimeError):
        synth_gguf.write(path, "tiny", seed=1)
    assert sha256_file(path) == first and _fork(path)["files"][0]["sha256"] == first

    monkeypatch.setattr(synth_gguf, "_write_model", real)
    synth_gguf.write(path, "tiny", seed=1)  # over the old pair (and the dead writer's .partial)
    second = sha256_file(path)
    assert second != first
    assert _fork(path)["files"][0]["sha256"] == second
    assert not list(tmp_path.glob("*.partial"))


# --- the dry run, end to end ----------------------------------------------------------------------------


def test_gpu_run_sh_restricts_the_dry_run_only_and_installs_the_missing_wheels(wheels, tmp_path):
    """What gpu_run.sh hands bench/gpu_run.py, seen through PYTHON= (a stand-in records it and stops):
    the dry run gets BANKML_GPU_RESTRICT=1 with bench/preflight_site first on PYTHONPATH, the device run
    neither; both get $BANKML_SITE on the path with each carried wheel whose module is missing here."""
    record = tmp_path / "record.json"
    stand_in = tmp_path / "python"
    stand_in.write_text(f"""#!/bin/bash
if [ "${{1:-}}" = "bench/gpu_run.py" ]; then
    exec {sys.executable} -c 'import json, os, sys; json.dump({{"argv": sys.argv[1:], "restrict": os.environ.get("BANKML_GPU_RESTRICT"), "path": os.environ["PYTHONPATH"], "installed": os.environ["BANKML_WHEELS_INSTALLED"]}}, open(os.environ["RECORD"], "w"))' "$@"
fi
exec {sys.executable} "$@"
""")
    stand_in.chmod(0o755)
    missing = {w: w.name.split("-")[0] for w in sorted(wheels.glob("*.whl"))
               if importlib.util.find_spec(w.name.split("-")[0]) is None}
    for mode in (["--cpu-dry-run"], []):
        site = tmp_path / f"site{len(mode)}"
        env = {k: v for k, v in os.environ.items() if k not in ("BANKML_GPU_RESTRICT", "PYTHONPATH")}
        env.update(PYTHON=str(stand_in), RECORD=str(record), BANKML_SITE=str(site))
        got = subprocess.run([str(BENCH / "gpu_run.sh"), str(tmp_path / "out"), *mode], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=300)
        assert got.returncode == 0, got.stderr[-3000:]
        seen = json.loads(record.read_text())
        record.unlink()
        assert seen["argv"] == ["bench/gpu_run.py", str(tmp_path / "out"), *mode]
        path = seen["path"].split(os.pathsep)
        if mode:
            assert seen["restrict"] == "1"
            assert path == [str(BENCH / "preflight_site"), str(ROOT), str(site)]
        else:
            assert seen["restrict"] is None
            assert path == [str(ROOT), str(site)]
        assert seen["installed"].split() == [f"bench/wheels/{w.name}" for w in missing]
        assert all((site / module).is_dir() for module in missing.values())


@pytest.mark.timeout(1000)
def test_cpu_dry_run_passes_every_step_and_packs_two_files(wheels, tmp_path):
    out, models = tmp_path / "out", tmp_path / "models"
    env = {**os.environ, "BANKML_GPU_MODELS": str(models), "BANKML_SITE": str(tmp_path / "site")}
    env.pop("BANKML_GPU_RESTRICT", None)
    proc = subprocess.Popen([str(BENCH / "gpu_run.sh"), str(out), "--cpu-dry-run"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    work = Path(f"/tmp/bankml-gpu-run-{proc.pid}")  # gpu_run.sh execs gpu_run.py: the same pid
    try:
        stdout, stderr = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        pytest.fail(f"the dry run took over 900 s: {stderr[-3000:]}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    run_json = out / "run.json"
    doc = json.loads(run_json.read_text()) if run_json.exists() else {}
    failed = [row for row in doc.get("steps", []) if row["exit"] != 0]
    assert proc.returncode == 0, (failed, stderr[-3000:])

    assert sorted(p.name for p in out.iterdir()) == ["logs.tar.gz", "run.json"]
    assert doc["dry_run"] is True and "finished_utc" in doc
    s = doc["summary"]
    assert s["steps_failed"] == []
    assert s["smoke"]["interpreter"] and all(s["smoke"]["interpreter"].values()), s["smoke"]
    assert s["gpu_tests"].get("passed", 0) > 0
    assert not {"failed", "error"} & set(s["gpu_tests"]), s["gpu_tests"]
    (bench,) = [b for b in s["bench"] if b["kernels"] != "jnp"]  # the kernels' engine (bench_jnp: the twins)
    assert bench["model"] == "synthetic-tiny" and bench["batch1_tok_per_s"] > 0
    assert json.loads(stdout) == s

    with tarfile.open(out / "logs.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"env.json", "smoke.json", "gpu_tests.jsonl", "bench.json", "usage.json"} <= names

    # the model went where BANKML_GPU_MODELS says, whole
    assert sorted(p.name for p in models.iterdir()) == ["synthetic-tiny.gguf", "synthetic-tiny.gguf.FORK.json"]
