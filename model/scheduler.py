"""The scheduler: which sequences run, which wait, and what each iteration computes.

Driven by the engine thread, one `iterate()` at a time; each iteration, top to bottom:

1. **Admit** waiting sequences, first come first served, while a sequence slot is free and the pages
   its prompt needs can be had. A prompt first takes the longest chain of cached pages it shares with
   any earlier sequence (model/pages.py, vLLM's automatic prefix caching) and computes only the rest;
   at least its last token is always computed, for the logits of the next one. The head of the queue
   that does not fit waits, and so does everyone behind it. So does a head whose next page another
   sequence is computing right now (eight clients sending one system prompt at once): it is admitted
   once that page is cached, rather than computing the same prefix beside it.
2. **Prefill**, at most `prefill_budget` prompt tokens in all, in chunks, oldest sequence first: a long
   prompt costs the running streams one chunk per iteration, never its whole length. A sequence whose
   prompt is done samples its first token.
3. **Decode** one token for every sequence past its prompt, in one batched step. A sequence whose next
   token starts a new page takes one; when none is left, the most recently admitted sequence is
   preempted (its pages freed, its full pages kept in the prefix cache, itself put back at the head of
   the queue to be computed again later), so the pool never runs out and nothing deadlocks.
4. **Hand out** one `StepOutput` per sampled token; a sequence that finished frees its slot and pages.

A request may name its slot (llama-server's `id_slot`); it waits for that slot, and so does everyone
behind it. A slot remembers the tokens its last sequence computed (`kept`), for llama-server's slot
files (model/slots.py): their K/V live in the prefix cache like any other, and `hold_kv` gets them
back, computing what the cache no longer holds.

With `lookahead` (a GPU), an iteration that only decodes sequences already running dispatches the
next step (forward and sample, its input tokens taken on the device) before it reads this step's
tokens, so the device computes while the host detokenizes, checks stops and hands out; the next
iteration reads that step instead of dispatching one. The step ahead is speculative: its cells are
counted (and its full pages published) only once this step's tokens are in and no sequence of the
batch finished; otherwise it is thrown away, its cells written again by the step that replaces it, so
every request gets the tokens, logprobs and finish it gets without lookahead. Its pages come from the
free list only (never an eviction, never a preemption); when they cannot, it is skipped. A row that
uses DRY or a grammar (whose bias or mask the host computes from the tokens)
or that surely ends at this step also skips it.

With speculation, step 3 may verify drafts instead of decoding (model/spec_steps.py).

The device work is the runner's (model/runner.py): it runs the compiled programs on the KV pool and
the token history; this module owns every decision and all the bookkeeping, and imports no jax.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from model.completion import Completion
from model.messages import (
    EngineStats,
    FinishReason,
    GenerateRequest,
    Iteration,
    PromptProgress,
    SequenceState,
    StepOutput,
)
from model.pages import ROOT_DIGEST, PagePool, chain_digest, page_digests
from model.spec_steps import SpeculativeSteps
from model.speculative import MAX_VERIFY_ROWS, DraftCosts, NgramIndex, Speculation


@dataclass(eq=False)
class Sequence:
    """One request's sequence: its tokens, where their K/V live, and its host side (`completion`)."""

    task: int
    request: GenerateRequest
    seed: int
    completion: Completion
    tokens: list[int]  # the prompt, then every sampled token
    next_token: int | None = None  # the last sampled token, whose K/V is not computed yet
    n_computed: int = 0  # tokens whose K/V are in `pages`
    pages: list[int] = field(default_factory=list)
    digests: list[bytes] = field(default_factory=list)  # keys of the full pages of `tokens`, in order
    n_published: int = 0  # full pages offered to the prefix cache
    slot: int = -1  # its row of the token history while it runs
    admitted_s: float | None = None  # its first admission
    ngrams: NgramIndex | None = None  # its drafts' index (speculation on)
    draft_n: int = 0  # drafted tokens verified
    draft_accepted: int = 0  # of those, kept
    draft_rejects: int = 0  # drafts that ended at a rejected token

    @property
    def target(self) -> int:
        """The tokens to compute before the next decode step: all of them but an unseen next token."""
        return len(self.tokens) - (self.next_token is not None)

    @property
    def prefilling(self) -> bool:
        return self.n_computed < self.target


