"""A pytest plugin for the GPU run: one JSON line per test, written as soon as the test is done.

    pytest -p gpu_report_plugin ...    (bench/ on PYTHONPATH; BANKML_GPU_TESTS_LOG=FILE.jsonl)

A run cut short by its time box keeps every test that finished: nodeid, outcome (passed, failed,
skipped, error), seconds, and for a failure or skip the first lines of pytest's report.
"""

from __future__ import annotations

import json
import os


def _write(row: dict) -> None:
    path = os.environ.get("BANKML_GPU_TESTS_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")


def pytest_runtest_logreport(report) -> None:
    # the call phase says how a test went; setup says so only when it failed or skipped there (no call ran)
    if report.when == "call" or (report.when == "setup" and not report.passed):
        outcome = report.outcome if report.when == "call" else ("error" if report.failed else "skipped")
        row = {"test": report.nodeid, "outcome": outcome, "seconds": round(report.duration, 3)}
        if not report.passed:
            row["report"] = str(report.longrepr)[-1500:]
        _write(row)
    elif report.when == "teardown" and report.failed:
        _write({"test": report.nodeid, "outcome": "error", "phase": "teardown", "report": str(report.longrepr)[-1500:]})
