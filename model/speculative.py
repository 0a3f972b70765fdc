"""Speculative decoding's host side: what to draft, and how many tokens a verify step holds.

A sequence's draft comes from its own tokens (prompt and answer), as llama-server's `--spec-type
ngram-simple` finds it: the last `n` tokens (the key) are looked up among the earlier n-grams of the
sequence, and the `m` tokens that followed the latest earlier occurrence are the draft, cut to the
request's `speculative.n_max` (`--draft-max`); a draft shorter than `speculative.n_min` is dropped.
The index of n-grams grows with the sequence (`NgramIndex`), so a step costs the tokens added since
the last one, never a scan of the whole context.

The scheduler (model/scheduler.py) runs every drafting sequence of a step through the target in one
forward of 1 + k tokens per row (the last sampled token, then the draft), samples each position with
the request's own sampler chain, seed and step index, and keeps the draft up to the first position
whose sample differs from it, plus that sample. Drafts here are deterministic (a point mass q on the
drafted token), so this is Leviathan et al. (2023)'s rejection sampling with q = delta(d): the draft
is accepted with probability p(d), and on rejection the token is drawn from p with d removed,
renormalised. Since every position is sampled with the random numbers its step would have had
without speculation, the tokens are the same as without it, at any temperature, whenever the logits
are.
"""

from __future__ import annotations

from dataclasses import dataclass

from model.programs import MAX_VERIFY_ROWS

SPEC_TYPES = ("none", "ngram-simple")
# llama-server's other types, refused by name at start
NOT_DONE = {
    "ngram-cache": "its n-gram statistics files",
    "ngram-map-k": "its key-hit counting",
    "ngram-map-k4v": "its four values per key",
    "ngram-mod": "its hash pool shared by all slots",
}
MIN_VERIFY_TOKENS = 4  # the smallest verify bucket (1 + k tokens a row)
MAX_DRAFT = 63  # the largest verify bucket: 64 tokens a row
__all__ = ["MAX_VERIFY_ROWS", "NgramIndex", "Speculation", "spec_type_refusal"]


def spec_type_refusal(spec_type: str) -> str | None:
    if spec_type in SPEC_TYPES:
        return None
    if spec_type in NOT_DONE:
        return (f"--spec-type {spec_type}: not in this engine ({NOT_DONE[spec_type]}); it drafts with "
                "ngram-simple, or none")
    return f"--spec-type {spec_type!r}: one of {', '.join(SPEC_TYPES)}"


@dataclass(frozen=True)
class Speculation:
    """The server's speculative decoding: llama-server's --spec-type, --spec-ngram-size-n/-m and
    --draft-max/--draft-min (the defaults of a request's speculative.n_max and n_min)."""

    spec_type: str = "none"
    ngram_n: int = 12  # the key: the last n tokens
    ngram_m: int = 48  # the draft: the m tokens after the key's earlier occurrence
    draft_max: int = 16
    draft_min: int = 0

    def __post_init__(self):
        if why := spec_type_refusal(self.spec_type):
            raise ValueError(why)
        for name in ("ngram_n", "ngram_m", "draft_max"):
            if getattr(self, name) < 1:
                raise ValueError(f"speculation's {name} must be at least 1, got {getattr(self, name)}")
        if self.draft_max > MAX_DRAFT:  # it sizes the verify programs: 1 + draft_max tokens a row
            raise ValueError(f"speculation's draft_max must be at most {MAX_DRAFT}, got {self.draft_max}")
        if self.draft_min < 0:
            raise ValueError(f"speculation's draft_min must be at least 0, got {self.draft_min}")

    @property
    def on(self) -> bool:
        return self.spec_type != "none"

    def verify_buckets(self) -> list[int]:
        """The tokens a verify row holds (1 + k, padded): 1 + draft_max, and below it the powers of two
        from MIN_VERIFY_TOKENS up to half of it (4, 8, 17 for draft_max 16). An n-gram draft is mostly
        as long as a request allows (m 48 > draft_max), so the top bucket fits it exactly; each bucket
        is a program per batch and window."""
        if not self.on:
            return []
        top, out, t = self.draft_max + 1, [], MIN_VERIFY_TOKENS
        while 2 * t <= top:
            out.append(t)
            t *= 2
        return [*out, top]

    def draft(self, index: NgramIndex, tokens: list[int], room: int, n_max: int, n_min: int) -> list[int]:
        """A sequence's draft from its n-gram index: at most `room` tokens (what the context and the
        request's max_tokens leave) and the request's limits (speculative.n_max, n_min: `limits`); none
        when shorter than n_min, or than 1."""
        n_max, n_min = self.limits(n_max, n_min)
        k = min(room, n_max, self.ngram_m)
        draft = index.draft(tokens, k) if k > 0 else []
        return draft if len(draft) >= max(n_min, 1) else []

    def limits(self, n_max: int, n_min: int) -> tuple[int, int]:
        """A request's (n_max, n_min), -1 meaning the server's, clamped as llama-server clamps them
        (n_min <= n_max, both >= 0) and to the server's --draft-max, which sizes the programs."""
        hi = self.draft_max if n_max < 0 else min(n_max, self.draft_max)
        lo = self.draft_min if n_min < 0 else n_min
        return max(hi, 0), max(min(lo, hi), 0)


