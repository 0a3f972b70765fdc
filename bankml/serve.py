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
    """Gate the model, then run the server until it stops. Returns the process exit code.

    Across processes (--num-processes, model/distributed.py) every process gates its own file, then
    they agree on it, or all refuse: process 0 goes on as one process does, the others follow its steps."""
    try:
        gated = gate_model(path, fork_text, rule_set=options.rule_set, fork_path=fork_path)
    except BankmlError as e:
        if options.cluster is None:
            return refuse_start(e)
        return _join(options, None, None, str(e))
    if options.cluster is not None and (code := _join(options, gated.path, gated.verified.model_sha256, None)) \
            is not None:
        return code
    v = gated.verified
    signed = f", signed by {v.model_signer}" if v.model_signer else ""
    print(f"bankml serve: verified {gated.path}: sha256 {v.model_sha256}, arch {v.arch}, name {v.name}{signed}",
          file=sys.stderr, flush=True)
    if not options.native:  # P0: in front of llama-server, --spawn or --upstream
        from gateway.p0.app import run_p0

        return run_p0(gated, options)
    from gateway.app import run_gateway

    code = run_gateway(gated, options)
    if options.cluster is not None:
        from model import distributed

        return distributed.leave(code)
    return code


def _join(options: ServeOptions, path: str | None, sha256: str | None, refused: str | None) -> int | None:
    """Join the cluster with this process's gate's verdict. None: process 0, go on serving; else the exit
    code (a refusal, on every process, or a follower's end)."""
    from model import distributed

    coordinator, n, pid = options.cluster
    if (fraction := _memory_fraction(options)) is not None:
        return fraction
    try:
        distributed.join(coordinator, n, pid, sha256=sha256, refused=refused)
    except distributed.DistributedRefused as e:
        return refuse_start(f"process {pid} of {n}: {e}")
    if refused is not None:  # join refuses then; never reached
        return refuse_start(refused)
    if pid == 0:
        return None
    print(f"bankml serve: process {pid} of {n}: verified sha256 {sha256}, as every process did; following "
          f"process 0's steps", file=sys.stderr, flush=True)
    from model.loading import load_engine

    return distributed.follow(path, load_engine)


def _memory_fraction(options: ServeOptions) -> int | None:
    """[engine] memory_fraction, before JAX starts (the gateway's own start does it on process 0 too)."""
    from bankml.config import ConfigInvalid
    from model import device_budget

    try:
        device_budget.apply_memory_fraction(options.config.engine.memory_fraction)
    except ConfigInvalid as e:
        return refuse_start(str(e))
    return None
