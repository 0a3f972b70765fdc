"""`POST /api/embed` and the legacy `POST /api/embeddings`, as Ollama answers them (server/routes.go,
EmbedHandler and EmbeddingsHandler), top to bottom.

1. the body read once, off the loop (ollama_request.read_body); /api/embed's `input` (a string, or an
   array of strings: anything else is Ollama's 400 "invalid input type"), `truncate` (default true),
   `dimensions`; the legacy route's `prompt`; then `model` resolved as /api/chat resolves it (404),
   `keep_alive` and `options` read with /api/chat's rules (a derived model's num_ctx applies);
2. the model leased (verified and loaded if it was not resident; `load_duration` is that wait) and
   /api/ps's record updated; no input (or an empty prompt) only loads: an empty answer;
3. each input tokenized off the loop (special tokens parsed, BOS as the vocabulary says) and fitted
   to the context as Ollama fits it: the limit min(num_ctx, the model's context_length), less one for
   a missing BOS and one for a missing EOS; past it, cut (truncate true) or Ollama's 400;
4. all inputs embedded on the model's engine thread (gateway/serving/embeddings.py, shared with the
   OpenAI routes; model/embed.py), pooled as the GGUF says; /api/embed L2-normalizes each (Ollama's
   `normalize`, in float32), cuts it to `dimensions` and normalizes again; the legacy route returns
   the pooled vector as it is;
5. written as Go writes them (/api/embed's float32s in their shortest form, the legacy route's
   float64s), with a `bankml_receipt` whose response_sha256 is the sha256 of the `embeddings`
   (or `embedding`) value as written; then touch(keep_alive) once the lease is given back.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from typing import Any

import numpy as np

from bankml import jstr
from bankml.errors import EngineFailed, InvalidRequest
from gateway.http.errors import json_response
from gateway.ollama.request import keep_alive, read_body, read_options
from gateway.serving.embeddings import check_input_count, embed_all, embedding_shape, vector_json
from gateway.serving.layer import layer_num_ctx
from gateway.serving.receipt import Tally
from model.pooling import POOLING_NONE

TOO_LONG = "the input length exceeds the context length"  # Ollama's 400 with truncate false
NOTHING_LEFT = "input after truncation exceeds maximum context length"


class _Request:
    def __init__(self, doc: dict, state, legacy: bool):
        registry, n_ctx = state.registry, state.residency.ctx
        if legacy:
            prompt = doc.get("prompt")
            if prompt is not None and not isinstance(prompt, str):
                raise InvalidRequest("prompt must be a string")
            self.inputs = [prompt] if prompt else []
        else:
            self.inputs = _inputs(doc.get("input"))
            check_input_count(self.inputs)
        self.truncate = doc.get("truncate")
        if self.truncate is not None and not isinstance(self.truncate, bool):
            raise InvalidRequest("truncate must be true or false")
        dims = doc.get("dimensions")
        if dims is not None and (not isinstance(dims, int) or isinstance(dims, bool)):
            raise InvalidRequest("dimensions must be an integer")
        self.dimensions = dims or 0
        self.resolved = registry.resolve(doc.get("model"))
        self.keep_alive_s = keep_alive(doc.get("keep_alive"), state.residency.default_keep_alive_s)
        num_ctx = read_options(doc.get("options"), n_ctx).num_ctx
        if self.resolved.derived is not None and num_ctx is None:
            num_ctx = layer_num_ctx(self.resolved.derived.layer)
        self.num_ctx = min(num_ctx or n_ctx, n_ctx)
        info = self.resolved.pin.info
        if info is not None and info.context_length:
            self.num_ctx = min(self.num_ctx, info.context_length)


def _inputs(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value else []
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise InvalidRequest("invalid input type")


def fit(tokens: list[int], limit: int, truncate: bool, bos: int | None, eos: int | None) -> list[int]:
    """Ollama's EmbedHandler: the limit less one for a first token that is not BOS and one for a last
    that is not EOS (room for the ones its runner would add), then cut, or refused without truncate."""
    if tokens and tokens[0] != bos:
        limit -= 1
    if tokens and tokens[-1] != eos:
        limit -= 1
    if limit <= 0:
        raise EngineFailed(NOTHING_LEFT)
    if len(tokens) <= limit:
        return tokens
    if not truncate:
        raise InvalidRequest(TOO_LONG)
    return tokens[:limit]


def ollama_normalize(vec: np.ndarray) -> np.ndarray:
    """Ollama's normalize (server/routes.go): the sum of squares in float32, 1/max(sqrt, 1e-12)."""
    x = vec.astype(np.float32)
    total = np.float32(0.0)
    for v in (x * x):  # Go's loop order, in float32
        total = np.float32(total + v)
    norm = np.float32(1.0 / max(math.sqrt(float(total)), 1e-12))
    return x * norm


