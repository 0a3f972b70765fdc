"""Derived models: a manifest `<registry>/<name>.MODEL.json` that layers a Modelfile's settings over a pinned base.

A derived model holds no weights. `create` parses the Modelfile (gateway/serving/modelfile.py), resolves FROM (a pin, a
derived model whose layer it inherits, a unique alias, or a pinned GGUF's path), verifies the base (the guard, then
its sha256 against its FORK.json), merges the layer and writes the manifest atomically. The manifest's `digest` is
the sha256 of the exact text of its `layer` (the Rust bankml's separators, key order, f32 floats and escaping),
so a copy has the same digest and a hand-edited manifest is refused each time it is read; the base is bound by
its sha256, so a pin that changed since refuses the derived model too. A request for a derived model loads its
base (residency is keyed by the base); gateway/serving/layer.py applies the layer to the request body as Ollama
applies a model's SYSTEM, MESSAGEs and PARAMETERs (server/routes.go), and to /api/show.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from bankml import __version__
from bankml.errors import BankmlError, InvalidRequest, ModelNotFound
from bankml.jstr import jstr
from bankml.pin import pinned_sha256
from bankml.verify import gate_model
from gateway.http.timestamps import created_at_ns
from gateway.serving.modelfile import (
    PARAMETERS,
    ModelSpec,
    check_as_request,
    f32,
    format_number,
    parse_modelfile,
    spec_from_request,
)

log = logging.getLogger("bankml.gateway")

KIND = "bankml derived model (a layer over a pinned base; no weights)"
MANIFEST_SUFFIX = ".MODEL.json"
# One manifest's most bytes: a derived model's SYSTEM, MESSAGEs, LICENSEs and stops fit in far less; a bigger
# file is refused when created and skipped (with a warning) when read, so no listing parses megabytes
MAX_MANIFEST_BYTES = 1 << 20
_NAME = re.compile(r"[a-z0-9._-]{1,128}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
SAFETENSORS_REFUSED = ("converting safetensors is out of scope for bankml serve (convert the model to GGUF with "
                       "llama.cpp's convert_hf_to_gguf.py, pin it with `bankml fork`, then FROM it)")
TEMPLATE_REFUSED = ("TEMPLATE: bankml renders the base's own chat template (the GGUF's tokenizer.chat_template); a "
                    "different template (Ollama's are Go templates) would change every prompt and is not reproduced. "
                    "Leave TEMPLATE out, or give the base's own byte for byte")


@dataclass(frozen=True)
class Layer:
    """The manifest's "layer" (spec §3.1): what a derived model changes, over the base it is bound to."""

    base_sha256: str
    system: str = ""
    parameters: Mapping[str, int | float] = field(default_factory=dict)  # PARAMETER keys but stop; f32 floats
    stop: tuple[str, ...] = ()
    template_sha256: str = ""
    license: tuple[str, ...] = ()
    messages: tuple[Mapping[str, str], ...] = ()  # {"role", "content"}
    requires: str = ""


@dataclass(frozen=True)
class Derived:
    name: str
    created_at: str
    base_name: str
    base_file: str
    base_sha256: str
    base_fork: str
    base_path: str
    layer: Layer
    digest: str  # "sha256:<hex>"
    manifest_path: str

    @property
    def tag(self) -> str:
        return f"{self.name}:latest"


# --- the manifest's text ----------------------------------------------------------------------------------


def _opt(s: str | None) -> str:
    # the Rust bankml writes an absent string as null
    return jstr(s) if s else "null"


def _strings(items: Any) -> str:
    return "[" + ", ".join(jstr(s) for s in items) + "]"


def layer_text(layer: Layer) -> str:
    """The exact text of a layer, as the digest is taken over it: `", "` and `": "`, this key order, floats in
    the shortest form that reads back as the same f32, ints bare, only `"`, `\\` and controls escaped."""
    params = ", ".join(f"{jstr(k)}: {format_number(v)}" for k, v in layer.parameters.items())
    messages = ", ".join(f'{{"role": {jstr(m["role"])}, "content": {jstr(m["content"])}}}' for m in layer.messages)
    return (f'{{"base_sha256": {jstr(layer.base_sha256)}, "system": {_opt(layer.system)}, '
            f'"parameters": {{{params}}}, "stop": {_strings(layer.stop)}, '
            f'"template_sha256": {_opt(layer.template_sha256)}, "license": {_strings(layer.license)}, '
            f'"messages": [{messages}], "requires": {_opt(layer.requires)}}}')


