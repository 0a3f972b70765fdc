"""model/sampler_chain.py, stage by stage on hand-made logits: each effect can be checked by hand.

Candidates are given sorted by logit, as the chain holds them; probabilities are chosen so the
arithmetic is visible (log-probabilities as logits).
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np

from model import sampler_chain as sc
from model.messages import SamplingParams

jax.config.update("jax_platforms", "cpu")


def arrays(*rows: dict, seeds=None) -> sc.ChainArrays:
    return jax.tree.map(jnp.asarray, sc.chain_arrays([SamplingParams(**r) for r in rows],
                                                     seeds or [7] * len(rows)))


def logp(*probs: float) -> jnp.ndarray:
    return jnp.log(jnp.array([probs], jnp.float32))


ALL = jnp.ones((1, 3), bool)


def test_penalties_divide_positive_multiply_negative_and_subtract_counts_in_the_window():
    logits = jnp.array([[2.0, -2.0, 1.0, 0.5, 0.0, 0.0]])
    history = jnp.array([[0, 2, 1, 0, 3, 5]])  # the window of 4 is positions 1..4: tokens 2, 1, 0, 3
    out = sc.penalties(logits, history, jnp.array([5]), arrays(dict(repeat_last_n=4, repeat_penalty=2.0,
                                                                    frequency_penalty=0.5, presence_penalty=0.25)))
    # token 0: 2/2 - (0.5 + 0.25); 1: -2*2 - 0.75; 2: 1/2 - 0.75; 3: 0.5/2 - 0.75; 4 unseen; 5 past the end
    np.testing.assert_allclose(out[0], [0.25, -4.75, -0.25, -0.5, 0.0, 0.0])


def test_a_token_seen_twice_pays_the_frequency_penalty_twice():
    out = sc.penalties(jnp.array([[1.0, 1.0]]), jnp.array([[0, 0, 1]]), jnp.array([3]),
                       arrays(dict(repeat_last_n=64, frequency_penalty=0.5)))
    np.testing.assert_allclose(out[0], [0.0, 0.5])


def test_penalties_are_off_with_repeat_last_n_0_or_neutral_values():
    logits, hist = jnp.array([[2.0, -2.0]]), jnp.array([[0, 1]])
    for row in (dict(repeat_last_n=0, repeat_penalty=2.0), dict(repeat_last_n=64)):
        np.testing.assert_array_equal(sc.penalties(logits, hist, jnp.array([2]), arrays(row)), logits)


def test_top_n_sigma_masks_logits_below_max_minus_n_std():
    logits = jnp.array([[3.0, 2.0, 1.0, 0.0]])  # mean 1.5, std sqrt(1.25) = 1.118
    out = sc.top_n_sigma(logits, arrays(dict(top_n_sigma=1.0)))
    np.testing.assert_array_equal(out[0], [3.0, 2.0, -np.inf, -np.inf])
    np.testing.assert_array_equal(sc.top_n_sigma(logits, arrays(dict(top_n_sigma=-1.0))), logits)


def test_top_k_keeps_the_k_best():
    assert sc.top_k(jnp.ones((1, 4), bool), arrays(dict(top_k=2))).tolist() == [[True, True, False, False]]
    assert sc.top_k(jnp.ones((1, 4), bool), arrays(dict(top_k=0))).all()


def test_typical_keeps_the_tokens_nearest_the_entropy_even_without_the_best():
    vals = logp(0.5, 0.3, 0.2)  # entropy 1.0297; |-log p - H|: 0.337, 0.174, 0.580
    assert sc.typical(vals, ALL, arrays(dict(typical_p=0.5))).tolist() == [[True, True, False]]
    assert sc.typical(vals, ALL, arrays(dict(typical_p=0.2))).tolist() == [[False, True, False]]
    assert sc.typical(vals, ALL, arrays(dict(typical_p=0.2, min_keep=2))).tolist() == [[True, True, False]]
    assert sc.typical(vals, ALL, arrays(dict(typical_p=1.0))).all()


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    vals = logp(0.5, 0.3, 0.2)
    assert sc.top_p(vals, ALL, arrays(dict(top_p=0.7))).tolist() == [[True, True, False]]
    assert sc.top_p(vals, ALL, arrays(dict(top_p=0.45))).tolist() == [[True, False, False]]
    assert sc.top_p(vals, ALL, arrays(dict(top_p=0.45, min_keep=3))).all()


def test_top_p_renormalises_over_what_is_left():
    vals = logp(0.5, 0.3, 0.2)
    kept = jnp.array([[False, True, True]])  # 0.3 and 0.2 become 0.6 and 0.4
    assert sc.top_p(vals, kept, arrays(dict(top_p=0.55))).tolist() == [[False, True, False]]


def test_min_p_keeps_logits_within_log_p_of_the_best():
    vals = logp(0.5, 0.3, 0.2)
    assert sc.min_p(vals, ALL, arrays(dict(min_p=0.5))).tolist() == [[True, True, False]]
    assert sc.min_p(vals, ALL, arrays(dict(min_p=0.5, min_keep=3))).all()
    assert sc.min_p(vals, ALL, arrays(dict(min_p=0.0))).all()


def test_xtc_drops_all_above_the_threshold_but_the_least_likely_when_its_chance_comes():
    vals = logp(0.5, 0.3, 0.2)
    on = arrays(dict(xtc_probability=0.5, xtc_threshold=0.25))
    assert sc.xtc(vals, ALL, on, jnp.array([0.1])).tolist() == [[False, True, True]]
    assert sc.xtc(vals, ALL, on, jnp.array([0.9])).all()  # the chance did not come
    off = arrays(dict(xtc_probability=0.5, xtc_threshold=0.6))  # a threshold over 0.5 disables it
    assert sc.xtc(vals, ALL, off, jnp.array([0.1])).all()
    assert sc.xtc(vals, ALL, arrays(dict(xtc_probability=1.0, xtc_threshold=0.25, min_keep=3)),
                  jnp.array([0.1])).all()  # it would leave fewer than min_keep


def test_temperature_scales_and_zero_keeps_the_first_maximum():
    vals = jnp.array([[2.0, 2.0, 1.0]])
    np.testing.assert_allclose(sc.temperature(vals, ALL, arrays(dict(temperature=0.5))), [[4.0, 4.0, 2.0]])
    np.testing.assert_array_equal(sc.temperature(vals, ALL, arrays(dict(temperature=0.0))),
                                  [[2.0, -np.inf, -np.inf]])


def test_dynatemp_follows_the_normalised_entropy():
    flat = jnp.array([[1.0, 1.0, -jnp.inf]])  # entropy log 2 over 2 candidates: normalised 1 -> t = 1.5
    kept = jnp.array([[True, True, False]])
    out = sc.temperature(flat, kept, arrays(dict(temperature=1.0, dynatemp_range=0.5, dynatemp_exponent=1.0)))
    np.testing.assert_allclose(out[0, :2], [1 / 1.5, 1 / 1.5], rtol=1e-6)
    peaked = logp(0.98, 0.01, 0.01)
    h = -(0.98 * math.log(0.98) + 2 * 0.01 * math.log(0.01)) / math.log(3)
    out = sc.temperature(peaked, ALL, arrays(dict(temperature=1.0, dynatemp_range=0.5, dynatemp_exponent=1.0)))
    np.testing.assert_allclose(out[0], peaked[0] / (0.5 + 1.0 * h), rtol=1e-5)


def test_dist_walks_the_cumulative_probabilities():
    final = logp(0.5, 0.3, 0.2)
    picks = [int(sc.dist(final, jnp.array([u]))[0]) for u in (0.0, 0.49, 0.51, 0.79, 0.81, 0.999)]
    assert picks == [0, 0, 1, 1, 2, 2]
    masked = jnp.array([[jnp.log(0.5), -jnp.inf, jnp.log(0.5), -jnp.inf]])
    assert [int(sc.dist(masked, jnp.array([u]))[0]) for u in (0.0, 0.6, 0.9999999)] == [0, 2, 2]


# --- the whole chain ------------------------------------------------------------------------------

V = 300
LOGITS = jax.random.normal(jax.random.PRNGKey(0), (1, V)) * 3.0
HIST = jnp.zeros((1, 8), jnp.int32)
SAMPLE = jax.jit(sc.sample_chain)  # one program for every value below (same shapes)


def draws(row: dict, steps, seed: int = 5, logits=LOGITS, history=HIST, length=0) -> list[int]:
    """One draw per step, all in one batch (rows are independent: same params, their own step)."""
    n = len(steps)
    out = SAMPLE(jnp.repeat(logits, n, 0), arrays(*[row] * n, seeds=[seed] * n), jnp.repeat(history, n, 0),
                 jnp.full((n,), length), jnp.asarray(steps))
    return [int(t) for t in out]


def chain(row: dict, step: int = 0, **kw) -> int:
    return draws(row, [step], **kw)[0]


def test_greedy_is_the_argmax_and_a_penalty_can_move_it():
    logits = jnp.array([[2.0, 1.9, 0.0, -1.0]])
    hist = jnp.array([[0, 0, 0, 0]])
    assert chain(dict(temperature=0.0), logits=logits, history=hist, length=0) == 0
    assert chain(dict(temperature=0.0, repeat_penalty=2.0), logits=logits, history=hist, length=1) == 1


def test_the_same_seed_gives_the_same_tokens_and_another_seed_others():
    row = dict(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0)
    a = draws(row, range(20), seed=11)
    assert a == draws(row, range(20), seed=11)
    assert a != draws(row, range(20), seed=12)


def test_top_k_bounds_every_draw():
    best = set(np.argsort(-np.asarray(LOGITS[0]))[:3].tolist())
    row = dict(temperature=5.0, top_k=3, top_p=1.0, min_p=0.0)
    # 40 draws in batches of 20: the program the test above compiled (each row draws on its own step)
    got = set(draws(row, range(20)) + draws(row, range(20, 40)))
    assert got <= best and len(got) > 1


def test_a_row_draws_the_same_whatever_shares_its_batch():
    """A row needing the full sort switches the batch to it; the other row's draws do not change."""
    row = dict(temperature=1.0, top_k=40, top_p=0.9, min_p=0.02)
    other = dict(temperature=1.0, top_k=0)
    logits = jnp.concatenate([LOGITS, LOGITS[:, ::-1]])
    alone = draws(row, range(20), seed=3)[:10]  # every row in 1..128: the partial sort (batch 20: compiled above)
    for step in range(10):
        both = SAMPLE(logits, arrays(row, other, seeds=[3, 4]), jnp.zeros((2, 8), jnp.int32),
                      jnp.array([0, 0]), jnp.array([step, step]))  # top_k 0: the full sort
        assert int(both[0]) == alone[step]


