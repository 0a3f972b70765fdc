"""`bankml gpu-check`: the three checks, run for real (child processes, Triton's interpreter, AOT compiles).

The fake kernel modules below keep the contract of kernels/triton/qmatmul.py and attention.py
(`aot_variants()`, `interpret_checks()`) with one tiny real kernel, so the checker's handling of a pass,
a failure, a module that raises and a child that dies is shown apart from the real kernels; the last
test runs the shipped modules.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

from bankml import gpu_check as gpu_check_module
from bankml.gpu_check import TARGETS

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[1]

KERNEL = '''
import triton
import triton.language as tl


@triton.jit
def scale_kernel(x_ptr, n_ptr, out_ptr, FACTOR: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < tl.load(n_ptr)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) * FACTOR, mask=mask)
'''

GOOD = KERNEL + '''
import jax
import jax.numpy as jnp
import numpy as np

from kernels.triton.call import triton_call
from kernels.triton.spec import AotVariant, CheckResult

print("noise on stdout from the module")  # must not spoil the child's JSON


def aot_variants():
    sig = {"x_ptr": "*fp32", "n_ptr": "*i32", "out_ptr": "*fp32", "FACTOR": "constexpr", "BLOCK": "constexpr"}
    return [AotVariant("scale_block64", ("f32",), scale_kernel, sig, {"FACTOR": 2.0, "BLOCK": 64},
                       {(0,): [["tt.divisibility", 16]]}),
            AotVariant("scale_block128", ("f32",), scale_kernel, sig, {"FACTOR": 2.0, "BLOCK": 128})]


def interpret_checks():
    print("more noise")
    x = jnp.arange(100, dtype=jnp.float32)
    n = jnp.array([100], jnp.int32)
    out = jax.ShapeDtypeStruct((128,), x.dtype)
    got = jax.jit(lambda x, n: triton_call(x, n, kernel=scale_kernel, out_shape=out, grid=(2,), FACTOR=2.0,
                                           BLOCK=64))(x, n)[:100]
    twin = x * 2.0
    err = float(np.max(np.abs(got - twin)) / np.max(np.abs(twin)))
    return [CheckResult("scale_n100", ("f32",), "n=100", np.float32(err), 1e-6, np.bool_(err <= 1e-6))]
'''

BAD = KERNEL + '''
from kernels.triton.spec import AotVariant, CheckResult


def aot_variants():
    sig = {"x_ptr": "*fp32", "n_ptr": "*i32", "out_ptr": "*fp32", "FACTOR": "constexpr", "BLOCK": "constexpr"}
    return [AotVariant("scale_bad", ("q9",), scale_kernel, sig, {"FACTOR": 2.0, "BLOCK": 48})]  # 48: not 2**k


def interpret_checks():
    return [CheckResult("scale_bad", ("q9",), "n=7", 0.5, 1e-3, False),
            CheckResult("never_compiled", ("f16",), "n=7", 0.0, 1e-3, True)]
'''

RAISES = '''
def aot_variants():
    raise RuntimeError("boom in aot_variants")


def interpret_checks():
    raise RuntimeError("boom in interpret_checks")
'''

WIRING_OK = '''
def run():
    print("wiring noise")
    return {"ok": True, "tokens": [1, 2, 3], "layers": 2}
'''

WIRING_TELLS = '''
def run():
    return {"ok": False, "tokens_equal": False, "max_logit_abs_diff": 0.5, "tokens": [[1], [2]]}
'''

WIRING_BAD = '''
def run():
    return {"ok": False, "reason": "decode step differs from the reference at token 3"}
'''


@pytest.fixture(scope="module")
def fakes(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("fakes")
    sources = {"fake_good": GOOD, "fake_bad": BAD, "fake_raises": RAISES, "fake_wiring_ok": WIRING_OK,
               "fake_wiring_bad": WIRING_BAD,
               "fake_wiring_tells": WIRING_TELLS, "fake_dies": "import os\nos._exit(3)\n",
               "fake_sleeps": "import time\ntime.sleep(60)\n", "fake_spins": "while True:\n    pass\n"}
    for name, text in sources.items():
        (d / f"{name}.py").write_text(text)
    (d / "no_triton" / "triton").mkdir(parents=True)
    (d / "no_triton" / "triton" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'triton'\", name='triton')\n")
    return d


def gpu_check(*args: str, path: list[Path] = (), timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, [*path, ROOT]))}
    return subprocess.run([sys.executable, "-m", "bankml.cli", "gpu-check", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT)


def report_of(r: subprocess.CompletedProcess) -> dict:
    assert "Traceback" not in r.stdout
    return json.loads(r.stdout)


def test_a_kernel_that_passes_all_three_checks(fakes):
    r = gpu_check("--json", "--kernel-module", "fake_good", "--wiring-module", "fake_wiring_ok", path=[fakes])
    assert r.returncode == 0, r.stdout + r.stderr
    report = report_of(r)
    assert report["ok"] is True and report["triton"] == triton.__version__ and report["errors"] == []
    (row,) = report["kernels"]  # scale_block64, scale_block128 and scale_n100 are one kernel, "scale"
    assert row["name"] == "scale" and row["types"] == ["f32"] and row["module"] == "fake_good"
    assert row["variants"] == ["scale_block64", "scale_block128"] and row["compiled"] == 2
    assert row["checks"] == [{"name": "scale_n100", "shape": "n=100", "max_rel_err": 0.0, "tolerance": 1e-6,
                              "ok": True}]
    assert row["targets"] == {"sm_90": "ok", "sm_80": "ok", "gfx942": "ok"}
    assert row["max_rel_err"] == 0.0 and row["tolerance"] == 1e-6 and row["ok"] is True
    assert report["wiring"]["ok"] is True and report["wiring"]["tokens"] == [1, 2, 3]
    assert report["seconds"] >= max(report["interpret_seconds"], report["aot_seconds"]) > 0


def test_failures_are_named_and_exit_1(fakes):
    r = gpu_check("--json", "--kernel-module", "fake_good", "--kernel-module", "fake_bad",
                  "--kernel-module", "fake_raises", "--wiring-module", "fake_wiring_bad", path=[fakes])
    assert r.returncode == 1, r.stdout + r.stderr
    report = report_of(r)
    assert report["ok"] is False
    rows = {k["name"]: k for k in report["kernels"]}
    assert rows["scale"]["ok"] is True  # the others failing does not spoil a good kernel's row
    bad = rows["scale_bad"]
    assert bad["ok"] is False and bad["max_rel_err"] == 0.5
    assert all(bad["targets"][t] != "ok" for t in ("sm_90", "sm_80", "gfx942"))
    assert bad["reasons"] == [f"sm_90: {bad['targets']['sm_90']}", f"sm_80: {bad['targets']['sm_80']}",
                              "scale_bad (n=7): max_rel_err 0.5, tolerance 0.001"]
    never = rows["never_compiled"]
    assert never["ok"] is False and never["targets"]["sm_90"] == "no AotVariant"
    assert bad["targets"]["sm_90"] == ("scale_bad: CompilationError: arange's range must be a power of 2 "
                                       "(at 2:38 in the kernel)")
    assert report["errors"] == [
        {"check": "interpret", "module": "fake_raises", "reason": "RuntimeError: boom in interpret_checks"},
        {"check": "aot", "module": "fake_raises", "reason": "RuntimeError: boom in aot_variants"}]
    assert report["wiring"] == {"module": "fake_wiring_bad", "ok": False,
                                "seconds": report["wiring"]["seconds"],
                                "reason": "decode step differs from the reference at token 3"}


def test_a_kernel_is_the_words_its_check_and_variant_names_share():
    def entry(name, types=("f16",), module="m"):
        return {"module": module, "name": name, "types": list(types), "shape": "s", "max_rel_err": 1e-7,
                "tolerance": 1e-5, "ok": True, "targets": dict.fromkeys(TARGETS, "ok")}

    checks = [entry("attn_decode_g4"), entry("attn_prefill_g4"), entry("attn_decode_g3"), entry("rope")]
    variants = [entry(f"attn_{k}_{m}_g4") for m in ("gemma3_d256", "llama3_d128")
                for k in ("decode_split", "decode_merge", "prefill")]
    variants += [entry("attn_prefill_gemma3_d256_g4"),  # a second shape under the same name
                 entry("attn_decode_split_q8", types=("q8_0",)), entry("attn_decode_g4", module="other")]
    rows = {(r["module"], r["name"], *r["types"]): r for r in gpu_check_module._rows(checks, variants)}
    assert sorted(rows) == [("m", "attn_decode", "f16"), ("m", "attn_decode_split_q8", "q8_0"),
                            ("m", "attn_prefill", "f16"), ("m", "rope", "f16"),
                            ("other", "attn_decode_g4", "f16")]
    decode = rows["m", "attn_decode", "f16"]
    assert decode["ok"] and decode["compiled"] == 4 and len(decode["checks"]) == 2
    prefill = rows["m", "attn_prefill", "f16"]
    assert prefill["ok"] and prefill["compiled"] == 3 and len(prefill["variants"]) == 2
    assert rows["m", "rope", "f16"]["reasons"] == ["sm_90: no AotVariant", "sm_80: no AotVariant"]
    for lonely in (rows["m", "attn_decode_split_q8", "q8_0"], rows["other", "attn_decode_g4", "f16"]):
        assert lonely["reasons"] == ["no interpreter check against its twin"]


def test_the_table_says_what_failed(fakes):
    r = gpu_check("--kernel-module", "fake_bad", "--wiring-module", "fake_wiring_ok", "--jobs", "1",
                  path=[fakes])
    assert r.returncode == 1
    lines = r.stdout.splitlines()
    assert lines[0] == f"bankml gpu-check (triton {triton.__version__})"
    (row,) = [" ".join(line.split()) for line in lines if line.startswith("scale_bad ")]
    assert row == "scale_bad q9 FAIL FAIL FAIL 5.00e-01 1e-03 FAIL (1 compiled, 1 checked)"
    assert "wiring (fake_wiring_ok): ok layers=2" in lines and lines[-1].startswith("FAILED in ")
    r = gpu_check("--kernel-module", "fake_good", "--wiring-module", "fake_wiring_tells", "--jobs", "1",
                  path=[fakes])
    assert r.returncode == 1
    told = "wiring (fake_wiring_tells): FAIL tokens_equal=False max_logit_abs_diff=0.5"
    assert told in r.stdout.splitlines()


def test_missing_modules_and_dead_children_are_failed_checks(fakes):
    r = gpu_check("--json", "--kernel-module", "fake_dies", "--wiring-module", "no_such_wiring",
                  "--jobs", "1", path=[fakes])
    assert r.returncode == 1
    report = report_of(r)
    (died,) = report["errors"]  # both children died alike: told once
    assert died["check"] == "interpret, aot" and died["module"] is None
    assert died["reason"].startswith("exited 3 without its report")
    assert report["wiring"]["ok"] is False and "exited 3" in report["wiring"]["reason"]

    r = gpu_check("--json", "--kernel-module", "fake_missing", "--wiring-module", "no_such_wiring",
                  "--jobs", "1", path=[fakes])
    report = report_of(r)
    assert r.returncode == 1 and report["errors"] == [
        {"check": "interpret, aot", "module": "fake_missing",
         "reason": "ModuleNotFoundError: No module named 'fake_missing'"}]
    assert report["wiring"]["reason"] == "ModuleNotFoundError: No module named 'no_such_wiring'"


def test_a_check_that_overruns_is_stopped(fakes):
    r = gpu_check("--json", "--kernel-module", "fake_sleeps", "--jobs", "1", "--timeout", "2", path=[fakes])
    assert r.returncode == 1
    assert {e["reason"] for e in report_of(r)["errors"]} == {"used no CPU for 2 s (asleep or blocked)"}


def test_a_check_that_spins_past_its_cpu_seconds_is_stopped(fakes):
    r = gpu_check("--json", "--kernel-module", "fake_spins", "--jobs", "1", "--timeout", "2", path=[fakes])
    assert r.returncode == 1
    assert {e["reason"] for e in report_of(r)["errors"]} == {"used more than 2 s of CPU"}


def test_without_triton_it_exits_2_and_says_what_to_install(fakes):
    r = gpu_check("--json", path=[fakes / "no_triton"])
    assert r.returncode == 2
    assert json.loads(r.stdout) == {"ok": False, "triton": None, "reason": r.stderr.strip()}
    assert "pip install 'bankml[gpu]'" in r.stderr and "'bankml[test]'" in r.stderr



@pytest.mark.timeout(3600)  # a hang guard only: gpu-check's own limit is on CPU seconds, which load does not stretch
def test_the_shipped_kernels_and_wiring():
    r = gpu_check("--json", timeout=None)  # the default limit: CPU seconds
    report = report_of(r)
    assert (r.returncode, report["ok"]) == (0, True), json.dumps(report, indent=1)
    modules = {k["module"] for k in report["kernels"]}
    assert modules == {"kernels.triton.qmatmul", "kernels.triton.attention"}
    for k in report["kernels"]:
        assert set(k) >= {"name", "types", "targets", "max_rel_err", "tolerance", "ok"}
        assert k["targets"]["sm_90"] == k["targets"]["sm_80"] == "ok"
        assert 0 <= k["max_rel_err"] <= k["tolerance"] and k["variants"] and k["checks"]
    wiring = report["wiring"]  # model/wiring_check.run(): the tiny model through the interpreted kernels
    assert wiring["ok"] is True and wiring["tokens_equal"] and wiring["triton_everywhere"], wiring
    assert wiring["max_logit_rel_diff"] <= wiring["tolerance"] and wiring["device_bytes"] == wiring["file_bytes"]


def test_help_lists_the_command_and_its_flags():
    def cli(*args):
        return subprocess.run([sys.executable, "-m", "bankml.cli", *args], capture_output=True, text=True,
                              timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})

    top = cli("--help")
    assert top.returncode == 0 and "bankml gpu-check [--json]" in top.stdout
    r = cli("gpu-check", "--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: bankml gpu-check ")
    for flag in ("--json", "--kernel-module M", "--wiring-module M", "--jobs N", "--timeout S",
                 "exit codes: 0 every check passed, 1 a check failed, 2 triton is not installed"):
        assert flag in r.stdout
    bad = cli("gpu-check", "--jobs", "0")
    assert bad.returncode == 1 and "'0' is not a positive integer" in bad.stderr