def layer_digest(layer: Layer) -> str:
    return "sha256:" + hashlib.sha256(layer_text(layer).encode("utf-8")).hexdigest()


def manifest_text(d: Derived) -> str:
    """The whole manifest file, laid out as the Rust bankml writes it."""
    base = (f'{{"name": {jstr(d.base_name)}, "file": {jstr(d.base_file)}, "sha256": {jstr(d.base_sha256)}, '
            f'"fork": {jstr(d.base_fork)}, "path": {jstr(d.base_path)}}}')
    return (f'{{\n "kind": {jstr(KIND)},\n "bankml": {jstr(__version__)},\n "name": {jstr(d.name)},\n'
            f' "created_at": {jstr(d.created_at)},\n "base": {base},\n "layer": {layer_text(d.layer)},\n'
            f' "digest": {jstr(d.digest)}\n}}\n')


def _sorted_parameters(params: Mapping[str, int | float]) -> dict[str, int | float]:
    order = list(PARAMETERS)
    return {k: params[k] for k in sorted(params, key=order.index)}


def _layer_from_json(raw: Any, where: str) -> tuple[Layer, str]:
    """A manifest's layer object back to a Layer, and the canonical text of what the file says (null and ""
    kept apart, so a manifest the Rust bankml wrote checks against its own digest)."""
    if not isinstance(raw, dict):
        raise InvalidRequest(f"{where}: no layer object")

    def string(key: str) -> str | None:
        v = raw.get(key)
        if v is not None and not isinstance(v, str):
            raise InvalidRequest(f"{where}: layer.{key} is not a string")
        return v

    def strings(key: str) -> tuple[str, ...]:
        v = raw.get(key, [])
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise InvalidRequest(f"{where}: layer.{key} is not a list of strings")
        return tuple(v)

    params: dict[str, int | float] = {}
    for k, v in (raw.get("parameters") or {}).items():
        if k not in PARAMETERS or isinstance(v, bool) or not isinstance(v, (int, float)):
            raise InvalidRequest(f"{where}: layer.parameters.{k} is not a parameter bankml reproduces")
        params[k] = int(v) if PARAMETERS[k] else f32(float(v))
    messages = raw.get("messages", [])
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise InvalidRequest(f"{where}: layer.messages is not a list of {{role, content}}")
    base_sha256 = string("base_sha256") or ""
    system, template, requires = string("system"), string("template_sha256"), string("requires")
    layer = Layer(base_sha256, system or "", params, strings("stop"), template or "", strings("license"),
                  tuple({"role": m["role"], "content": m["content"]} for m in messages), requires or "")
    text = layer_text(layer)
    # a "" the Rust bankml wrote (SYSTEM "") is not the null layer_text writes for it: keep what the file says
    for key, value in (("system", system), ("template_sha256", template), ("requires", requires)):
        if value == "":
            text = text.replace(f'"{key}": null', f'"{key}": ""', 1)
    return layer, text


def _too_big(file: str, size: int) -> InvalidRequest:
    return InvalidRequest(f"{file} is {size} bytes, more than a derived model's manifest may hold "
                          f"({MAX_MANIFEST_BYTES}): refused")


def read_manifest(path: str) -> Derived:
    """A manifest read back and its digest checked against its layer: a mismatch is a hand edit, refused;
    one over MAX_MANIFEST_BYTES is refused unread."""
    file = os.path.basename(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_MANIFEST_BYTES:
                raise _too_big(file, size)
            raw = f.read(MAX_MANIFEST_BYTES + 1)
    except OSError as e:
        raise InvalidRequest(f"{file}: cannot read it: {e.strerror or e}") from e
    if len(raw) > MAX_MANIFEST_BYTES:  # grew since the fstat
        raise _too_big(file, len(raw))
    try:
        doc = json.loads(raw.decode("utf-8"))
    except ValueError as e:  # UnicodeDecodeError is one
        raise InvalidRequest(f"{file} is not JSON ({e}): edited by hand, refused — create it again") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("base"), dict):
        raise InvalidRequest(f"{file} is not a derived model's manifest, refused — create it again")
    base = doc["base"]
    layer, text = _layer_from_json(doc.get("layer"), file)
    want = "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()
    got = doc.get("digest")
    if got != want or layer.base_sha256 != base.get("sha256"):
        raise InvalidRequest(f"{file} was edited by hand, refused — create it again (its digest {got} is not "
                             f"its layer's {want})")
    name = doc.get("name")
    if not isinstance(name, str) or name + MANIFEST_SUFFIX != file:
        raise InvalidRequest(f"{file} names another model ({name!r}): renamed by hand, refused — create it again")
    fields_ = {k: base.get(k) for k in ("name", "file", "sha256", "fork", "path")}
    if not all(isinstance(v, str) for v in fields_.values()) or not _HEX64.fullmatch(fields_["sha256"]):
        raise InvalidRequest(f"{file}: its base record is incomplete, refused — create it again")
    return Derived(name, str(doc.get("created_at", "")), fields_["name"], fields_["file"], fields_["sha256"],
                   fields_["fork"], fields_["path"], layer, want, os.path.abspath(path))