def test_any_values_run_in_the_one_compiled_program():
    rows = (dict(temperature=0.0), dict(temperature=0.7, typical_p=0.9, xtc_probability=0.5, top_n_sigma=2.0),
            dict(temperature=1.2, dynatemp_range=0.4, repeat_penalty=1.3, presence_penalty=0.2),
            dict(temperature=0.8, xtc_probability=1.0, top_k=0))
    chain(rows[0])
    compiled = SAMPLE._cache_size()
    for row in rows:
        assert 0 <= chain(row, step=1, length=3) < V
    assert SAMPLE._cache_size() == compiled  # no value recompiles


# --- the branchless chain (a GPU's: no lax.cond) ----------------------------------------------------

MIXED = (dict(temperature=0.0), dict(temperature=0.9, top_k=5), dict(temperature=1.1, top_k=0, top_p=0.8),
         dict(temperature=0.7, min_p=0.1, n_probs=3), dict(temperature=0.8, typical_p=0.7),
         dict(temperature=1.0, top_n_sigma=1.0), dict(temperature=0.0, repeat_penalty=1.5, presence_penalty=0.3),
         dict(temperature=1.2, xtc_probability=0.7, xtc_threshold=0.05, dynatemp_range=0.3))


def _select_both(rows: tuple[dict, ...], step: int):
    """steps.select with and without branches on the same rows: (tokens, logprob, top ids, top logprobs)."""
    from model.steps import select

    n = len(rows)
    logits = jax.random.normal(jax.random.PRNGKey(step), (n, V)) * 3.0
    ca = arrays(*rows, seeds=list(range(n)))
    history = jax.random.randint(jax.random.PRNGKey(100 + step), (n + 1, 16), 0, V)
    args = (jnp.arange(n), jnp.full((n,), 10), jnp.full((n,), step), jnp.zeros((n, V)))
    out = []
    for branchless in (False, True):
        sampled, _ = select(logits, ca, jnp.array(history), *args, branchless=branchless)
        out.append([np.asarray(a) for a in jax.tree.leaves(sampled)])
    return out


