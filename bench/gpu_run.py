"""The GPU run's steps, in the order that proves the most when the machine is lent for minutes.

    bench/gpu_run.sh OUT                # on the GPU machine (it installs the carried wheels, then runs this)
    bench/gpu_run.sh OUT --cpu-dry-run  # here: the same steps on the CPU, small sizes, imports restricted

Standard library only (it runs before anything is known to import). Each step is a child process in its
own time box, its stdout and stderr kept; a step that fails says why and the next one still runs. The
steps, on the device within about 8 minutes (`--deadline-s`, 480 by default there; no step starts past it,
and one that would outrun it gets what is left):

1. env: Python and packages, JAX's devices and memory, Triton's target, the custom-call targets jaxlib
   registers, nvidia-smi;
2. synth, in the background from the start: bench/synth_gguf.py's llama3-8b (4.9 GB, random weights,
   written whole or not at all) under --model-dir (kept between runs on one machine);
3. smoke: bench/gpu_smoke.py, three kernels against their twins under each Triton call target; the target
   that ran is what every later step uses (BANKML_TRITON_CALL), and with none, the bench runs the jnp twins;
4. gpu_tests: tests/test_gpu_kernels.py (marker gpu), one JSON line per test as it ends; then
   attention_diag: bench/gpu_attention_diag.py (kernel, device twin and CPU twin compared; the decode
   GEMV's bandwidth);
5. bench: bench/gpu.py on the synthetic model (batch-1 decode, TTFT 512, 8 and 128 sequences first;
   energy per token from NVML's counter), while bench/gpu_usage_sample.py takes /bankml/usage's body
   once a second (VRAM, busy %, watts);
6. monitor_tests: tests/test_gpu_monitor_device.py against the real NVML;
7. bench_jnp: the bench's first parts again on the jnp twins in place of the Triton kernels.

The device tool brings back at most 8 files, so OUT holds two, rewritten after every step and every 15 s
within one: run.json (every step's JSON, merged, with a summary) and logs.tar.gz (the work directory:
each step's raw output and log). A run killed at its limit keeps what was packed last.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable

# seconds per step: on the device, and in the dry run on a 2-core CPU (kernels interpreted)
BOXES = {
    "env": (45, 120), "synth": (150, 120), "smoke": (75, 300), "smoke_lower": (None, 300),
    "gpu_tests": (170, 900), "attention_diag": (60, 300), "bench": (190, 600), "monitor_tests": (40, 60),
    "bench_jnp": (110, 300),
}  # on the H200 (bench/results/2026-12-04-h200-*): env 8-11 s, smoke 13-17, gpu_tests 126-140+, diag 29,
#    synth 140 (beside them), bench 118-127, monitor_tests 2, bench_jnp 74
STEPS = ("env", "synth", "smoke", "smoke_lower", "gpu_tests", "attention_diag", "bench", "monitor_tests", "bench_jnp")
BENCH_BUDGET = {False: 120, True: 400}  # bench/gpu.py --budget-s: no part starts after it


class Run:
    def __init__(self, out: Path, work: Path, dry: bool, deadline_s: float):
        self.out, self.work, self.dry = out, work, dry
        self.t0 = time.monotonic()
        self.deadline_s = deadline_s
        self.doc: dict = {"run": "bankml gpu run", "dry_run": dry, "started_utc": _now(), "steps": []}
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")
        # run 4's env step could not query Triton's target: "Could not create or locate cache dir" under the
        # image's HOME; every step gets one beside the work folder (not in it: the work folder is packed)
        self.env.setdefault("TRITON_CACHE_DIR", f"{work}-triton-cache")
        self._packed_at = 0.0
        self.only: set[str] = set(STEPS)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def box(self, name: str) -> float | None:
        return BOXES[name][1 if self.dry else 0]

    # --- packing: OUT gets run.json and logs.tar.gz, never more --------------------------------------

    def pack(self) -> None:
        self._packed_at = time.monotonic()
        self.doc["elapsed_s"] = round(self.elapsed(), 1)
        for key, name in (("env", "env.json"), ("smoke", "smoke.json"), ("smoke_lower", "smoke_lower.json"),
                          ("synth", "synth.json"), ("bench", "bench.json"), ("bench_jnp", "bench_jnp.json"),
                          ("usage", "usage.json"), ("attention_diag", "attention_diag.json")):
            got = _read_json(self.work / name)
            if got is not None:
                self.doc[key] = got
        for key in ("gpu_tests", "monitor_tests"):
            rows = _read_jsonl(self.work / f"{key}.jsonl")
            if rows is not None:
                counts: dict[str, int] = {}
                for r in rows:
                    counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
                self.doc[key] = {"counts": counts, "tests": rows}
        report = _read_json(self.work / "gpu_tests_report.json")
        if report is not None:
            self.doc.setdefault("gpu_tests", {})["numbers"] = report
        self.doc["summary"] = summary(self.doc)
        tmp = self.out / "run.json.tmp"
        tmp.write_text(json.dumps(self.doc, indent=1, default=str) + "\n")
        tmp.replace(self.out / "run.json")
        with tarfile.open(self.out / "logs.tar.gz.tmp", "w:gz") as tar:
            for path in sorted(self.work.iterdir()):
                if path.is_file() and path.stat().st_size < 64 << 20:
                    tar.add(path, arcname=path.name)
        (self.out / "logs.tar.gz.tmp").replace(self.out / "logs.tar.gz")

    # --- steps ----------------------------------------------------------------------------------------

    def start(self, name: str, cmd: list[str], env: dict | None = None, stdout: Path | None = None):
        """A child in its own process group (so its whole tree can be stopped), stdout to `stdout` or
        NAME.out, stderr to NAME.log."""
        out = open(stdout or self.work / f"{name}.out", "wb")
        err = open(self.work / f"{name}.log", "wb")
        _say(f"{name}: {' '.join(cmd)}")
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**self.env, **(env or {})}, stdout=out, stderr=err,
                                start_new_session=True)
        return proc, (out, err), time.monotonic()

    def step(self, name: str, cmd: list[str], env: dict | None = None, stdout: Path | None = None,
             box: float | None = None) -> int | None:
        """Run a step to its end or its box (and the run's deadline); record it; pack. Returns its exit
        code (None: not run, or stopped at its box). A step not in --only is not run and not recorded."""
        if name not in self.only:
            return None
        limit = self._limit(box if box is not None else self.box(name))
        if limit <= 0:
            self._record(name, None, 0.0, "not started: past the run's deadline")
            return None
        proc, files, t0 = self.start(name, cmd, env, stdout)
        return self.finish(name, proc, files, t0, limit)

    def finish(self, name: str, proc, files, t0: float, limit: float) -> int | None:
        while proc.poll() is None and time.monotonic() - t0 < limit:
            time.sleep(0.5)
            if time.monotonic() - self._packed_at > 15:
                self.pack()
        rc, why = proc.poll(), None
        if rc is None:
            _stop(proc)
            why = f"stopped at its time box ({limit:.0f} s)"
        for f in files:
            f.close()
        self._record(name, rc, time.monotonic() - t0, why)
        return rc

    def stop_sampler(self, proc, files, t0: float) -> None:
        """A background sampler, stopped (SIGTERM: it writes its JSON and exits 0) when its step is done."""
        died = proc.poll()
        _stop(proc)
        for f in files:
            f.close()
        self._record("usage", died if died is not None else 0, time.monotonic() - t0,
                      None if died is None else "ended before the bench did")

    def _limit(self, box: float) -> float:
        left = self.deadline_s - self.elapsed()
        return min(box, left)

    def _record(self, name: str, rc: int | None, seconds: float, why: str | None) -> None:
        row = {"step": name, "exit": rc, "seconds": round(seconds, 1)}
        if why:
            row["why"] = why
        elif rc:
            row["why"] = _tail(self.work / f"{name}.log")
        self.doc["steps"] = [s for s in self.doc["steps"] if s["step"] != name] + [row]
        _say(f"{name}: exit {rc}" + (f" ({why})" if why else ""))
        self.pack()


def _stop(proc) -> None:
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(wait)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(path: Path, n: int = 1200) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _read_jsonl(path: Path) -> list | None:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return None


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _say(text: str) -> None:
    print(f"[gpu_run {datetime.now(UTC).strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


# --- the summary ---------------------------------------------------------------------------------------


def summary(doc: dict) -> dict:
    """The figures that matter, from what the steps wrote (absent parts are absent)."""
    out: dict = {"steps_failed": [s["step"] for s in doc["steps"] if s["exit"] != 0]}
    env = doc.get("env") or {}
    out["device"] = env.get("devices")
    smoke = doc.get("smoke") or {}
    out["triton_call"] = smoke.get("chosen")
    out["smoke"] = {r["target"]: {c["check"]: c.get("ok") for c in r["checks"]} for r in smoke.get("runs", [])}
    for key in ("gpu_tests", "monitor_tests"):
        if key in doc:
            out[key] = doc[key].get("counts")
    models = [(b.get("kernels"), m) for b in (doc.get("bench"), doc.get("bench_jnp")) if b for m in b.get("models", [])]
    for kernels, model in models:
        b1 = model.get("batch1") or {}
        out.setdefault("bench", []).append({
            "model": model.get("model"), "kernels": kernels, "errors": model.get("errors"), "load_s": model.get("load_s"),
            "batch1_tok_per_s": b1.get("decode_tok_per_s"), "bandwidth_share": b1.get("bandwidth_share_of_peak"),
            "batch1_j_per_token": (b1.get("energy") or {}).get("j_per_token"),
            "concurrency_tok_per_s": {c["seqs"]: c["aggregate_tok_per_s"] for c in model.get("concurrency", [])},
            "ttft_ms": {t["prompt_tokens"]: t["ms"] for t in model.get("ttft", [])},
        })
    usage = (doc.get("usage") or {}).get("summary")
    if usage:
        out["usage"] = usage
    return out


# --- the environment (a child: it imports jax) ----------------------------------------------------------

ENV_SCRIPT = r"""
import importlib, json, os, platform, shutil, subprocess, sys
env = {"python": platform.python_version(), "executable": sys.executable, "machine": platform.machine(),
       "cpus": os.cpu_count(), "installed_here": [w for w in os.environ.get("BANKML_WHEELS_INSTALLED", "").split() if w]}
for name in ("jax", "jaxlib", "triton", "jax_triton", "gguf", "numpy", "torch", "pytest", "pynvml", "psutil"):
    try:
        env[name] = getattr(importlib.import_module(name), "__version__", "present")
    except Exception as e:
        env[name] = f"absent: {type(e).__name__}: {e}"
try:
    import jax
    env["backend"] = jax.default_backend()
    env["devices"] = [f"{d.platform}:{d.device_kind}" for d in jax.devices()]
    d = jax.devices()[0]
    env["memory_stats"] = d.memory_stats() if d.platform != "cpu" else None
except Exception as e:
    env["backend"] = f"failed: {type(e).__name__}: {e}"
try:
    from kernels.triton import call
    env["triton_targets_registered"] = call.registered_targets()
    env["triton_call"] = call.call_target()
except Exception as e:
    env["triton_targets_registered"] = f"{type(e).__name__}: {e}"
try:
    import triton
    env["triton_target"] = str(triton.runtime.driver.active.get_current_target())
except Exception as e:
    env["triton_target"] = f"{type(e).__name__}: {e}"
if shutil.which("nvidia-smi"):
    q = ["nvidia-smi", "--query-gpu=name,memory.total,memory.used,driver_version,clocks.max.sm,clocks.max.mem,"
         "power.limit,temperature.gpu", "--format=csv"]
    env["nvidia_smi"] = subprocess.run(q, capture_output=True, text=True, timeout=20).stdout.strip()
env["disk_free_bytes"] = shutil.disk_usage("/tmp").free
print(json.dumps(env, indent=1, default=str))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--cpu-dry-run", action="store_true")
    ap.add_argument("--deadline-s", type=float, help="no step starts after this (device 480, dry run 3600)")
    ap.add_argument("--model-dir", type=Path, default=Path(os.environ.get("BANKML_GPU_MODELS", "/tmp/bankml-gpu-models")))
    ap.add_argument("--work", type=Path, help="the steps' files (default: a fresh folder under /tmp)")
    ap.add_argument("--only", help=f"comma-separated steps to run (default: all of {','.join(STEPS)}; the bench "
                                   "steps need synth)")
    args = ap.parse_args()
    only = set(args.only.split(",")) if args.only else set(STEPS)
    if only - set(STEPS):
        ap.error(f"unknown steps {sorted(only - set(STEPS))}: {', '.join(STEPS)}")
    dry = args.cpu_dry_run
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(f"/tmp/bankml-gpu-run-{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    run = Run(args.out.resolve(), work, dry, args.deadline_s or (3600 if dry else 480))
    run.doc["host"] = platform.node()
    run.only = only
    if args.only:
        run.doc["only"] = sorted(only)
    run.pack()

    # 1. the environment
    run.step("env", [PY, "-c", ENV_SCRIPT], stdout=work / "env.json")

    # 2. the synthetic model, in the background, whole or not at all (bench/synth_gguf.py)
    shape = "tiny" if dry else "llama3-8b"
    synth_path = args.model_dir / f"synthetic-{shape}.gguf"
    synth = None
    if "synth" not in run.only:
        pass
    elif synth_path.exists() and synth_path.with_name(synth_path.name + ".FORK.json").exists():
        (work / "synth.json").write_text(json.dumps({"path": str(synth_path), "found": "present"}) + "\n")
    else:
        args.model_dir.mkdir(parents=True, exist_ok=True)
        synth = run.start("synth", [PY, "bench/synth_gguf.py", shape, str(synth_path)], stdout=work / "synth.json")

    # 3. smoke: which Triton call runs here
    run.step("smoke", [PY, "bench/gpu_smoke.py", str(work / "smoke.json")],
             env={"TRITON_INTERPRET": "1" if dry else "0"})
    call_env: dict[str, str] = {}
    chosen = (_read_json(work / "smoke.json") or {}).get("chosen")
    if chosen in ("ffi", "legacy"):
        call_env["BANKML_TRITON_CALL"] = chosen
    if dry:  # and the same checks lowered for CUDA, where jax-triton and jaxlib's GPU plugin are installed
        run.step("smoke_lower", [PY, "bench/gpu_smoke.py", str(work / "smoke_lower.json"), "--lower"],
                 env={"TRITON_INTERPRET": "0"})

    # 4. the kernel tests
    test_env = {"TRITON_INTERPRET": "1", "BANKML_GPU_TESTS_ON_CPU": "1"} if dry else {"TRITON_INTERPRET": "0"}
    pytest = [PY, "-m", "pytest", "-q", "-o", "addopts=-ra", "-p", "no:cacheprovider", "-p", "bench.gpu_report_plugin"]
    run.step("gpu_tests", [*pytest, "-m", "gpu", "tests/test_gpu_kernels.py"],
             env={**test_env, **call_env, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
                  "BANKML_GPU_TESTS_LOG": str(work / "gpu_tests.jsonl"),
                  "BANKML_GPU_REPORT": str(work / "gpu_tests_report.json")})

    # where the kernel tests disagreed with the twins: which side is off (bench/gpu_attention_diag.py)
    run.step("attention_diag", [PY, "bench/gpu_attention_diag.py", str(work / "attention_diag.json")],
             env={**test_env, **call_env})

    # 5. the bench, with /bankml/usage's body sampled beside it
    if synth is not None:  # its box counts from its start, within the run's deadline
        proc, files, t0 = synth
        run.finish("synth", proc, files, t0, min(run.box("synth"), run.deadline_s - (t0 - run.t0)))
    sampler = None if "bench" not in run.only else run.start("usage", [PY, "bench/gpu_usage_sample.py", str(work / "usage.json"), "--interval-s", "1"])

    def bench_cmd(name: str, budget: float, *extra: str) -> list[str]:
        return [PY, "bench/gpu.py", "--models", "synth", "--model-dir", str(args.model_dir), "--no-write",
                "--no-llama", "--out", str(work / f"{name}.json"), "--budget-s", str(budget),
                *(["--quick"] if dry else []), *extra]

    kernels_env = {**call_env, "TRITON_INTERPRET": "1" if dry else "0"}
    if dry or call_env:
        run.step("bench", bench_cmd("bench", BENCH_BUDGET[dry]), env=kernels_env)
    else:  # no Triton call ran in the smoke: the twins, on the GPU, and said so
        run.step("bench", bench_cmd("bench", BENCH_BUDGET[dry], "--kernels", "jnp"), env=kernels_env)
    if sampler is not None:
        run.stop_sampler(*sampler)

    # 6. the monitor against the real NVML
    run.step("monitor_tests", [*pytest, "tests/test_gpu_monitor_device.py"],
             env={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "BANKML_GPU_TESTS_LOG": str(work / "monitor_tests.jsonl")})

    # 7. the same bench on the jnp twins (XLA's dequantize-and-dot, its attention): what the Triton kernels
    # buy, side by side in one run; its first parts only, as time allows
    run.step("bench_jnp", bench_cmd("bench_jnp", BENCH_BUDGET[dry] // 2, "--kernels", "jnp"), env=kernels_env)

    run.doc["finished_utc"] = _now()
    run.pack()
    if args.work is None:  # everything is in OUT now
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(run.doc["summary"], indent=1, default=str))
    return 1 if run.doc["summary"]["steps_failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
