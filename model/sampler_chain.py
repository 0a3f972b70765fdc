"""llama-server's sampler chain on device, per row, as pure functions over [B] parameter arrays.

Order (common/sampling.cpp, the default `samplers`): penalties -> DRY -> top-n-sigma -> top-k ->
typical-p -> top-p -> min-p -> XTC -> temperature (dynatemp) -> dist. Each stage mirrors its
llama.cpp sampler (src/llama-sampler.cpp) in what it keeps and how it changes logits:
- penalties: a token seen `count` times in the last `repeat_last_n` tokens of the row (prompt and
  generated, as llama-server accepts the whole prompt first) has its logit divided by
  `repeat_penalty` if positive, else multiplied, then `count * frequency + presence` subtracted;
- DRY: host-side (see `dry_bias`, model/dry.py); the device adds the bias it computed;
- top-n-sigma: logits below `max - n * std` (over the finite logits) become -inf, still candidates;
- top-k, typical-p, top-p, min-p, XTC remove candidates (a `keep` mask over the candidates sorted by
  logit); `min_keep` as llama.cpp applies it in each;
- temperature: `logit / t`, or with dynatemp `t` from the normalised entropy of the candidates;
  t <= 0 keeps only the first maximum (greedy);
- dist: one uniform draw walked along the cumulative probabilities of what is left.
The candidates are the 128 best logits when every row's top_k is in 1..128 (the usual case), else
the whole vocabulary sorted: the result is the same either way. Every parameter is an array, so a
new value never recompiles. On a GPU (`branchless`) every stage that the CPU skips when no row
needs it (a `lax.cond`, which there costs a device-to-host sync to read the predicate) is computed
anyway and the result chosen with `jnp.where`: the same tokens, no data-dependent branch. Random bits are JAX's, keyed by (seed, step) so a request draws the
same tokens whatever shares its batch; XTC draws from its own stream (llama.cpp gives it its own
mt19937). They are not llama.cpp's bits: the same seed repeats our draws, not llama.cpp's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from model.messages import SamplingParams

TOP_K_CAP = 128
NEG_INF = -jnp.inf


@jax.tree_util.register_dataclass
@dataclass
class ChainArrays:
    """Every sampler parameter of every row, [B] each."""

    temperature: jax.Array  # f32; <= 0: greedy
    dynatemp_range: jax.Array  # f32; > 0: dynamic temperature
    dynatemp_exponent: jax.Array  # f32
    top_k: jax.Array  # i32; <= 0: off
    top_p: jax.Array  # f32; >= 1: off
    min_p: jax.Array  # f32; <= 0: off
    typical_p: jax.Array  # f32; >= 1: off
    top_n_sigma: jax.Array  # f32; <= 0: off
    xtc_probability: jax.Array  # f32
    xtc_threshold: jax.Array  # f32; > 0.5: off
    repeat_last_n: jax.Array  # i32; 0: no penalties
    repeat_penalty: jax.Array  # f32
    frequency_penalty: jax.Array  # f32
    presence_penalty: jax.Array  # f32
    min_keep: jax.Array  # i32
    seed: jax.Array  # u32
    n_probs: jax.Array  # i32; > 0: report top logprobs (model/sampling.py)


def chain_arrays(params: Sequence[SamplingParams | None], seeds: Sequence[int]) -> ChainArrays:
    """Host-side [B] arrays; a None row (an idle slot) is greedy and its token is thrown away."""
    idle = SamplingParams(temperature=0.0, repeat_last_n=0)
    rows = [p or idle for p in params]

    def f32(name: str) -> np.ndarray:
        return np.array([getattr(p, name) for p in rows], np.float32)

    def i32(name: str) -> np.ndarray:
        return np.array([getattr(p, name) for p in rows], np.int32)

    return ChainArrays(
        temperature=f32("temperature"), dynatemp_range=f32("dynatemp_range"),
        dynatemp_exponent=f32("dynatemp_exponent"), top_k=i32("top_k"), top_p=f32("top_p"), min_p=f32("min_p"),
        typical_p=f32("typical_p"), top_n_sigma=f32("top_n_sigma"), xtc_probability=f32("xtc_probability"),
        xtc_threshold=f32("xtc_threshold"), repeat_last_n=i32("repeat_last_n"), repeat_penalty=f32("repeat_penalty"),
        frequency_penalty=f32("frequency_penalty"), presence_penalty=f32("presence_penalty"),
        min_keep=i32("min_keep"), seed=np.array([s & 0xFFFFFFFF for s in seeds], np.uint32), n_probs=i32("n_probs"))


# --- stages on the whole vocabulary ---------------------------------------------------------------


def penalties(logits: jax.Array, history: jax.Array, length: jax.Array, ca: ChainArrays) -> jax.Array:
    """logits [B, V]; history [B, T] the row's tokens (valid below `length` [B])."""
    b, t = history.shape
    pos = jnp.arange(t)[None, :]
    window = (pos < length[:, None]) & (pos >= (length - ca.repeat_last_n)[:, None])  # [B, T]
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
    counts = jnp.zeros(logits.shape, jnp.float32).at[rows, history].add(window.astype(jnp.float32))  # [B, V]
    rp = ca.repeat_penalty[:, None]
    penalised = jnp.where(logits <= 0, logits * rp, logits / rp)
    # llama.cpp subtracts `count * freq + (count > 0) * present` as one float
    penalised = penalised - (counts * ca.frequency_penalty[:, None] + ca.presence_penalty[:, None])
    off = (ca.repeat_last_n == 0) | ((ca.repeat_penalty == 1.0) & (ca.frequency_penalty == 0.0)
                                     & (ca.presence_penalty == 0.0))
    return jnp.where((counts > 0) & ~off[:, None], penalised, logits)