def go_float32(v: float) -> str:
    """strconv.FormatFloat(v, 'f' or 'e', -1, 32) as encoding/json writes a float32."""
    f = np.float32(v)
    if f == 0:
        return "-0" if np.signbit(f) else "0"
    a = abs(float(f))
    if a < 1e-6 or a >= 1e21:
        s = np.format_float_scientific(f, unique=True, trim="-", exp_digits=2)
        mant, exp = s.split("e")
        if exp.startswith("-0"):  # encoding/json: "clean up e-09 to e-9"
            exp = "-" + exp[2:]
        return f"{mant}e{exp}"
    return np.format_float_positional(f, unique=True, trim="-")


def float32_json(vec: np.ndarray) -> str:
    return "[" + ",".join(go_float32(v) for v in vec.tolist()) + "]"


async def embed(request, state):
    return await _answer(request, state, legacy=False)


async def embeddings(request, state):
    return await _answer(request, state, legacy=True)


async def _answer(request, state, legacy: bool):
    t0_ns = time.perf_counter_ns()
    body = request.body
    req = await asyncio.to_thread(lambda: _Request(read_body(body), state, legacy))
    residency = state.residency
    name = req.resolved.pin.name
    try:
        async with residency.lease(req.resolved.pin) as held:
            loaded = held.loaded
            residency.record_shown(name, req.resolved.tag, req.num_ctx, held.reloaded)
            if not req.inputs:  # Ollama: no input only loads
                return json_response('{"embedding": []}' if legacy else
                                     f'{{"model": {jstr.jstr(req.resolved.tag)}, "embeddings": []}}')
            tok = loaded.model.tokenizer
            bos, eos = getattr(tok, "bos_id", None), getattr(tok, "eos_id", None)

            def tokens_of() -> list[list[int]]:
                out = [loaded.model.tokenize(text, True, True) for text in req.inputs]
                if legacy:  # no truncation on the legacy route: too long is the runner's failure
                    for t in out:
                        if len(t) > req.num_ctx:
                            raise EngineFailed("input exceeds maximum context length")
                    return out
                return [fit(t, req.num_ctx, req.truncate is not False, bos, eos) for t in out]

            token_lists = await asyncio.to_thread(tokens_of)
            if (await embedding_shape(loaded)).pooling == POOLING_NONE:
                raise InvalidRequest("this model does not pool its embeddings (pooling type none)")
            tally = Tally.start(body, state.receipt_key)
            vectors = await embed_all(loaded, token_lists)
            n_tokens = sum(len(t) for t in token_lists)
            tally.prompt_tokens = n_tokens
            text = await asyncio.to_thread(_write, req, legacy, vectors, n_tokens, tally, loaded, t0_ns, held.load_ns)
            return json_response(text)
    finally:
        residency.touch(name, req.keep_alive_s)  # after the answer, as Ollama's scheduler does


def _write(req: _Request, legacy: bool, vectors: list[np.ndarray], n_tokens: int, tally: Tally, loaded,
           t0_ns: int, load_ns: int) -> str:
    if legacy:
        written = vector_json(vectors[0])  # float64(float32) values, unnormalized, as Go writes []float64
        receipt = _receipt(tally, loaded, written)
        return f'{{"embedding": {written}, "bankml_receipt": {jstr.dumps(receipt)}}}'
    rows = []
    for v in vectors:
        v = ollama_normalize(v)
        if 0 < req.dimensions < v.shape[0]:
            v = ollama_normalize(v[:req.dimensions])
        rows.append(float32_json(v))
    written = "[" + ",".join(rows) + "]"
    receipt = _receipt(tally, loaded, written)
    total_ns = time.perf_counter_ns() - t0_ns
    return (f'{{"model": {jstr.jstr(req.resolved.tag)}, "embeddings": {written}, "total_duration": {total_ns}, '
            f'"load_duration": {load_ns}, "prompt_eval_count": {n_tokens}, "bankml_receipt": {jstr.dumps(receipt)}}}')


def _receipt(tally: Tally, loaded, written: str) -> dict:
    return tally.receipt_for(loaded, hashlib.sha256(written.encode("utf-8")).hexdigest())