class NgramIndex:
    """One sequence's n-grams of length n, each with where its latest occurrence that a token follows
    ends; the draft after the sequence's last n tokens (`draft`)."""

    def __init__(self, n: int):
        self.n = n
        self._end: dict[tuple[int, ...], int] = {}
        self._indexed = n  # n-grams ending (exclusive) below this are indexed

    def draft(self, tokens: list[int], m: int) -> list[int]:
        """Up to m tokens that followed the latest earlier occurrence of the last n of `tokens`."""
        n, length = self.n, len(tokens)
        for end in range(self._indexed, length):  # every n-gram a token follows: end < length
            self._end[tuple(tokens[end - n:end])] = end
        self._indexed = max(self._indexed, length)
        if length < n or m <= 0:
            return []
        end = self._end.get(tuple(tokens[length - n:]))
        return [] if end is None else tokens[end:end + m]


def expected_kept(p: float, k: int) -> float:
    """The draft tokens a verify step keeps on average from a draft of k whose every token, given the
    ones before it were kept, is kept with probability p: p + p^2 + ... + p^k."""
    return k if p >= 1.0 else p * (1.0 - p ** k) / (1.0 - p)


def acceptance(kept: int, rejected: int) -> float:
    """A sequence's estimate of p from its own drafts so far: the tokens kept over the tokens tried (kept,
    plus one per draft that ended at a rejection), with one of each assumed before any (0.5 at first)."""
    return (kept + 1) / (kept + rejected + 2)


class DraftCosts:
    """Whether a verify step is worth it, from what the steps themselves cost.

    A decode step of n rows yields n tokens; a verify step of n rows of T tokens yields n plus the drafts'
    kept tokens and costs r(T, n) decode steps, measured here as the engine runs (on a 2-vCPU CPU a
    17-token verify of one row costs about 4 decode steps; on a GPU, near 1). `choose` takes the bucket
    with the most tokens per decode-step cost, or none when decoding yields more: on a CPU a draft
    must be likely to pay for itself, a long one likelier still. A shape not measured yet counts as
    costing one decode step, so it is tried once and known from then on.
    """

    EMA = 0.2  # weight of the newest measurement

    def __init__(self, fixed_ratio: float | None = None):
        self.fixed_ratio = fixed_ratio  # tests: every verify step costs this many decode steps
        self.decode_s: dict[int, float] = {}  # by rows
        self.verify_s: dict[tuple[int, int], float] = {}  # by (tokens a row, rows)

    def _record(self, table: dict, key, seconds: float) -> None:
        old = table.get(key)
        table[key] = seconds if old is None else old + self.EMA * (seconds - old)

    def record_decode(self, rows: int, seconds: float) -> None:
        self._record(self.decode_s, rows, seconds)

    def record_verify(self, tokens: int, rows: int, seconds: float) -> None:
        self._record(self.verify_s, (tokens, rows), seconds)

    def ratio(self, tokens: int, rows: int) -> float:
        if self.fixed_ratio is not None:
            return self.fixed_ratio
        v, d = self.verify_s.get((tokens, rows)), self.decode_s.get(rows)
        return 1.0 if v is None or d is None else v / d

    def choose(self, drafts: list[list[int]], p: list[float], buckets: list[int]) -> int | None:
        """The verify bucket for these rows' drafts (each row's kept-token probability in `p`), or None
        for a plain decode step. A draft longer than T - 1 is cut to it."""
        n = len(drafts)
        best, best_rate = None, float(n)  # a decode step: n tokens for one step's cost
        for t in buckets:
            gain = sum(expected_kept(q, min(len(d), t - 1)) for d, q in zip(drafts, p, strict=True))
            rate = (n + gain) / self.ratio(t, n)
            if rate > best_rate:
                best, best_rate = t, rate
            if t - 1 >= max(len(d) for d in drafts):
                break  # a larger bucket holds no more of the drafts
        return best
