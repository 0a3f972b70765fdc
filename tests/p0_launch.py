"""`bankml serve FILE --fork F [--spawn BIN | --upstream H:P] ...` in P0 mode, for the tests.

The same steps as bankml.serve.serve_main (options, the gate, then the server), ending in
gateway.p0.run_p0 rather than the native gateway, so the P0 tests run whatever serve_main's wiring.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bankml.cli import engine_of, model_and_fork  # noqa: E402
from bankml.serve import Refusal, gate_model, parse_serve_options  # noqa: E402
from gateway.p0 import run_p0  # noqa: E402


def main(argv: list[str]) -> int:
    args = ["bankml", "serve", *argv]
    found = model_and_fork(args, "serve")
    if found is None:
        return 1
    try:
        options = parse_serve_options(args)
        gated = gate_model(found[0], found[1], engine=engine_of(args))
    except Refusal as e:
        print(f"bankml serve: refuse: {e}", file=sys.stderr, flush=True)
        return 2
    return run_p0(gated, options)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
