"""The contract between the gateway and the engine: a few typed messages, nothing else.

The gateway (Sanic, never jax) builds a `GenerateRequest`, hands it to the engine thread through an
engine client, and reads `StepOutput`s back from its own asyncio queue until one carries a
`finish_reason`. This module imports neither jax nor sanic, so both sides can use it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(str, enum.Enum):
    STOP = "stop"  # an end-of-generation token or a stop string
    LENGTH = "length"  # max_tokens reached, or the context is full
    ABORT = "abort"  # the client went away or the request was cancelled
    ERROR = "error"  # the engine failed; `StepOutput.error` says why


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters. Every field becomes an array on device, so none recompiles."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int = -1  # -1: random
    max_tokens: int = -1  # -1: until EOG or the context is full
    n_probs: int = 0  # how many top logprobs to return per step (0: none)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass
class GenerateRequest:
    """One sequence to generate: prompt token ids and how to sample."""

    prompt_tokens: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = ""


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float


@dataclass
class StepOutput:
    """What one decode step produced for one request.

    `text` holds only complete UTF-8: bytes of a character split across tokens wait for the token
    that completes it. The last output of a request has `finish_reason` set.
    """

    token: int | None
    text: str = ""
    logprob: float | None = None
    top_logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # Set by the engine thread on a request's last output, as llama-server's timings measure them:
    # the prompt (prefill up to the first token) and the decode steps after it, in milliseconds.
    prompt_ms: float = 0.0
    predicted_ms: float = 0.0
