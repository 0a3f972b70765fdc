"""Serve configuration, typed: the defaults below, a preset or file over them, then the CLI's flags.

The dataclasses here hold every key and its default; nothing else does. A preset (`--config cpu`,
configs/cpu.toml) or a file (`--config path.toml`) may set only keys these name, with their type; an
unknown key, a wrong type or a bad value is a `ConfigInvalid` naming the file and the key, so a typo
never passes silently as a default. `--config default` is the defaults themselves. The result is
read once, into frozen dataclasses: code reads fields.

`ServeOptions` is what `bankml serve` runs with: the config, with the command line's flags over it.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from dataclasses import dataclass, field, fields, replace
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bankml import serve_files
from bankml.errors import ConfigInvalid
from bankml.serve_files import ChatTemplateFile
from model.speculative import MAX_DRAFT, Speculation, spec_type_refusal  # no jax (the flags need no engine)

if TYPE_CHECKING:
    from bankml.signing import ReceiptKey
    from model.kv_events import KVEventsConfig

RULE_SETS = ("mainline",)  # the guard's only rule set: the Bonsai/prism rules are out of scope
CACHE_TYPES = ("f16", "q8_0")  # the KV cache's types (model/kvcache.py; this module never imports jax)
PAGE_SIZE = 16  # tokens per KV page: `[engine] page_size`'s default, and the engine's (model/engine.py)


@dataclass(frozen=True)
class ServeConfig:
    listen: str = "127.0.0.1:18093"  # the gateway, bound only after verification
    upstream: str = "127.0.0.1:18092"  # P0: the llama-server to check or spawn; native: the second listener
    threads: int = 3  # P0: -t of a spawned llama-server
    ctx: int = 4096  # -c of a spawned llama-server, or the native n_ctx
    keep_alive: str = "5m"  # native: default keep_alive for Ollama's /api/* (a Go duration or seconds)
    rule_set: str = "mainline"  # the guard's rule set
    spec_ngram: bool = False  # P0: --spec-type ngram-simple
    slot_dir: str = ""  # slot files (POST /slots/{id}?action=save|restore); P0 passes it as --slot-save-path
    shutdown_grace_s: float = 10.0  # SIGTERM/SIGINT: answers in flight get this long to finish, then end
    # API keys, one a line ("" = none; --api-key KEY adds more): every route but /health, /v1/health,
    # /models, /v1/models and / then needs `Authorization: Bearer KEY` or `x-api-key: KEY` (bankml/serve_files.py reads it)
    api_key_file: str = ""
    # browser origins admitted besides the server's own (scheme://host[:port]; --allow-origin O,...)
    allowed_origins: tuple[str, ...] = ()
    chat_template_file: str = ""  # --native: replaces the startup model's GGUF chat template (read once)
    receipt_key: str = ""  # the ed25519 key receipts are signed with ("" = receipt-key.pem in the config dir)
    # --native: vLLM's --kv-events-config JSON: the prefix cache's KV events over ZMQ, for a router
    # (model/kv_events.py; "" = none); an endpoint off this machine needs a non-loopback --listen
    kv_events_config: str = ""
    access_log: bool = True  # a line per request on stderr (gateway/http/access_log.py); --quiet: off


@dataclass(frozen=True)
class LimitsConfig:
    """The loopback rules (gateway/http/loopback.py enforces them) and P0's bound on llama-server's answers."""

    max_connections: int = 32  # more open connections: 503
    max_body_bytes: int = 16 << 20  # 413
    max_line_bytes: int = 16 << 10  # a request or header line over 16 KiB: 400
    max_header_lines: int = 100  # more header lines: 400
    read_timeout_s: float = 30.0
    write_timeout_s: float = 120.0
    drain_ms: int = 200  # refusals drain what the client sent, this long at most
    head_timeout_s: float = 10.0  # the whole request head, however it trickles in: else 408
    body_grace_s: float = 10.0  # after this, a body slower than min_body_bytes_per_s on average: 408
    min_body_bytes_per_s: int = 1024  # 0: no minimum rate
    body_timeout_s: float = 60.0  # the whole request body, at whatever rate: else 408 (16 MiB takes ms here)
    max_upstream_body_bytes: int = 64 << 20  # P0: from llama-server, refused before it is buffered
    # --native: /health is 503 once an engine, or every one of the loop's worker threads, has had work
    # waiting this long without completing any (gateway/http/liveness.py); 200 again when it moves
    wedged_after_s: float = 120.0
    # --native: the Responses API's stored responses (store: true), least recently used evicted past this
    responses_store_bytes: int = 64 << 20

    @property
    def max_head_bytes(self) -> int:
        # the request line, every header line and the blank line, each at its longest
        return (self.max_header_lines + 2) * self.max_line_bytes


@dataclass(frozen=True)
class EngineConfig:
    """The native engine."""

    max_seqs: int = 4  # sequences decoded at once (llama-server's automatic --parallel; the limiter's second half)
    max_waiting: int = 256  # requests queued for a sequence beyond that; one more gets 503 and Retry-After
    # the paged KV cache's pool: 0 sizes it for max_seqs whole contexts on a CPU, or from memory_fraction
    # of the device's memory after the weights on a GPU; it never grows
    kv_cache_bytes: int = 0
    page_size: int = PAGE_SIZE  # tokens per KV page (a power of two)
    # the KV cache's type: f16 (llama.cpp's default) or q8_0 (about half the bytes: twice the tokens in the
    # same pool; needs head_dim % 32 == 0); $BANKML_CACHE_TYPE overrides it
    cache_type: str = "f16"
    memory_fraction: float = 0.75  # share of device memory the server may take (the limiter)
    max_prefill_bucket: int = 512  # longest prefill chunk; prompts are padded to powers of two up to it
    # JAX's persistent compilation cache: a restart reuses the compiled programs ("" = off); `{cache}` is
    # $BANKML_CACHE_DIR, else $XDG_CACHE_HOME/bankml, else ~/.cache/bankml
    compile_cache_dir: str = "{cache}/xla"
    # speculative decoding (model/speculative.py), llama-server's flags of the same names: --spec-type
    # "none" or "ngram-simple" (drafts from the sequence's own n-grams: the last spec_ngram_size_n tokens
    # looked up, up to spec_ngram_size_m tokens after them drafted); --draft-max / --draft-min, a request's
    # speculative.n_max / n_min when it gives none (draft_max also sizes the verify programs)
    spec_type: str = "none"
    spec_ngram_size_n: int = 12
    spec_ngram_size_m: int = 48
    draft_max: int = 16
    draft_min: int = 0
    # split the model over this many devices of the platform (model/parallel.py; --tensor-parallel, vLLM's
    # --tensor-parallel-size): heads and FFN columns, the vocabulary and the KV pool; 1: one device
    tensor_parallel: int = 1
    # one model across processes and machines (model/distributed.py, jax.distributed): the coordinator's
    # HOST:PORT (process 0 listens there), how many processes, and this one's id; "" / 1: one process.
    # JAX's own $JAX_COORDINATOR_ADDRESS, $JAX_NUM_PROCESSES and $JAX_PROCESS_ID stand in for the flags
    coordinator: str = ""
    num_processes: int = 1
    process_id: int = 0

    @property
    def speculation(self) -> Speculation:
        """The engine's speculative decoding, as these keys say (checked when they were read)."""
        return Speculation(self.spec_type, self.spec_ngram_size_n, self.spec_ngram_size_m, self.draft_max,
                           self.draft_min)


