"""The registry: every model bankml serve may answer with, and how a client's `model` name finds one.

Entry 0 is the startup model (the one bankml serve gated). The rest come from `DIR/*.FORK.json`, sorted:
each `files[]` entry whose path ends in `.gguf` is a pin, named by its stem (lower-cased, `.gguf`
dropped); the first pin of a name wins. A pinned file is looked for beside the startup model, then in DIR.

Building the registry reads headers only: the guard's bounded parser first (a file it refuses is never
read by anything else), then the verdict from what the header says -- architecture, tensor types,
tokenizer, chat template -- so /api/tags can list every pin with the reason it cannot play. Nothing is
hashed here: a file is verified (guard + sha256) when it is loaded (gateway/serving/residency.py).

`resolve` is spec §2's lookup: exact pin > derived model > alias (the name without a quantization
suffix, when exactly one pin has that base); anything else is a 404 naming what is served.
`v1_models_data` is the listing every dialect shares (/v1/models' `data`; Ollama's /api/tags lists the
same models, gateway/ollama/models.py): pins first, then the derived models whose base is here.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from bankml.errors import InvalidRequest, ModelNotFound
from bankml.guard import GGUFArray, Report, guard_file
from bankml.pin import pinned_sha256
from bankml.verify import GatedModel
from gateway.serving.derived import Derived, DerivedStore
from gateway.serving.request_fields import gguf_defaults
from kernels.supported_types import SUPPORTED_TYPES
from model.chat_template import TemplateError, _compile
from model.config import Config, UnsupportedModel
from model.messages import SamplingParams
from model.tokenizer_bpe import PRE_TOKENIZERS

log = logging.getLogger("bankml.gateway")

# spec §2 step 5: a pin answers to its name without one of these (the longer -q2_0_g64 before -q2_0)
ALIAS_SUFFIXES = ("-f16", "-bf16", "-f32", "-q1_0", "-q2_0_g64", "-q2_0", "-q8_0", "-q4_k_m", "-q4_0")
MAX_SHOWN_NAME = 200  # a client's name inside the 404 message is cut here


def model_name(text: str) -> str:
    """A pin's name: the file stem, lower-cased, `.gguf` dropped (any path before it ignored)."""
    name = text.strip().rsplit("/", 1)[-1].lower()
    return name[:-5] if name.endswith(".gguf") else name


def alias_base(name: str) -> str:
    """The name without its quantization suffix (the name itself when it has none)."""
    for suffix in ALIAS_SUFFIXES:
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)]
    return name


@dataclass(frozen=True)
class HeaderInfo:
    arch: str | None
    quantization_level: str  # most common non-F32 tensor type name, e.g. "Q4_1"
    parameter_size: str  # general.size_label, else counted: "135M", "1.7B"
    n_params: int
    context_length: int | None  # <arch>.context_length
    chat_template: str | None  # tokenizer.chat_template
    sampling: SamplingParams  # gguf_defaults(general.sampling.*)
    model_info: dict[str, Any]  # /api/show's: scalar header keys, sorted, no arrays, no chat template


@dataclass(frozen=True)
class Pin:
    name: str  # the resolution key: file stem lower-cased, ".gguf" dropped
    file_name: str  # the basename as pinned
    sha256: str  # pinned, lower hex ("" when the FORK.json has no valid one)
    fork_text: str  # the FORK.json's text (what gate_model verifies against)
    fork_path: str | None  # the FORK.json file, when there is one
    path: str | None  # the file, None: not on this machine
    size: int  # bytes (0: absent)
    modified_at: float  # mtime, unix seconds (0: absent)
    info: HeaderInfo | None  # None: absent, or the guard refused it
    native: bool  # this engine can play it
    reason: str | None  # why not

    @property
    def tag(self) -> str:
        return f"{self.name}:latest"


@dataclass(frozen=True)
class Resolved:
    pin: Pin  # the weights (a derived model's base)
    derived: Derived | None  # None for a pin
    tag: str  # what answers show as "model"


# --- header info -------------------------------------------------------------------------------------


def human_number(n: int) -> str:
    """A parameter count as Ollama's `ollama list` shows it: "135M", "1.7B", "8.0B" (format/format.go)."""
    for unit, scale in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            x = n / scale
            return f"{x:.0f}{unit}" if x >= 100 else f"{x:.1f}{unit}"
    return str(n)


def _f32_shortest(v: float) -> float:
    # the guard decodes f32 keys to Python floats; shown as Ollama shows a float32 (1e-05, not 9.99e-06)
    f = np.float32(v)
    return float(str(f)) if np.isfinite(f) and float(f) == v else v


def _scalar(v: Any) -> Any:
    return _f32_shortest(v) if isinstance(v, float) else v