def test_the_branchless_chain_draws_what_the_branching_one_draws():
    """Every stage computed and selected gives the very tokens and logprobs of the chain that skips the
    stages no row needs, batch by batch: all kinds of rows at once, only greedy rows, no penalties,
    rows all in the 128 best, one row that needs the whole vocabulary sorted."""
    batches = [MIXED, MIXED[:1] * 8, (MIXED[1], MIXED[3]) * 4, (MIXED[2], MIXED[0]) * 4, (MIXED[4], MIXED[5]) * 4]
    for i, rows in enumerate(batches):
        for step in range(3):
            branching, branchless = _select_both(rows, 7 * i + step)
            for a, b in zip(branching, branchless, strict=True):
                np.testing.assert_array_equal(a, b)
    assert len(set(_select_both(MIXED, 1)[1][0].tolist())) > 1  # the rows draw different tokens


def test_the_branchless_select_has_no_conditional():
    from model.steps import select

    n = 4
    spec = jax.ShapeDtypeStruct
    ca = jax.tree.map(lambda a: spec(a.shape, a.dtype), sc.chain_arrays([None] * n, [0] * n))
    args = (spec((n, V), jnp.float32), ca, spec((n + 1, 16), jnp.int32), spec((n,), jnp.int32),
            spec((n,), jnp.int32), spec((n,), jnp.int32), spec((n, V), jnp.float32))

    def ops(branchless: bool) -> set[str]:
        """The op names of the lowered program, StableHLO and HLO (no compile)."""
        lowered = select.lower(*args, branchless=branchless)
        return (set(re.findall(r"stablehlo\.\w+", lowered.as_text()))
                | set(re.findall(r"= \S+ (\w+)\(", lowered.as_text(dialect="hlo"))))

    assert {"stablehlo.case", "conditional"} <= ops(False)  # the check sees a branch
    assert not {"stablehlo.case", "stablehlo.if", "conditional"} & ops(True)