@dataclass(frozen=True)
class RegistryConfig:
    """--native: the pinned models served beside the startup one, and how many stay resident."""

    dir: str = ""  # every model pinned by a *.FORK.json here ("" = the startup model only; --registry DIR)
    max_loaded: int = 3  # models resident at once (and the memory budget), least recently used idle go first


@dataclass(frozen=True)
class Config:
    serve: ServeConfig = field(default_factory=ServeConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    registry: RegistryConfig = field(default_factory=RegistryConfig)


# --- values ------------------------------------------------------------------------------------------


def parse_host_port(text: str, what: str, any_port: bool = False) -> tuple[str, int]:
    """'127.0.0.1:18093' or '[::1]:18093' -> (host, port); an http:// prefix and a trailing / are dropped.
    `any_port`: port 0 too (the system picks one: the tests' servers; the CLI and the config refuse it)."""
    t = text.removeprefix("http://").rstrip("/")
    host, sep, port = t.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()) or not int(not any_port) <= int(port) < 65536:
        raise ConfigInvalid(f"{what} {text!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


_GO_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_GO_PART = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|µs|μs|ms|s|m|h)")


def parse_keep_alive(text: str, what: str) -> float:
    """A keep_alive as Ollama reads one (api/types.go, Duration): a Go duration ("5m", "1h30m", "-1s")
    or a number of seconds; 0 unloads at once, and any negative value means forever (math.inf)."""
    t = text.strip()
    try:
        seconds = float(t)
    except ValueError:
        sign, body = (-1.0, t[1:]) if t[:1] == "-" else (1.0, t.removeprefix("+"))
        parts = list(_GO_PART.finditer(body))
        if not body or not parts or "".join(p.group(0) for p in parts) != body:
            raise ConfigInvalid(f"{what} {text!r} is not a duration (e.g. 5m, 1h30m, 300, -1)") from None
        seconds = sign * sum(float(p.group(1)) * _GO_UNIT_S[p.group(2)] for p in parts)
    if not math.isfinite(seconds):
        raise ConfigInvalid(f"{what} {text!r} is not a duration (e.g. 5m, 1h30m, 300, -1)")
    return math.inf if seconds < 0 else seconds