def write_manifest(d: Derived) -> None:
    """Written atomically: `<name>.MODEL.json.part`, then renamed over the manifest."""
    part = d.manifest_path + ".part"
    try:
        # a stale `.part` (a symlink planted to point outside the registry, say) is removed, never followed
        if os.path.lexists(part):
            os.unlink(part)
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
        with open(fd, "w", encoding="utf-8") as f:
            f.write(manifest_text(d))
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, d.manifest_path)
    except OSError as e:
        raise InvalidRequest(f"cannot write {d.manifest_path}: {e.strerror or e}") from e


# --- names and the store -----------------------------------------------------------------------------------


def normalize_name(text: str) -> str:
    """A requested name as a derived model is filed: trimmed, `:latest` dropped, lower-cased."""
    return text.strip().removesuffix(":latest").lower()


def check_name(text: Any) -> str:
    """A new derived model's name (spec §3.1): 1-128 of [a-z0-9._-] after `:latest` is stripped and it is
    lower-cased, not starting with `.` or `-`, not ending `.gguf`."""
    if not isinstance(text, str):
        raise InvalidRequest("model: name the model to create")
    name = normalize_name(text)
    if not _NAME.fullmatch(name) or name[0] in ".-" or name.endswith(".gguf"):
        shown = repr(text) if len(text) <= 160 else f"{text[:160]!r}… ({len(text)} characters)"
        raise InvalidRequest(f"model name {shown}: use 1 to 128 letters, digits, '.', '_' and '-' (not starting "
                             "with '.' or '-', not ending in .gguf; no tag but :latest)")
    return name


class DerivedStore:
    """The derived models of a registry directory. Each manifest is parsed once per file identity (device,
    inode, size, mtime): a manifest edited or replaced after start-up is read again, and refused, at the next
    request, and one unchanged costs a stat, never a parse (a listing of megabytes of manifests stalled the
    event loop for seconds). The base check runs on every read, against the registry's pins."""

    def __init__(self, directory: str | None):
        self.directory = directory
        self._pins: list[Any] = []
        self._warned: set[tuple[str, int]] = set()
        # path -> (its identity when read, what reading it gave: the Derived or the refusal)
        self._parsed: dict[str, tuple[tuple[int, int, int, int], Derived | BankmlError]] = {}
        self._lock = threading.Lock()  # the loop and worker threads read through it

    def load(self, pins: list[Any]) -> None:
        """Bind to the registry's pins and read every manifest once, warning about the ones refused."""
        self._pins = list(pins)
        for d in self.all():
            log.info("derived model %s over %s (%s)", d.name, d.base_file, d.digest)

    def path(self, name: str) -> str | None:
        return os.path.join(self.directory, name + MANIFEST_SUFFIX) if self.directory else None

    def get(self, name: str) -> Derived | None:
        """The derived model of that name, checked; None if there is none. A manifest edited by hand, too
        big, or whose base pin changed, raises InvalidRequest."""
        n = normalize_name(name) if isinstance(name, str) else ""
        path = self.path(n) if _NAME.fullmatch(n) else None
        if path is None:
            return None
        d = self._read(path)
        if d is None:
            return None
        self._check_base(d)
        return d

    def all(self) -> list[Derived]:
        """Every derived model that reads back and binds, sorted by name; the others are skipped with a warning."""
        if not self.directory:
            return []
        out = []
        paths = sorted(glob.glob(os.path.join(glob.escape(self.directory), "*" + MANIFEST_SUFFIX)))
        with self._lock:
            for gone in set(self._parsed) - set(paths):  # deleted or renamed: forgotten
                del self._parsed[gone]
        for path in paths:
            try:
                d = self._read(path)
                if d is None:
                    continue
                self._check_base(d)
            except BankmlError as e:
                self._warn(path, e.message)
                continue
            out.append(d)
        return sorted(out, key=lambda d: d.name)

    def _read(self, path: str) -> Derived | None:
        """The manifest at `path`, parsed once per identity (None: no such file). Raises its refusal."""
        try:
            st = os.stat(path)
        except OSError:
            return None
        if not stat.S_ISREG(st.st_mode):
            return None
        identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        with self._lock:
            cached = self._parsed.get(path)
        if cached is None or cached[0] != identity:
            try:
                result: Derived | BankmlError = read_manifest(path)
            except BankmlError as e:
                result = e
            cached = (identity, result)
            with self._lock:
                self._parsed[path] = cached
        result = cached[1]
        if isinstance(result, BankmlError):
            raise type(result)(result.message, **result.extra)  # a fresh copy: one instance gathers tracebacks
        return result

    def _warn(self, path: str, message: str) -> None:
        try:
            key = (path, os.stat(path).st_mtime_ns)
        except OSError:
            key = (path, 0)
        if key not in self._warned:
            self._warned.add(key)
            log.warning("skipping %s: %s", path, message)

    def base_pin(self, d: Derived) -> Any:
        return (next((p for p in self._pins if p.name == d.base_name), None)
                or next((p for p in self._pins if p.file_name == d.base_file), None))

    def _check_base(self, d: Derived) -> None:
        pin = self.base_pin(d)
        if pin is None:
            raise InvalidRequest(f"{d.name}: its base {d.base_file} (sha256 {d.base_sha256}) is not pinned in the "
                                 "registry any more, refused — pin it again, or create the model again")
        if pin.sha256 != d.base_sha256:
            raise InvalidRequest(f"{d.name}: its base {d.base_file} was sha256 {d.base_sha256} when it was created; "
                                 f"the pin in the registry now says {pin.sha256 or 'nothing'} — refused, create it "
                                 "again")


