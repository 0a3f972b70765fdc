"""llama.cpp's pooling types and what a GGUF asks for; no jax here, so the gateway can read them.

llama.cpp's `enum llama_pooling_type` (include/llama.h). A model's pooling is `<arch>.pooling_type`
from its GGUF. A chat model has none: b11434's llama-server then pools it as none (one vector per
token) and refuses /v1/embeddings (recorded in tests/fixtures/embeddings_smollm2.json); bankml pools it
by mean, as `llama-server --embeddings --pooling mean` does, so the OpenAI route serves it.
"""

from __future__ import annotations

POOLING_NONE, POOLING_MEAN, POOLING_CLS, POOLING_LAST, POOLING_RANK = 0, 1, 2, 3, 4
POOLING_NAMES = {POOLING_NONE: "none", POOLING_MEAN: "mean", POOLING_CLS: "cls", POOLING_LAST: "last",
                 POOLING_RANK: "rank"}
SERVED = (POOLING_NONE, POOLING_MEAN, POOLING_CLS, POOLING_LAST)


class EmbedError(ValueError):
    """An embedding request the engine cannot take; the message is the reason."""


def pooling_of(metadata: dict, arch: str) -> int | None:
    """`<arch>.pooling_type` from GGUF key/values; None when the file has none."""
    value = metadata.get(f"{arch}.pooling_type")
    return None if value is None else int(value)


def resolve_pooling(gguf_pooling: int | None) -> int:
    """The pooling bankml uses for a model: the GGUF's, else (a chat model) mean."""
    return POOLING_MEAN if gguf_pooling is None else gguf_pooling
