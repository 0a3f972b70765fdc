"""The embedding core both dialects share (OpenAI's and llama-server's in gateway/openai/embeddings.py,
Ollama's in gateway/ollama/embed.py): how many inputs one request may hold, the inputs embedded on the
model's engine thread in batches, and a vector written as nlohmann writes a std::vector<float>.

Each engine call runs between two decode iterations (the handle's `embed`, model/embed.py through
`Engine.embed`); PER_CALL inputs of similar length at a time, so a request of many inputs never stalls
the streams beside it. An engine thread that is gone is a 503, an input the engine refuses a 400.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, TypeVar

import numpy as np

from bankml.errors import EngineGone, InvalidRequest
from gateway.serving.engine_handle import EmbeddingShape
from gateway.serving.prompt_input import prompt_count
from model.engine_thread import EngineThreadFailed
from model.pooling import EmbedError

PER_CALL = 16  # inputs per engine call (model/embed.py's largest batch)
# ours (llama-server has no bound): the inputs of one request, as OpenAI's embeddings API caps them
# ("any array must be 2048 dimensions or less"); counted on the JSON before the model is held or any
# input tokenized, so a body of 100k one-word inputs is a 400 at once
MAX_INPUTS = 2048

T = TypeVar("T")


def check_input_count(value: Any, field: str = "input") -> None:
    """At most MAX_INPUTS prompts, counted as tokenize_input_prompts splits them (nothing tokenized)."""
    if prompt_count(value) > MAX_INPUTS:
        raise InvalidRequest(f"'{field}': {prompt_count(value)} inputs, more than one request may hold "
                             f"(at most {MAX_INPUTS}, as OpenAI's embeddings API)")


async def engine_call(work: Awaitable[T]) -> T:
    """An embedding call on the model's engine thread (the handle's): a thread that is gone is a 503,
    EmbedError a 400."""
    try:
        return await work
    except EngineThreadFailed as e:
        raise EngineGone(f"the engine thread stopped: {e}") from None
    except EmbedError as e:
        raise InvalidRequest(str(e)) from None


async def embedding_shape(loaded) -> EmbeddingShape:
    """The model's pooling, vector size and vocabulary size, read on its engine thread."""
    return await engine_call(loaded.client.embedding_shape())


async def embed_all(loaded, token_lists: list[list[int]]) -> list[np.ndarray]:
    """Every input's vector, PER_CALL inputs of similar length per engine call: the decode loop's
    iterations run between two calls, so a request of many inputs never stalls the streams beside it."""
    order = sorted(range(len(token_lists)), key=lambda i: len(token_lists[i]))
    out: list[np.ndarray | None] = [None] * len(token_lists)
    for s in range(0, len(order), PER_CALL):
        part = order[s:s + PER_CALL]
        batch = [token_lists[i] for i in part]
        for i, v in zip(part, await engine_call(loaded.client.embed(batch)), strict=True):
            out[i] = v
    return out  # type: ignore[return-value]


def vector_json(vec: np.ndarray) -> str:
    """One float32 vector as nlohmann writes a std::vector<float> (each as a double, shortest round trip)."""
    return "[" + ",".join(map(repr, vec.astype(np.float64).tolist())) + "]"
