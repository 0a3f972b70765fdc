"""The engine's fixed table of program shapes: every (kind, padded length, window) a step can take.

Fixed by the engine's sizes alone (n_ctx, the largest prefill chunk, the page size, max_seqs), so no
temperature, token or batch ever asks for a program outside it:
- "prefill": a chunk of one sequence's prompt, padded to a power of two (from MIN_PREFILL_BUCKET up to
  the largest chunk); a chunk after cached cells (a reused prefix, or the chunks before it) from
  CONTINUE_BUCKET up, attending to a window of them;
- "decode": one token for each of up to `max_seqs` rows (`batches`), attending to a window;
- "select": the sampler for a batch, with 0 or a batch bucket of rows that use DRY;
- "row": a prompt into the token history;
- with speculation (model/speculative.py), for each verify bucket T: "verify{T}", T tokens for each of up
  to MAX_VERIFY_ROWS rows (a next token and its draft) attending to a prefill window, and "vselect{T}",
  the sampler at each of their positions (with 0 or a bucket of DRY rows, as "select"); those past the
  smallest window compile when a step first wants them (`on_demand`), not at start.
Windows are counted in cells and given to programs in pages: powers of two from MIN_WINDOW up to the
whole context, and for decode, which reads its whole window every step, 1.5x each between them.
`essential_keys` are what first short requests need (model/compiled.py compiles them before the rest).
"""

from __future__ import annotations

from dataclasses import dataclass, field

MIN_PREFILL_BUCKET = 16
CONTINUE_BUCKET = 64  # the smallest bucket of a prompt's rest after a reused prefix
MIN_WINDOW = 256  # smallest attention-window bucket over cached cells
# What first requests need (`essential_keys`): prompts of up to this many tokens from position 0 (or
# a short rest after a cached prefix), then an answer while prompt and answer fit in ESSENTIAL_CELLS
# (several at once: MIN_WINDOW); larger shapes compile in the background
ESSENTIAL_PROMPT = 256
ESSENTIAL_CELLS = 512

# a batch of more sequences decodes without drafts: its step reads the weights for many tokens already,
# and 1 + k tokens for each would make it a prefill (vLLM's disable_by_batch_size does the same)
MAX_VERIFY_ROWS = 8

Key = tuple[str, int, int]


def pow2_at_least(n: int, floor: int) -> int:
    return max(floor, 1 << max(0, n - 1).bit_length())


def batch_buckets(max_seqs: int) -> list[int]:
    """Decode batch sizes: the powers of two below max_seqs, and max_seqs."""
    return sorted({*(1 << i for i in range(max_seqs.bit_length()) if 1 << i < max_seqs), max_seqs})


