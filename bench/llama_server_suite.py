"""llama.cpp's own server tests (tools/server/tests/unit) against `bankml serve --native` in place of
llama-server, with the default model (SmolLM2) for every model the tests name. Prints JSON.

    python bench/llama_server_suite.py --tests DIR [-k EXPR] [--relax-text] [--out FILE] [unit files...]

DIR is a copy of llama.cpp's tools/server/tests (utils.py, conftest.py, unit/); the tests that give
--chat-template-file read ../../../models/templates/ from it, so copy models/templates beside it as in
llama.cpp's tree (`git archive REV tools/server/tests models/templates | tar -x -C /tmp/llama_tests`).
Nothing is fetched here. Each unit file (default: the seven below) runs as its own pytest, in DIR, with
LLAMA_SERVER_BIN_PATH at a wrapper around bench/llama_server_shim.py; the JSON gives per file the
passed/failed/skipped counts and each failing test's id with its first error line.

This module is also the pytest plugin (`-p llama_server_suite_plugin`, a link to this file) those runs load: it turns off the
harness's session-start ServerPreset.load_all() (it starts and stops a server per preset to download
the models; ours is always the local default, so that would be seven starts for nothing), and with
--relax-text makes utils.match_regex always true, which shows whether a test fails only on the
tinyllama words it expects. Before the runs, each (ctx, parallel) shape in --prewarm is started once so
the compile cache (~/.cache/bankml/xla) is warm: the harness waits 60 s for /health.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHIM = HERE / "llama_server_shim.py"
DEFAULT_FILES = ["test_ctx_shift.py", "test_security.py", "test_tool_call.py", "test_embedding.py",
                 "test_slot_save.py", "test_chat_completion.py", "test_completion.py"]
DEFAULT_PREWARM = "512/2,512/1,8192/1,256/1"
PLUGIN = "llama_server_suite_plugin"


# --- the pytest plugin (loaded inside each run by -p llama_server_suite) ---------------------------------


def pytest_collection_finish(session) -> None:  # noqa: ANN001 (pytest's Session)
    utils = sys.modules.get("utils")
    if utils is None:
        return
    if os.environ.get("LLAMA_SUITE_PRELOAD") != "1":
        utils.ServerPreset.load_all = staticmethod(lambda: None)
    if os.environ.get("LLAMA_SUITE_RELAX_TEXT") == "1":
        def always(regex: str, text: str) -> bool:
            return True
        utils.match_regex = always
        for item in session.items:
            module = getattr(item, "module", None)
            if module is not None and hasattr(module, "match_regex"):
                module.match_regex = always


# --- the runner ------------------------------------------------------------------------------------------


def make_wrapper(directory: Path) -> Path:
    """DIR/llama-server, running the shim with the caller's PYTHONPATH (the runs' own adds DIR, for the
    plugin: never bench/, whose gateway.py would shadow the gateway package)."""
    wrapper = directory / "llama-server"
    pythonpath = os.environ.get("PYTHONPATH")
    setenv = f"PYTHONPATH={shlex.quote(pythonpath)}; export PYTHONPATH" if pythonpath else "unset PYTHONPATH"
    wrapper.write_text(f"#!/bin/sh\n{setenv}\nexec {shlex.quote(sys.executable)} {shlex.quote(str(SHIM))} \"$@\"\n")
    wrapper.chmod(0o755)
    # the plugin, importable by a name of its own from DIR alone
    (directory / f"{PLUGIN}.py").symlink_to(Path(__file__).resolve())
    return wrapper


def prewarm(wrapper: Path, shapes: list[tuple[int, int]], port: int, timeout_s: float) -> list[dict]:
    """Start the shim once per (ctx, parallel) shape and wait for /health: the compile cache is then warm."""
    out = []
    for ctx, parallel in shapes:
        t0 = time.monotonic()
        proc = subprocess.Popen([str(wrapper), "--host", "127.0.0.1", "--port", str(port), "--ctx-size", str(ctx),
                                 "--parallel", str(parallel)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        ready = False
        try:
            while time.monotonic() - t0 < timeout_s and proc.poll() is None:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                        if r.status == 200:
                            ready = True
                            break
                except OSError:
                    pass
                time.sleep(0.5)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        out.append({"ctx": ctx, "parallel": parallel, "ready": ready, "start_s": round(time.monotonic() - t0, 1)})
    return out


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def first_line(text: str | None) -> str:
    for line in (text or "").splitlines():
        if line.strip():
            return line.strip()[:300]
    return ""


def read_junit(path: Path) -> dict:
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failures: list[dict] = []
    if not path.exists():
        return {**counts, "failures": failures}
    for case in ET.parse(path).getroot().iter("testcase"):
        test_id = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        if bad is not None:
            counts["failed"] += 1
            # the message attribute is pytest's one-line reason; the element text ends in the `E ...` lines
            e_lines = [ln[1:].strip() for ln in (bad.text or "").splitlines() if ln.startswith("E ")]
            failures.append({"id": test_id, "kind": bad.tag,
                             "error": first_line(e_lines[0] if e_lines else bad.get("message"))})
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return {**counts, "failures": failures}


def run_file(tests: Path, name: str, env: dict, work: Path, timeout_s: int, keep_logs: Path | None,
             select: str | None) -> dict:
    junit = work / f"{name}.xml"
    cmd = [sys.executable, "-m", "pytest", f"unit/{name}", "-p", PLUGIN, "-p", "no:cacheprovider",
           "-o", f"timeout={timeout_s}", f"--junitxml={junit}", "-q", "-rN"]
    if select:
        cmd += ["-k", select]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=tests, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if keep_logs is not None:
        (keep_logs / f"{name}.log").write_text(proc.stdout)
    result = read_junit(junit)
    result["wall_s"] = round(time.monotonic() - t0, 1)
    result["pytest_rc"] = proc.returncode
    if not junit.exists():
        result["error"] = first_line(proc.stdout[-2000:])
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tests", required=True, type=Path, help="a copy of llama.cpp's tools/server/tests")
    p.add_argument("files", nargs="*", default=DEFAULT_FILES, help="unit files (default: %(default)s)")
    p.add_argument("--relax-text", action="store_true", help="utils.match_regex always true (tinyllama's words)")
    p.add_argument("--prewarm", default=DEFAULT_PREWARM,
                   help="CTX/PARALLEL shapes started once first, comma-separated ('' for none; %(default)s)")
    p.add_argument("-k", dest="select", help="pytest -k: only the tests this expression selects")
    p.add_argument("--timeout", type=int, default=900, help="pytest-timeout per test, seconds (a hang guard)")
    p.add_argument("--logs", type=Path, help="keep each file's pytest output here")
    p.add_argument("--out", type=Path, help="also write the JSON here")
    args = p.parse_args()
    tests = args.tests.resolve()
    if not (tests / "utils.py").is_file() or not (tests / "unit").is_dir():
        sys.exit(f"{tests}: not llama.cpp's tools/server/tests (no utils.py and unit/)")
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)
    (tests / "tmp").mkdir(exist_ok=True)  # the harness's LLAMA_CACHE and slot files

    with tempfile.TemporaryDirectory(prefix="llama-suite-") as tmp:
        work = Path(tmp)
        wrapper = make_wrapper(work)
        env = {**os.environ, "LLAMA_SERVER_BIN_PATH": str(wrapper),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(work), os.environ.get("PYTHONPATH")]))}
        env.pop("PYTEST_ADDOPTS", None)
        if args.relax_text:
            env["LLAMA_SUITE_RELAX_TEXT"] = "1"
        # the harness listens on $PORT (utils.py); a free one, so a busy 8080 on a shared machine is no matter
        port = int(os.environ.get("PORT") or free_port())
        env["PORT"] = str(port)
        shapes = [tuple(int(x) for x in s.split("/")) for s in args.prewarm.split(",") if s.strip()]
        warm = prewarm(wrapper, shapes, port, timeout_s=600) if shapes else []
        files = {}
        for name in args.files:
            name = Path(name).name
            print(f"llama_server_suite: {name} ...", file=sys.stderr, flush=True)
            files[name] = run_file(tests, name, env, work, args.timeout, args.logs, args.select)
            r = files[name]
            print(f"llama_server_suite: {name}: {r['passed']} passed, {r['failed']} failed, {r['skipped']} skipped "
                  f"in {r['wall_s']} s", file=sys.stderr, flush=True)

    totals = {k: sum(f[k] for f in files.values()) for k in ("passed", "failed", "skipped")}
    report = {"bench": "llama_server_suite", "server": "bankml serve --native (bench/llama_server_shim.py)",
              "tests": str(tests), "select": args.select, "relax_text": args.relax_text, "prewarm": warm, "totals": totals,
              "files": files}
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