def _positive(value: Any, what: str) -> None:
    if value <= 0:
        raise ConfigInvalid(f"{what} must be positive, not {value!r}")


def _draft_max(value: Any, what: str) -> None:
    _positive(value, what)
    if value > MAX_DRAFT:  # it sizes the verify programs (1 + draft_max tokens a row)
        raise ConfigInvalid(f"{what} must be at most {MAX_DRAFT}, not {value!r} (a verify step holds 1 + that "
                            "many tokens a row)")


def _not_negative(value: Any, what: str) -> None:
    if value < 0:
        raise ConfigInvalid(f"{what} must not be negative, not {value!r}")


def _rule_set(value: str, what: str) -> None:
    if value not in RULE_SETS:
        raise ConfigInvalid(f"{what} {value!r} is not supported: the only rule set is mainline "
                            "(the Bonsai/prism rules are out of scope)")


def _power_of_two(value: int, what: str) -> None:
    if value <= 0 or value & (value - 1) or value > 1024:
        raise ConfigInvalid(f"{what} must be a power of two up to 1024, not {value!r}")


def _cache_type(value: str, what: str) -> None:
    if value not in CACHE_TYPES:
        raise ConfigInvalid(f"{what} {value!r} is not a KV cache type bankML has (one of {', '.join(CACHE_TYPES)})")


def _spec_type(value: str, what: str) -> None:
    why = spec_type_refusal(value)  # names llama-server's flag, and why (not done here, or not a type)
    if why is not None:
        raise ConfigInvalid(f"{what}: {why}")


def _fraction(value: float, what: str) -> None:
    if not 0.0 < value <= 1.0:
        raise ConfigInvalid(f"{what} must be in (0, 1], not {value!r}")


# Checks beyond the type, per dotted key; each raises ConfigInvalid naming `what` (file and key).
_CHECKS = {
    "serve.listen": parse_host_port,
    "serve.upstream": parse_host_port,
    "serve.threads": _positive,
    "serve.ctx": _positive,
    "serve.keep_alive": parse_keep_alive,
    "serve.rule_set": _rule_set,
    "serve.allowed_origins": lambda value, what: serve_files.parse_origins(value, what),
    **{f"limits.{f.name}": _positive for f in fields(LimitsConfig)},
    "limits.drain_ms": _not_negative,  # 0: refusals close at once
    "engine.max_seqs": _positive,
    "engine.max_waiting": _positive,
    "engine.kv_cache_bytes": _not_negative,
    "engine.page_size": _power_of_two,
    "engine.cache_type": _cache_type,
    "engine.memory_fraction": _fraction,
    "engine.max_prefill_bucket": _positive,
    "engine.spec_type": _spec_type,
    "engine.spec_ngram_size_n": _positive,
    "engine.spec_ngram_size_m": _positive,
    "engine.draft_max": _draft_max,
    "engine.draft_min": _not_negative,
    "engine.tensor_parallel": _positive,
    "engine.coordinator": lambda value, what: parse_host_port(value, what) if value else None,
    "engine.num_processes": _positive,
    "engine.process_id": _not_negative,
    "registry.max_loaded": _positive,
}