def top_n_sigma(logits: jax.Array, ca: ChainArrays) -> jax.Array:
    """Logits below max - n * std (over the finite ones) become -inf; n <= 0 is off."""
    finite = jnp.isfinite(logits)
    n_valid = jnp.maximum(finite.sum(-1, keepdims=True), 1)
    mx = jnp.max(jnp.where(finite, logits, NEG_INF), -1, keepdims=True)
    mean = jnp.where(finite, logits, 0.0).sum(-1, keepdims=True) / n_valid
    std = jnp.sqrt(jnp.where(finite, (logits - mean) ** 2, 0.0).sum(-1, keepdims=True) / n_valid)
    on = (ca.top_n_sigma > 0)[:, None]
    return jnp.where(on & (logits < mx - ca.top_n_sigma[:, None] * std), NEG_INF, logits)


# --- stages on the sorted candidates (vals [B, K] descending, keep [B, K]) ----------------------


def _softmax(vals: jax.Array, keep: jax.Array) -> jax.Array:
    masked = jnp.where(keep, vals, NEG_INF)
    mx = jnp.max(masked, -1, keepdims=True)
    e = jnp.where(keep, jnp.exp(masked - jnp.where(jnp.isfinite(mx), mx, 0.0)), 0.0)
    return e / jnp.maximum(e.sum(-1, keepdims=True), 1e-38)


def _rank(keep: jax.Array) -> jax.Array:
    """The position of each kept candidate among the kept ones, in logit order."""
    return jnp.cumsum(keep, -1) - 1


def top_k(keep: jax.Array, ca: ChainArrays) -> jax.Array:
    k = ca.top_k[:, None]
    return keep & ((k <= 0) | (jnp.arange(keep.shape[-1])[None, :] < k))


def typical(vals: jax.Array, keep: jax.Array, ca: ChainArrays) -> jax.Array:
    """Keep the tokens whose -log p is nearest the entropy, until their mass exceeds typical_p."""
    p = _softmax(vals, keep)
    logp = jnp.log(jnp.where(p > 0, p, 1.0))
    entropy = -(p * logp).sum(-1, keepdims=True)
    shifted = jnp.where(keep, jnp.abs(-logp - entropy), jnp.inf)
    order = jnp.argsort(shifted, axis=-1, stable=True)  # [B, K] most typical first
    cum = jnp.cumsum(jnp.take_along_axis(p, order, -1), -1)
    i = jnp.arange(keep.shape[-1])[None, :]
    min_keep = ca.min_keep[:, None]
    stop = (cum > ca.typical_p[:, None]) & ((min_keep == 0) | (i >= min_keep - 1))
    n_keep = jnp.where(stop.any(-1, keepdims=True), jnp.argmax(stop, -1)[:, None] + 1, keep.sum(-1, keepdims=True))
    kept_sorted = i < n_keep
    kept = jnp.zeros_like(keep).at[jnp.arange(keep.shape[0])[:, None], order].set(kept_sorted)
    return jnp.where((ca.typical_p >= 1.0)[:, None], keep, keep & kept)


