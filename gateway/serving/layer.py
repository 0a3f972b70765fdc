"""A derived model's layer (gateway/serving/derived.py) at work: applied to a request body as Ollama applies a
model's SYSTEM, MESSAGEs and PARAMETERs (server/routes.go), to `/api/chat`, `/api/generate` and
`/v1/chat/completions`; and what `/api/show` says of a derived model (its Modelfile, parameters, layer)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bankml import __version__
from bankml.jstr import jstr
from gateway.serving.derived import Derived, Layer
from gateway.serving.modelfile import format_number, render_modelfile

# --- applying a layer to a request -------------------------------------------------------------------------


def _msg(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


def _chat_messages(layer: Layer, messages: list) -> list:
    """Ollama's rule: the layer's MESSAGEs before the request's; its SYSTEM first unless the request's first
    message is a system message."""
    out: list = [_msg(m["role"], m["content"]) for m in layer.messages] + list(messages)
    first = messages[0] if messages else None
    if layer.system and not (isinstance(first, Mapping) and first.get("role") == "system"):
        out.insert(0, _msg("system", layer.system))
    return out


def apply_ollama(layer: Layer, kind: str, body: dict) -> dict:
    """A new `/api/chat` (kind "chat") or `/api/generate` body with the layer applied (spec §3.3): its parameters
    are defaults under `options` the request overrides key by key (`stop` as a whole list); chat messages by
    Ollama's rule; a generate that is not raw gets `bankml_messages` (system, MESSAGEs, the prompt as user)."""
    out = {k: v for k, v in body.items() if k != "bankml_messages"}
    options = body.get("options")
    if options is None:
        options = {}
    if isinstance(options, dict):  # anything else is left for the options check to refuse
        merged: dict[str, Any] = {k: v for k, v in layer.parameters.items() if options.get(k) is None}
        if layer.stop and options.get("stop") is None:
            merged["stop"] = list(layer.stop)
        merged.update({k: v for k, v in options.items() if not (v is None and k in merged)})
        if merged or "options" in body:
            out["options"] = merged
    if kind == "chat":
        messages = body.get("messages")
        if isinstance(messages, list) and messages:
            out["messages"] = _chat_messages(layer, messages)
    elif body.get("raw") is not True:
        system = body.get("system")
        system = system if isinstance(system, str) and system else layer.system
        prompt = body.get("prompt")
        out["bankml_messages"] = ([_msg("system", system)] if system else []) + [
            _msg(m["role"], m["content"]) for m in layer.messages] + [_msg("user", prompt if isinstance(prompt, str)
                                                                           else "")]
    return out


def apply_openai(layer: Layer, body: dict) -> dict:
    """A new `/v1/chat/completions` body with the layer applied: the same message rule; the parameters fill
    absent or null top-level fields (num_predict >= 0 becomes max_tokens unless max_tokens or n_predict is
    set). The layer's num_ctx is not a /v1 field: `layer_num_ctx` gives it to the route to fit the prompt."""
    out = dict(body)

    def absent(key: str) -> bool:
        return out.get(key) is None

    for k, v in layer.parameters.items():
        if k == "num_ctx":
            continue
        if k == "num_predict":
            if v >= 0 and absent("max_tokens") and absent("n_predict"):
                out["max_tokens"] = v
        elif absent(k):
            out[k] = v
    if layer.stop and absent("stop"):
        out["stop"] = list(layer.stop)
    messages = body.get("messages")
    if isinstance(messages, list):
        out["messages"] = _chat_messages(layer, messages)
    return out


def layer_num_ctx(layer: Layer) -> int | None:
    """The layer's num_ctx (the context a request for it is fitted to; above --ctx, a 400)."""
    v = layer.parameters.get("num_ctx")
    return int(v) if v is not None else None


# --- /api/show ---------------------------------------------------------------------------------------------


def modelfile_of(d: Derived) -> str:
    """The Modelfile `ollama show --modelfile` prints for a derived model: FROM its base, by name."""
    header = (f"bankml {__version__}: derived model {d.name} (digest {d.digest}), a layer over the pinned base "
              f"{d.base_name} (sha256 {d.base_sha256}),\nverified before every load\n"
              f"To build a new Modelfile based on this, replace FROM with:\nFROM {d.tag}")
    layer = d.layer
    return render_modelfile(d.base_name, system=layer.system, parameters=layer.parameters, stop=layer.stop,
                            license=layer.license, messages=layer.messages, requires=layer.requires, header=header)


def parameters_text(layer: Layer) -> str:
    """`/api/show`'s `parameters`: one `key value` line each, keys padded to 30, the stops quoted (Ollama's)."""
    lines = [f"{k:<30} {format_number(v)}" for k, v in layer.parameters.items()]
    lines += [f"{'stop':<30} {jstr(s)}" for s in layer.stop]
    return "\n".join(lines)


def show_fields(d: Derived) -> dict:
    """What `/api/show` adds to or replaces in its base's answer for a derived model. Top-level keys replace
    the base's (`modelfile`, `parameters`, `modified_at`, and `system`, `license`, `messages` when the layer has
    them); `bankml` is a dict to merge key by key into the base's (`bankml.layer`). `details.parent_model` is
    the base's tag, which /api/show sets itself."""
    layer = d.layer
    out: dict[str, Any] = {"modelfile": modelfile_of(d), "parameters": parameters_text(layer),
                           "modified_at": d.created_at}
    if layer.system:
        out["system"] = layer.system
    if layer.license:
        out["license"] = "\n".join(layer.license)
    if layer.messages:
        out["messages"] = [dict(m) for m in layer.messages]
    out["bankml"] = {"layer": {"derived": True, "digest": d.digest, "base_sha256": d.base_sha256,
                               "base_fork": d.base_fork}}
    return out


__all__ = ["apply_ollama", "apply_openai", "layer_num_ctx", "modelfile_of", "parameters_text", "show_fields"]