@dataclass(eq=False)
class KVHold:
    """Pages holding the K/V of `tokens`, held for a slot file (`Scheduler.hold_kv`); what the runner's
    `prefill` reads of a sequence."""

    tokens: list[int]
    pages: list[int]
    n_computed: int


@dataclass(eq=False)
class Step:
    """A decode step dispatched for `rows`, its tokens not read yet (`sampled`: the runner's handle)."""

    rows: list[Sequence]
    sampled: Any


class Runner(Protocol):
    """The device side the scheduler drives (model.runner.Runner)."""

    def start_sequence(self, seq: Sequence) -> None:
        """A newly admitted sequence's tokens into its slot's row of the token history."""

    def prefill(self, seq: Sequence, n: int) -> Any:
        """Compute `seq`'s next `n` prompt tokens from `seq.n_computed`; the logits after the last."""

    def decode(self, seqs: list[Sequence]) -> Any:
        """One token for each of `seqs` (its `next_token`, at position `n_computed`); their logits."""

    def sample(self, seqs: list[Sequence], logits: Any) -> list[tuple[int, float | None, list[tuple[int, float]]]]:
        """The next token of each of `seqs` from its row of `logits`: (token, logprob, top)."""

    def sample_async(self, seqs: list[Sequence], logits: Any, ahead: int = 0) -> Any:
        """`sample`, dispatched and not read: a handle for `read`. ahead 1: each sequence's tokens and
        steps count one more token than the host holds (the step ahead's)."""

    def read(self, seqs: list[Sequence], sampled: Any) -> list[tuple[int, float | None, list[tuple[int, float]]]]:
        """What `sample_async` dispatched, as `sample` returns it (waits for the device)."""

    def needs_host(self, seqs: list[Sequence]) -> bool:
        """Whether sampling any of `seqs` needs its last token on the host (DRY): no step ahead."""

    def can_verify(self, rows: int, tokens: int, seqs: list[Sequence]) -> bool:
        """Whether the verify programs for `rows` rows of `tokens` tokens over `seqs`' cells are
        compiled (a verify step never waits for a compile)."""

    def verify(self, seqs: list[Sequence], drafts: list[list[int]], tokens: int) -> Any:
        """Each of `seqs`' next token and its draft through the target at once, every position sampled
        (dispatched, not read): a handle for `read_verify`."""

    def read_verify(self, seqs: list[Sequence], sampled: Any,
                    drafts: list[list[int]]) -> list[list[tuple[int, float | None, list[tuple[int, float]]]]]:
        """Per sequence, the 1 + len(draft) positions' (token, logprob, top), as `read` returns them."""