_RENAMED = {"engine.n_slots": "engine.max_seqs"}


# --- files ---------------------------------------------------------------------------------------


def presets() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("configs").iterdir() if p.name.endswith(".toml"))


def _read(name: str) -> tuple[str, dict]:
    res = resources.files("configs").joinpath(f"{name}.toml")
    path = Path(name)
    if res.is_file():
        source, text = f"configs/{name}.toml", res.read_text()
    elif path.is_file():
        source, text = str(path), path.read_text()
    else:
        raise ConfigInvalid(f"no config preset or file {name!r} (presets: {', '.join(presets())})")
    try:
        return source, tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigInvalid(f"{source}: {e}") from e


def _type_ok(want: type, value: Any) -> bool:
    if want is tuple:  # a list of strings (allowed_origins)
        return type(value) is list and all(type(v) is str for v in value)
    if want is float:
        return type(value) in (float, int)  # TOML writes 30 for 30.0
    return type(value) is want  # bool is not int here: `ctx = true` is refused


def _over(base: Any, table: dict, source: str, where: str) -> Any:
    """`base` (a config dataclass) with the keys of one TOML table over it, each checked."""
    known = {f.name: f for f in fields(base)}
    changes: dict[str, Any] = {}
    for key, value in table.items():
        dotted = f"{where}{key}"
        if key not in known:
            renamed = _RENAMED.get(dotted)
            if renamed:
                raise ConfigInvalid(f"{source}: {dotted!r} is now {renamed!r}")
            raise ConfigInvalid(f"{source}: unknown key {dotted!r}")
        current = getattr(base, key)
        if isinstance(current, ServeConfig | LimitsConfig | EngineConfig | RegistryConfig):
            if not isinstance(value, dict):
                raise ConfigInvalid(f"{source}: {dotted!r} must be a table")
            changes[key] = _over(current, value, source, dotted + ".")
            continue
        want = type(current)
        if not _type_ok(want, value):
            wanted = "a list of strings" if want is tuple else want.__name__
            raise ConfigInvalid(f"{source}: {dotted!r} must be {wanted}, not {type(value).__name__}")
        check = _CHECKS.get(dotted)
        if check is not None:
            check(value, f"{source}: {dotted!r}")
        changes[key] = want(value)
    return replace(base, **changes)


def load_config(preset: str | None = None) -> Config:
    """The defaults, with `preset` (a name in configs/ or a path to a TOML file) over them, and the
    environment over both: $BANKML_CACHE_TYPE sets [engine] cache_type."""
    config = Config()
    if preset and preset != "default":
        source, table = _read(preset)
        config = _over(config, table, source, "")
    cache_type = os.environ.get("BANKML_CACHE_TYPE")
    if cache_type:
        _cache_type(cache_type, "BANKML_CACHE_TYPE")
        config = replace(config, engine=replace(config.engine, cache_type=cache_type))
    return config


# --- what serve runs with ------------------------------------------------------------------------