def top_p(vals: jax.Array, keep: jax.Array, ca: ChainArrays) -> jax.Array:
    """The smallest prefix (in logit order) whose probability reaches top_p, at least min_keep."""
    p = _softmax(vals, keep)
    cum = jnp.cumsum(p, -1)
    rank = _rank(keep)
    stop = keep & (cum >= ca.top_p[:, None]) & (rank + 1 >= ca.min_keep[:, None])
    last = jnp.where(stop.any(-1, keepdims=True), jnp.take_along_axis(rank, jnp.argmax(stop, -1)[:, None], -1),
                     keep.shape[-1])
    return jnp.where((ca.top_p >= 1.0)[:, None], keep, keep & (rank <= last))


def min_p(vals: jax.Array, keep: jax.Array, ca: ChainArrays) -> jax.Array:
    """Keep logits >= max + log(min_p); the first max(1, min_keep) in logit order always stay."""
    mx = jnp.max(jnp.where(keep, vals, NEG_INF), -1, keepdims=True)
    floor = mx + jnp.log(jnp.maximum(ca.min_p, 1e-38))[:, None]
    stays = (vals >= floor) | (_rank(keep) < jnp.maximum(ca.min_keep, 1)[:, None])
    return jnp.where((ca.min_p <= 0.0)[:, None], keep, keep & stays)


def xtc(vals: jax.Array, keep: jax.Array, ca: ChainArrays, chance: jax.Array) -> jax.Array:
    """With probability xtc_probability (`chance` [B] uniform), drop every candidate at or above the
    threshold but the least likely of them."""
    size = keep.sum(-1)
    p = _softmax(vals, keep)
    rank = _rank(keep)
    leading = jnp.cumprod(jnp.where(keep, p >= ca.xtc_threshold[:, None], True), -1).astype(bool) & keep
    pos_last = jnp.maximum(leading.sum(-1) - 1, 0)  # [B]
    on = ((ca.xtc_probability > 0) & (ca.xtc_threshold <= 0.5) & (size >= 2) & (chance <= ca.xtc_probability)
          & (size - pos_last >= ca.min_keep) & (pos_last > 0))
    return jnp.where(on[:, None], keep & (rank >= pos_last[:, None]), keep)


def temperature(vals: jax.Array, keep: jax.Array, ca: ChainArrays) -> jax.Array:
    """The candidates' logits scaled by the (dynamic) temperature; -inf outside `keep`.

    t <= 0 keeps only the first maximum, as llama.cpp's greedy temperature does.
    """
    size = keep.sum(-1)
    p = _softmax(vals, keep)
    entropy = -(p * jnp.log(jnp.where(p > 0, p, 1.0))).sum(-1)
    max_entropy = jnp.log(jnp.maximum(size, 1).astype(jnp.float32))
    norm = entropy / jnp.where(max_entropy > 0, max_entropy, 1.0)
    lo = jnp.maximum(0.0, ca.temperature - ca.dynatemp_range)
    hi = ca.temperature + ca.dynatemp_range
    dyn = lo + (hi - lo) * jnp.power(norm, ca.dynatemp_exponent)
    t = jnp.where((ca.dynatemp_range > 0) & (size > 1), dyn, ca.temperature)  # [B]
    masked = jnp.where(keep, vals, NEG_INF)
    first_max = jnp.arange(vals.shape[-1])[None, :] == jnp.argmax(masked, -1)[:, None]
    greedy = jnp.where(first_max, masked, NEG_INF)
    return jnp.where((t <= 0)[:, None], greedy, masked / jnp.where(t > 0, t, 1.0)[:, None])


# --- the chain ------------------------------------------------------------------------------------


def either(branchless: bool, pred: jax.Array, on, off):
    """`lax.cond(pred, on, off)`; branchless: both computed, the one `pred` names selected."""
    if not branchless:
        return lax.cond(pred, on, off)
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on(), off())


