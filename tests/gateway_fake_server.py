"""Run the real gateway (gate, loopback rules, routes, receipts) over the fake engine, for tests.

    python tests/gateway_fake_server.py MODEL.gguf --fork F [--listen H:P] [--upstream H:P]
        [--ctx N] [--step-ms MS] [--limits JSON] [--engine JSON] [--fail-load] [--replay]
        [--registry DIR] [--max-loaded N] [--keep-alive DUR] [--load-s JSON] [--model-bytes JSON]
        [--budget-bytes N]

The model file is gated for real (guard, then the pin); only the engine is fake. --limits overrides
keys of the [limits] table (e.g. short timeouts), --engine those of [engine] (max_seqs, max_waiting:
the fake engine serves max_seqs sequences at once, as the real one). --replay serves llama-server's recorded tokens
through the real tokenizer and host side (tests/replay_engine.py; MODEL must be SmolLM2).
--registry DIR serves every model pinned there too, each on a fake engine of its own; --max-loaded
bounds how many are resident ([registry] max_loaded), --keep-alive is serve's. --load-s {"name": S}
makes loading the pin `name` take S seconds (on its engine thread), --model-bytes {"name": B} says
what it holds, --budget-bytes the memory all resident models may hold (default: 80% of the RAM).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from fake_engine import fake_estimate, fake_loader  # noqa: E402

from bankml.cli import add_serve_arguments, read_fork, serve_options_of  # noqa: E402
from bankml.errors import BankmlError, refuse_start  # noqa: E402
from bankml.verify import gate_model  # noqa: E402
from gateway.app import run_gateway  # noqa: E402


def _port_zero(text: str | None) -> str | None:
    """H:0 (the system picks; the log line names it) is for tests only, so the CLI refuses it."""
    return text if text and text.endswith(":0") else None


def main(argv: list[str]) -> int:
    fake = argparse.ArgumentParser(add_help=False)
    fake.add_argument("--step-ms", type=float, default=2.0)
    fake.add_argument("--limits", default="{}")
    fake.add_argument("--engine", default="{}")
    fake.add_argument("--fail-load", action="store_true")
    fake.add_argument("--replay", action="store_true")
    fake.add_argument("--max-loaded", type=int, default=None)
    fake.add_argument("--load-s", default="{}")
    fake.add_argument("--model-bytes", default="{}")
    fake.add_argument("--budget-bytes", type=int, default=None)
    extra, rest = fake.parse_known_args(argv)
    zero = {flag: _port_zero(value) for flag, value in zip(rest, rest[1:], strict=False)
            if flag in ("--listen", "--upstream")}
    rest = ["127.0.0.1:1" if i and rest[i - 1] in zero and zero[rest[i - 1]] else a for i, a in enumerate(rest)]
    serve = argparse.ArgumentParser(prog="gateway_fake_server")
    add_serve_arguments(serve)
    args = serve.parse_args([*rest, "--native"])
    listen, upstream = zero.get("--listen"), zero.get("--upstream")
    try:
        options = serve_options_of(args)
        c = options.config
        config = dataclasses.replace(
            c, limits=dataclasses.replace(c.limits, **json.loads(extra.limits)),
            engine=dataclasses.replace(c.engine, **json.loads(extra.engine)),
            serve=dataclasses.replace(c.serve, listen=listen or c.serve.listen, upstream=upstream or c.serve.upstream),
            registry=dataclasses.replace(c.registry, max_loaded=extra.max_loaded or c.registry.max_loaded))
        options = dataclasses.replace(options, config=config)
        gated = gate_model(args.file, read_fork(args.fork, "serve"), fork_path=str(Path(args.fork).resolve()))
    except BankmlError as e:
        return refuse_start(e)
    sizes = json.loads(extra.model_bytes)
    loader = fake_loader(options.ctx, extra.step_ms / 1e3, max_seqs=options.config.engine.max_seqs,
                         load_s=json.loads(extra.load_s), size_bytes=sizes,
                         speculation=options.config.engine.speculation)
    if extra.replay:
        from replay_engine import replay_loader

        loader = replay_loader(n_ctx=options.ctx)
    if extra.fail_load:
        def loader(path: str):
            raise RuntimeError("the fake engine cannot load this")
    return run_gateway(gated, options, loader=loader, estimate=fake_estimate(sizes), budget_bytes=extra.budget_bytes)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
