"""The model an OpenAI or llama-server request is for, with a derived model's layer over its body."""

from __future__ import annotations

from bankml.errors import InvalidRequest
from gateway.serving.layer import apply_openai, layer_num_ctx


def resolve_for(state, doc, by_name: bool):
    """The model a request is for (`model` when `by_name`, else the startup model, as llama-server serves
    its one model), the body with a derived model's layer over it, and the context its prompt must fit in
    (a derived model's num_ctx above --ctx is a 400)."""
    resolved = state.registry.resolve_openai(doc.get("model") if by_name and isinstance(doc, dict) else None)
    n_ctx = state.residency.ctx
    if resolved.derived is not None and isinstance(doc, dict):
        layer = resolved.derived.layer
        doc = apply_openai(layer, doc)
        num_ctx = layer_num_ctx(layer)
        if num_ctx is not None and num_ctx > n_ctx:
            raise InvalidRequest(f"num_ctx {num_ctx} is larger than the context this server holds ({n_ctx}); "
                                 f"restart bankml serve with --ctx {num_ctx} if it fits in memory")
        n_ctx = min(n_ctx, num_ctx or n_ctx)
    return resolved, doc, n_ctx


def shown_name(loaded, resolved) -> str:
    """The answer's `model`: the file's name, or the derived model's tag it was asked by."""
    return loaded.file_name if resolved.derived is None else resolved.tag
