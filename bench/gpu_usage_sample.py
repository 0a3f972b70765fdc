"""What /bankml/usage says about the GPU, once a second, while something else runs (the GPU run's bench).

    python bench/gpu_usage_sample.py OUT.json [--interval-s 1] [--seconds 600]

The samples are gpu_monitor's `Monitor.get_usage_sync()`, the very body `GET /bankml/usage` serves (its
NVML readings on an NVIDIA machine: VRAM used and total, busy %, watts from the energy counter over the
sample's window, power limit, temperature, throttle reasons). OUT.json is rewritten after every sample:
each sample's GPU fields in `samples`, the whole body of the first sample and of the one that drew the
most watts, and `summary` (peaks and medians). It stops on SIGTERM or SIGINT, or after --seconds.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

GPU_FIELDS = ("name", "source", "busy_percent", "vram_used_bytes", "vram_total_bytes", "power_watts",
              "power_limit_watts", "temperature_c", "throttle")


def summary(samples: list[dict]) -> dict:
    gpus = [g for s in samples for g in s["gpus"]]

    def values(key: str) -> list[float]:
        return [g[key] for g in gpus if isinstance(g.get(key), (int, float))]

    out: dict = {"samples": len(samples), "gpu_readings": len(gpus)}
    for key in ("busy_percent", "vram_used_bytes", "power_watts", "temperature_c"):
        v = values(key)
        out[key] = {"max": max(v), "median": statistics.median(v)} if v else None
    total = values("vram_total_bytes")
    out["vram_total_bytes"] = max(total) if total else None
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--interval-s", type=float, default=1.0)
    ap.add_argument("--seconds", type=float, default=600.0)
    args = ap.parse_args()

    from gpu_monitor.sample import Monitor

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    monitor = Monitor(amdsmi=None, min_interval_s=args.interval_s)
    doc: dict = {"source": "gpu_monitor.sample.Monitor.get_usage_sync (the body of GET /bankml/usage)",
                 "interval_s": args.interval_s, "samples": []}
    t0 = time.monotonic()
    peak_w = -1.0
    try:
        while not stop.is_set() and time.monotonic() - t0 < args.seconds:
            body = monitor.get_usage_sync()
            gpus = [{k: g.get(k) for k in GPU_FIELDS} for g in body.get("gpus", [])]
            doc["samples"].append({"t_s": round(time.monotonic() - t0, 2), "gpus": gpus})
            if "first_full" not in doc:
                doc["first_full"] = body
            watts = sum(g["power_watts"] for g in gpus if isinstance(g.get("power_watts"), (int, float)))
            if gpus and watts > peak_w:
                peak_w, doc["peak_full"] = watts, body
            doc["summary"] = summary(doc["samples"])
            args.out.write_text(json.dumps(doc, indent=1, default=str) + "\n")
            stop.wait(args.interval_s)
    finally:
        monitor.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
