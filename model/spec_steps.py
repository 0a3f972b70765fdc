"""The scheduler's verify steps (model/scheduler.py step 3, with speculation on).

With speculation (model/speculative.py; llama-server's --spec-type ngram-simple), step 3 first asks each
decoding sequence for a draft from its own n-grams. When some have one (and no step is in flight), the
step verifies instead of decoding: every decoding row runs its next token and its draft (k tokens, 0
for a row without one) through the target in one forward, each position is sampled with the row's
chain, and the row keeps its draft up to the first position whose sample differs, plus that sample:
1 + accepted tokens, handed out in order, each through the same stops and limits as a decoded one (a
row that finishes keeps nothing after). The cells of rejected draft tokens lie past the row's
computed ones: never read, never published, written over by the next step. Draft pages come from
the free list only; a row that uses DRY or a grammar, or a batch of more than MAX_VERIFY_ROWS, does
not draft, and a verify program not compiled yet means a plain decode step.

Whether a verify step is taken at all is `DraftCosts.choose`'s: only where it yields more tokens per
decode step's cost, as the engine's own step times and each answer's record of kept drafts say.
"""

from __future__ import annotations

from typing import Any

from model.messages import Iteration
from model.speculative import MAX_VERIFY_ROWS, NgramIndex, acceptance

Sequence = Any  # model/scheduler.py's Sequence, which imports this module


class SpeculativeSteps:
    """The Scheduler's part that drafts and verifies (a mixin: it reads and updates the scheduler's
    pool, runner, counters and sequences, as its other steps do)."""

    def _may_draft(self, seq: Sequence) -> bool:
        p = seq.request.params
        return (self.speculation.limits(p.spec_n_max, p.spec_n_min)[0] > 0
                and not self.runner.needs_host([seq]))

    def _drafts(self, rows: list[Sequence]) -> tuple[list[list[int]], int] | None:
        """Each row's draft (maybe empty), cut to what its limits, the context and the free pages
        allow and to the bucket that `draft_costs` finds worth it, and the verify bucket holding them;
        None when no row has one, decoding yields more, or no verify program fits (a plain decode step)."""
        spec = self.speculation
        if len(rows) > MAX_VERIFY_ROWS:
            return None
        drafts: list[list[int]] = []
        for seq in rows:
            draft: list[int] = []
            if self._may_draft(seq):
                p = seq.request.params
                room = self.n_ctx - 1 - seq.n_computed  # cells n_computed + 1 .. + k must lie in the context
                if p.max_tokens >= 0:
                    room = min(room, p.max_tokens - seq.completion.n_generated - 1)  # the last kept is sampled
                if seq.ngrams is None:
                    seq.ngrams = NgramIndex(spec.ngram_n)
                draft = spec.draft(seq.ngrams, seq.tokens, room, p.spec_n_max, p.spec_n_min)
            drafts.append(draft)
        if not any(drafts):
            return None
        p = [acceptance(s.draft_accepted, s.draft_rejects) for s in rows]
        chosen = self.draft_costs.choose(drafts, p, self.verify_buckets)
        if chosen is None:  # a plain decode step yields more
            return None
        free = self.pool.available() - self.pool.cached  # drafts never evict a cached prefix
        for seq, draft in zip(rows, drafts, strict=True):
            have = len(seq.pages) * self.page_size - seq.n_computed - 1  # cells past the next token's
            want = min(len(draft), chosen - 1)
            need = -(-(want - have) // self.page_size) if want > have else 0
            take = min(need, free)
            if take:
                seq.pages += self.pool.take(take)
                free -= take
            del draft[max(0, min(chosen - 1, have + take * self.page_size)):]
            if len(draft) < spec.limits(seq.request.params.spec_n_max, seq.request.params.spec_n_min)[1]:
                draft.clear()  # cut below the request's n_min
        longest = max(len(d) for d in drafts)
        if longest == 0:
            return None
        tokens = next(t for t in self.verify_buckets if t >= longest + 1)
        if not self.runner.can_verify(len(rows), tokens, rows):
            return None
        return drafts, tokens

    def _verify(self, rows: list[Sequence], drafts: list[list[int]], tokens: int, it: Iteration) -> None:
        """One verify step for `rows` of `tokens` a row (see the module's docstring)."""
        sampled = self.runner.verify(rows, drafts, tokens)
        self.spec_steps += 1
        for seq, draft, positions in zip(rows, drafts, self.runner.read_verify(rows, sampled, drafts), strict=True):
            base = seq.n_computed  # the next token's cell
            seq.draft_n += len(draft)
            kept = 0
            for j, (token, logprob, top) in enumerate(positions):
                seq.n_computed = base + 1 + j  # the next token's cell and the draft's before position j
                accepted = j < len(draft) and token == draft[j]
                kept += accepted
                seq.draft_accepted += accepted
                seq.draft_rejects += j < len(draft) and not accepted
                out = self._push(seq, token, logprob, top)
                it.outputs.append((seq.task, out))
                if out.finish_reason is not None:
                    break
                self._publish(seq)
                if not accepted:
                    break
            if draft:
                self.spec_drafts += 1
                self.spec_draft_tokens += len(draft)
                self.spec_accepted_tokens += kept
