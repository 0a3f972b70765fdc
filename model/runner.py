"""The step runner: the device side the scheduler drives (model/scheduler.py's `Runner`).

It holds the weights, the paged KV pool (model/kvcache.py) and the token history the penalties read,
and runs the engine's compiled programs (model/compiled.py) on them: a newly admitted sequence's
prompt into its history row (`start_sequence`), a prefill chunk, a decode step for a batch, and the
sampler over their logits (`sample_async`, then `read`). The decode loop stays on the device: a
step's input tokens are gathered there from the history the last select wrote, DRY's bias is sent
for DRY's rows alone (model/host_bias.py), and nothing here waits on the device but `read`. Each
program consumes (donates) the pool or the history it is given and returns the new one, which the
runner keeps; `reset` makes again whatever a failed program consumed.

Slot files (model/slots.py) reach the pool through `pages_to_host` and `pages_from_host` alone.

Every program runs through `_op`, by name and with host arrays only (the device state is the runner's
own: weights, pool, history, the last step's logits), so that across processes (model/distributed.py)
process 0 publishes each op and the others `apply` the same ones, in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from model.compiled import ProgramCache
from model.config import Config
from model.dry import PieceIndex, RestartCache, RestartSequences, dry_bias, dry_enabled, restart_sequences
from model.host_bias import bias_rows, host_bias, wants_bias
from model.kvcache import KVPool, gather_pages, init_pool, scatter_pages
from model.messages import SamplingParams
from model.programs import ProgramTable
from model.sampler_chain import chain_arrays
from model.scheduler import Sequence as SchedSequence
from model.steps import Sampled
from model.weights import Weights

Tokens = list[tuple[int, float | None, list]]  # per sequence: (token, logprob, top [(id, logprob)])


def empty_history(max_seqs: int, n_ctx: int, parallel=None) -> jax.Array:
    """Each slot's tokens, for the penalties [max_seqs + 1, n_ctx]; the last row takes the padding
    rows' writes. With `parallel` (model/parallel.py), on every device of its mesh."""
    def zeros() -> jax.Array:
        return jnp.zeros((max_seqs + 1, n_ctx), jnp.int32)

    return zeros() if parallel is None else jax.jit(zeros, out_shardings=parallel.replicated)()