@dataclass(frozen=True)
class ServeOptions:
    """`bankml serve`'s options: `config` with every flag given written over its key, and what only the
    command line and the files it names add (the mode, the keys read, the template read). Nothing is
    copied: each setting is read from `config` (the properties)."""

    config: Config
    native: bool
    spawn: str | None
    receipt_key: ReceiptKey  # signs every receipt (bankml/signing.py)
    api_keys: tuple[str, ...] = ()  # none: no key is asked for
    allowed_origins: tuple[str, ...] = ()  # serialized origins, as browsers send them
    chat_template: ChatTemplateFile | None = None  # --native: the startup model's template, replaced

    @property
    def listen(self) -> tuple[str, int]:
        return parse_host_port(self.config.serve.listen, "--listen", any_port=True)

    @property
    def upstream(self) -> tuple[str, int]:
        """The --upstream address: P0's llama-server; see compat_listen."""
        return parse_host_port(self.config.serve.upstream, "--upstream", any_port=True)

    @property
    def cluster(self) -> tuple[str, int, int] | None:
        """--native across processes: (coordinator, processes, this one's id); None: one process."""
        e = self.config.engine
        return (e.coordinator, e.num_processes, e.process_id) if e.num_processes > 1 else None

    @property
    def compat_listen(self) -> tuple[str, int]:
        """--native: the second listener, for llama-server's clients (the --upstream flag names it)."""
        return self.upstream

    @property
    def threads(self) -> int:
        return self.config.serve.threads

    @property
    def ctx(self) -> int:
        return self.config.serve.ctx

    @property
    def keep_alive_s(self) -> float:
        """math.inf: forever: the default keep_alive of Ollama's API."""
        return parse_keep_alive(self.config.serve.keep_alive, "--keep-alive")

    @property
    def spec_ngram(self) -> bool:
        """P0: the spawned llama-server drafts n-grams (--spec-ngram, or --spec-type ngram-simple)."""
        return self.config.serve.spec_ngram or self.config.engine.spec_type == "ngram-simple"

    @property
    def spec_sizes(self) -> list[str]:
        """P0: llama-server's draft flags whose values differ from its defaults (which are ours), for a
        spawned llama-server that drafts n-grams."""
        e, d = self.config.engine, EngineConfig()
        return [arg for flag, key in (("--spec-ngram-size-n", "spec_ngram_size_n"),
                                      ("--spec-ngram-size-m", "spec_ngram_size_m"),
                                      ("--draft-max", "draft_max"), ("--draft-min", "draft_min"))
                if getattr(e, key) != getattr(d, key) for arg in (flag, str(getattr(e, key)))]

    @property
    def slot_dir(self) -> str | None:
        return self.config.serve.slot_dir or None

    @property
    def rule_set(self) -> str:
        return self.config.serve.rule_set

    @property
    def registry_dir(self) -> str | None:
        """--native: the directory of *.FORK.json pins (None: the startup model only)."""
        return self.config.registry.dir or None

    @property
    def max_loaded(self) -> int:
        """Models resident at once."""
        return self.config.registry.max_loaded

    @property
    def kv_events(self) -> KVEventsConfig | None:
        """--kv-events-config, checked (serve_options did); None: no events published."""
        text = self.config.serve.kv_events_config
        if not text:
            return None
        from model import kv_events

        config = kv_events.parse(text, self.listen[0])
        return config if config.on else None


