#!/usr/bin/env python3
"""Stand in for llama-server under llama.cpp's own server tests (tools/server/tests, utils.py ServerProcess):
read llama-server's command line, start `bankml serve --native` on the same address instead.

    LLAMA_SERVER_BIN_PATH=<a wrapper that runs this file> pytest unit/test_security.py

bench/llama_server_suite.py makes the wrapper and runs the tests. The model is always bankml's default
(SmolLM2, or FILE given as $BANKML_SHIM_MODEL with $BANKML_SHIM_FORK): a model named by --hf-repo,
--hf-file, --model or --model-url is ignored. Mapped flags:

    --host H --port P             --listen H:P (and --upstream on a free port: the compat listener)
    -c/--ctx-size C -np/--parallel N
                                  --ctx C/N per sequence, and a --config TOML with [engine] max_seqs = N
                                  (llama-server splits -c among its slots); -c alone: --ctx C
    --api-key KEY                 --api-key KEY (repeatable)
    --slot-save-path DIR          --slot-save-path DIR
    --chat-template-file FILE     --chat-template-file FILE

Every other flag (--pooling, --jinja, --alias, --n-predict, --temp, --context-shift, --lora, ...) is
ignored, and the ignored ones are listed on stderr, so a test's log says what its server did not get.
The process execs bankml, so the harness's SIGTERM reaches bankml itself.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path

# llama-server flags that take a value (common/arg.cpp spellings the tests' utils.py passes); any other
# flag followed by a token that is not a flag is taken to have a value too
_VALUED = {
    "--port", "--host", "--temp", "--seed", "--model", "-m", "--model-url", "-mu", "--model-draft", "-md",
    "--hf-repo", "-hf", "-hfr", "--hf-file", "-hff", "--models-dir", "--models-max", "--models-preset",
    "--cors-origins", "--batch-size", "-b", "--ubatch-size", "-ub", "--threads", "-t", "--n-gpu-layers",
    "-ngl", "--pooling", "--alias", "-a", "--tags", "--ctx-size", "-c", "--parallel", "-np", "-ctk", "-ctv",
    "--cache-type-k", "--cache-type-v", "-fa", "--flash-attn", "--n-predict", "-n", "--slot-save-path",
    "--grp-attn-n", "--grp-attn-w", "--lora", "--spec-type", "--api-key", "--spec-draft-n-max",
    "--spec-draft-n-min", "--spec-synth-len", "--spec-synth-rates", "--reasoning-format", "--reasoning",
    "--chat-template", "--chat-template-file", "--mmproj-url", "--media-path", "--sleep-idle-seconds",
    "--cache-ram", "--cache-reuse-hybrid", "--cache-reuse-hybrid-min-share", "--tools", "--tools-runtime",
    "--mcp-servers-config", "--mcp-servers-json", "--draft-max", "--draft-min",
}
# the flags this shim maps; everything else parsed is reported as ignored
_MAPPED = {"--port", "--host", "--ctx-size", "-c", "--parallel", "-np", "--api-key", "--slot-save-path",
           "--chat-template-file"}
# flags whose absence or presence changes nothing for bankml: not worth a line on stderr
_QUIET = {"--no-slots", "--slots", "--no-jinja", "--offline", "--seed", "--hf-repo", "--hf-file", "--model",
          "-m", "--batch-size", "-b", "--ubatch-size", "-ub", "--threads", "-t", "--n-gpu-layers", "-ngl"}


def parse(argv: list[str]) -> list[tuple[str, str | None]]:
    """llama-server's argv -> [(flag, value or None)], in order (`--flag=value` split too)."""
    out: list[tuple[str, str | None]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if "=" in arg and arg.startswith("--"):
            flag, value = arg.split("=", 1)
            out.append((flag, value))
            continue
        takes = arg in _VALUED or (
            i < len(argv) and not (argv[i].startswith("-") and not _is_number(argv[i])) and arg.startswith("-"))
        if takes and i < len(argv):
            out.append((arg, argv[i]))
            i += 1
        else:
            out.append((arg, None))
    return out


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _config_file(max_seqs: int) -> Path:
    """A --config TOML with [engine] max_seqs (the rest bankml's defaults: the warm compile cache in
    ~/.cache/bankml/xla included); the same file for the same N, so nothing piles up in /tmp."""
    d = Path(tempfile.gettempdir()) / f"bankml-llama-shim-{os.getuid()}"
    d.mkdir(mode=0o700, exist_ok=True)
    path = d / f"max_seqs-{max_seqs}.toml"
    text = f"# written by bench/llama_server_shim.py: llama-server's --parallel {max_seqs}\n" \
           f"[engine]\nmax_seqs = {max_seqs}\n"
    if not path.exists() or path.read_text() != text:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        tmp.replace(path)
    return path


def bankml_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """llama-server's argv -> (bankml's argv, the flags ignored, as 'flag value' strings)."""
    host, port = "127.0.0.1", "8080"
    ctx: int | None = None
    parallel: int | None = None
    extra: list[str] = []
    ignored: list[str] = []
    for flag, value in parse(argv):
        if flag == "--host" and value:
            host = value.split(",")[0].strip()
        elif flag == "--port" and value:
            port = value
        elif flag in ("--ctx-size", "-c") and value:
            ctx = int(value)
        elif flag in ("--parallel", "-np") and value:
            parallel = int(value)
        elif flag == "--api-key" and value:
            extra += ["--api-key", value]
        elif flag == "--slot-save-path" and value:
            extra += ["--slot-save-path", str(Path(value).resolve())]
        elif flag == "--chat-template-file" and value:
            extra += ["--chat-template-file", str(Path(value).resolve())]
        elif flag not in _MAPPED and flag not in _QUIET:
            ignored.append(flag if value is None else f"{flag} {value}")
    out = [*_bankml(), "serve"]
    model = os.environ.get("BANKML_SHIM_MODEL")
    if model:
        out += [model, "--fork", os.environ["BANKML_SHIM_FORK"]]
    out += ["--native", "--listen", f"{host}:{port}", "--upstream", f"{host}:{_free_port(host)}"]
    if parallel is not None and parallel > 0:
        out += ["--config", str(_config_file(parallel))]
        if ctx:  # llama-server: each of the N slots gets n_ctx / N
            out += ["--ctx", str(max(1, ctx // parallel))]
    elif ctx:
        out += ["--ctx", str(ctx)]
    return out + extra, ignored


def _bankml() -> list[str]:
    exe = os.environ.get("BANKML_BIN") or shutil.which("bankml")
    return [exe] if exe else [sys.executable, "-m", "bankml.cli"]


def main(argv: list[str]) -> None:
    if any(a in ("--version", "-h", "--help") for a in argv):
        print("llama_server_shim: bankml serve --native standing in for llama-server", file=sys.stderr)
        sys.exit(0)
    out, ignored = bankml_argv(argv)
    if ignored:
        print(f"llama_server_shim: ignored (bankml has no such option): {'; '.join(ignored)}", file=sys.stderr)
    print(f"llama_server_shim: exec {' '.join(out)}", file=sys.stderr, flush=True)
    os.execvp(out[0], out)


if __name__ == "__main__":
    main(sys.argv[1:])