def header_info(report: Report) -> HeaderInfo:
    """What /api/tags and /api/show say about a file, from the guard's parse of its header."""
    kv = report.metadata
    arch = report.arch
    non_f32 = Counter({t: c for t, c in report.types.items() if t != "F32"})
    quant = non_f32.most_common(1)[0][0] if non_f32 else "F32"
    n_params = sum(t.n_elements for t in report.tensor_infos)
    label = kv.get("general.size_label")
    ctx = kv.get(f"{arch}.context_length")
    template = kv.get("tokenizer.chat_template")
    info = {k: _scalar(v) for k, v in sorted(kv.items())
            if not isinstance(v, GGUFArray) and k != "tokenizer.chat_template"}
    return HeaderInfo(
        arch=arch,
        quantization_level=quant,
        parameter_size=label if isinstance(label, str) and label else human_number(n_params),
        n_params=n_params,
        context_length=int(ctx) if isinstance(ctx, int) and not isinstance(ctx, bool) else None,
        chat_template=template if isinstance(template, str) else None,
        sampling=gguf_defaults({k: v for k, v in kv.items() if k.startswith("general.sampling.")}),
        model_info=info,
    )


def native_reason(report: Report, chat_template: str | None = None) -> str | None:
    """Why this engine cannot play a file the guard passed (None: it can): arch, types, tokenizer, template.
    `chat_template`: the --chat-template-file that replaces the GGUF's (checked at start, so not here)."""
    kv = report.metadata
    try:
        Config.from_gguf(kv)  # the guard's arrays are counted, never decoded
    except UnsupportedModel as e:
        return str(e)
    except (TypeError, ValueError) as e:
        return f"the header's model configuration cannot be read: {e}"
    supported = SUPPORTED_TYPES
    bad = sorted({t.type_id for t in report.tensor_infos if t.type_id not in supported})
    if bad:
        first = next(t for t in report.tensor_infos if t.type_id == bad[0])
        names = ", ".join(supported.values())
        return (f"tensor {first.name} has type {first.type_name}, which bankml's engine does not support "
                f"(supported: {names})")
    model = kv.get("tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        return (f"unsupported tokenizer model {model!r}: this engine tokenizes 'gpt2' (byte-level BPE) "
                "and 'llama' (SentencePiece)")
    if model == "gpt2":
        pre = kv.get("tokenizer.ggml.pre") or "default"
        if pre not in PRE_TOKENIZERS:
            return f"unsupported pre-tokenizer {pre!r}: this engine runs {', '.join(sorted(PRE_TOKENIZERS))}"
    template = kv.get("tokenizer.chat_template")
    if chat_template is None and isinstance(template, str) and template:
        try:
            _compile(template)
        except TemplateError as e:
            return str(e)
    return None


def guard_reason(path: str, file_name: str, rule_set: str = "mainline") -> tuple[Report | None, str | None]:
    """The guard's report, or why there is none to trust (unreadable, truncated, refused)."""
    try:
        report = guard_file(path, rule_set=rule_set)
    except OSError as e:
        return None, f"cannot read {file_name}: {e.strerror or e}"
    if report.verdict == "need_more":
        return None, f"guard needs {report.bytes_needed} header bytes: file truncated"
    if report.verdict != "play":
        return None, "guard refused: " + "; ".join(report.reasons)
    return report, None


def make_pin(file_name: str, sha256: str | None, fork_text: str, fork_path: str | None,
             path: str | None, rule_set: str = "mainline", chat_template: str | None = None) -> Pin:
    """A pin with its header verdict. `sha256` None: the FORK.json has no valid record for the file.
    `chat_template`: a --chat-template-file's text, in force instead of the GGUF's (the startup model's)."""
    name = model_name(file_name)
    reason = None if sha256 else f"{file_name} has no sha256 record in FORK.json: unpinned, refused"
    size, mtime, info = 0, 0.0, None
    if path is not None:
        try:
            st = os.stat(path)
            size, mtime = st.st_size, st.st_mtime
        except OSError:
            path = None
    if path is None:
        reason = reason or f"{file_name} is pinned but not on this machine"
    else:
        report, why = guard_reason(path, file_name, rule_set)
        if report is not None:
            info = header_info(report)
            if chat_template is not None:
                info = replace(info, chat_template=chat_template)
            why = native_reason(report, chat_template)
        reason = reason or why
    return Pin(name, file_name, sha256 or "", fork_text, fork_path, path, size, mtime, info, reason is None,
               reason)


def _fork_files(fork_text: str) -> list[str]:
    """The `files[].path` entries of a FORK.json that end in `.gguf`, in order."""
    try:
        doc = json.loads(fork_text)
    except ValueError:
        return []
    files = doc.get("files") if isinstance(doc, dict) else None
    if not isinstance(files, list):
        return []
    return [e["path"] for e in files if isinstance(e, dict) and isinstance(e.get("path"), str)
            and e["path"].lower().endswith(".gguf")]