@dataclass(frozen=True)
class ProgramTable:
    n_ctx: int
    prefill_chunk: int
    page_size: int
    max_seqs: int
    verify_tokens: tuple[int, ...] = ()  # speculation's verify buckets (1 + k tokens a row); () none
    # looked up on every step: computed once
    prefill_windows: list[int] = field(init=False, repr=False)
    decode_windows: list[int] = field(init=False, repr=False)
    batches: list[int] = field(init=False, repr=False)

    def __post_init__(self):
        windows, w = [], MIN_WINDOW
        while w < self.n_ctx:
            windows.append(w)
            w *= 2
        windows.append(self.n_ctx)
        between = [w * 3 // 2 for w in windows if w * 3 // 2 < self.n_ctx]
        object.__setattr__(self, "prefill_windows", windows)
        object.__setattr__(self, "decode_windows", sorted({*windows, *between}))
        object.__setattr__(self, "batches", batch_buckets(self.max_seqs))

    def prefill_buckets(self) -> list[int]:
        top = min(self.prefill_chunk, pow2_at_least(self.n_ctx, MIN_PREFILL_BUCKET))
        return [b for b in (MIN_PREFILL_BUCKET << i for i in range(16)) if b <= top]

    def continue_buckets(self) -> list[int]:
        """The buckets of a prompt chunk that starts after cached cells: the prefill buckets from
        CONTINUE_BUCKET up."""
        return [b for b in self.prefill_buckets() if b >= CONTINUE_BUCKET] or self.prefill_buckets()[-1:]

    def dry_buckets(self, b: int) -> list[int]:
        """The DRY-row counts a select of b rows is compiled for: 0 (none), then the batch buckets."""
        return [0, *(d for d in self.batches if d <= b)]

    def window_pages(self, n_cells: int, buckets: list[int]) -> int:
        """The pages of the smallest window bucket holding `n_cells` cached cells (0: none)."""
        if n_cells == 0:
            return 0
        w = next((w for w in buckets if w >= n_cells), None)
        if w is None:
            raise ValueError(f"{n_cells} cells exceed the largest window ({buckets[-1]}) of a {self.n_ctx}-cell context")
        return -(-w // self.page_size)

    def prefill_shape(self, start: int, n: int) -> tuple[int, int]:
        """The bucket (padded tokens) and the window (pages) of a chunk of `n` tokens from `start`."""
        if start == 0:
            t = min(self.prefill_chunk, pow2_at_least(n, MIN_PREFILL_BUCKET))
        else:
            t = next(b for b in self.continue_buckets() if b >= n)
        return t, self.window_pages(start, self.prefill_windows)

    def keys(self) -> list[Key]:
        """Every program the engine can run: what its `warmup` compiles."""
        keys = [("prefill", t, 0) for t in self.prefill_buckets()]
        for w in self.prefill_windows:
            keys += [("prefill", t, self.window_pages(w, self.prefill_windows)) for t in self.continue_buckets()]
        for b in self.batches:
            keys += [("decode", b, self.window_pages(w, self.decode_windows)) for w in self.decode_windows]
        keys += [("row", 0, 0)] + [("select", b, d) for b in self.batches for d in self.dry_buckets(b)]
        for t in self.verify_tokens:
            for b in self.verify_batches():
                keys += [(f"verify{t}", b, self.window_pages(w, self.prefill_windows)) for w in self.prefill_windows]
                keys += [(f"vselect{t}", b, d) for d in self.dry_buckets(b)]
        return keys

    def verify_window(self, n_cells: int) -> int:
        """The window (pages) of a verify step whose rows hold at most `n_cells` cached cells: the
        powers of two only (a verify step is rarer than a decode step, and each window is a program
        for every verify bucket and batch)."""
        return self.window_pages(n_cells, self.prefill_windows)

    def on_demand(self, key: Key) -> bool:
        """Whether a program is compiled only once a step wants it (model/compiled.py `compile_soon`),
        not in the background at start: the verify programs past the smallest window. Most servers use
        few of them (the windows their conversations reach), and all of them would take minutes of a
        small CPU's time (SmolLM2 on 2 vCPUs: 156 programs, 430 s)."""
        return key[0].startswith("verify") and key[2] > self.verify_window(min(MIN_WINDOW, self.n_ctx))

    def verify_batches(self) -> list[int]:
        """The batch buckets a verify step takes: those up to the one holding MAX_VERIFY_ROWS rows."""
        top = next((b for b in self.batches if b >= MAX_VERIFY_ROWS), self.batches[-1])
        return [b for b in self.batches if b <= top]

    def essential_keys(self) -> list[Key]:
        """The programs first requests need when their prompts have at most ESSENTIAL_PROMPT tokens (or
        a rest of at most 2 * CONTINUE_BUCKET after a cached prefix of less than MIN_WINDOW) and prompt
        and answer fit in ESSENTIAL_CELLS (several requests at once: MIN_WINDOW): the smallest prefill
        buckets, the smallest decode windows, the samplers and the history row."""
        keys = [("prefill", t, 0) for t in self.prefill_buckets() if t <= ESSENTIAL_PROMPT]
        keys += [("prefill", t, self.window_pages(min(MIN_WINDOW, self.n_ctx), self.prefill_windows))
                 for t in self.continue_buckets() if t <= 2 * CONTINUE_BUCKET]
        for b in self.batches:  # one sequence up to ESSENTIAL_CELLS, several at once in the smallest window
            keys += [("decode", b, self.window_pages(w, self.decode_windows))
                     for w in self.decode_windows if w <= (ESSENTIAL_CELLS if b == 1 else MIN_WINDOW)]
        keys += [("row", 0, 0)] + [("select", b, 0) for b in self.batches]
        return list(dict.fromkeys(keys))

    def background_order(self, compiled) -> list[Key]:
        """The programs not in `compiled`, the likeliest next needs first: small windows (a longer answer,
        a second turn reusing its prefix) before large ones, then the larger chunks."""
        rest = [k for k in self.keys() if k not in compiled and not self.on_demand(k)]
        return sorted(rest, key=lambda k: (k[2], k[0] != "decode", k[1]))