def dist(final: jax.Array, u: jax.Array) -> jax.Array:
    """One uniform `u` [B] walked along the cumulative probabilities (llama.cpp's dist): the index
    [B] of the first candidate whose running sum passes u * total. The candidates past the 128 best
    add nothing, so the full-sort and the partial-sort paths draw the same token."""
    mx = jnp.max(final, -1, keepdims=True)
    p = jnp.where(jnp.isfinite(final), jnp.exp(final - mx), 0.0)
    cum = jnp.cumsum(p, -1)
    idx = jnp.sum(cum <= (u * cum[:, -1])[:, None], -1)
    last = final.shape[-1] - 1 - jnp.argmax(jnp.isfinite(final)[:, ::-1], -1)  # the last candidate left
    return jnp.minimum(idx, last)


def _keys(ca: ChainArrays, steps: jax.Array) -> tuple[jax.Array, jax.Array]:
    base = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.PRNGKey(s), n))(ca.seed, steps)
    return jax.vmap(lambda k: jax.random.fold_in(k, 0))(base), jax.vmap(lambda k: jax.random.fold_in(k, 1))(base)


def filtered(vals: jax.Array, ca: ChainArrays, chance: jax.Array, branchless: bool = False) -> jax.Array:
    """The candidates' final logits (sorted input vals [B, K]): -inf for what the chain removed."""
    keep = jnp.ones(vals.shape, bool)
    keep = top_k(keep, ca)
    keep = either(branchless, jnp.any(ca.typical_p < 1.0), lambda: typical(vals, keep, ca), lambda: keep)  # a sort
    keep = top_p(vals, keep, ca)
    keep = min_p(vals, keep, ca)
    keep = xtc(vals, keep, ca, chance)
    return temperature(vals, keep, ca)


def sample_chain(logits: jax.Array, ca: ChainArrays, history: jax.Array, length: jax.Array,
                 steps: jax.Array, bias: jax.Array | None = None, branchless: bool = False) -> jax.Array:
    """logits [B, V] f32 -> tokens [B] int32 through the whole chain.

    history [B, T] / length [B]: each row's tokens so far (for the penalties); steps [B]: the token's
    index in its request (for the random keys); bias [B, V]: DRY's penalties, added after the others.
    branchless (static): no `lax.cond`, for a GPU (see the module's docstring).
    """
    penalised = (ca.repeat_last_n != 0) & ((ca.repeat_penalty != 1.0) | (ca.frequency_penalty != 0.0)
                                           | (ca.presence_penalty != 0.0))
    x = either(branchless, jnp.any(penalised), lambda: penalties(logits, history, length, ca), lambda: logits)
    if bias is not None:
        x = x + bias
    x = either(branchless, jnp.any(ca.top_n_sigma > 0), lambda: top_n_sigma(x, ca), lambda: x)
    # all rows greedy, and nothing that can remove the best candidate (typical-p, XTC): the argmax
    greedy = (ca.temperature <= 0) & ((ca.dynatemp_range <= 0) | (ca.temperature + ca.dynatemp_range <= 0))
    xtc_on = (ca.xtc_probability > 0) & (ca.xtc_threshold <= 0.5)
    simple_greedy = greedy & (ca.typical_p >= 1.0) & ~xtc_on
    return either(branchless, jnp.all(simple_greedy), lambda: jnp.argmax(x, -1).astype(jnp.int32),
                  lambda: _draw(x, ca, steps, simple_greedy, branchless))


def _draw(x: jax.Array, ca: ChainArrays, steps: jax.Array, simple_greedy: jax.Array,
          branchless: bool = False) -> jax.Array:
    """top-k ... dist on the penalised logits x [B, V]. A greedy row with nothing that can drop the
    best token is served by the 128 best whatever its top_k."""
    draw_key, xtc_key = _keys(ca, steps)
    chance = jax.vmap(lambda k: jax.random.uniform(k))(xtc_key)
    u = jax.vmap(lambda k: jax.random.uniform(k))(draw_key)

    def draw(vals, ids):
        pick = dist(filtered(vals, ca, chance, branchless), u)  # [B]
        return jnp.take_along_axis(ids, pick[:, None], -1)[:, 0]

    def partial_sort():
        vals, ids = lax.top_k(x, min(TOP_K_CAP, x.shape[-1]))
        return draw(vals, ids.astype(jnp.int32))

    def full_sort():
        ids = jnp.argsort(-x, axis=-1, stable=True).astype(jnp.int32)
        return draw(jnp.take_along_axis(x, ids, -1), ids)

    needs_full = jnp.any(((ca.top_k <= 0) | (ca.top_k > TOP_K_CAP)) & ~simple_greedy)
    return either(branchless, needs_full, full_sort, partial_sort)