def serve_options(config: Config, *, listen: str | None = None, upstream: str | None = None,
                  threads: int | None = None, ctx: int | None = None, keep_alive: str | None = None,
                  native: bool = False, spawn: str | None = None, spec_ngram: bool = False,
                  slot_dir: str | None = None, rule_set: str | None = None,
                  registry: str | None = None, api_keys: list[str] | None = None, api_key_file: str | None = None,
                  allow_origin: list[str] | None = None, chat_template_file: str | None = None,
                  receipt_key: str | None = None, spec_type: str | None = None,
                  spec_ngram_size_n: int | None = None, spec_ngram_size_m: int | None = None,
                  draft_max: int | None = None, draft_min: int | None = None, model_draft: str | None = None,
                  fork_draft: str | None = None, tensor_parallel: int | None = None, coordinator: str | None = None,
                  kv_events_config: str | None = None,
                  num_processes: int | None = None, process_id: int | None = None,
                  quiet: bool = False) -> ServeOptions:
    """The options from `config` and the flags given (None: not given). Raises ConfigInvalid for what
    this mode cannot honour, by name: P0's llama-server flags with --native, a registry without
    --native. The slot directory is made if it is missing. `registry`: the --registry directory ("" for
    a bare flag: $BANKML_FORKS, else ~/.local/share/bankml/forks); it must be a directory. The API
    keys (the flags' and the key file's), the allowed origins (the flags' over the config's) and the
    chat template file are read and checked here (bankml/serve_files.py), and the receipt key read, or made at the first start
    (bankml/signing.py). The speculative decoding flags (llama-server's --spec-type, --spec-ngram-size-n/-m,
    --draft-max/--draft-min) are written over [engine]'s keys; a draft model (--model-draft, --fork-draft)
    is refused: this engine drafts n-grams only, and P0's gate verifies only the model it serves."""
    from bankml import signing  # cryptography: only serve needs it

    s = config.serve
    registry_dir = config.registry.dir if registry is None else registry or default_registry_dir()
    if registry_dir and not native:
        raise ConfigInvalid("--registry / [registry] dir: serving every pinned model is --native's; P0 serves "
                            "the one model llama-server runs")
    if registry_dir:
        registry_dir = os.path.expanduser(registry_dir)
        if not os.path.isdir(registry_dir):
            raise ConfigInvalid(f"--registry {registry_dir}: not a directory")
    if native:
        given = [name for name, v in (("--spawn", spawn), ("--threads", threads), ("--spec-ngram", spec_ngram))
                 if v]
        if given:
            raise ConfigInvalid(f"{', '.join(given)}: llama-server's flags (P0); --native runs bankML's own engine"
                                + (" (its n-gram drafts: --spec-type ngram-simple)" if spec_ngram else ""))
    for flag, path in (("--model-draft", model_draft), ("--fork-draft", fork_draft)):
        if path is not None:
            raise ConfigInvalid(f"{flag}: a draft model is not in bankML yet (its engine drafts from the sequence's "
                                "own n-grams: --spec-type ngram-simple; P0 verifies only the model it serves)")
    if spec_type is not None and (why := spec_type_refusal(spec_type)):
        raise ConfigInvalid(why)
    for flag, value, check in (("--spec-ngram-size-n", spec_ngram_size_n, _positive),
                               ("--spec-ngram-size-m", spec_ngram_size_m, _positive),
                               ("--draft-max", draft_max, _draft_max), ("--draft-min", draft_min, _not_negative)):
        if value is not None:
            check(value, flag)
    if tensor_parallel is not None:
        _positive(tensor_parallel, "--tensor-parallel")
    split = tensor_parallel if tensor_parallel is not None else config.engine.tensor_parallel
    if split > 1 and not native:
        raise ConfigInvalid(f"--tensor-parallel {split} / [engine] tensor_parallel: bankML's own engine splits a model "
                            "over devices (--native); P0's llama-server splits with its own flags (--split-mode, "
                            "--tensor-split)")
    cluster = _cluster(config.engine, coordinator, num_processes, process_id)
    if cluster["num_processes"] > 1:
        if not native:
            raise ConfigInvalid("--num-processes: a model across processes is bankML's own engine's (--native)")
        if registry_dir:
            raise ConfigInvalid("--registry: a model across processes is the one startup model (every process "
                                "holds its share of it)")
    drafts = {"spec_type": spec_type, "spec_ngram_size_n": spec_ngram_size_n, "spec_ngram_size_m": spec_ngram_size_m,
              "draft_max": draft_max, "draft_min": draft_min, "tensor_parallel": tensor_parallel, **cluster}
    engine = replace(config.engine, **{k: v for k, v in drafts.items() if v is not None})
    chosen_slot_dir = slot_dir or s.slot_dir or None
    if chosen_slot_dir:  # made now, as llama-server's --slot-save-path is: a typo is refused at start
        chosen_slot_dir = os.path.expanduser(chosen_slot_dir)
        try:
            os.makedirs(chosen_slot_dir, exist_ok=True)
        except OSError as e:
            raise ConfigInvalid(f"--slot-dir {chosen_slot_dir}: {e.strerror or e}") from None
    template_path = s.chat_template_file if chat_template_file is None else chat_template_file
    if template_path and not native:
        raise ConfigInvalid("--chat-template-file / [serve] chat_template_file: the template is --native's (P0's "
                            "llama-server renders with its own; give it --chat-template-file)")
    keys = serve_files.flag_keys(api_keys)
    key_file = s.api_key_file if api_key_file is None else api_key_file
    if key_file:
        keys += serve_files.read_key_file(key_file, "--api-key-file" if api_key_file else "[serve] api_key_file")
    origins = (serve_files.parse_origins(allow_origin, "--allow-origin") if allow_origin
               else serve_files.parse_origins(list(s.allowed_origins), "[serve] allowed_origins"))
    keep_alive_text = s.keep_alive if keep_alive is None else keep_alive
    chosen_rule_set = s.rule_set if rule_set is None else rule_set
    _rule_set(chosen_rule_set, "--rule-set")
    parse_keep_alive(keep_alive_text, "--keep-alive")
    given = {"listen": listen or None, "upstream": upstream or None, "threads": threads, "ctx": ctx,
             "keep_alive": keep_alive, "rule_set": rule_set}
    serve = replace(s, **{k: v for k, v in given.items() if v is not None}, spec_ngram=spec_ngram or s.spec_ngram,
                    slot_dir=chosen_slot_dir or "", access_log=s.access_log and not quiet)
    parse_host_port(serve.listen, "--listen")  # a bad address is refused now, by its flag's name
    parse_host_port(serve.upstream, "--upstream")
    if kv_events_config is not None:
        serve = replace(serve, kv_events_config=kv_events_config)
    _kv_events(serve, native, registry_dir, "--kv-events-config" if kv_events_config else "[serve] kv_events_config")
    config = replace(config, serve=serve, engine=engine, registry=replace(config.registry, dir=registry_dir or ""))
    return ServeOptions(
        config=config,
        native=native,
        spawn=spawn,
        receipt_key=signing.server_key(s.receipt_key if receipt_key is None else receipt_key,
                                       "--receipt-key" if receipt_key else "[serve] receipt_key"),
        api_keys=tuple(dict.fromkeys(keys)),
        allowed_origins=origins,
        chat_template=serve_files.read_chat_template(template_path, "--chat-template-file") if template_path else None,
    )