# --- create, copy, delete ----------------------------------------------------------------------------------


MAX_SHOWN_FROM = 200  # a FROM longer than this is cut in a refusal (as registry.MAX_SHOWN_NAME cuts a name)


def _is_path(value: str) -> bool:
    """What the CLI's FROM takes for a file (spec §3.3)."""
    return "/" in value or value.startswith(".") or value.lower().endswith(".gguf")


def _looks_like_a_file(value: str) -> bool:
    """A server's FROM that could only be read as a file, never a model's name: a separator, a leading `.`
    or `~`, a NUL (a pin's file name, `X.gguf`, is a name /v1/models lists: it resolves)."""
    v = value.strip()
    return "/" in v or "\\" in v or "\0" in v or v.startswith((".", "~"))


def _fork_name(registry: Any, pin: Any) -> str:
    """The FORK.json that pins the base: its file name when it is in the registry directory, else its path."""
    candidates = [pin.fork_path] if pin.fork_path else []
    if not candidates and registry.directory:  # a pin read without its file's path: look for it in DIR
        for path in sorted(glob.glob(os.path.join(glob.escape(registry.directory), "*.FORK.json"))):
            try:
                with open(path, encoding="utf-8") as f:
                    if pinned_sha256(f.read(), pin.file_name) == pin.sha256:
                        candidates.append(path)
            except (OSError, UnicodeDecodeError):
                continue
    if not candidates:
        raise InvalidRequest(f"{pin.file_name}: its FORK.json is not in the registry directory; a derived model "
                             "records its base's pin there (copy the FORK.json that pins it into that directory)")
    fork = os.path.abspath(candidates[0])
    inside = registry.directory and os.path.dirname(fork) == os.path.abspath(registry.directory)
    return os.path.basename(fork) if inside else fork


def _not_served(registry: Any, value: str) -> InvalidRequest:
    """The one refusal of a FROM that names no model this server serves: it echoes only what was sent, so a
    client learns nothing of the server's files (whether a path exists, its home, its working directory)."""
    return InvalidRequest(f"FROM {_shown_from(value)}: {registry.not_found(value).message}")


def _shown_from(value: str) -> str:
    return value if len(value) <= MAX_SHOWN_FROM else f"{value[:MAX_SHOWN_FROM]}… ({len(value)} characters)"