# --- the registry --------------------------------------------------------------------------------


class Registry:
    def __init__(self, startup: GatedModel | None, directory: str | None, rule_set: str = "mainline",
                 chat_template: str | None = None):
        """`startup` None (`bankml create`, which serves nothing): the pins are DIR's only. `chat_template`:
        the --chat-template-file's text, which replaces the startup model's template (only its)."""
        self.directory = directory
        self.rule_set = rule_set
        self.pins: list[Pin] = []
        beside = directory or ""
        if startup is not None:
            given = startup.given or startup.path
            beside = os.path.dirname(os.path.abspath(given))
            self.pins.append(make_pin(os.path.basename(given), startup.verified.model_sha256,
                                      startup.fork_text, startup.fork_path, startup.path, rule_set,
                                      chat_template))
        seen = {p.name for p in self.pins}
        for fork_path in sorted(glob.glob(os.path.join(glob.escape(directory), "*.FORK.json"))) if directory else []:
            try:
                with open(fork_path, encoding="utf-8") as f:
                    text = f.read()
            except (OSError, UnicodeDecodeError) as e:
                log.warning("%s skipped: %s", fork_path, e)
                continue
            entries = _fork_files(text)
            if not entries:
                log.warning("%s pins no .gguf file: skipped", fork_path)
            for entry in entries:
                file_name = os.path.basename(entry)
                name = model_name(file_name)
                if not name or name in seen:
                    continue
                seen.add(name)
                found = [p for p in (os.path.join(beside, file_name), os.path.join(directory, file_name))
                         if os.path.isfile(p)]
                # the load pins the basename (bankml.pin.pin), so the record must be under it
                self.pins.append(make_pin(file_name, pinned_sha256(text, file_name), text, fork_path,
                                          found[0] if found else None, rule_set))
        self.derived = DerivedStore(directory)
        self.derived.load(self.pins)

    @property
    def startup(self) -> Pin:
        return self.pins[0]

    def pin(self, name: str) -> Pin | None:
        return next((p for p in self.pins if p.name == name), None)

    def names(self) -> list[str]:
        return [p.name for p in self.pins]

    def resolve_openai(self, text: Any) -> Resolved:
        """`model` on /v1 and llama-server's routes: as `resolve`, except that a server of one model (no
        other pin, no derived model) answers any name with it, as llama-server does: its clients send
        "gpt-3.5-turbo" or "davinci-002" and expect the one model to answer. With several models a name
        must say which (404 otherwise), as Ollama's and vLLM's OpenAI routes decide."""
        try:
            return self.resolve(text)
        except ModelNotFound:
            if len(self.pins) == 1 and not self.derived.all():
                return Resolved(self.startup, None, self.startup.tag)
            raise

    def resolve(self, text: Any) -> Resolved:
        """A client's `model` name to the weights that answer it (spec §2, Resolution)."""
        if not isinstance(text, str) or not text.strip():
            return Resolved(self.startup, None, self.startup.tag)
        name = text.strip().rsplit("/", 1)[-1].lower()
        name = name.removesuffix(":latest").removesuffix(".gguf")
        exact = self.pin(name)
        if exact is not None:
            return Resolved(exact, None, exact.tag)
        d = self.derived.get(name)
        if d is not None:
            base = self.derived.base_pin(d)  # by name, else by file (as the store binds it)
            if base is None:
                raise InvalidRequest(f"derived model '{d.name}' is built on '{d.base_name}', which is not in "
                                     "the registry")
            return Resolved(base, d, d.tag)
        key = alias_base(name)
        matches = [p for p in self.pins if alias_base(p.name) == key]
        if len(matches) == 1:
            return Resolved(matches[0], None, matches[0].tag)
        raise self.not_found(text)

    def not_found(self, text: str) -> ModelNotFound:
        """The 404 of a name that resolves to nothing: the name as sent (cut), and what is served."""
        known = self.names() + [d.name for d in self.derived.all()]
        shown = text if len(text) <= MAX_SHOWN_NAME else text[:MAX_SHOWN_NAME]
        return ModelNotFound(f"model '{shown}' not found: bankml serves pinned models only ({', '.join(known)})")


def derived_with_base(registry: Registry) -> list[tuple[Derived, Pin]]:
    """Every derived model whose base is in the registry, with that base, in the store's order."""
    out = []
    for d in registry.derived.all():
        base = registry.derived.base_pin(d)
        if base is not None:
            out.append((d, base))
    return out


def v1_models_data(registry: Registry) -> list[dict]:
    """/v1/models' `data`: every pin by its file name, then every derived model by its tag."""
    data = [{"id": p.file_name, "object": "model", "owned_by": "bankML"} for p in registry.pins]
    data += [{"id": d.tag, "object": "model", "owned_by": "bankML"} for d, _ in derived_with_base(registry)]
    return data
