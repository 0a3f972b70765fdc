"""`bankml serve`'s launcher: the gate, then (only then) the server. Only bankml/cli.py imports it.

Start-up order: take the file's identity, verify it (guard, pin, then the model's signature when its
FORK.json names one), canonicalise the path and take the identity again; a file that changed while it
was hashed is refused (bankml.verify.gate_model).
Then P0 (gateway/p0/app.py, in front of llama-server) or, with --native, the native gateway
(gateway/app.py). Any refusal prints `bankml serve: refuse: <why>` and exits 2 with no socket bound.
"""

from __future__ import annotations

import sys

from bankml.config import ServeOptions
from bankml.errors import BankmlError, refuse_start
from bankml.verify import gate_model


def serve(path: str, fork_text: str, options: ServeOptions, fork_path: str | None = None) -> int:
    """Gate the model, then run the server until it stops. Returns the process exit code."""
    try:
        gated = gate_model(path, fork_text, rule_set=options.rule_set, fork_path=fork_path)
    except BankmlError as e:
        return refuse_start(e)
    v = gated.verified
    signed = f", signed by {v.model_signer}" if v.model_signer else ""
    print(f"bankml serve: verified {gated.path}: sha256 {v.model_sha256}, arch {v.arch}, name {v.name}{signed}",
          file=sys.stderr, flush=True)
    if not options.native:  # P0: in front of llama-server, --spawn or --upstream
        from gateway.p0.app import run_p0

        return run_p0(gated, options)
    from gateway.app import run_gateway

    return run_gateway(gated, options)
