"""`bankml gpu-check`: are the Triton kernels and the engine's GPU wiring right? Answered on any machine.

Three checks, in child processes, because Triton reads TRITON_INTERPRET once, when it is imported:
1. interpreter (TRITON_INTERPRET=1): every kernel module's `interpret_checks()`, its kernels run by
   Triton's interpreter against their jnp twins; then
3. in the same process, `model.wiring_check.run()`: the engine's GPU path end to end on a tiny model with
   the kernels interpreted;
2. ahead of time (TRITON_INTERPRET unset): every module's `aot_variants()` compiled for sm_90 and sm_80
   (a cubin must come out) and, as information only, for AMD's gfx942 (an hsaco); the variants are
   shared out over `jobs` processes, which run beside the interpreter's.
Each child prints one JSON object on stdout (what the checks themselves print goes to stderr); the parent
merges them into one row per kernel and types, joining a module's checks and variants by name (`_rows`).
A module that is missing or raises, or a child that dies or overruns (more CPU seconds than `--timeout`, or
none for that long), is a failed check with its reason,
never a traceback.

Both children run JAX on the CPU (JAX_PLATFORMS=cpu): the checks read the same on a GPU machine and
take none of its memory.

Exit codes: 0 everything passed, 1 something failed, 2 triton is not installed.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import psutil

KERNEL_MODULES = ("kernels.triton.qmatmul", "kernels.triton.attention")
WIRING_MODULE = "model.wiring_check"

# report name -> triton's GPUTarget(backend, arch, warp_size), and the binary that must come out
TARGETS = {"sm_90": ("cuda", 90, 32), "sm_80": ("cuda", 80, 32), "gfx942": ("hip", "gfx942", 64)}
BINARY = {"cuda": "cubin", "hip": "hsaco"}
REQUIRED_TARGETS = ("sm_90", "sm_80")  # gfx942 is told, not required

EXIT_PASSED, EXIT_FAILED, EXIT_NO_TRITON = 0, 1, 2
NO_TRITON = ("triton is not installed: pip install 'bankml[gpu]' on a GPU machine, or 'bankml[test]' to "
             "interpret and compile the kernels on the CPU")

ROOT = Path(__file__).resolve().parents[1]  # the children import the same tree as this process


def _reason(e: BaseException) -> str:
    """One line for a failure: the exception, and where in the project it was raised."""
    text = str(e).strip().splitlines()
    where = ""
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if f.filename.startswith(str(ROOT)) and f.filename != __file__]
    if frames:
        where = f" (at {Path(frames[-1].filename).relative_to(ROOT)}:{frames[-1].lineno})"
    gist = text[0] if text else ""
    if len(text) > 1 and re.fullmatch(r"at \d+:\d+:", gist):  # triton's CompilationError: the error is last
        gist = f"{text[-1]} (at {gist[3:-1]} in the kernel)"
    line = f"{type(e).__name__}: {gist}"
    return (line[:300] + where).strip()


# --- the children ------------------------------------------------------------------------------------


@contextlib.contextmanager
def _stdout_to_stderr():
    """Whatever the checks print, from Python or from a C library, goes to stderr; yields the real stdout."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield saved
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)


def _emit(fd: int, result: dict) -> None:
    os.write(fd, (json.dumps(result, default=str) + "\n").encode())
    os.close(fd)


def interpret_part(kernel_modules: list[str], wiring_module: str) -> dict:
    """Checks 1 and 3: each module's interpreter checks, then the wiring run."""
    errors: list[dict] = []
    checks: list[dict] = []
    for name in kernel_modules:
        try:
            checks += [_check_of(name, r) for r in importlib.import_module(name).interpret_checks()]
        except BaseException as e:  # noqa: B036 -- a module's SystemExit is its failure too
            errors.append({"check": "interpret", "module": name, "reason": _reason(e)})
    started = time.perf_counter()
    try:
        wiring = importlib.import_module(wiring_module).run()
        if not isinstance(wiring, dict):
            wiring = {"ok": False, "reason": f"run() returned {type(wiring).__name__}, not a dict"}
    except BaseException as e:  # noqa: B036
        wiring = {"ok": False, "reason": _reason(e)}
    wiring = {"module": wiring_module, **wiring, "ok": bool(wiring.get("ok")),
              "seconds": round(time.perf_counter() - started, 2)}
    return {"errors": errors, "checks": checks, "wiring": wiring}


