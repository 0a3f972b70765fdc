"""`bankml serve`: options, then the gate, then (only then) the server.

Start-up order (gate.md §1): take the file's identity, verify it (guard, then pin), canonicalise the
path and take the identity again; a file that changed while it was hashed is refused. Any refusal
prints `bankml serve: refuse: <why>` and exits 2 with no socket bound.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from bankml.cli import engine_of, model_and_fork, opt
from bankml.config import ConfigError, load_config, parse_host_port
from bankml.verify import FileIdentity, Verified, VerifyError, verify


class Refusal(Exception):
    """serve refuses to start; the message is the reason."""


@dataclass(frozen=True)
class GatedModel:
    """A model file that passed the gate at start-up."""

    path: str  # canonical
    verified: Verified
    identity: FileIdentity
    fork_text: str
    given: str = ""  # the path as given: a re-verification pins its basename, as the first one did


def gate_model(path: str, fork_text: str, engine: str = "mainline") -> GatedModel:
    try:
        before = FileIdentity.of(path)
    except OSError as e:
        raise Refusal(f"cannot read {path}: {e.strerror or e}") from e
    try:
        verified = verify(path, fork_text, engine=engine)
    except VerifyError as e:
        raise Refusal(str(e)) from e
    canonical = os.path.realpath(path)
    try:
        after = FileIdentity.of(canonical)
    except OSError as e:
        raise Refusal(f"cannot read {path}: {e.strerror or e}") from e
    if after != before:
        raise Refusal(f"{path} changed while it was being hashed: refused")
    return GatedModel(canonical, verified, after, fork_text, os.fspath(path))


@dataclass(frozen=True)
class ServeOptions:
    listen: tuple[str, int]
    upstream: tuple[str, int]
    threads: int
    ctx: int
    keep_alive: str
    native: bool
    spawn: str | None
    spec_ngram: bool
    slot_dir: str | None
    config: dict


def parse_serve_options(args: list[str]) -> ServeOptions:
    try:
        config = load_config(opt(args, "--config"))
        serve = config["serve"]
        listen = parse_host_port(opt(args, "--listen") or serve["listen"], "--listen")
        upstream = parse_host_port(opt(args, "--upstream") or serve["upstream"], "--upstream")
    except ConfigError as e:
        raise Refusal(str(e)) from e
    threads_text = opt(args, "--threads")
    threads = int(threads_text) if threads_text and threads_text.isdigit() and int(threads_text) > 0 else serve["threads"]
    ctx_text = opt(args, "--ctx")
    if ctx_text is not None and not (ctx_text.isdigit() and int(ctx_text) > 0):
        raise Refusal(f"--ctx {ctx_text!r} is not a positive integer")
    return ServeOptions(
        listen=listen,
        upstream=upstream,
        threads=threads,
        ctx=int(ctx_text) if ctx_text else serve["ctx"],
        keep_alive=opt(args, "--keep-alive") or serve["keep_alive"],
        native="--native" in args,
        spawn=opt(args, "--spawn"),
        spec_ngram="--spec-ngram" in args or serve["spec_ngram"],
        slot_dir=opt(args, "--slot-dir") or serve["slot_dir"] or None,
        config=config,
    )


def serve_main(args: list[str]) -> int:
    found = model_and_fork(args, "serve")
    if found is None:
        return 1
    path, fork_text = found
    try:
        options = parse_serve_options(args)
        gated = gate_model(path, fork_text, engine=engine_of(args))
    except Refusal as e:
        print(f"bankml serve: refuse: {e}", file=sys.stderr, flush=True)
        return 2
    v = gated.verified
    print(f"bankml serve: verified {gated.path}: sha256 {v.model_sha256}, arch {v.arch}, name {v.name}",
          file=sys.stderr, flush=True)
    if not options.native:  # P0: in front of llama-server, --spawn or --upstream
        from gateway.p0 import run_p0

        return run_p0(gated, options)
    from gateway.app import run_gateway

    return run_gateway(gated, options)