def _resolve_from(registry: Any, value: str, base_dir: str | None) -> tuple[Any, Derived | None]:
    """FROM to (the base pin, the derived model it inherits from or None), spec §3.3. `base_dir` None (a
    server's /api/create and /api/copy): FROM names a model the server serves (a pin, a derived model, an
    alias), anything else -- a path, existing or not -- is the one refusal `_not_served`. `base_dir` given
    (`bankml create` on the user's own machine): a path names a pinned GGUF, relative to base_dir."""
    if base_dir is None:
        if _looks_like_a_file(value):
            raise _not_served(registry, value)
    elif _is_path(value):
        return _pin_at_path(registry, value, base_dir), None
    try:
        resolved = registry.resolve(value)
    except ModelNotFound:
        raise _not_served(registry, value) from None
    except BankmlError as e:  # a derived model refused (edited by hand, its base changed)
        raise InvalidRequest(f"FROM {_shown_from(value)}: {e.message}") from None
    return resolved.pin, resolved.derived


def _pin_at_path(registry: Any, value: str, base_dir: str) -> Any:
    """The pin a local path names (the CLI's FROM ./x.gguf, relative to the Modelfile)."""
    if "\0" in value:  # os.path.expanduser("~a\0b") raises ValueError: a 500
        raise InvalidRequest(f"FROM {value!r}: no such file (a path holds no NUL character)")
    path = os.path.expanduser(value)
    if not os.path.isabs(path):
        path = os.path.join(base_dir, path)
    if os.path.isdir(path):
        raise InvalidRequest(f"FROM {value}: a directory: {SAFETENSORS_REFUSED}")
    if not os.path.isfile(path):
        raise InvalidRequest(f"FROM {value}: no such file ({path})")
    file = os.path.basename(path)
    pin = next((p for p in registry.pins if p.file_name == file), None)
    if pin is None:
        raise InvalidRequest(f"FROM {value}: {file} is not pinned in the registry — bankml layers only on "
                             "pinned files (pin it with `bankml fork`, its FORK.json in the registry directory)")
    if pin.path is None or not os.path.samefile(path, pin.path):
        where = pin.path or "nowhere on this machine"
        raise InvalidRequest(f"FROM {value}: the registry's {file} is {where}; FROM that file, or by its name "
                             f"{pin.name}")
    return pin


def _merge(spec: ModelSpec, parent: Layer | None, base_sha256: str, template_sha256: str) -> Layer:
    """This spec's layer over the parent's: new values win, stop and messages replaced as lists, licences unioned."""
    p = parent or Layer(base_sha256)
    params = {**p.parameters, **spec.parameters}
    license = list(p.license)
    license += [x for x in spec.license if x not in license]
    return Layer(
        base_sha256=base_sha256,
        system=spec.system if spec.system is not None else p.system,
        parameters=_sorted_parameters(params),
        stop=tuple(spec.stop) if spec.stop is not None else p.stop,
        template_sha256=template_sha256 or p.template_sha256,
        license=tuple(license),
        messages=tuple(spec.messages) if spec.messages is not None else p.messages,
        requires=spec.requires if spec.requires is not None else p.requires,
    )


def _spec(spec: str | Mapping[str, Any] | ModelSpec) -> ModelSpec:
    if isinstance(spec, ModelSpec):
        return spec
    if isinstance(spec, str):
        return parse_modelfile(spec)
    return spec_from_request(spec)


def _check_size(d: Derived) -> None:
    size = len(manifest_text(d).encode("utf-8"))
    if size > MAX_MANIFEST_BYTES:
        raise InvalidRequest(f"{d.name}: its manifest would be {size} bytes, more than a derived model's may hold "
                             f"({MAX_MANIFEST_BYTES}): shorten its SYSTEM, MESSAGEs, LICENSEs or stops")


