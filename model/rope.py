"""Rotary position embeddings as ggml's `ggml_rope_ext` computes them (ggml/src/ggml-cpu/ops.cpp).

theta_i = pos * freq_scale * base^(-2i/n_rot) / freq_factor_i, for i < n_rot/2; dims past n_rot pass
through. NORM mode rotates adjacent pairs (2i, 2i+1), NEOX mode pairs (i, i + n_rot/2). YaRN is
refused in `Config`, so ext_factor is 0 and the magnitude factor is 1 here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from model.config import Config


def rope_angles(positions: jax.Array, n_rot: int, base: float, freq_scale: float,
                freq_factors: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """positions [B, T] int -> (cos, sin), each [B, T, n_rot/2] f32."""
    inv_freq = base ** (-jnp.arange(0, n_rot, 2, dtype=jnp.float32) / n_rot)  # [n_rot/2]
    inv_freq = inv_freq * freq_scale
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors
    theta = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, n_rot/2]
    return jnp.cos(theta), jnp.sin(theta)


def rope_tables(config: Config, positions: jax.Array, freq_factors: jax.Array | None):
    """(cos, sin) for global layers and for sliding-window layers (the same arrays when they agree)."""
    glob = rope_angles(positions, config.n_rot, config.rope_base, config.rope_freq_scale, freq_factors)
    if (config.rope_base_swa, config.rope_freq_scale_swa) == (config.rope_base, config.rope_freq_scale):
        return glob, glob
    swa = rope_angles(positions, config.n_rot, config.rope_base_swa, config.rope_freq_scale_swa, freq_factors)
    return glob, swa


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, neox: bool) -> jax.Array:
    """x [B, T, H, Dh]; cos/sin [B, T, n_rot/2]. Returns x with its first n_rot dims rotated."""
    n_rot = 2 * cos.shape[-1]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # [B, T, 1, n_rot/2]
    rot, rest = x[..., :n_rot], x[..., n_rot:]
    if neox:
        x0, x1 = rot[..., : n_rot // 2], rot[..., n_rot // 2:]
        out = jnp.concatenate([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1)
    else:
        pairs = rot.reshape(*rot.shape[:-1], n_rot // 2, 2)
        x0, x1 = pairs[..., 0], pairs[..., 1]
        out = jnp.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1).reshape(rot.shape)
    return out if rest.shape[-1] == 0 else jnp.concatenate([out, rest], axis=-1)
