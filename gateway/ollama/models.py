"""Ollama's model listing routes: GET /api/version, /api/tags, /api/ps and POST /api/show (spec §1.5).

Every answer comes from the registry (gateway/serving/registry.py): pins in registry order, then derived
models (gateway/serving/derived.py). A pin's digest is its bare sha256; a derived model's is
"sha256:<layer digest>", its size and details are its base's, with `parent_model` naming the base.
/api/ps lists what residency holds, most recently used first, under the name the last request used.
/v1/models' `data` (gateway/serving/registry.py, `v1_models_data`) lists the same models in OpenAI's shape.
Key orders are Ollama's (api/types.go), since clients and tests compare the bytes.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

from bankml import __version__, jstr
from bankml.errors import BankmlError, InvalidRequest, ModelNotFound
from gateway.http.body import parse_body
from gateway.http.errors import json_response
from gateway.http.timestamps import created_at
from gateway.serving.derived import Derived
from gateway.serving.layer import show_fields
from gateway.serving.registry import Pin, Registry, derived_with_base, model_name
from gateway.serving.request_fields import gguf_defaults

FOREVER_S = 292 * 365 * 86400  # Ollama shows a model kept forever as expiring in 292 years
PIN_STOP = "<|im_end|>"  # /api/show's parameters name this stop for every pin (spec §1.5)
# ShowResponse's field order (api/types.go), then ours
SHOW_ORDER = ("license", "modelfile", "parameters", "template", "system", "details", "messages", "model_info",
              "capabilities", "modified_at", "bankml")


def _num(v: Any) -> str:
    # a float as Go prints a float32 (%v: shortest form), an int as itself
    return str(np.float32(v)) if isinstance(v, float) else str(v)


def details(pin: Pin, parent_model: str = "") -> dict:
    info = pin.info
    arch = info.arch if info else None
    return {"parent_model": parent_model, "format": "gguf", "family": arch or "",
            "families": [arch] if arch else None,
            "parameter_size": info.parameter_size if info else "",
            "quantization_level": info.quantization_level if info else ""}


def _bankml_listing(pin: Pin) -> dict:
    return {"native": pin.native, "reason": pin.reason, "file": pin.file_name, "found": pin.path is not None}


def tag_entry(pin: Pin) -> dict:
    return {"name": pin.tag, "model": pin.tag, "modified_at": created_at(pin.modified_at), "size": pin.size,
            "digest": pin.sha256, "details": details(pin), "bankml": _bankml_listing(pin)}


def tags_body(registry: Registry) -> dict:
    models = [tag_entry(p) for p in registry.pins]
    for d, base in derived_with_base(registry):
        models.append({"name": d.tag, "model": d.tag, "modified_at": d.created_at, "size": base.size,
                       "digest": d.digest, "details": details(base, base.tag), "bankml": _bankml_listing(base)})
    return {"models": models}


# --- /api/show ---------------------------------------------------------------------------------------


def pin_parameters(pin: Pin) -> list[tuple[str, str]]:
    s = pin.info.sampling if pin.info else gguf_defaults({})
    return [("temperature", _num(s.temperature)), ("top_k", _num(s.top_k)), ("top_p", _num(s.top_p)),
            ("min_p", _num(s.min_p)), ("stop", jstr.dumps(PIN_STOP))]


def show_pin(pin: Pin, n_ctx: int | None) -> dict:
    params = pin_parameters(pin)
    modelfile = "\n".join([
        f"# bankml {__version__}: a pinned model (sha256 {pin.sha256}), verified before every load; not editable",
        f"FROM {pin.path or pin.file_name}",
        *(f"PARAMETER {k} {v}" for k, v in params),
    ]) + "\n"
    info = pin.info
    return {
        "modelfile": modelfile,
        "parameters": "\n".join(f"{k} {v}" for k, v in params),
        "template": (info.chat_template or "") if info else "",
        "details": details(pin),
        "model_info": dict(info.model_info) if info else {},
        "capabilities": ["completion"] if pin.native else [],
        "modified_at": created_at(pin.modified_at),
        "bankml": {"sha256": pin.sha256, "native": pin.native, "n_ctx": n_ctx},
    }


def show_derived(d: Derived, base: Pin, n_ctx: int | None) -> dict:
    """The base's answer with what the derived model changes (gateway/serving/layer.py's show_fields)."""
    out = show_pin(base, n_ctx)
    out["details"] = details(base, base.tag)
    out["modified_at"] = d.created_at
    for key, value in show_fields(d).items():
        if key == "bankml":
            out["bankml"] = {**out["bankml"], **value}
        else:
            out[key] = value
    return {k: out[k] for k in SHOW_ORDER if k in out} | {k: v for k, v in out.items() if k not in SHOW_ORDER}


def _n_ctx(state, pin: Pin) -> int | None:
    """The context the pin answers with: the resident engine's, else the server's --ctx."""
    for rec in state.residency.ps():
        if rec.loaded.pin.name == pin.name:
            return int(rec.loaded.model.n_ctx)
    return state.residency.ctx


# --- /api/ps -----------------------------------------------------------------------------------------


def ps_entry(registry: Registry, rec: Any, now: float) -> dict:
    pin = rec.loaded.pin
    shown, digest, parent = pin.tag, pin.sha256, ""
    name = model_name(rec.shown_as.removesuffix(":latest"))
    if name != pin.name:
        try:
            d = registry.derived.get(name)
        except BankmlError:  # tampered, or its base changed: shown as the weights it runs on
            d = None
        if d is not None and d.base_name == pin.name:
            shown, digest, parent = d.tag, d.digest, pin.tag
    expires = now + FOREVER_S if rec.expires_at is None else rec.expires_at
    return {"name": shown, "model": shown, "size": rec.loaded.size_bytes, "digest": digest,
            "details": details(pin, parent), "expires_at": created_at(expires),
            "size_vram": rec.loaded.vram_bytes, "context_length": rec.context_length}


# --- the handlers --------------------------------------------------------------------------------------


async def version(request, state):
    return json_response(jstr.dumps({"version": __version__, "bankml": True}))


async def tags(request, state):
    # off the loop: each derived model's manifest is read (and its digest checked) from disk
    return json_response(jstr.dumps(await asyncio.to_thread(tags_body, state.registry)))


async def ps(request, state):
    records, now = state.residency.ps(), time.time()
    entries = await asyncio.to_thread(lambda: [ps_entry(state.registry, r, now) for r in records])
    return json_response(jstr.dumps({"models": entries}))


def show_body(state, raw: bytes) -> dict:
    """POST /api/show's answer; any failure is a ModelNotFound (spec §1.5: a 404)."""
    try:
        body = parse_body(raw)
        if not isinstance(body, dict):
            raise InvalidRequest("body is not a JSON object")
        text = body.get("model") or body.get("name")
        if not isinstance(text, str) or not text.strip():
            raise InvalidRequest("model is required")
        resolved = state.registry.resolve(text)
    except ModelNotFound:
        raise
    except BankmlError as e:
        raise ModelNotFound(e.message) from None
    pin = resolved.pin
    n_ctx = _n_ctx(state, pin)
    return show_pin(pin, n_ctx) if resolved.derived is None else show_derived(resolved.derived, pin, n_ctx)


async def show(request, state):
    """POST /api/show: `model` (or `name`), a pin or a derived model (off the loop: it reads the manifest)."""
    return json_response(jstr.dumps(await asyncio.to_thread(show_body, state, request.body)))
