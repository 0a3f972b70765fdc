"""Hashing throughput: `bankml sha256` against a bare hashlib loop on the same 1 GiB file. Prints JSON.

The file is read from the page cache in every run (one warm-up read first), so this measures the hash,
not the disk. Medians of --runs runs; the ratio is ours over the bare loop (1.0 = as fast).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bankml.pin import sha256_file  # noqa: E402


def bare_hashlib(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def timed(fn, runs: int) -> tuple[float, str]:
    times, out = [], ""
    for _ in range(runs):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--file", help="hash this file instead of a fresh random one")
    args = ap.parse_args()
    tmp = None
    if args.file:
        path = args.file
    else:
        tmp = tempfile.NamedTemporaryFile(prefix="bankml-hash-", delete=False)
        block = os.urandom(1 << 20)
        for _ in range(args.size_mib):
            tmp.write(block)
        tmp.close()
        path = tmp.name
    size = os.path.getsize(path)
    bare_hashlib(path)  # warm the page cache
    cli = shutil.which("bankml")
    results = {}
    t_bare, want = timed(lambda: bare_hashlib(path), args.runs)
    t_ours, got = timed(lambda: sha256_file(path), args.runs)
    assert got == want
    results["bare_hashlib_1mib_reads"] = {"median_s": round(t_bare, 4), "mib_per_s": round(size / 2**20 / t_bare)}
    results["bankml_sha256_in_process"] = {"median_s": round(t_ours, 4), "mib_per_s": round(size / 2**20 / t_ours)}
    if cli:
        t_cli, out = timed(lambda: subprocess.run([cli, "sha256", path], capture_output=True, text=True).stdout, args.runs)
        assert out.split()[0] == want
        results["bankml_sha256_cli"] = {"median_s": round(t_cli, 4), "mib_per_s": round(size / 2**20 / t_cli)}
    if shutil.which("sha256sum"):
        t_sum, _ = timed(lambda: subprocess.run(["sha256sum", path], capture_output=True), max(1, args.runs // 2))
        results["coreutils_sha256sum"] = {"median_s": round(t_sum, 4), "mib_per_s": round(size / 2**20 / t_sum)}
    report = {
        "bench": "hash",
        "file_bytes": size,
        "runs": args.runs,
        "results": results,
        "ratio_in_process_over_bare": round(t_ours / t_bare, 3),
        "ratio_cli_over_bare": round(results["bankml_sha256_cli"]["median_s"] / t_bare, 3) if cli else None,
        "openssl": __import__("ssl").OPENSSL_VERSION,
    }
    print(json.dumps(report, indent=1))
    if tmp:
        os.unlink(path)


if __name__ == "__main__":
    main()