def create(registry: Any, name: str, spec: str | Mapping[str, Any] | ModelSpec, ctx: int | None = None, *,
           base_dir: str | None = None) -> Iterator[str]:
    """Create (or replace) the derived model `name`, yielding Ollama's status lines as it goes (spec §3.3).

    `spec` is a Modelfile's text, the structured form of `/api/create`, or a ModelSpec; `ctx` the context the
    server holds (a larger num_ctx is accepted with a warning). `base_dir` None (the server's routes): FROM names
    a model the server serves, and nothing else; given (`bankml create`): FROM may also be a pinned GGUF's path,
    relative to it. The layer is checked as a request's fields are and its manifest's size bounded before the
    base is verified; nothing is written unless the base verified. Raises InvalidRequest."""
    if not registry.directory:
        raise InvalidRequest("bankml serve was started without --registry: a derived model is written beside the "
                             "pins of the registry directory")
    n = check_name(name)
    if registry.pin(n) is not None:
        raise InvalidRequest(f"{n} is a pinned model's name (its file's); a derived model needs its own — e.g. "
                             f"{n}-persona")
    parsed = _spec(spec)
    yield "parsing modelfile"
    pin, parent = _resolve_from(registry, parsed.from_, base_dir)
    if pin.path is None:
        raise InvalidRequest(f"FROM {_shown_from(parsed.from_)}: {pin.file_name} is pinned but not on this machine")
    if not pin.native:
        raise InvalidRequest(f"FROM {_shown_from(parsed.from_)}: {pin.file_name} cannot be played by bankml: {pin.reason}")
    template_sha256 = ""
    if parsed.template is not None:
        if pin.info is None or pin.info.chat_template != parsed.template:
            raise InvalidRequest(TEMPLATE_REFUSED)
        template_sha256 = hashlib.sha256(parsed.template.encode("utf-8")).hexdigest()
    # the layer over the sha256 the registry pins: a base that verifies as anything else is refused below
    layer = _merge(parsed, parent.layer if parent else None, pin.sha256, template_sha256)
    check_as_request(layer.parameters, layer.stop)
    fork = _fork_name(registry, pin)
    d = Derived(n, created_at_ns(time.time_ns()), pin.name, pin.file_name, pin.sha256, fork, pin.path, layer,
                layer_digest(layer), os.path.abspath(registry.derived.path(n)))
    _check_size(d)
    yield f"verifying {pin.file_name} (the guard, then its sha256 against {fork})"
    try:
        gated = gate_model(pin.path, pin.fork_text, getattr(registry, "rule_set", "mainline"), pin.fork_path)
    except BankmlError as e:
        raise InvalidRequest(f"FROM {_shown_from(parsed.from_)}: refuse: {e.message}") from e
    sha = gated.verified.model_sha256
    if sha != pin.sha256:
        raise InvalidRequest(f"FROM {_shown_from(parsed.from_)}: {pin.file_name} verified as {sha}, the registry "
                             f"pins {pin.sha256}: refused")
    yield f"using existing layer sha256:{sha}"
    num_ctx = layer.parameters.get("num_ctx")
    if ctx is not None and num_ctx is not None and num_ctx > ctx:
        log.warning("bankml create: %s asks num_ctx %d; this server holds %d — its requests are refused until "
                    "bankml serve runs with --ctx %d", n, num_ctx, ctx, num_ctx)
    if layer.system:
        yield "creating system layer"
    if layer.parameters or layer.stop:
        yield "creating parameters layer"
    if layer.license:
        yield "creating license layer"
    if layer.messages:
        yield "creating messages layer"
    d = dataclasses.replace(d, base_path=gated.path)
    _check_size(d)
    yield f"writing manifest {n}{MANIFEST_SUFFIX} (digest {d.digest})"
    write_manifest(d)
    yield "success"


def copy(registry: Any, source: Any, destination: Any) -> None:
    """`POST /api/copy`: create `destination` FROM `source` and nothing else (a pin's copy is an empty layer; a
    derived model's copy has its layer, so its digest)."""
    if not isinstance(source, str) or not source.strip():
        raise InvalidRequest("source: name the model to copy")
    if not isinstance(destination, str) or not destination.strip():
        raise InvalidRequest("destination: name the copy")
    for _ in create(registry, destination, ModelSpec(from_=source.strip())):
        pass


def delete(registry: Any, name: Any) -> None:
    """`DELETE /api/delete`: a derived model's manifest removed; a pin refused (400); anything else 404."""
    if not isinstance(name, str) or not name.strip():
        raise InvalidRequest("model: name the model to delete")
    n = normalize_name(name)
    pin = registry.pin(n)
    if pin is None:
        path = registry.derived.path(n) if _NAME.fullmatch(n) else None
        if path is not None and os.path.isfile(path):
            try:
                os.remove(path)
            except OSError as e:
                raise InvalidRequest(f"cannot delete {path}: {e.strerror or e}") from e
            return
        try:
            pin = registry.resolve(name).pin  # an alias of a pin is a pin too
        except ModelNotFound:
            raise ModelNotFound(f"model '{name}' not found") from None
    raise InvalidRequest(f"{pin.name} is a pinned model (its FORK.json pins {pin.file_name}): bankml does not "
                         "delete pins over HTTP; remove the file and its FORK.json by hand")


__all__ = ["Layer", "Derived", "DerivedStore", "create", "copy", "delete", "check_name", "layer_text", "layer_digest",
           "read_manifest"]
