"""bankML's own route `GET /bankml` (the native keys): what was verified, and what is resident.

"models" are the registry's names; "resident" the most recently used resident model, "loaded" every
resident one, most recently used first. Only when started with them: "chat_template_sha256" and
"chat_template_file" (the --chat-template-file in force for the startup model), "api_keys" (how many
keys are asked for, never which), "allowed_origins" (admitted besides the server's own origin),
"speculation" (the resident engine's speculative decoding: --spec-type and its sizes). Only for a
signed model: "model_signer" (who signed the most recently verified file: bankml/model_signature.py).

It answers from the most recent verification, so a client (sAGI's models.py reads
`verified.model_sha256` and `model`) can check what it is talking to before it asks anything. The
status page shows the same dict (`bankml_info`). "weights" is the engine's own report of its weights
(layout, device bytes against the file's, which kernel runs each op: model/engine.py `weights_report`). /bankml/usage, /bankml/metrics, /bankml/status and
/metrics are the monitor's (monitor_routes.py).

`GET /bankml/receipt-key` (native and P0) is the public half of the key every receipt is signed with:
`key_id`, `algorithm` ("ed25519"), `public_key` (PEM) and `public_key_raw` (base64 of its 32 bytes).
"""

from __future__ import annotations

from typing import Any

from bankml import jstr
from gateway.http import liveness
from gateway.http.errors import json_response
from gateway.monitor.answer_metrics import KEEP  # noqa: F401  (P0 answers with the ring's size)


def bankml_info(state) -> dict[str, Any]:
    res = state.residency
    last = res.last
    loaded = [r.name for r in res.resident()]
    access = getattr(state, "access", None)
    return {
        "verified": last.verified.as_dict() if last else None,
        "model": last.path if last else None,
        "upstream": state.compat_listen,  # the Rust bankml's key for the second address
        "engine": last.backend if last else None,  # the Rust bankml's key for the inference backend
        "hashed_at": last.hashed_at if last else 0,
        "resident": loaded[0] if loaded else None,
        "models": res.names,
        "weights": (weights := _weights_report(state)),
        **({"mesh": weights["mesh"]} if weights and "mesh" in weights else {}),
        "cache_type": _cache_type(state),
        "loaded": loaded,  # bankml's own key, after the Rust bankml's
        **({"model_signer": last.verified.model_signer} if last and last.verified.model_signer else {}),
        **_edge(res, access),
        **_speculation(res),
        **_health(res),
    }


def _speculation(res) -> dict[str, Any]:
    """bankml's own "speculation", only while the most recently used engine drafts: its [engine] keys
    (--spec-type, --spec-ngram-size-n/-m, --draft-max/--draft-min)."""
    recent = res.most_recent()
    spec = recent.client.speculation if recent is not None else None
    if spec is None or not spec.on:
        return {}
    return {"speculation": {"spec_type": spec.spec_type, "spec_ngram_size_n": spec.ngram_n,
                            "spec_ngram_size_m": spec.ngram_m, "draft_max": spec.draft_max,
                            "draft_min": spec.draft_min}}


def _health(res) -> dict[str, Any]:
    """bankml's own "health" (the server's, once it serves): "ok", or "wedged" and why (what /health's
    503 says), and the loop's worker threads (gateway/http/liveness.py)."""
    live = liveness.serving()
    return {"health": live.report(res.resident())} if live is not None else {}


def _edge(res, access) -> dict[str, Any]:
    """Keys only a server started with them has (the Rust bankml's shape stays as it is without)."""
    out: dict[str, Any] = {}
    template = getattr(res, "chat_template", None)
    if template is not None:  # a --chat-template-file in force for the startup model: it changes every prompt
        out["chat_template_sha256"], out["chat_template_file"] = template.sha256, template.path
    if access is not None and access.key_digests:  # how many keys are asked for, never which
        out["api_keys"] = len(access.key_digests)
    if access is not None and access.allowed_origins:  # admitted besides the server's own origin
        out["allowed_origins"] = sorted(access.allowed_origins)
    return out


def _cache_type(state) -> str | None:
    """What the most recently used engine's KV pages hold ([engine] cache_type: "f16", "q8_0"); None
    without an engine."""
    recent = state.residency.most_recent()
    return recent.client.cache_type if recent is not None else None


def _weights_report(state) -> dict[str, Any] | None:
    """The most recently used engine's weights/kernels report, or None (no engine,
    or an engine that does not report: the tests' fakes)."""
    recent = state.residency.most_recent()
    return recent.client.weights_report() if recent is not None else None


async def bankml(request, state):
    return json_response(jstr.dumps(bankml_info(state)))


async def receipt_key(request, state):
    return json_response(jstr.dumps(state.receipt_key.public_info()))
