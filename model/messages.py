"""The contract between the gateway and the engine: a few typed messages, nothing else.

The gateway (Sanic, never jax) builds a `GenerateRequest`, hands it to the engine thread through an
engine client, and reads `StepOutput`s back from its own asyncio queue until one carries a
`finish_reason`. This module imports neither jax nor sanic, so both sides can use it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpu_monitor.energy import EnergyReading
    from model.constraint import Constraint


class FinishReason(str, enum.Enum):  # noqa: UP042 (str() of a member must stay "FinishReason.X")
    STOP = "stop"  # an end-of-generation token or a stop string
    LENGTH = "length"  # max_tokens reached, or the context is full
    ABORT = "abort"  # the client went away or the request was cancelled
    ERROR = "error"  # the engine failed; `StepOutput.error` says why


# The most top logprobs a step reports (model/sampling.py). llama-server answers any n_probs (a
# request for 50 gets 50); OpenAI's top_logprobs stops at 20. Past this cap a request is refused by
# name: each token's answer grows with it.
N_PROBS_CAP = 256

# llama-server's default sampler order (common/common.h); the only order this engine runs
DEFAULT_SAMPLERS = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
DEFAULT_DRY_BREAKERS = ("\n", ":", "\"", "*")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request parameters, with llama.cpp's meanings and defaults (common/common.h).

    The sampler fields become [B] arrays on the device, so no value ever recompiles. The GGUF's
    `general.sampling.*` keys replace some defaults (gateway/serving/request_fields.py, `gguf_defaults`).
    """

    temperature: float = 0.8  # <= 0: greedy
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    top_k: int = 40  # <= 0: off
    top_p: float = 0.95  # >= 1: off
    min_p: float = 0.05  # <= 0: off
    typical_p: float = 1.0  # >= 1: off
    top_n_sigma: float = -1.0  # <= 0: off
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1  # > 0.5: off
    repeat_last_n: int = 64  # 0: no penalties
    repeat_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    dry_multiplier: float = 0.0  # 0: no DRY
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = 64  # 0: no DRY; -1: the context (a GGUF/CLI default only)
    dry_sequence_breakers: tuple[str, ...] = DEFAULT_DRY_BREAKERS
    min_keep: int = 0
    seed: int = -1  # -1 (or 0xFFFFFFFF): random
    max_tokens: int = -1  # -1: until EOG or the context is full; 0 still gives one token (llama-server)
    n_probs: int = 0  # how many top logprobs to return per token (0: none)
    stop: tuple[str, ...] = ()  # stop strings, never in the answer
    cache_prompt: bool = True  # reuse the slot's longest common prefix
    samplers: tuple[str, ...] = DEFAULT_SAMPLERS
    mirostat: int = 0  # llama.cpp's mirostat 1 or 2 replaces the chain; refused unless 0
    # (token, bias) added to the raw logits before the chain (llama.cpp's logit-bias sampler, first in
    # llama-server's chain); -inf forbids the token
    logit_bias: tuple[tuple[int, float], ...] = ()
    ignore_eos: bool = False  # every end-of-generation token forbidden (llama-server: a -inf logit bias)
    # llama-server's speculative.n_max / n_min / p_min: the draft's longest and shortest lengths (-1: the
    # server's --draft-max / --draft-min; model/speculative.py) and the draft model's least probability
    # (read and kept: an n-gram draft has none)
    spec_n_max: int = -1
    spec_n_min: int = -1
    spec_p_min: float = 0.75

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass
class GenerateRequest:
    """One sequence to generate: prompt token ids and how to sample."""

    prompt_tokens: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = ""
    return_progress: bool = False  # an output after each prefill chunk (llama-server's return_progress)
    # the sequence's grammar (model/constraint.py `Constraint`, compiled by the gateway before any
    # model work, one per sequence): the engine masks every token it forbids and ends the sequence
    # when it is complete
    constraint: Constraint | None = None
    # llama-server's `id_slot`: run in that sequence slot (modulo the slots, as its get_slot_by_id
    # wraps), waiting for it if busy; -1: any free slot
    id_slot: int = -1


@dataclass(frozen=True)
class PromptProgress:
    """How far a prompt's prefill has come, as llama-server's `prompt_progress` says it
    (server-task.cpp `result_prompt_progress`): measured on the engine thread after each chunk."""

    total: int  # the prompt's tokens
    cache: int  # of those, served from the prefix cache
    processed: int  # in the sequence's cache so far (the cached ones included)
    time_ms: int  # since the sequence was admitted

    def to_json(self) -> dict:
        return {"total": self.total, "cache": self.cache, "processed": self.processed, "time_ms": self.time_ms}


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float


@dataclass(frozen=True)
class TopLogprob:
    token: int
    piece: bytes  # the token's bytes as llama-server renders them (a control token: b"")
    logprob: float


@dataclass(frozen=True)
class LogprobEntry:
    """One entry of OpenAI's `logprobs.content`, made for a token that completes its UTF-8.

    `text` is what the stop filter released at this token (llama-server's `text_to_send`), not the
    token's own piece: b"" while a possible stop is held back.
    """

    token: int
    text: bytes
    logprob: float
    top: tuple[TopLogprob, ...]