class Runner:
    """Runs the steps of the sequences the scheduler picks, on this engine's weights, pool and history."""

    def __init__(self, config: Config, weights: Weights, tokenizer, table: ProgramTable, compiled: ProgramCache,
                 pool: KVPool, history: jax.Array, *, eog_ids: frozenset[int]):
        self.config = config
        self.weights = weights
        self.tokenizer = tokenizer  # each token's text, for DRY's breakers
        self.table = table
        self.compiled = compiled
        self.pool = pool
        self.history = history
        self.cache_type = pool.cache_type
        self.eog_ids = eog_ids  # for ignore_eos
        self.n_ctx = table.n_ctx
        self.max_seqs = table.max_seqs
        self.max_pages = -(-table.n_ctx // table.page_size)
        self._pieces: PieceIndex | None = None  # each token's text, for DRY's breakers
        self._dry_restarts = RestartCache()  # by breaker list, bounded: each request may name its own
        self._logits: jax.Array | None = None  # the last forward step's, until it is sampled
        self.lockstep = None  # process 0 of several (model/distributed.py): each op is published first
        self.out_of_step = False  # an op failed here after it was published: the processes no longer agree
        self.barrier = None  # across processes: waits until every process has compiled a program (first run)

    # --- the device programs, by name: what another process replays --------------------------------

    def _op(self, name: str, *args):
        run = getattr(self, f"_op_{name}")
        if self.lockstep is None:
            return run(*args)
        try:
            self.lockstep.publish(name, args)
            return run(*args)
        except BaseException:  # the others may have run it, or be waiting in it: out of step for good
            self.out_of_step = True
            raise

    def _host(self, sampled: Sampled) -> Sampled:
        """`_to_host`: across processes a failure here is a failed step too (its collectives ran there)."""
        try:
            return _to_host(sampled)
        except BaseException:
            if self.lockstep is not None:
                self.out_of_step = True
            raise

    def _program(self, kind: str, t: int, window: int):
        program = self.compiled.get(kind, t, window)
        if self.barrier is not None:
            self.barrier((kind, t, window))
        return program

    def apply(self, name: str, args: tuple) -> None:
        """Run an op process 0 published (model/distributed.py's follower)."""
        if name not in OPS:
            raise ValueError(f"lockstep: unknown op {name!r}")
        getattr(self, f"_op_{name}")(*args)

    def _op_row(self, slot, tokens: np.ndarray) -> None:
        row = np.zeros(self.n_ctx, np.int32)
        row[:len(tokens)] = tokens
        self.history = self._program("row", 0, 0)(self.history, np.int32(slot), row)

    def _op_forward(self, kind: str, t: int, window: int, *arrays: np.ndarray) -> jax.Array:
        """A prefill, decode or verify{T} program; its logits stay here for the sampler."""
        extra = (self.history,) if kind == "decode" else ()
        self.pool, self._logits = self._program(kind, t, window)(self.weights, self.pool, *extra, *arrays)
        return self._logits

    def _op_sample(self, kind: str, b: int, bias_rows: int, sa, post, at, pre, *rows: np.ndarray) -> Sampled:
        """A select or vselect{T} program over the last forward step's logits."""
        logits, self._logits = self._logits, None
        out, self.history = self._program(kind, b, bias_rows)(logits, sa, self.history, *rows, post, at, pre)
        return out

    def _op_reset(self) -> None:
        self._logits = None
        if self.pool.k.is_deleted() or self.pool.v.is_deleted():
            self.pool = init_pool(self.config, self.pool.n_pages, self.table.page_size, self.cache_type,
                                  self.weights.parallel)
        if self.history.is_deleted():
            self.history = empty_history(self.max_seqs, self.n_ctx, self.weights.parallel)

    # --- the scheduler's runner ---------------------------------------------------------------------

    def start_sequence(self, seq: SchedSequence) -> None:
        self._op("row", int(seq.slot), np.asarray(seq.tokens, np.int32))

    def _table(self, seqs: list[SchedSequence], rows: int) -> np.ndarray:
        table = np.zeros((rows, self.max_pages), np.int32)
        for i, seq in enumerate(seqs):
            table[i, :len(seq.pages)] = seq.pages
        return table

    def prefill(self, seq: SchedSequence, n: int) -> jax.Array:
        start = seq.n_computed
        t, window = self.table.prefill_shape(start, n)
        padded = np.zeros((1, t), np.int32)
        padded[0, :n] = seq.tokens[start:start + n]
        return self._op("forward", "prefill", t, window, padded, self._table([seq], 1), np.array([start], np.int32),
                        np.array([n], np.int32))

    def decode(self, seqs: list[SchedSequence]) -> jax.Array:
        """One step for `seqs`, each at `n_computed`; its input token is read on the device, from
        the history row its last select (or its prompt) wrote, never from the host's `next_token`."""
        b = next(x for x in self.table.batches if x >= len(seqs))
        slots = np.full(b, self.max_seqs, np.int32)  # padding rows read the spare row, write nothing
        starts, n_new = np.zeros(b, np.int32), np.zeros(b, np.int32)
        for i, seq in enumerate(seqs):
            slots[i], starts[i], n_new[i] = seq.slot, seq.n_computed, 1
        window = self.table.window_pages(int(starts.max()), self.table.decode_windows)
        return self._op("forward", "decode", b, window, slots, self._table(seqs, b), starts, n_new)

    # --- speculation (model/speculative.py) -----------------------------------------------------------

    def _verify_shape(self, n_rows: int, seqs: list[SchedSequence]) -> tuple[int, int]:
        b = next(x for x in self.table.batches if x >= n_rows)
        return b, self.table.verify_window(max(s.n_computed for s in seqs))

    def can_verify(self, rows: int, tokens: int, seqs: list[SchedSequence]) -> bool:
        b, window = self._verify_shape(rows, seqs)
        keys = [(f"verify{tokens}", b, window), (f"vselect{tokens}", b, self._host_rows(seqs, b))]
        missing = [k for k in keys if k not in self.compiled.ready]
        if missing:
            self.compiled.compile_soon(missing)  # a plain decode step meanwhile
        return not missing

    def _host_rows(self, seqs: list[SchedSequence], b: int) -> int:
        """The bias rows `host_bias` will pick for `seqs` (0: none needs the host's bias)."""
        n = sum(wants_bias(s.request.params, s.request.constraint, _wants_dry(s.request.params)) for s in seqs)
        return bias_rows(n, self.table.dry_buckets(b))

    def verify(self, seqs: list[SchedSequence], drafts: list[list[int]], tokens: int) -> Sampled:
        """Each of `seqs`' next token and its draft through the target (`tokens` a row, padded), and
        every position sampled; the sampled arrays start copying to the host (`read_verify`)."""
        b, window = self._verify_shape(len(seqs), seqs)
        ids = np.zeros((b, tokens), np.int32)
        drafted = np.zeros((b, tokens), np.int32)
        slots = np.full(b, self.max_seqs, np.int32)
        starts, n_new = np.zeros(b, np.int32), np.zeros(b, np.int32)
        lengths, steps = np.zeros(b, np.int32), np.zeros(b, np.int32)
        for i, (seq, draft) in enumerate(zip(seqs, drafts, strict=True)):
            ids[i, 0] = seq.next_token
            ids[i, 1:1 + len(draft)] = draft
            drafted[i, :len(draft)] = draft
            slots[i], starts[i], n_new[i] = seq.slot, seq.n_computed, 1 + len(draft)
            lengths[i], steps[i] = len(seq.tokens), seq.completion.n_generated
        logits = self._op("forward", f"verify{tokens}", b, window, ids, self._table(seqs, b), starts, n_new)
        return self._select(f"vselect{tokens}", seqs, logits, slots, lengths, steps, drafted, n_new)

    def read_verify(self, seqs: list[SchedSequence], sampled: Sampled, drafts: list[list[int]]) -> list[Tokens]:
        out = self._host(sampled)
        return [[_entry(out, (i, j), seq.request.params.n_probs) for j in range(1 + len(draft))]
                for i, (seq, draft) in enumerate(zip(seqs, drafts, strict=True))]

    def sample(self, seqs: list[SchedSequence], logits: jax.Array) -> Tokens:
        return self.read(seqs, self.sample_async(seqs, logits))

    def sample_async(self, seqs: list[SchedSequence], logits: jax.Array, ahead: int = 0) -> Sampled:
        """Dispatch the sampling of `seqs` from `logits` and start copying what it returns to the
        host; `read` waits for it. ahead 1: the step ahead's, one token past what the host holds
        (that token is in the history already: the previous select wrote it)."""
        if ahead and self.needs_host(seqs):
            raise AssertionError("DRY's bias and grammars need the host's tokens: no step ahead (needs_host)")
        b = logits.shape[0]
        rows = np.full(b, self.max_seqs, np.int32)  # padding rows write to the spare row
        lengths, steps = np.zeros(b, np.int32), np.zeros(b, np.int32)
        for i, seq in enumerate(seqs):
            rows[i], lengths[i], steps[i] = seq.slot, len(seq.tokens) + ahead, seq.completion.n_generated + ahead
        return self._select("select", seqs, logits, rows, lengths, steps)

    def _select(self, kind: str, seqs: list[SchedSequence], logits: jax.Array, *rows: np.ndarray) -> Sampled:
        """Dispatch the `kind` sampling program over `logits` with each row's chain and the host's bias
        (filled while the device computes the step just dispatched, model/host_bias.py); what it returns
        starts copying to the host."""
        b = logits.shape[0]
        params = [s.request.params for s in seqs] + [None] * (b - len(seqs))
        sa = chain_arrays(params, [s.seed for s in seqs] + [0] * (b - len(seqs)))
        host = host_bias(seqs, b, self.table.dry_buckets(b), self.config.n_vocab, self.eog_ids, self._dry_row)
        if logits is not self._logits:
            raise AssertionError("the sampler runs on the last forward step's logits only")
        post, at, pre = (None, None, None) if host is None else (host[1], host[2], host[0])
        out = self._op("sample", kind, b, 0 if host is None else host[2].shape[0], sa, post, at, pre, *rows)
        for leaf in jax.tree.leaves(out):
            if leaf.is_fully_addressable:  # across processes `read` takes this process's copy
                leaf.copy_to_host_async()
        return out

    def read(self, seqs: list[SchedSequence], sampled: Sampled) -> Tokens:
        out = self._host(sampled)
        return [_entry(out, (i,), seq.request.params.n_probs) for i, seq in enumerate(seqs)]

    def needs_host(self, seqs: list[SchedSequence]) -> bool:
        """Whether any of `seqs` uses DRY or a grammar, which the host computes from its tokens."""
        return any(_wants_dry(s.request.params) or s.request.constraint is not None for s in seqs)

    def _dry_row(self, s: SchedSequence) -> np.ndarray | None:
        """DRY's penalties [V] for a sequence that asks for it, else None."""
        p = s.request.params
        if not _wants_dry(p):
            return None
        last_n = self.n_ctx if p.dry_penalty_last_n < 0 else p.dry_penalty_last_n
        return dry_bias(s.tokens, p.dry_multiplier, p.dry_base, p.dry_allowed_length, last_n,
                        self._restarts(tuple(p.dry_sequence_breakers)), self.config.n_vocab)

    def _restarts(self, breakers: tuple[str, ...]) -> RestartSequences:
        """The breakers' restart sequences, built once per breaker list (searches of the vocabulary's
        text) and kept while that list is among the recently used."""
        if self._pieces is None:
            self._pieces = PieceIndex([self.tokenizer.token_to_piece(t, True) for t in range(self.tokenizer.n_vocab)])
        return self._dry_restarts.get(breakers, lambda: restart_sequences(
            breakers, self._pieces, lambda text: self.tokenizer.encode(text, False, False)))

    # --- after a failed iteration -------------------------------------------------------------------

    def reset(self) -> None:
        """Make again a pool or history the failed program consumed (donated)."""
        self._op("reset")

    # --- slot files (model/slots.py) -----------------------------------------------------------------

    def pages_to_host(self, pages: list[int], n_tokens: int) -> list[np.ndarray]:
        """The K/V of the first `n_tokens` cells of `pages` (in order), per pool array (`KVPool.arrays`):
        [L, n_tokens, Hkv * X] each, on the host."""
        ids = _pages_bucket(pages, self.pool.n_pages)
        cells = [np.asarray(gather_pages(leaf, ids))[:, :n_tokens] for leaf in self.pool.arrays]
        par = self.weights.parallel  # a split pool: the model's KV heads, as one device holds them
        return cells if par is None else [par.pool_to_model_heads(c, self.config) for c in cells]

    def pages_from_host(self, pages: list[int], cells: Sequence[np.ndarray]) -> None:
        """`cells` (per pool array, [L, n, Hkv * X], as `pages_to_host` returns them) into the first n
        cells of `pages`, in order."""
        ids = _pages_bucket(pages, self.pool.n_pages)
        rows = len(ids) * self.table.page_size
        if self.weights.parallel is not None:
            cells = [self.weights.parallel.model_to_pool_heads(c, self.config) for c in cells]
        leaves = []
        for leaf, part in zip(self.pool.arrays, cells, strict=True):
            padded = np.zeros((part.shape[0], rows, part.shape[2]), part.dtype)
            padded[:, :part.shape[1]] = part
            leaves.append(scatter_pages(leaf, ids, padded))
        self.pool = KVPool(*leaves)


OPS = frozenset({"row", "forward", "sample", "reset"})


def _to_host(sampled: Sampled) -> Sampled:
    """A sampled step's arrays on the host; across processes (replicated on every device), this
    process's copy."""
    return jax.tree.map(lambda a: np.asarray(a if a.is_fully_addressable else a.addressable_data(0)), sampled)


def _pages_bucket(pages: list[int], n_pages: int) -> np.ndarray:
    """The page ids padded to a power of two with `n_pages` (past the pool: reads clip, writes drop),
    so a few programs serve every length."""
    size = 1 << max(0, len(pages) - 1).bit_length()
    out = np.full(size, n_pages, np.int32)
    out[:len(pages)] = pages
    return out


def _entry(out: Sampled, at: tuple[int, ...], n_probs: int) -> tuple[int, float | None, list]:
    """One sampled position of `out` (read to the host) at index `at`: (token, logprob, top)."""
    top = [(int(t), float(lp)) for t, lp in zip(out.top_ids[at][:n_probs], out.top_logprobs[at][:n_probs],
                                                strict=True)]
    return int(out.tokens[at]), float(out.logprob[at]) if n_probs > 0 else None, top


def _wants_dry(p: SamplingParams) -> bool:
    return dry_enabled(p.dry_multiplier, p.dry_base, p.dry_penalty_last_n)
