"""The Python generation API: load a verified GGUF, then serve many requests at once.

`add` checks a request and queues it; each `iterate` is one scheduler iteration (model/scheduler.py:
admit, a bounded chunk of prefill, one decode step for every running sequence) and returns one
`StepOutput` per sequence that produced a token, until each finishes: an end-of-generation token or a
stop string ("stop"), max_tokens or a full context ("length"), or `cancel` ("abort"). `generate`
wraps this for one sequence. The engine thread of the gateway drives it; nothing here blocks on I/O.

The engine is three parts, and this module is the facade the engine thread drives: the step runner
(model/runner.py) holds the weights, the paged KV pool (model/kvcache.py; `max_seqs` sequences at
once, any of them up to `n_ctx` tokens, their sum bounded by the pool) and the token history the
penalties read, and runs the compiled programs, which the program cache (model/compiled.py) compiles.
Sampling runs on the device (llama-server's chain, model/sampler_chain.py); text, stops and limits
are the host side's, one `model.completion.Completion` per request. On a GPU the sampler has no
data-dependent branch (`branchless`) and the scheduler dispatches the next step before it reads this
one's tokens (`lookahead`, model/scheduler.py). Slot files (model/slots.py) and scoring
(model/score.py) get the scheduler, the runner or the weights they need from here, nothing more.

Prompt reuse (llama-server's `cache_prompt`, on by default) is the scheduler's prefix cache: the full
pages of every sequence stay cached until the pool needs them, and a new prompt computes only what
follows the longest chain of pages it shares with any of them (`cached_tokens`).

Every compiled program comes from a fixed table of shapes (model/programs.py), so no temperature, token
or batch ever triggers a compilation. `warmup()` compiles the whole table; a server that wants to
bind sooner compiles `warmup(essential=True)` (what first short requests need), then the rest with
`compile_in_background()` while it serves (model/compiled.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import threading
import time
from collections.abc import Iterator, Sequence

import jax
import numpy as np

from bankml.config import PAGE_SIZE
from bankml.errors import InvalidRequest
from model import slots
from model.compiled import LOWERING, ProgramCache, Specs
from model.completion import Completion
from model.config import Config
from model.embed import Embedder
from model.forward import forward
from model.kvcache import KVPool, cache_type_refusal, init_pool, page_bytes
from model.messages import EngineStats, GenerateRequest, Iteration, SamplingParams, StepOutput
from model.pages import PageEvents, PagePool
from model.pooling import pooling_of, resolve_pooling
from model.programs import MIN_PREFILL_BUCKET, MIN_WINDOW, ProgramTable, pow2_at_least
from model.runner import Runner, empty_history
from model.sampling import N_PROBS_MAX, unsupported_sampling
from model.scheduler import Scheduler
from model.score import Scored, Scorer
from model.slot_file import Expect, Slot
from model.speculative import Speculation
from model.tokenizer_gguf import gguf_fields
from model.weights import Weights, device_bytes, file_tensor_bytes, layout_of, load_weights, matrix_types

log = logging.getLogger(__name__)

PREFILL_CHUNK = 512  # the default largest prefill bucket; longer prompts run in chunks of this many tokens
DEVICE_BYTES_RATIO = 1.15  # the most the device layout may take over the file's tensor bytes


class EngineError(InvalidRequest, ValueError):
    """A request (or a configuration) the engine cannot take. The message is the reason, told to the
    client as it is; any other exception in the engine is a failure, named by its type."""


class Engine:
    """The engine the engine thread drives: requests in (`add`), one scheduler iteration at a time out
    (`iterate`), over a step runner (`runner`) and its compiled programs (`compiled`)."""

    def __init__(self, config: Config, weights: Weights, tokenizer, *, n_ctx: int = 4096, max_seqs: int = 4,
                 prefill_chunk: int = PREFILL_CHUNK, page_size: int = PAGE_SIZE, n_pages: int | None = None,
                 lookahead: bool | None = None, cache_type: str = "f16", speculation: Speculation | None = None):
        if n_ctx < 2:
            raise EngineError(f"n_ctx must be at least 2, got {n_ctx}")
        if max_seqs < 1:
            raise EngineError(f"max_seqs must be at least 1, got {max_seqs}")
        if prefill_chunk < MIN_PREFILL_BUCKET or prefill_chunk & (prefill_chunk - 1):
            raise EngineError(f"the largest prefill bucket must be a power of two of at least {MIN_PREFILL_BUCKET},"
                              f" got {prefill_chunk}")
        if page_size < 1 or page_size & (page_size - 1) or page_size > MIN_WINDOW:
            raise EngineError(f"the page size must be a power of two up to {MIN_WINDOW}, got {page_size}")
        if why := cache_type_refusal(config, cache_type):
            raise EngineError(why)
        self.cache_type = cache_type  # the KV pool's: "f16" or "q8_0" (model/kvcache.py)
        self.prefill_chunk = prefill_chunk
        self.config = config
        self.weights = weights
        self.tokenizer = tokenizer
        self.n_ctx = n_ctx
        self.max_seqs = max_seqs
        self.page_size = page_size
        self.max_pages = -(-n_ctx // page_size)
        n_pages = max_seqs * self.max_pages if n_pages is None else n_pages
        self.speculation = speculation if speculation is not None else Speculation()
        self.programs = ProgramTable(n_ctx, prefill_chunk, page_size, max_seqs,  # every shape a step takes
                                     verify_tokens=tuple(self.speculation.verify_buckets()))
        pool = init_pool(config, n_pages, page_size, cache_type, weights.parallel)
        history = empty_history(max_seqs, n_ctx, weights.parallel)
        self.compiled = ProgramCache(self.programs, config, Specs.of(weights, pool, history),
                                     branchless=jax.default_backend() != "cpu")
        self.runner = Runner(config, weights, tokenizer, self.programs, self.compiled, pool, history,
                             eog_ids=frozenset(int(t) for t in getattr(tokenizer, "eog_ids", ()) or ()))
        self.scheduler = Scheduler(self.runner, PagePool(n_pages, page_size), max_seqs=max_seqs,
                                   n_ctx=n_ctx, prefill_budget=prefill_chunk,
                                   lookahead=jax.default_backend() != "cpu" if lookahead is None else lookahead,
                                   speculation=self.speculation)
        self._scorer = Scorer(weights, config, self.programs, cache_type)
        self.file_bytes: int | None = None  # the GGUF's tensor bytes, when loaded from a file (`load`)
        # True: `warmup()` compiles only what a first request needs, and `compile_in_background` the rest
        self.lazy_compile = False
        self.gguf_pooling: int | None = None  # <arch>.pooling_type, when loaded from a file that has one
        self._embedder = None  # model/embed.py's programs, made on the first embedding request
        self._mesh: dict | None = None  # `mesh`'s sizes, read once

    def watch_pages(self, events: PageEvents) -> None:
        """Tell `events` what the prefix cache keys and forgets from now on (vLLM's KV cache events,
        model/kv_events.py); call it on the engine thread."""
        self.scheduler.pool.watch(events)

    @property
    def pool(self) -> KVPool:
        """The KV pool as it is now (the runner's: each step replaces it)."""
        return self.runner.pool

    @property
    def eog_ids(self) -> frozenset[int]:
        """The tokens that end a generation (the tokenizer's): where a request stops, and what
        `ignore_eos` forbids. Tests and benches set it (to frozenset(): every answer runs its max_tokens)."""
        return self.runner.eog_ids

    @eog_ids.setter
    def eog_ids(self, ids: frozenset[int]) -> None:
        self.runner.eog_ids = ids

    @property
    def compile_s(self) -> float:
        """The seconds the compiles of the programs compiled so far took."""
        return self.compiled.compile_s

    # --- construction -------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | os.PathLike, *, verified: bool, n_ctx: int = 4096, max_seqs: int = 4,
             tokenizer=None, warmup: bool = True, packed: bool | None = None, activations: str = "f32",
             prefill_chunk: int = PREFILL_CHUNK, compile_cache_dir: str | os.PathLike | None = None,
             kv_cache_bytes: int = 0, page_size: int = PAGE_SIZE, layout: str | None = None,
             lookahead: bool | None = None, cache_type: str = "f16",
             speculation: Speculation | None = None, tensor_parallel: int = 1) -> Engine:
        """Load a GGUF that `bankml.verify.verify` accepted (the caller says so with `verified=True`).

        layout: the weights' layout (model/weights.py): "packed" (the CPU default), "dense", or "device"
        (the GPU default: quantized blocks as they are, kernels chosen by kernels/ops.py).
        packed: the older switch (True: "packed", False: "dense").
        activations: "f32", or "ggml" for llama.cpp's activation rounding (model/actquant.py).
        prefill_chunk: the largest prefill bucket (a power of two); longer prompts run in such chunks.
        compile_cache_dir: JAX's persistent compilation cache (process-wide), so a restart reloads the
        compiled programs instead of compiling them again (SmolLM2 on 2 CPUs: 18.5 s -> 3.7 s).
        kv_cache_bytes: the KV pool's size (0: `kv_pool_pages` decides); page_size: tokens per page.
        cache_type: the KV cache's type, "f16" or "q8_0" (llama-server's --cache-type-k/v; about half
        the bytes, so the same kv_cache_bytes holds about twice the tokens).
        lookahead: dispatch a decode step before reading the last one's tokens (model/scheduler.py);
        default: on a GPU backend.
        speculation: drafts and their verify steps (model/speculative.py); default none.
        tensor_parallel: split the model over this many devices (model/parallel.py); a model that does
        not split that many ways, or more devices than the platform has, is refused with the reason. The
        weights are read into host memory first, then each device gets its share.
        """
        t0 = time.perf_counter()
        if compile_cache_dir is not None:
            jax.config.update("jax_compilation_cache_dir", os.fspath(compile_cache_dir))
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
            jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        from model import distributed

        cluster = distributed.current()
        if cluster is not None:  # across processes: split over every device of every process
            if tensor_parallel not in (1, jax.device_count()):
                raise EngineError(f"--tensor-parallel {tensor_parallel}: across processes the model is split over "
                                  f"every device of every process ({jax.device_count()})")
            tensor_parallel = jax.device_count()
        if tensor_parallel > 1:
            config, weights = _load_split(path, tensor_parallel, verified=verified, packed=packed,
                                          activations=activations, layout=layout)
        else:
            config, weights = load_weights(path, verified=verified, packed=packed, activations=activations,
                                           layout=layout)
        if tokenizer is None:
            from model.tokenizer import Tokenizer

            tokenizer = Tokenizer.from_gguf(path)
        if why := cache_type_refusal(config, cache_type):
            raise EngineError(why)
        n_pages = kv_pool_pages(config, n_ctx=n_ctx, max_seqs=max_seqs, page_size=page_size,
                                kv_cache_bytes=kv_cache_bytes, cache_type=cache_type, parallel=weights.parallel)
        if cluster is not None:  # each process sized it from its own device's room: the smallest fits all
            n_pages = distributed.smallest("kv_pool_pages", n_pages)
        engine = cls(config, weights, tokenizer, n_ctx=n_ctx, max_seqs=max_seqs, prefill_chunk=prefill_chunk,
                     page_size=page_size, n_pages=n_pages, lookahead=lookahead, cache_type=cache_type,
                     speculation=speculation)
        if cluster is not None and cluster.leader:
            distributed.lead(engine.runner)
        engine.file_bytes = file_tensor_bytes(path)
        engine.gguf_pooling = pooling_of(gguf_fields(path, (f"{config.arch}.pooling_type",)), config.arch)
        log.info("loaded %s (%s, %d layers) in %.2f s; KV pool %d pages of %d tokens (%.0f MiB, %s), %d sequences "
                 "at once", os.fspath(path), config.arch, config.n_layer, time.perf_counter() - t0, n_pages,
                 page_size, engine.pool.nbytes / 2**20, cache_type, max_seqs)
        _log_weights(engine.weights_report())
        if warmup:
            engine.warmup()
        return engine

    def weights_report(self) -> dict:
        """What the weights take and which kernels run them: {"layout", "device_bytes", "file_bytes"
        (None unless loaded from a file), "ratio" (device over file bytes), "kernels" (kernels.ops.report
        for the device layout; the stacked layouts do not go through kernels.ops), "mesh" (`mesh`)}."""
        layout = layout_of(self.weights)
        device = device_bytes(self.weights)
        if layout == "device":
            from kernels import ops

            kernels = ops.report(matrix_types(self.weights))
        else:
            kernels = {"all": {"impl": "jnp", "why": f"the {layout} layout: stacked layers under lax.scan"
                                                     f"{' (model/packed.py)' if layout == 'packed' else ''}"}}
        return {"layout": layout, "device_bytes": device, "file_bytes": self.file_bytes,
                "ratio": round(device / self.file_bytes, 4) if self.file_bytes else None, "kernels": kernels,
                "mesh": self.mesh()}

    def mesh(self) -> dict:
        """The devices the model runs on (model/parallel.py): {"axes": {"tp": N}, "devices", "processes",
        "kv_heads", "vocabulary", "weight_bytes" and "kv_bytes" per device of this process, and on a GPU
        "memory": JAX's allocator's bytes in use and limit per device}; one device: axes tp 1."""
        if self._mesh is None:  # the sizes never change; read once (the pool's arrays are replaced each step)
            from model import parallel

            par = self.weights.parallel
            if par is None:
                device = next(iter(jax.tree.leaves(self.weights)[0].devices()))
                out = {"axes": {parallel.AXIS: 1}, "devices": [f"{device.platform}:{device.id}"], "processes": 1}
            else:
                out = par.describe()
            self._mesh = {**out, "weight_bytes": parallel.per_device_bytes(self.weights),
                          "kv_bytes": parallel.per_device_bytes(self.pool.arrays)}
        memory = {}
        for d in jax.local_devices():
            stats = d.memory_stats() if d.platform != "cpu" else None
            if stats and f"{d.platform}:{d.id}" in self._mesh["weight_bytes"]:
                memory[f"{d.platform}:{d.id}"] = {"in_use_bytes": stats.get("bytes_in_use"),
                                                  "limit_bytes": stats.get("bytes_limit")}
        return {**self._mesh, **({"memory": memory} if memory else {})}

    def memory_bytes(self) -> int:
        """What the engine holds: its weights' device bytes and its KV pool's (/api/ps "size")."""
        return int(device_bytes(self.weights)) + self.pool.nbytes

    # --- compiled programs (model/compiled.py) -----------------------------------------------------

    def warmup(self, threads: int | None = None, essential: bool | None = None) -> float:
        """Compile every program this engine can use, or with `essential` (default: `lazy_compile`)
        only `programs.essential_keys()`; returns the seconds spent (wall clock). A progress line shows on a
        terminal.

        XLA compiles outside the GIL, so programs compile in parallel on `threads` (default: CPUs).
        """
        return self.compiled.warmup(self.lazy_compile if essential is None else essential, threads)

    def compile_in_background(self) -> threading.Thread | None:
        """Compile what `warmup(essential=True)` left on a daemon thread, while the engine serves; None:
        nothing was left. An engine unloaded meanwhile is freed, and the rest of its programs never compiled."""
        return self.compiled.compile_in_background()

    # --- requests -----------------------------------------------------------------------------

    def add(self, request: GenerateRequest) -> int:
        """Check `request` and queue it for a sequence; returns its task id. EngineError: refused."""
        tokens = request.prompt_tokens
        params = request.params
        if not tokens:
            raise EngineError("the prompt is empty")
        if len(tokens) >= self.n_ctx:
            raise EngineError(f"the prompt has {len(tokens)} tokens, the context only {self.n_ctx}")
        if any(t < 0 or t >= self.config.n_vocab for t in tokens):
            raise EngineError("the prompt contains a token id outside the vocabulary")
        if params.n_probs > N_PROBS_MAX:
            raise EngineError(f"n_probs is at most {N_PROBS_MAX}, got {params.n_probs}")
        if (why := unsupported_sampling(params)) is not None:
            raise EngineError(why)
        # llama.cpp's LLAMA_DEFAULT_SEED (0xFFFFFFFF, i.e. -1) asks for a random seed
        seed = params.seed & 0xFFFFFFFF
        seed = secrets.randbits(32) if seed == 0xFFFFFFFF else seed
        completion = Completion(self.tokenizer, params, n_prompt=len(tokens), n_ctx=self.n_ctx,
                                eog_ids=self.eog_ids)
        return self.scheduler.add(request, seed, completion)

    def iterate(self) -> Iteration:
        """One scheduler iteration (model/scheduler.py)."""
        return self.scheduler.iterate()

    def cancel(self, task: int) -> StepOutput | None:
        """Drop the task, waiting or running; its final output ("abort"), or None if it is not live."""
        return self.scheduler.cancel(task)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def reset(self) -> list[int]:
        """After a failed iteration: the running tasks are dropped (returned), the waiting ones kept;
        a pool or history the failed program consumed (donated) is made again."""
        dropped = self.scheduler.reset()
        self.runner.reset()
        return dropped

    def stats(self) -> EngineStats:
        return self.scheduler.stats()

    def free_slots(self) -> int:
        return self.max_seqs - len(self.scheduler.running)

    def generate(self, prompt_tokens: Sequence[int], params: SamplingParams | None = None,
                 request_id: str = "generate") -> Iterator[StepOutput]:
        """One sequence, streamed (beside whatever else is queued): yields a StepOutput per token; the
        last has `finish_reason`. Tests and tools; the server drives `add` and `iterate` itself."""
        task = self.add(GenerateRequest(list(prompt_tokens), params or SamplingParams(), request_id))
        try:
            while True:
                for t, out in self.iterate().outputs:
                    if t == task:
                        yield out
                        if out.finish_reason is not None:
                            return
        finally:
            self.cancel(task)

    # --- embeddings ---------------------------------------------------------------------------------

    @property
    def pooling(self) -> int:
        """The pooling llama-server --embeddings would use for this model (model/embed.py)."""
        return resolve_pooling(self.gguf_pooling)

    @property
    def n_embd(self) -> int:
        return self.config.n_embd

    @property
    def n_vocab(self) -> int:
        return self.config.n_vocab

    def embed(self, token_lists: Sequence[Sequence[int]], pooling: int | None = None) -> list[np.ndarray]:
        """Embeddings of `token_lists`, batched, no KV cache touched (model/embed.py); on the engine thread."""
        self._one_process("embeddings")
        if self._embedder is None:
            self._embedder = Embedder(self.config, self.weights, self.cache_type, LOWERING)
        return self._embedder.embed(token_lists, self.pooling if pooling is None else pooling)

    def prompt_logprobs(self, tokens: Sequence[int], n_probs: int = 0) -> list[Scored]:
        """Teacher-forced: each token's logprob after the ones before it, and the top `n_probs` there
        (model/score.py); OpenAI's echo with logprobs. On the engine thread, between iterations."""
        self._one_process("the prompt's logprobs (echo)")
        return self._scorer.score(tokens, n_probs)

    def prompt_log_softmax(self, tokens: Sequence[int]) -> np.ndarray:
        """The same pass, every position's whole distribution [len(tokens) - 1, V] (bench/fidelity.py)."""
        self._one_process("the prompt's logprobs")
        return self._scorer.log_softmax(tokens)

    def _one_process(self, what: str) -> None:
        """Refuse what runs programs outside the step runner, which the other processes of a cluster
        would not run (model/distributed.py)."""
        if self.runner.lockstep is not None:
            raise EngineError(f"{what}: not served by a model split across processes yet (only generation is)")

    # --- slot files (model/slots.py) -----------------------------------------------------------------

    def slot_expect(self, model_sha256: str) -> Expect:
        return slots.expect(self.runner, model_sha256)

    def save_slot(self, slot: int) -> Slot:
        self._one_process("slot files")
        return slots.snapshot(self.scheduler, self.runner, slot)

    def restore_slot(self, slot: int, restored: Slot | None) -> int:
        self._one_process("slot files")
        return slots.install(self.scheduler, self.runner, slot, restored)

    def erase_slot(self, slot: int) -> int:
        return slots.erase(self.scheduler, slot)

    # --- tests and tools ------------------------------------------------------------------------

    def logits(self, tokens: Sequence[int]) -> np.ndarray:
        """Logits [T, V] for every position of `tokens`, one full forward pass in a scratch pool."""
        n = len(tokens)
        t = pow2_at_least(n, MIN_PREFILL_BUCKET)
        padded = np.zeros((1, t), np.int32)
        padded[0, :n] = tokens
        n_pages = -(-t // self.page_size)
        scratch = init_pool(self.config, n_pages, self.page_size, self.cache_type, self.weights.parallel)
        logits, _ = forward(self.weights, scratch, padded, np.arange(n_pages, dtype=np.int32)[None],
                            np.zeros(1, np.int32), np.array([n], np.int32), config=self.config, window_pages=0,
                            all_logits=True)
        return np.asarray(logits[0, :n])


def _load_split(path, n: int, **how) -> tuple[Config, Weights]:
    """load_weights into host memory (the CPU backend), then split over the first n devices."""
    from model import parallel

    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        config, whole = load_weights(path, **how)
    devices = jax.devices()
    why = parallel.refusal(config, n, len(devices), devices[0].platform, parallel.row_blocks(whole))
    if why:
        raise EngineError(why)
    plan = parallel.make(config, n, devices)
    t0 = time.perf_counter()
    weights = parallel.shard_weights(whole, config, plan)
    log.info("split the weights %d ways (%s) in %.1f s: %s", n, plan.describe()["kv_heads"] + " KV heads",
             time.perf_counter() - t0, ", ".join(f"{d} {b / 2**20:.1f} MiB" for d, b in
                                                 parallel.per_device_bytes(weights).items()))
    return config, weights


def _log_weights(report: dict) -> None:
    ratio = report["ratio"]
    log.info("weights: %s layout, %.1f MiB on the device for %.1f MiB in the file (%sx)", report["layout"],
             report["device_bytes"] / 2**20, (report["file_bytes"] or 0) / 2**20,
             "?" if ratio is None else f"{ratio:.3f}")
    if report["layout"] == "device" and ratio is not None and ratio > DEVICE_BYTES_RATIO:
        log.warning("weights: the device layout takes %.3fx the file's bytes (more than %.2fx): some matrix is "
                    "held wider than its type", ratio, DEVICE_BYTES_RATIO)
    for op, rows in report["kernels"].items():
        if op in ("backend", "mode"):
            continue
        for name, row in (rows.items() if op == "qmatmul" else [("", rows)]):
            log.info("kernels: %s%s: %s (%s)", op, f" {name}" if name else "", row["impl"], row["why"])


def kv_pool_pages(config: Config, *, n_ctx: int, max_seqs: int, page_size: int, kv_cache_bytes: int = 0,
                  cache_type: str = "f16", parallel=None) -> int:
    """The KV pool's pages. kv_cache_bytes > 0: as many as fit in it. 0: on a GPU, 80% of what the
    device's allocator has left after the weights (its limit is memory_fraction of the device); on a
    CPU (no allocator to ask), `max_seqs` whole contexts. Never fewer than one whole context.
    parallel (model/parallel.py): kv_cache_bytes is the whole pool's, every device's share together; a
    GPU's room is its first device's, each device holding 1/N of every page."""
    stored = config if parallel is None else dataclasses.replace(config, n_head_kv=parallel.pool_heads(config))
    per_page = page_bytes(stored, page_size, cache_type)
    devices = 1 if parallel is None else parallel.n
    one_context = -(-n_ctx // page_size)
    if kv_cache_bytes > 0:
        n = kv_cache_bytes // per_page
        if n < one_context:
            raise EngineError(f"[engine] kv_cache_bytes = {kv_cache_bytes} holds {n} pages of {page_size} tokens; "
                              f"one sequence of the whole context ({n_ctx} tokens) needs {one_context} "
                              f"({one_context * per_page} bytes)")
        return n
    device = jax.local_devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and stats.get("bytes_limit"):
        left = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        return max(one_context, int(0.8 * left) // (per_page // devices))
    return max_seqs * one_context
