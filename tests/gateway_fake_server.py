"""Run the real gateway (gate, loopback rules, routes, receipts) over the fake engine, for tests.

    python tests/gateway_fake_server.py MODEL.gguf --fork F [--listen H:P] [--upstream H:P]
        [--ctx N] [--step-ms MS] [--limits JSON] [--fail-load] [--replay]

The model file is gated for real (guard, then the pin); only the engine is fake. --limits overrides
keys of the [limits] table (e.g. short timeouts). --replay serves llama-server's recorded tokens
through the real tokenizer and host side (tests/replay_engine.py; MODEL must be SmolLM2).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from fake_engine import fake_loader  # noqa: E402

from bankml.cli import opt  # noqa: E402
from bankml.serve import Refusal, gate_model, parse_serve_options  # noqa: E402
from gateway.app import run_gateway  # noqa: E402


def _address(text: str | None, parsed: tuple[str, int]) -> tuple[str, int]:
    if text and text.endswith(":0"):
        return text[:-2].strip("[]"), 0
    return parsed


def main(argv: list[str]) -> int:
    args = ["bankml", "serve", *argv, "--native"]
    options = parse_serve_options([a if not a.endswith(":0") else "127.0.0.1:1" for a in args])
    # port 0 (the system picks; the log line names it) is for tests only, so the CLI refuses it
    options = dataclasses.replace(options, listen=_address(opt(args, "--listen"), options.listen),
                                  upstream=_address(opt(args, "--upstream"), options.upstream))
    options.config["limits"].update(json.loads(opt(args, "--limits") or "{}"))
    try:
        gated = gate_model(argv[0], Path(opt(args, "--fork")).read_text())
    except Refusal as e:
        print(f"bankml serve: refuse: {e}", file=sys.stderr)
        return 2
    step_s = float(opt(args, "--step-ms") or 2) / 1e3
    loader = fake_loader(options.ctx, step_s)
    if "--replay" in args:
        from replay_engine import replay_loader

        loader = replay_loader(n_ctx=options.ctx)
    if "--fail-load" in args:
        def loader(path: str):
            raise RuntimeError("the fake engine cannot load this")
    return run_gateway(gated, options, loader=loader)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