def _check_of(module: str, r) -> dict:
    """A CheckResult as plain JSON values (a numpy float or bool would not survive json.dumps)."""
    return {"module": module, "name": str(r.name), "types": [str(t) for t in r.types], "shape": str(r.shape),
            "max_rel_err": float(r.max_rel_err), "tolerance": float(r.tolerance), "ok": bool(r.ok)}


def aot_part(kernel_modules: list[str], shard: int, shards: int) -> dict:
    """Check 2, for every `shards`-th variant from the `shard`-th: compiled for each target."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    errors: list[dict] = []
    variants: list[tuple[str, dict[str, Any]]] = []  # (module, backend -> its AotVariant)
    for name in kernel_modules:
        try:
            variants += [(name, v) for v in _variants_of(importlib.import_module(name))]
        except BaseException as e:  # noqa: B036
            if shard == 0:  # every shard sees the same failure; one tells it
                errors.append({"check": "aot", "module": name, "reason": _reason(e)})
    compiled: list[dict] = []
    for module, per_backend in variants[shard::shards]:
        targets: dict[str, str] = {}
        started = time.perf_counter()
        for target, (backend, arch, warp) in TARGETS.items():
            v = per_backend[backend]
            try:
                kernel = triton.compile(ASTSource(fn=v.kernel, signature=v.signature, constexprs=v.constexprs,
                                                  attrs=v.attrs), target=GPUTarget(backend, arch, warp))
                binary = kernel.asm.get(BINARY[backend])
                targets[target] = "ok" if binary else f"no {BINARY[backend]} came out"
            except BaseException as e:  # noqa: B036
                targets[target] = _reason(e)
        v = per_backend["cuda"]
        compiled.append({"module": module, "name": v.name, "types": list(v.types), "targets": targets,
                         "seconds": round(time.perf_counter() - started, 2)})
    return {"errors": errors, "variants": compiled}


def _variants_of(module) -> list[dict[str, Any]]:
    """The module's variants, each as {backend: AotVariant}. A module whose `aot_variants` takes a
    `backend` ("cuda" or "hip": qmatmul's tl.dot precision differs) gives one list per backend, in the
    same order; otherwise one list serves both."""
    backends = sorted(set(BINARY))
    if "backend" in inspect.signature(module.aot_variants).parameters:
        lists = [module.aot_variants(backend=b) for b in backends]
    else:
        lists = [module.aot_variants()] * len(backends)
    if len({len(x) for x in lists}) != 1:
        raise ValueError(f"aot_variants gives {' and '.join(map(str, map(len, lists)))} variants for "
                         f"{' and '.join(backends)}")
    return [dict(zip(backends, vs, strict=True)) for vs in zip(*lists, strict=True)]


def _child_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bankml.gpu_check")
    p.add_argument("part", choices=("interpret", "aot"))
    p.add_argument("--kernel-modules", default=",".join(KERNEL_MODULES))
    p.add_argument("--wiring-module", default=WIRING_MODULE)
    p.add_argument("--shard", type=int, default=0)
    p.add_argument("--shards", type=int, default=1)
    args = p.parse_args(argv)
    modules = [m for m in args.kernel_modules.split(",") if m]
    started = time.perf_counter()
    with _stdout_to_stderr() as stdout:
        if args.part == "interpret":
            result = interpret_part(modules, args.wiring_module)
        else:
            result = aot_part(modules, args.shard, args.shards)
    _emit(stdout, {**result, "seconds": round(time.perf_counter() - started, 1)})
    return 0


# --- the parent --------------------------------------------------------------------------------------


def _child_env(interpret: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    env["JAX_PLATFORMS"] = "cpu"
    if interpret:  # two CPU devices: the wiring run splits the model over them (model/parallel.py)
        env["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS"),
                                                  "--xla_force_host_platform_device_count=2"]))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def _run_children(commands: list[tuple[list[str], bool]], timeout_s: float) -> list[dict]:
    """Runs the children side by side; each one's JSON, or {"failed": reason} for one that did not give it.

    The limit is on the work, not the wall: a child is stopped when it has used more than `timeout_s`
    seconds of CPU (itself and its own children), or when it has used none for `timeout_s` seconds (asleep
    or blocked). A busy machine stretches the wall time of the same work, never its CPU time."""
    outs = [tempfile.TemporaryFile("w+") for _ in commands]  # files, not pipes: no child blocks on a full pipe
    errs = [tempfile.TemporaryFile("w+") for _ in commands]
    procs = [subprocess.Popen([sys.executable, "-m", "bankml.gpu_check", *argv], stdout=out, stderr=err,
                              text=True, env=_child_env(interpret), cwd=ROOT)
             for (argv, interpret), out, err in zip(commands, outs, errs, strict=True)]
    stopped = [_watch(proc, timeout_s) for proc in procs]
    results = []
    for proc, out, err, why in zip(procs, outs, errs, stopped, strict=True):
        out.seek(0)
        err.seek(0)
        text, log = out.read(), err.read()
        out.close()
        err.close()
        if why is not None:
            results.append({"failed": why})
            continue
        try:
            results.append(json.loads(text.strip().splitlines()[-1]))
        except (json.JSONDecodeError, IndexError):
            tail = " | ".join(log.strip().splitlines()[-3:])
            results.append({"failed": f"exited {proc.returncode} without its report: {tail[-500:]}"})
    return results


def _watch(proc: subprocess.Popen, limit_s: float, poll_s: float = 0.25) -> str | None:
    """Waits for `proc`; None when it ended by itself, else why it was stopped (see _run_children)."""
    try:
        watched = psutil.Process(proc.pid)
    except psutil.Error:
        watched = None
    used = 0.0
    idle_since = time.monotonic()
    while True:
        try:
            proc.wait(timeout=poll_s)
            return None
        except subprocess.TimeoutExpired:
            pass
        now_used = _cpu_s(watched) if watched is not None else used
        if now_used > used:
            used, idle_since = now_used, time.monotonic()
        why = (f"used more than {limit_s:g} s of CPU" if used > limit_s else
               f"used no CPU for {limit_s:g} s (asleep or blocked)" if time.monotonic() - idle_since > limit_s
               else None)
        if why is not None:
            for p in [*(_children(watched) if watched is not None else []), proc]:
                with contextlib.suppress(psutil.Error, OSError):
                    p.kill()
            proc.wait()
            return why


def _children(p: psutil.Process) -> list[psutil.Process]:
    try:
        return p.children(recursive=True)
    except psutil.Error:
        return []


def _cpu_s(p: psutil.Process) -> float:
    """CPU seconds used by `p`, its running children and the children it has waited for."""
    total = 0.0
    for q in [p, *_children(p)]:
        with contextlib.suppress(psutil.Error):
            t = q.cpu_times()
            total += t.user + t.system + (t.children_user + t.children_system if q is p else 0.0)
    return total


def _rows(checks: list[dict], variants: list[dict]) -> list[dict]:
    """One row per kernel: its compiled variants' targets, and its worst check against the twin.

    A module names its checks and its variants as it likes (attention checks `attn_decode_g4` and
    compiles `attn_decode_split_gemma3_d256_g4` and `attn_decode_merge_...`), so a kernel is the longest
    run of leading `_`-separated words that a name shares with a name from the other side, in the same
    module and types: both of those are `attn_decode`. A name that shares none is a kernel of its own,
    which fails for want of a check or of a variant."""
    rows: dict[tuple, dict] = {}
    for side, entries, others in (("checks", checks, variants), ("variants", variants, checks)):
        for e in entries:
            key = (e["module"], _kernel_of(e, others), tuple(e["types"]))
            rows.setdefault(key, {"checks": [], "variants": []})[side].append(e)
    return [_row(*key, **sides) for key, sides in rows.items()]


def _kernel_of(entry: dict, others: list[dict]) -> str:
    words = entry["name"].split("_")
    shared = 0
    for o in others:
        if (o["module"], o["types"]) == (entry["module"], entry["types"]):
            shared = max(shared, len(os.path.commonprefix([words, o["name"].split("_")])))
    return "_".join(words[:shared]) if shared else entry["name"]


def _row(module: str, name: str, types: tuple[str, ...], checks: list[dict], variants: list[dict]) -> dict:
    reasons = []
    targets = {}
    for target in TARGETS:
        failed = [(v["name"], v["targets"][target]) for v in variants if v["targets"][target] != "ok"]
        targets[target] = ("no AotVariant" if not variants else "ok" if not failed
                           else f"{failed[0][0]}: {failed[0][1]}")
        if target in REQUIRED_TARGETS and targets[target] != "ok":
            reasons.append(f"{target}: {targets[target]}")
    err = tolerance = None
    if not checks:
        reasons.append("no interpreter check against its twin")
    else:
        worst = max(checks, key=lambda c: (not _passed(c), _ratio(c)))
        err = max(c["max_rel_err"] for c in checks)
        err = err if math.isfinite(err) else None  # JSON has no NaN; the reason says it
        tolerance = worst["tolerance"]
        reasons += [f"{c['name']} ({c['shape']}): max_rel_err {c['max_rel_err']:.3g}, tolerance "
                    f"{c['tolerance']:.3g}" for c in checks if not _passed(c)]
    return {"name": name, "types": list(types), "module": module, "targets": targets, "max_rel_err": err,
            "tolerance": tolerance, "ok": not reasons, **({"reasons": reasons} if reasons else {}),
            "variants": list(dict.fromkeys(v["name"] for v in variants)), "compiled": len(variants),
            "checks": [{k: c[k] for k in ("name", "shape", "max_rel_err", "tolerance")}
                       | {"ok": _passed(c)} for c in checks]}


def _passed(check: dict) -> bool:
    return bool(check["ok"]) and check["max_rel_err"] <= check["tolerance"]  # NaN is not <=


def _ratio(check: dict) -> float:
    err = check["max_rel_err"]
    return math.inf if not math.isfinite(err) else err / max(check["tolerance"], 1e-30)


def check(kernel_modules: list[str] | None = None, wiring_module: str = WIRING_MODULE, jobs: int = 2,
          timeout_s: float = 1200) -> dict:
    """The three checks, merged: {"ok", "triton", "kernels", "wiring", "errors", "seconds",
    "interpret_seconds", "aot_seconds"} (the last two: each child's own time, the slowest AOT one).
    The caller has checked that triton is installed (`triton_version`)."""
    started = time.perf_counter()
    modules = ",".join(KERNEL_MODULES if kernel_modules is None else kernel_modules)
    jobs = max(1, jobs)
    commands = [(["interpret", "--kernel-modules", modules, "--wiring-module", wiring_module], True)]
    commands += [(["aot", "--kernel-modules", modules, "--shard", str(i), "--shards", str(jobs)], False)
                 for i in range(jobs)]
    interpreted, *compiled = _run_children(commands, timeout_s)
    errors: list[dict] = []
    if "failed" in interpreted:
        errors.append({"check": "interpret", "module": None, "reason": interpreted["failed"]})
        wiring = {"module": wiring_module, "ok": False,
                  "reason": f"the interpreter's process {interpreted['failed']}"}
    else:
        wiring = interpreted["wiring"]
    variants: list[dict] = []
    for part in compiled:
        if "failed" in part:
            errors.append({"check": "aot", "module": None, "reason": part["failed"]})
        else:
            variants += part["variants"]
    for part in [interpreted, *compiled]:
        errors += part.get("errors", [])
    errors = _merged(errors)
    kernels = _rows(interpreted.get("checks", []), variants)
    ok = not errors and bool(kernels) and all(k["ok"] for k in kernels) and wiring.get("ok") is True
    return {"ok": ok, "triton": triton_version(), "kernels": kernels, "wiring": wiring, "errors": errors,
            "seconds": round(time.perf_counter() - started, 1),
            "interpret_seconds": interpreted.get("seconds"),
            "aot_seconds": max((c["seconds"] for c in compiled if "seconds" in c), default=None)}


def _merged(errors: list[dict]) -> list[dict]:
    """A module that fails to import fails both children alike: one entry, naming both checks."""
    merged: dict[tuple, dict] = {}
    for e in errors:
        key = (e["module"], e["reason"])
        if key in merged:
            merged[key]["check"] += f", {e['check']}"
        else:
            merged[key] = dict(e)
    return list(merged.values())


def triton_version() -> str | None:
    """Triton's version, or None when it cannot be imported."""
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def table(report: dict) -> str:
    """The report for a terminal: one line per kernel, then the wiring, then what failed and why."""
    wide = max([len(k["name"]) for k in report["kernels"]] + [len("kernel")])
    lines = [f"bankml gpu-check (triton {report['triton']})",
             f"{'kernel':{wide}} {'types':14} " + " ".join(f"{t:7}" for t in TARGETS)
             + f" {'max_rel_err':>11} {'tolerance':>9}  ok"]
    for k in report["kernels"]:
        err = "-" if k["max_rel_err"] is None else f"{k['max_rel_err']:.2e}"
        tol = "-" if k["tolerance"] is None else f"{k['tolerance']:.0e}"
        lines.append(f"{k['name']:{wide}} {','.join(k['types']):14} "
                     + " ".join(f"{'ok' if k['targets'][t] == 'ok' else 'FAIL':7}" for t in TARGETS)
                     + f" {err:>11} {tol:>9}  {'ok' if k['ok'] else 'FAIL':4}"
                     + f"  ({k['compiled']} compiled, {len(k['checks'])} checked)")
    if not report["kernels"]:
        lines.append("(no kernels reported)")
    w = report["wiring"]
    told = [f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in w.items()
            if k not in ("module", "ok", "seconds", "reason") and isinstance(v, bool | int | float | str)]
    lines.append(f"wiring ({w.get('module')}): {'ok' if w.get('ok') is True else 'FAIL'}"
                 + (f" -- {w['reason']}" if w.get("reason") else f" {' '.join(told)}" if told else ""))
    if isinstance(w.get("split"), dict):  # the same model split over devices, its kernels under shard_map
        sp = w["split"]
        lines.append(f"  split {sp['devices']} ways: {'ok' if sp.get('ok') else 'FAIL'} "
                     f"max_logit_rel_diff={sp.get('max_logit_rel_diff', float('nan')):.3g}")
    for k in report["kernels"]:
        for r in k.get("reasons", []):
            lines.append(f"  {k['name']} {','.join(k['types'])}: {r}")
        gfx = k["targets"]["gfx942"]
        if gfx != "ok" and not k.get("reasons"):
            lines.append(f"  {k['name']} {','.join(k['types'])}: gfx942 (not required): {gfx}")
    for e in report["errors"]:
        lines.append(f"  {e['check']} {e['module'] or ''}: {e['reason']}")
    lines.append(f"{'passed' if report['ok'] else 'FAILED'} in {report['seconds']} s (interpreter and wiring "
                 f"{report['interpret_seconds']} s, ahead of time {report['aot_seconds']} s)")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """`bankml gpu-check [--json]` (bankml/cli.py parses the flags)."""
    if triton_version() is None:
        if args.json:
            print(json.dumps({"ok": False, "triton": None, "reason": NO_TRITON}))
        print(NO_TRITON, file=sys.stderr)
        return EXIT_NO_TRITON
    report = check(args.kernel_module or None, args.wiring_module, args.jobs, args.timeout)
    print(json.dumps(report, indent=1) if args.json else table(report))
    return EXIT_PASSED if report["ok"] else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