@dataclass(frozen=True)
class Timeline:
    """When one request reached each stage, in `time.perf_counter()` seconds, stamped on the engine
    thread. Every duration the gateway reports (llama-server's `timings`, the /bankml/metrics record,
    the receipt's `ttft_ms`, Prometheus) is derived here, so each is measured once.

    Durations start at `started_s`, the request's turn on the engine: time queued behind other
    requests is `queue_ms`, never part of the prompt or the time to first token.
    """

    queued_s: float  # handed to the engine thread's queue
    started_s: float  # its turn on the engine
    first_token_s: float  # the prompt is done: the first token came out
    first_text_s: float | None  # the first token that released text (None: none did)
    ended_s: float  # the last output

    @property
    def queue_ms(self) -> float:
        return (self.started_s - self.queued_s) * 1e3

    @property
    def prompt_ms(self) -> float:
        return (self.first_token_s - self.started_s) * 1e3

    @property
    def predicted_ms(self) -> float:
        return (self.ended_s - self.first_token_s) * 1e3

    @property
    def ttft_ms(self) -> float | None:
        """To the first non-empty, valid-UTF-8 piece: what a client sees first."""
        return None if self.first_text_s is None else (self.first_text_s - self.started_s) * 1e3

    @property
    def latency_ms(self) -> float:
        """From the queue to the last output."""
        return (self.ended_s - self.queued_s) * 1e3


@dataclass
class StepOutput:
    """What one decode step produced for one request.

    `text` holds only complete UTF-8 that no stop string can still claim: bytes of a character split
    across tokens wait for the token that completes it, text that may begin a stop waits until it
    cannot (model/completion.py). The last output of a request has `finish_reason` set, and says
    what a non-streamed answer adds: `held_text`, generated but never released (a possible stop cut
    short by the limit, a character cut by the end), which llama-server's non-streamed content keeps
    and its stream never sends; `logprobs_trim`, how many entries at the end belong to the stop word.
    """

    token: int | None
    text: str = ""
    logprob: float | None = None
    top_logprobs: list[TokenLogprob] | None = None
    logprobs: LogprobEntry | None = None  # the entry this token made (n_probs > 0, complete UTF-8)
    finish_reason: FinishReason | None = None
    held_text: str = ""
    logprobs_trim: int = 0
    # why a finished completion stopped, as llama-server's /completion names it (server-task.cpp
    # `stop_type_to_str`): "eos", "word" (then `stopping_word`), "limit"; `truncated` when the limit
    # was the context itself (llama-server's `slot.truncated` when it runs out of context)
    # the generated bytes end on a whole character here: llama-server sends a streamed /completion
    # event for this token (server-context.cpp `process_token`), empty when a possible stop holds it
    utf8_complete: bool = True
    id_slot: int = -1  # the sequence slot that produced it (-1: none, e.g. an engine that has no slots)
    progress: PromptProgress | None = None  # a prefill progress output: no token, no text
    stop_type: str = "none"
    stopping_word: str = ""
    truncated: bool = False
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # speculative decoding so far (llama-server's timings.draft_n, draft_n_accepted): drafted tokens the
    # target checked, and of those, the ones it kept
    draft_n: int = 0
    draft_n_accepted: int = 0
    # Set by the engine thread on every output of a request that ran (`ended_s`: when this output
    # came; llama-server's `timings_per_token` reads it), and on the last one, for a completed
    # request, the energy its device used from `timeline.started_s` to the end (None:
    # unmeasured, `energy_why` says why).
    timeline: Timeline | None = None
    energy: EnergyReading | None = None
    energy_why: str | None = None
    grammar_ms: float = 0.0  # host time spent on the sequence's grammar so far (masks and advances)

    @property
    def prompt_ms(self) -> float:
        return self.timeline.prompt_ms if self.timeline is not None else 0.0

    @property
    def predicted_ms(self) -> float:
        return self.timeline.predicted_ms if self.timeline is not None else 0.0

    @property
    def ttft_ms(self) -> float | None:
        return self.timeline.ttft_ms if self.timeline is not None else None


@dataclass(frozen=True)
class SequenceState:
    """One sequence slot of the engine, as `GET /slots` shows it (llama-server's shape is built from it)."""

    id: int  # the slot: its row of the token history
    id_task: int  # the request it serves (-1: idle)
    is_processing: bool
    n_ctx: int
    n_prompt: int = 0
    n_cached: int = 0  # prompt tokens served from the prefix cache
    n_prompt_done: int = 0  # prompt tokens computed or cached so far
    n_decoded: int = 0
    n_remain: int = -1  # tokens left before max_tokens (-1: no limit)
    prefilling: bool = False  # its prompt is not yet all computed
    params: SamplingParams | None = None
    # idle: the tokens the slot's last sequence (or a restored slot file) left in the KV cache; None
    # for a slot that never ran
    n_kept: int | None = None


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the scheduler, published after each iteration; safe to read from any thread."""

    max_seqs: int = 0
    running: int = 0  # sequences holding a slot (prefilling or decoding)
    waiting: int = 0  # admitted to the engine, waiting for a slot and pages (preempted ones included)
    page_size: int = 0
    pages_total: int = 0
    pages_used: int = 0  # held by running sequences
    pages_cached: int = 0  # free, but still holding a cached prefix (evicted first-in-LRU when needed)
    prefix_queries_tokens: int = 0  # prompt tokens looked up in the prefix cache (cumulative)
    prefix_hits_tokens: int = 0  # of those, tokens served from cached pages
    preemptions: int = 0  # sequences preempted for pages (cumulative)
    iterations: int = 0
    # speculative decoding (cumulative): verify steps, drafts checked (one per drafting row of such a step),
    # drafted tokens checked, and of those accepted
    spec_steps: int = 0
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    sequences: tuple[SequenceState, ...] = ()

    @property
    def kv_usage_ratio(self) -> float:
        return self.pages_used / self.pages_total if self.pages_total else 0.0


@dataclass
class Iteration:
    """What one scheduler iteration did: the tasks it admitted to a sequence (with when), and one
    output per sequence that produced a token (or ended)."""

    admitted: list[tuple[int, float]] = field(default_factory=list)
    outputs: list[tuple[int, StepOutput]] = field(default_factory=list)
