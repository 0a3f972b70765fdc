"""Around the sampler chain (model/sampler_chain.py): what it cannot do, and the logprobs a step reports.

Logprobs come from the raw logits, before any sampler (llama-server's `get_token_probabilities`):
the chosen token's log-softmax and the top N_PROBS_MAX, computed only when some row asks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from model.messages import DEFAULT_SAMPLERS, N_PROBS_CAP, SamplingParams
from model.sampler_chain import ChainArrays, either

# the top-k is computed (only when some row asks) at the cap's width (model/messages.py)
N_PROBS_MAX = N_PROBS_CAP


def unsupported_sampling(p: SamplingParams) -> str | None:
    """The reason this sampler cannot honour `p`, or None. Refuse, never approximate."""
    active = {
        "mirostat": p.mirostat != 0,
        "samplers": tuple(p.samplers) != DEFAULT_SAMPLERS,
    }
    asked = [name for name, on in active.items() if on]
    if asked:
        return f"not supported by this engine's sampler yet: {', '.join(asked)}"
    return None


def logprobs(logits: jax.Array, tokens: jax.Array, sa: ChainArrays, branchless: bool = False):
    """Log-softmax of the raw logits (before any filter): the chosen token's and the top N_PROBS_MAX.

    Returns (token_logprob [B], top_ids [B, N], top_logprobs [B, N]); skipped (zeros) when no row asks,
    or with `branchless` (a GPU) computed anyway and zeroed.
    """
    n = min(N_PROBS_MAX, logits.shape[-1])

    def compute():
        lp = jax.nn.log_softmax(logits, axis=-1)
        top_lp, top_ids = lax.top_k(lp, n)
        return jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0], top_ids.astype(jnp.int32), top_lp

    def skip():
        b = logits.shape[0]
        return jnp.zeros((b,), jnp.float32), jnp.zeros((b, n), jnp.int32), jnp.zeros((b, n), jnp.float32)

    return either(branchless, jnp.any(sa.n_probs > 0), compute, skip)
