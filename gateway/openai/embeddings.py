"""`POST /v1/embeddings` (OpenAI's shape), `/embedding` and `/embeddings` (llama-server's own), top to bottom.

1. read the JSON off the loop, as llama-server reads it (tools/server/server-context.cpp,
   `handle_embeddings_impl`): `input`, else `content` (which also makes the answer llama-server's
   own shape, even on /v1), else its 400; `encoding_format` "float" or "base64"; `embd_normalize`
   (default 2); `dimensions` refused unless it is the model's n_embd (llama-server ignores it, and
   a client that asks for fewer dimensions would get vectors it did not ask for);
2. the model: /v1/embeddings resolves `model` as /v1/chat/completions does (404 for an unknown name);
   /embedding and /embeddings name none and use the current model; either is leased for the answer;
3. the inputs tokenized off the loop as llama-server's `tokenize_input_prompts` does (a string, a
   token list, a list of those, a string/token mix in one prompt), special tokens parsed, BOS as the
   vocabulary says; each input checked as llama-server checks a task (empty, too large for its
   physical batch, past the context);
4. the inputs embedded on the model's engine thread (gateway/serving/embeddings.py, shared with Ollama's
   routes; model/embed.py through `Engine.embed`), batched, up to 16 of similar length per call so
   decode steps run between calls; pooled as the GGUF says
   (a model without `<arch>.pooling_type`: mean, as `llama-server --pooling mean`; b11434 without
   `--pooling` pools such a model as none and refuses this OAI route, recorded);
5. normalized as llama-server's `send_embedding` does (common_embd_normalize, only when pooled; the
   OAI route always Euclidean) and written: OpenAI's `{"model", "object", "usage", "data"}`, or
   llama-server's list `[{"index", "embedding": [[...]]}]`. The receipt's response_sha256 is the sha256
   of the vectors as written (module `vectors_json`); one receipt for the OAI body, one per answer
   object in llama-server's list (a list has no place for a single one).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
from typing import Any

import numpy as np

from bankml import jstr
from bankml.errors import InvalidRequest, NotSupported, RequestFailed
from gateway.http.body import parse_body
from gateway.http.errors import json_response
from gateway.http.json_values import type_name
from gateway.serving.embeddings import check_input_count, embed_all, embedding_shape, vector_json
from gateway.serving.native_model import NativeModel
from gateway.serving.prompt_input import tokenize_input_prompts
from gateway.serving.receipt import Tally
from gateway.serving.residency import FOREVER
from model.pooling import POOLING_NONE

N_UBATCH = 512  # llama-server's default physical batch (--ubatch-size): a pooled input must fit in one


# --- reading ---------------------------------------------------------------------------------------------


def _type_error(expected: str, v: Any) -> InvalidRequest:
    # a json exception while reading the body is llama-server's 400 (recorded: embeddings_smollm2.json)
    return InvalidRequest(f"[json.exception.type_error.302] type must be {expected}, but is {type_name(v)}")


def _nlohmann_int(v: Any) -> int:
    """`int x = json` as nlohmann converts it: numbers truncated, booleans 0/1, anything else its type_error.
    A number past a C int is undefined behaviour in llama-server's static_cast: ours is a 400 naming the
    field (it was nlohmann's "type must be number, but is number" for one past 64 bits)."""
    if isinstance(v, bool | int | float) and not isinstance(v, bool) and not -2**31 <= v < 2**31:
        raise InvalidRequest(f"'embd_normalize' must be an int (-1 none, 0 max absolute, 1 taxicab, 2 Euclidean, "
                             f"p > 2 a p-norm), got {v!r}")
    if isinstance(v, bool | int):
        return int(v)
    if isinstance(v, float) and v == v:
        return int(v)
    raise _type_error("number", v)


def input_prompts(model: NativeModel, value: Any) -> list[list[int]]:
    """llama-server's tokenize_input_prompts (gateway/serving/prompt_input.py, shared with /completion), its empty
    list's 400 naming "input"."""
    return tokenize_input_prompts(model, value, "input")


def empty_input(model: NativeModel) -> list[int]:
    """An input of no tokens (an empty string on a model that adds no BOS, as SmolLM2) is embedded as the
    model's BOS token, else its EOS: llama-server answers 200 with a vector for it, and a client embedding
    a list of documents should not fail on an empty one."""
    tok = model.tokenizer
    for special in (tok.bos_id, tok.eos_id):
        if special is not None:
            return [special]
    raise InvalidRequest("Input content cannot be empty")


def check_task(tokens: list[int], n_ctx: int, n_vocab: int) -> None:
    """What llama-server refuses of one embedding task before it runs (server-context.cpp): an empty input,
    a token outside the vocabulary, and one that does not fit in a physical batch (a pooled embedding is
    never split, nor is one with pooling none): its default 512 tokens, or the context when that is
    smaller (llama-context.cpp clamps n_ubatch to n_batch, and n_batch to n_ctx; recorded with -c 256)."""
    if not tokens:
        raise InvalidRequest("Input content cannot be empty")
    if any(t < 0 or t >= n_vocab for t in tokens):
        raise InvalidRequest("Prompt contains invalid tokens")
    n_ubatch = min(N_UBATCH, n_ctx)
    if len(tokens) > n_ubatch:
        raise RequestFailed(f"input ({len(tokens)} tokens) is too large to process. increase the physical batch "
                            f"size (current batch size: {n_ubatch})")


# --- normalizing and writing ----------------------------------------------------------------------------


def normalize(vec: np.ndarray, mode: int) -> np.ndarray:
    """common_embd_normalize (common/common.cpp): -1 none, 0 max-abs scaled to int16's range, 2 Euclidean,
    any other p-norm (1 taxicab); the sum in double, the products and the result in float."""
    x = vec.astype(np.float32)
    if mode == -1:
        total = 1.0
    elif mode == 0:
        total = float(np.max(np.abs(x))) / 32760.0 if x.size else 0.0
    elif mode == 2:
        total = float(np.sqrt(np.sum((x * x).astype(np.float64))))
    else:
        total = float(np.sum(np.power(np.abs(x).astype(np.float64), mode))) ** (1.0 / mode) if mode else 0.0
    norm = np.float32(1.0 / total) if total > 0.0 else np.float32(0.0)
    return x * norm


def base64_of(vec: np.ndarray) -> str:
    """llama-server's base64: the float32 bytes, little-endian, as OpenAI's client decodes them."""
    return base64.b64encode(vec.astype("<f4").tobytes()).decode("ascii")


def vectors_sha256(written: list[str]) -> str:
    """The OAI receipt's response_sha256: the `embedding` values as written (JSON texts: arrays, or base64
    strings in quotes) joined as one JSON array, `[v0,v1,...]`."""
    return hashlib.sha256(("[" + ",".join(written) + "]").encode("utf-8")).hexdigest()


# --- the request ------------------------------------------------------------------------------------------


class EmbeddingRequest:
    """The body read as llama-server reads it, before any model work."""

    def __init__(self, doc: Any, oai: bool):
        if not isinstance(doc, dict):  # nlohmann's count()/contains() on a non-object: neither field
            doc = {}
        self.doc = doc
        if "input" in doc:
            self.prompt = doc["input"]
        elif "content" in doc:
            self.prompt, oai = doc["content"], False  # "content" is not OAI compatible
        else:
            raise InvalidRequest('"input" or "content" must be provided')
        check_input_count(self.prompt, "input" if "input" in doc else "content")
        self.oai = oai
        self.base64 = False
        if "encoding_format" in doc:
            fmt = doc["encoding_format"]
            if not isinstance(fmt, str):
                raise _type_error("string", fmt)
            if fmt == "base64":
                self.base64 = True
            elif fmt != "float":
                raise InvalidRequest("The format to return the embeddings in. Can be either float or base64")
        self.normalize = _nlohmann_int(doc["embd_normalize"]) if "embd_normalize" in doc else 2
        self.dimensions = doc.get("dimensions")


async def oai_embeddings(request, state):
    """`POST /v1/embeddings`."""
    doc = await asyncio.to_thread(parse_body, request.body)
    resolved = state.registry.resolve_openai(doc.get("model") if isinstance(doc, dict) else None)
    return await _answer(request, state, doc, True, resolved.pin)


async def embedding(request, state):
    """`POST /embedding` and `/embeddings`: llama-server's own shape (even with `input`, as it answers them);
    no model name (the current model)."""
    doc = await asyncio.to_thread(parse_body, request.body)
    loaded = await state.residency.current()
    return await _answer(request, state, doc, False, loaded.pin)


async def _answer(request, state, doc: Any, oai: bool, pin):
    req = EmbeddingRequest(doc, oai)
    async with state.residency.lease(pin) as held:
        loaded = held.loaded
        model = loaded.model
        token_lists = await asyncio.to_thread(input_prompts, model, req.prompt)
        shape = await embedding_shape(loaded)
        pooling = shape.pooling
        if req.oai and pooling == POOLING_NONE:
            raise InvalidRequest("Pooling type 'none' is not OAI compatible. Please use a different pooling type")
        check_dimensions(req.dimensions, shape.n_embd)
        token_lists = [tokens or empty_input(model) for tokens in token_lists]
        for tokens in token_lists:
            check_task(tokens, model.n_ctx, shape.n_vocab)
        tally = Tally.start(request.body, state.receipt_key)
        vectors = await embed_all(loaded, token_lists)
        text = await asyncio.to_thread(_write, req, loaded, token_lists, vectors, pooling, tally)
        state.residency.touch(pin.name, FOREVER)  # spec §2: llama-server's routes keep their model forever
        return json_response(text)


def check_dimensions(dimensions: Any, n_embd: int) -> None:
    """OpenAI's `dimensions`: honoured only as the model's own size (a shortened vector is not what the
    model gives)."""
    if dimensions is None:
        return
    if dimensions != n_embd or isinstance(dimensions, bool):
        raise NotSupported(f"dimensions: this model's embeddings have {n_embd} dimensions, and bankml serve --native "
                           "does not shorten them (llama-server would ignore the field)")


def _write(req: EmbeddingRequest, loaded, token_lists: list[list[int]], vectors: list[np.ndarray], pooling: int,
           tally: Tally) -> str:
    n_tokens = sum(len(t) for t in token_lists)
    if req.oai:
        # the OAI route: pooled (checked above), normalized by embd_normalize (default Euclidean)
        written = [jstr.jstr(base64_of(normalize(v, req.normalize))) if req.base64
                   else vector_json(normalize(v, req.normalize)) for v in vectors]
        tally.prompt_tokens = n_tokens
        tally_receipt = tally.receipt_for(loaded, vectors_sha256(written))
        items = []
        for i, w in enumerate(written):
            extra = ', "encoding_format": "base64"' if req.base64 else ""
            items.append(f'{{"embedding": {w}, "index": {i}, "object": "embedding"{extra}}}')
        model = req.doc.get("model")
        shown = model if isinstance(model, str) else loaded.file_name
        return (f'{{"model": {jstr.jstr(shown)}, "object": "list", "usage": {{"prompt_tokens": {n_tokens}, '
                f'"total_tokens": {n_tokens}}}, "data": [{", ".join(items)}], '
                f'"bankml_receipt": {jstr.dumps(tally_receipt)}}}')
    out = []
    for i, (tokens, v) in enumerate(zip(token_lists, vectors, strict=True)):
        if pooling == POOLING_NONE:  # one vector per token, never normalized (send_embedding)
            w = "[" + ",".join(vector_json(row) for row in v) + "]"
        else:
            w = "[" + vector_json(normalize(v, req.normalize)) + "]"
        one = Tally(tally.request_sha256, tally.key, tally.t0, prompt_tokens=len(tokens))
        receipt = one.receipt_for(loaded, hashlib.sha256(w.encode("utf-8")).hexdigest())
        out.append(f'{{"index": {i}, "embedding": {w}, "bankml_receipt": {jstr.dumps(receipt)}}}')
    return "[" + ", ".join(out) + "]"