def _kv_events(serve: ServeConfig, native: bool, registry_dir: str | None, what: str) -> None:
    """The KV events' JSON, checked against where the server listens; events are one model's (vLLM's stream
    names none: llm-d reads it from the topic), so the startup model's alone, and the native engine's."""
    if not serve.kv_events_config:
        return
    from model import kv_events  # no zmq until events are on

    try:
        config = kv_events.parse(serve.kv_events_config, parse_host_port(serve.listen, "--listen")[0], what)
    except ValueError as e:
        raise ConfigInvalid(str(e)) from None
    if config.on and not native:
        raise ConfigInvalid(f"{what}: KV events come from bankML's own prefix cache (--native); P0's "
                            "llama-server publishes none")
    if config.on and registry_dir:
        raise ConfigInvalid(f"{what}: the events name no model (a subscriber reads it from the topic), so they "
                            "are the startup model's alone: not with --registry")


def _cluster(engine: EngineConfig, coordinator: str | None, num_processes: int | None,
             process_id: int | None) -> dict[str, Any]:
    """The flags, else JAX's environment variables, else [engine]'s keys; checked together."""
    env = os.environ
    if coordinator is None:
        coordinator = env.get("JAX_COORDINATOR_ADDRESS", engine.coordinator)
    for name, value in (("JAX_NUM_PROCESSES", num_processes), ("JAX_PROCESS_ID", process_id)):
        if value is None and env.get(name, "").strip():
            try:
                int(env[name])
            except ValueError:
                raise ConfigInvalid(f"${name}={env[name]!r} is not an integer") from None
    if num_processes is None:
        num_processes = int(env.get("JAX_NUM_PROCESSES", "").strip() or engine.num_processes)
    if process_id is None:
        process_id = int(env.get("JAX_PROCESS_ID", "").strip() or engine.process_id)
    _positive(num_processes, "--num-processes")
    _not_negative(process_id, "--process-id")
    if num_processes > 1:
        if not coordinator:
            raise ConfigInvalid(f"--num-processes {num_processes}: --coordinator HOST:PORT is needed (process 0 "
                                "listens there, the others connect)")
        parse_host_port(coordinator, "--coordinator")
        if process_id >= num_processes:
            raise ConfigInvalid(f"--process-id {process_id} is not in 0..{num_processes - 1}")
    elif process_id:
        raise ConfigInvalid(f"--process-id {process_id} without --num-processes (more than 1)")
    elif coordinator:
        raise ConfigInvalid(f"--coordinator {coordinator} without --num-processes (more than 1): this process would "
                            "serve the whole model alone while the others wait for it")
    return {"coordinator": coordinator, "num_processes": num_processes, "process_id": process_id}


def default_registry_dir() -> str:
    """A bare --registry: $BANKML_FORKS, else ~/.local/share/bankml/forks."""
    return os.environ.get("BANKML_FORKS") or os.path.expanduser("~/.local/share/bankml/forks")