class Scheduler(SpeculativeSteps):
    def __init__(self, runner: Runner, pool: PagePool, *, max_seqs: int, n_ctx: int, prefill_budget: int,
                 lookahead: bool = False, speculation: Speculation | None = None):
        self.runner = runner
        self.speculation = speculation if speculation is not None and speculation.on else None
        self.verify_buckets = self.speculation.verify_buckets() if self.speculation else []
        self.spec_steps = self.spec_drafts = self.spec_draft_tokens = self.spec_accepted_tokens = 0
        self.draft_costs = DraftCosts()  # whether a verify step pays, learned from the steps' times
        self.lookahead = lookahead
        self._ahead: Step | None = None  # the step dispatched ahead, its tokens not read yet
        self.lookahead_steps = 0  # steps dispatched ahead
        self.lookahead_dropped = 0  # of those, thrown away (a sequence of the batch ended)
        self.pool = pool
        self.max_seqs = max_seqs
        self.n_ctx = n_ctx
        self.page_size = pool.page_size
        self.max_pages = -(-n_ctx // pool.page_size)  # one sequence's pages at most
        if pool.n_pages < self.max_pages:
            raise ValueError(f"the KV pool has {pool.n_pages} pages of {pool.page_size} tokens; one sequence "
                             f"of the whole context ({n_ctx} tokens) needs {self.max_pages}")
        self.prefill_budget = prefill_budget
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is preempted first
        self._free_slots = list(range(max_seqs - 1, -1, -1))  # popped from the end: slot 0 first
        self.kept: list[list[int] | None] = [None] * max_seqs  # each slot's last tokens (None: never ran)
        self._next_task = 0
        self.preemptions = 0
        self.iterations = 0
        # what the running iteration touched, for `reset` after it raised: the sequences running when it
        # began and those it admitted, and the head of the queue it was admitting
        self._touched: list[Sequence] = []
        self._admitting: Sequence | None = None

    # --- requests ----------------------------------------------------------------------------------

    def add(self, request: GenerateRequest, seed: int, completion: Completion) -> int:
        seq = Sequence(self._next_task, request, seed, completion, [int(t) for t in request.prompt_tokens])
        self._next_task += 1
        self.waiting.append(seq)
        return seq.task

    def cancel(self, task: int) -> StepOutput | None:
        for seq in self.waiting:
            if seq.task == task:
                self.waiting.remove(seq)
                return self._abort(seq)
        for seq in self.running:
            if seq.task == task:
                self._leave(seq)
                return self._abort(seq)
        return None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def reset(self) -> list[int]:
        """After a failed iteration: drop every sequence it touched (returns their tasks: their outputs
        went with it) and every cached page (the device's pool may hold anything now). Touched: running
        when it began or admitted by it (finished or preempted since, or not), and the head of the queue
        it was admitting, which would only fail the next iteration the same way. The waiting ones it did
        not reach stay queued, computed from their tokens."""
        touched = [*self._touched, *self.running, *([self._admitting] if self._admitting is not None else [])]
        dropped = []
        for seq in dict.fromkeys(touched):  # each once, in order (a Sequence hashes by identity)
            if seq in self.running:
                self._leave(seq)
            elif seq in self.waiting:
                self.waiting.remove(seq)
            dropped.append(seq.task)
        self._touched, self._admitting = [], None
        for seq in self.waiting:
            seq.n_computed = 0
        self.pool.clear()
        # nothing runs now: every slot is free, one a failed admission had taken too
        self._free_slots = list(range(self.max_seqs - 1, -1, -1))
        self.kept = [None if k is None else [] for k in self.kept]
        self._ahead = None
        return dropped

    # --- one iteration -----------------------------------------------------------------------------

    def iterate(self) -> Iteration:
        it = Iteration()
        self.iterations += 1
        self._touched = list(self.running)
        if self._ahead is not None and not self._decode_only():  # a request came: end the step in flight
            self._read(self._ahead, it)
            self._ahead = None

        # 1. admit, first come first served
        while self.waiting and self._free_slots:
            seq = self._admitting = self.waiting[0]
            if not self._slot_free_for(seq) or self._prefix_in_flight(seq) or not self._admit(seq):
                break
            self.waiting.popleft()
            self.running.append(seq)
            self._touched.append(seq)
            if seq.admitted_s is None:
                seq.admitted_s = time.perf_counter()
                it.admitted.append((seq.task, seq.admitted_s))
                if seq.request.return_progress:  # b11434 reports the prompt once before its first batch
                    it.outputs.append((seq.task, self._progress(seq)))

        self._admitting = None

        # 2. prefill, a bounded number of tokens, oldest first
        budget = self.prefill_budget
        for seq in [s for s in self.running if s.prefilling]:
            if budget <= 0:
                break
            n = min(seq.target - seq.n_computed, budget)
            logits = self.runner.prefill(seq, n)
            seq.n_computed += n
            budget -= n
            self._publish(seq)
            if seq.request.return_progress:
                it.outputs.append((seq.task, self._progress(seq)))
            if not seq.prefilling and seq.next_token is None:  # the prompt is done: its first token
                [(token, logprob, top)] = self.runner.sample([seq], logits)
                it.outputs.append((seq.task, self._push(seq, token, logprob, top)))

        # 3. decode one token for every sequence past its prompt, or take the step already in flight;
        # with lookahead, dispatch the next one before reading this one
        step, self._ahead = self._ahead, None
        timed = self.speculation is not None and step is None and budget == self.prefill_budget
        t0 = time.perf_counter()
        if step is None:
            rows = self._reserve([s for s in self.running if not s.prefilling])
            drafted = self._drafts(rows) if self.speculation and rows else None
            if drafted is not None:
                self._verify(rows, *drafted, it)
                if timed:  # nothing else ran in this iteration: the step's own time
                    self.draft_costs.record_verify(drafted[1], len(rows), time.perf_counter() - t0)
                return it
            step = self._dispatch(rows) if rows else None
        if step is not None:
            ahead = self._look_ahead() if self.lookahead else None
            self._read(step, it)
            if timed and ahead is None:
                self.draft_costs.record_decode(len(step.rows), time.perf_counter() - t0)
            if ahead is not None and all(seq in self.running for seq in ahead.rows):
                self._count(ahead.rows)
                self._ahead = ahead
            elif ahead is not None:
                self.lookahead_dropped += 1
        return it

    def _reserve(self, rows: list[Sequence]) -> list[Sequence]:
        """A page for each of `rows` whose next cell starts one, preempting the newest sequences when
        none is left; the rows still running."""
        for seq in list(rows):
            if seq not in self.running:  # preempted for an earlier row's page
                continue
            while seq.n_computed // self.page_size >= len(seq.pages):
                page = self.pool.take(1)
                if page is not None:
                    seq.pages += page
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                if victim in rows:
                    rows.remove(victim)
                if victim is seq:
                    break
        return rows

    def _dispatch(self, rows: list[Sequence]) -> Step:
        logits = self.runner.decode(rows)
        self._count(rows)
        return Step(rows, self.runner.sample_async(rows, logits))

    def _count(self, rows: list[Sequence]) -> None:
        """The cells a step computed for `rows` are theirs: counted, their full pages published."""
        for seq in rows:
            seq.n_computed += 1
            self._publish(seq)

    def _read(self, step: Step, it: Iteration) -> None:
        running = set(self.running)
        for seq, (token, logprob, top) in zip(step.rows, self.runner.read(step.rows, step.sampled), strict=True):
            if seq in running:  # not cancelled while its step was in flight
                it.outputs.append((seq.task, self._push(seq, token, logprob, top)))

    def _decode_only(self) -> bool:
        return not self.waiting and not any(seq.prefilling for seq in self.running)

    def _look_ahead(self) -> Step | None:
        """The next step of every running sequence, dispatched while this step's tokens are unread
        (its input tokens are theirs, on the device); None when it cannot be had safely (see the
        module's docstring). Its cells stay uncounted until the caller confirms it."""
        rows = list(self.running)
        if not rows or not self._decode_only() or self.runner.needs_host(rows):
            return None
        if self.speculation and len(rows) <= MAX_VERIFY_ROWS and any(self._may_draft(s) for s in rows):
            return None  # the next step may verify a draft, which needs this step's tokens
        for seq in rows:
            c, max_tokens = seq.completion, seq.request.params.max_tokens
            if c.n_prompt + c.n_generated + 1 >= self.n_ctx or 0 <= max_tokens <= c.n_generated + 1:
                return None  # it ends at this step: the step ahead would be thrown away
        for seq in rows:
            while seq.n_computed // self.page_size >= len(seq.pages):
                if self.pool.available() - self.pool.cached == 0:
                    return None  # no free page: evicting a cached prefix would change later requests
                seq.pages += self.pool.take(1)
        self.lookahead_steps += 1
        return Step(rows, self.runner.sample_async(rows, self.runner.decode(rows), ahead=1))

    # --- the steps' parts --------------------------------------------------------------------------

    def _admit(self, seq: Sequence) -> bool:
        """Give `seq` a slot and pages (cached ones first) for everything it must compute and its next
        token; False, with nothing taken, when the pool cannot."""
        target, page = seq.target, self.page_size
        n_shareable = self._shareable_pages(seq)
        cached: list[int] = []
        if seq.request.params.cache_prompt and n_shareable:
            cached = self.pool.match(self._digests(seq, n_shareable), len(seq.tokens))
        own = self.pool.take(min(self.max_pages, -(-(target + 1) // page)) - len(cached))
        if own is None:
            self.pool.unmatch(cached, len(seq.tokens))
            return False
        seq.pages, seq.n_computed = cached + own, len(cached) * page
        seq.n_published = len(cached)
        if seq.admitted_s is None:
            seq.completion.n_cached = seq.n_computed
        want = seq.request.id_slot
        if want >= 0:
            self._free_slots.remove(want % self.max_seqs)
            seq.slot = want % self.max_seqs
        else:
            seq.slot = self._free_slots.pop()
        self.runner.start_sequence(seq)
        return True

    def _slot_free_for(self, seq: Sequence) -> bool:
        want = seq.request.id_slot
        return want < 0 or want % self.max_seqs in self._free_slots

    def _shareable_pages(self, seq: Sequence) -> int:
        """The full pages of `seq` it may take from the cache: at least one token is computed when the
        next token must be sampled from its logits."""
        return (seq.target if seq.next_token is not None else seq.target - 1) // self.page_size

    def _prefix_in_flight(self, seq: Sequence) -> bool:
        """Whether the first page of `seq` that is not cached is being computed by a running sequence
        (and so will be cached within a few iterations: every prefilling sequence advances)."""
        n_shareable = self._shareable_pages(seq)
        if not seq.request.params.cache_prompt or not n_shareable:
            return False
        digests = self._digests(seq, n_shareable)
        n_cached = self.pool.cached_chain(digests)
        if n_cached == n_shareable:
            return False
        i = n_cached  # keys name the position too: another sequence holds this page at the same index
        return any(other.prefilling and other.n_published <= i < other.target // self.page_size
                   and self._digests(other, i + 1)[i] == digests[i] for other in self.running)

    def _digests(self, seq: Sequence, n_pages: int) -> list[bytes]:
        """The keys of `seq`'s first `n_pages` full pages, extending the ones already computed."""
        page = self.page_size
        while len(seq.digests) < n_pages:
            i = len(seq.digests)
            seq.digests.append(chain_digest(seq.digests[-1] if i else ROOT_DIGEST, seq.tokens[i * page:(i + 1) * page]))
        return seq.digests[:n_pages]

    def _publish(self, seq: Sequence) -> None:
        """Offer the pages `seq` has just filled to the prefix cache."""
        n_full = seq.n_computed // self.page_size
        if n_full > seq.n_published:
            digests = self._digests(seq, n_full)
            for i in range(seq.n_published, n_full):
                self._key_page(seq.pages[i], i, seq.tokens, digests)
            seq.n_published = n_full

    def _key_page(self, page: int, i: int, tokens: list[int], digests: list[bytes]) -> None:
        """Key `page`, the i-th full page of `tokens` (`digests`: their chain), in the prefix cache,
        with what the pool's watcher hears: its tokens and its parent's key."""
        size = self.page_size
        self.pool.publish(page, digests[i], tokens[i * size:(i + 1) * size], digests[i - 1] if i else ROOT_DIGEST)

    def _push(self, seq: Sequence, token: int, logprob: float | None, top: list[tuple[int, float]]) -> StepOutput:
        out = seq.completion.push(token, logprob, top)
        constraint = seq.request.constraint
        if constraint is not None:  # advanced past the token; a complete grammar ends the sequence
            if out.finish_reason is None:
                if not constraint.consume(token):
                    seq.completion.end_by_grammar(out, constraint.error or "not allowed")
                elif constraint.done:
                    seq.completion.end_by_grammar(out)
            out.grammar_ms = constraint.grammar_ms
        out.id_slot = seq.slot  # llama-server's `id_slot` in /completion's answer: the slot that decoded it
        out.draft_n, out.draft_n_accepted = seq.draft_n, seq.draft_accepted
        if out.finish_reason is not None:
            self._leave(seq)
        else:
            seq.tokens.append(token)
            seq.next_token = token
        return out

    @staticmethod
    def _progress(seq: Sequence) -> StepOutput:
        """llama-server's prompt progress when the prompt starts and after each prefill chunk
        (server-context.cpp: sent when the request streams with return_progress). `processed` counts
        what the sequence's cache holds of the prompt (at the start: what the prefix cache gave it)."""
        c = seq.completion
        ms = int((time.perf_counter() - seq.admitted_s) * 1e3) if seq.admitted_s is not None else 0
        progress = PromptProgress(c.n_prompt, c.n_cached, min(seq.n_computed, c.n_prompt), ms)
        return StepOutput(token=None, prompt_tokens=c.n_prompt, cached_tokens=c.n_cached, utf8_complete=False,
                          id_slot=seq.slot, progress=progress)

    def _preempt(self, seq: Sequence) -> None:
        """Free `seq`'s slot and pages and put it back at the head of the queue; it is computed again
        (mostly from the prefix cache, if its pages are still there) when it is admitted next."""
        self._leave(seq)
        seq.n_computed = 0
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def _leave(self, seq: Sequence) -> None:
        self.kept[seq.slot] = seq.tokens[:seq.n_computed]
        self.running.remove(seq)
        self.pool.release(seq.pages)
        seq.pages, seq.n_published = [], 0
        self._free_slots.append(seq.slot)
        seq.slot = -1

    @staticmethod
    def _abort(seq: Sequence) -> StepOutput:
        return StepOutput(token=None, finish_reason=FinishReason.ABORT, prompt_tokens=seq.completion.n_prompt,
                          completion_tokens=seq.completion.n_generated, cached_tokens=seq.completion.n_cached)

    # --- seen from outside -------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        by_slot = {s.slot: s for s in self.running}
        states = []
        for slot in range(self.max_seqs):
            seq = by_slot.get(slot)
            if seq is None:
                kept = self.kept[slot]
                states.append(SequenceState(id=slot, id_task=-1, is_processing=False, n_ctx=self.n_ctx,
                                            n_kept=None if kept is None else len(kept)))
                continue
            c, max_tokens = seq.completion, seq.request.params.max_tokens
            states.append(SequenceState(
                id=slot, id_task=seq.task, is_processing=True, n_ctx=self.n_ctx, n_prompt=c.n_prompt,
                n_cached=c.n_cached, n_prompt_done=min(seq.n_computed, c.n_prompt), n_decoded=c.n_generated,
                n_remain=-1 if max_tokens < 0 else max(0, max_tokens - c.n_generated),
                prefilling=seq.prefilling, params=seq.request.params))
        return EngineStats(
            max_seqs=self.max_seqs, running=len(self.running), waiting=len(self.waiting),
            page_size=self.page_size, pages_total=self.pool.n_pages, pages_used=self.pool.used,
            pages_cached=self.pool.cached, prefix_queries_tokens=self.pool.queries_tokens,
            prefix_hits_tokens=self.pool.hits_tokens, preemptions=self.preemptions, iterations=self.iterations,
            spec_steps=self.spec_steps, spec_drafts=self.spec_drafts, spec_draft_tokens=self.spec_draft_tokens,
            spec_accepted_tokens=self.spec_accepted_tokens, sequences=tuple(states))

    # --- slot files (model/slots.py) ---------------------------------------------------------------

    def slot_busy(self, slot: int) -> bool:
        return any(seq.slot == slot for seq in self.running)

    def hold_kv(self, tokens: list[int]) -> KVHold | None:
        """Pages holding the K/V of all of `tokens`, held until `release_kv` (which publishes what was
        computed): the prefix cache's chain first, the rest computed into pages of its own. None, with
        nothing held, when the pool has no pages for the rest."""
        page = self.page_size
        digests = page_digests(tokens, page)
        cached = self.pool.hold(digests)
        own = self.pool.take(-(-len(tokens) // page) - len(cached))
        if own is None:
            self.pool.release(cached)
            return None
        hold = KVHold(tokens, cached + own, len(cached) * page)
        while hold.n_computed < len(tokens):
            n = min(len(tokens) - hold.n_computed, self.prefill_budget)
            self.runner.prefill(hold, n)
            hold.n_computed += n
        return hold

    def take_kv(self, n_tokens: int) -> list[int] | None:
        """Pages for `n_tokens` restored from a slot file (None when the pool has too few)."""
        return self.pool.take(-(-n_tokens // self.page_size))

    def release_kv(self, tokens: list[int], pages: list[int]) -> None:
        """Let go of pages `hold_kv` or `take_kv` gave, their full pages of `tokens` kept in the prefix cache."""
        digests = page_digests(tokens, self.page_size)
        for i, page in enumerate(pages[:len(digests)]):
            self._key_page(page, i, tokens, digests)
        self.pool.release(pages)

    def keep(self, slot: int, tokens: list[int] | None) -> None:
        """The slot's kept tokens, after a restore (None: as if it never ran)."""
        self.kept[slot] = tokens

    def erase(self, slot: int) -> int:
        """Forget the slot's tokens and their pages in the prefix cache; how many tokens it had."""
        tokens = self.kept[slot] or []
        self.pool.forget(page_digests(tokens, self.page_size))
        self.kept[slot] = []
        return len(tokens)
