"""Tensor parallelism: one model over the N devices of a mesh axis, as Megatron-LM and vLLM split it.

Each device holds about 1/N of every layer (`shard_weights`): the Q, K, V, gate and up projections by
their output rows (column-parallel: a device computes its own heads and its own FFN columns), the
attention output and down projections by their input columns (row-parallel: a device multiplies its
heads' and columns' share, and one all-reduce per projection sums the shares), the token embeddings and
the output matrix by vocabulary when it divides N (the lookup is one all-reduce, the logits one
all-gather). A quantized matrix is split along whole blocks, its planes (device layout) or codes and
group constants (packed layout) cut where the blocks end, so no weight is dequantized on the host.
KV heads are split where they divide N; where N is a multiple of them (gemma3's one KV head over two
devices) each device holds the one KV head its query heads read, as vLLM replicates them. The paged KV
pool is split the same way, by KV head: block tables, the scheduler and the prefix cache see one pool.

The forward pass (model/forward.py) runs each device's share under `jax.shard_map` when the weights
carry a `Parallel` (a static field of `Weights`, so every program traced from them is the sharded one);
the arrays it returns, the logits and the sampler's, are replicated on the mesh, and the sampler runs
on the gathered logits as on one device.

A sharded array is laid out for its shard: a nibble-packed matrix split by columns is packed again per
shard, and the K/V of a replicated KV head are stored once per device, so only the shard_map body reads
them as matrices. `refusal` says, before anything is loaded onto the devices, why a model does not split
N ways.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kernels.dequant_ref import BLOCK_LAYOUT
from kernels.qlayout import QWeight
from model.config import Config
from model.packed import Packed

log = logging.getLogger(__name__)

AXIS = "tp"
COLUMN = ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up")  # split by output rows
ROW = ("attn_output", "ffn_down")  # split by input columns; an all-reduce sums the shares
COLUMN_BIASES = ("attn_q_bias", "attn_k_bias", "attn_v_bias")
KV = ("attn_k", "attn_v", "attn_k_bias", "attn_v_bias")


@dataclass(frozen=True)
class Parallel:
    """How a model is split over a mesh: `n` devices on the axis "tp" (hashable: a static field of Weights).

    kv_split: the KV heads are split N ways; False: each device holds the one KV head its query heads
    read (N a multiple of the KV heads). vocab_split: token_embd and output are split by vocabulary;
    False: every device holds them whole (a vocabulary N does not divide).
    """

    mesh: Mesh
    kv_split: bool
    vocab_split: bool

    @property
    def n(self) -> int:
        return self.mesh.shape[AXIS]

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def pool_sharding(self) -> NamedSharding:
        """The KV pool's arrays [L, pages, KV heads, P, X]: split by KV head."""
        return NamedSharding(self.mesh, P(None, None, AXIS))

    def local_config(self, config: Config) -> Config:
        """The config one device's share runs: its query heads and KV heads."""
        return dataclasses.replace(config, n_head=config.n_head // self.n,
                                   n_head_kv=config.n_head_kv // self.n if self.kv_split else 1)

    def pool_heads(self, config: Config) -> int:
        """The KV heads the pool stores across the mesh: the model's, or one per device."""
        return config.n_head_kv if self.kv_split else self.n

    def pool_to_model_heads(self, cells: np.ndarray, config: Config) -> np.ndarray:
        """Pool cells [..., pool heads * X] (model/runner.py's slot files) -> the model's KV heads
        [..., Hkv * X]: where each device holds a copy, the first copy of each head."""
        if self.kv_split:
            return cells
        n, hkv = self.n, config.n_head_kv
        split = cells.reshape(*cells.shape[:-1], n, -1)
        return split[..., [h * n // hkv for h in range(hkv)], :].reshape(*cells.shape[:-1], -1)

    def model_to_pool_heads(self, cells: np.ndarray, config: Config) -> np.ndarray:
        """The inverse of `pool_to_model_heads`: each device's copy of the KV head it reads."""
        if self.kv_split:
            return cells
        n, hkv = self.n, config.n_head_kv
        split = cells.reshape(*cells.shape[:-1], hkv, -1)
        return split[..., [i * hkv // n for i in range(n)], :].reshape(*cells.shape[:-1], -1)

    def describe(self) -> dict:
        """The mesh, as /bankml and /props show it."""
        devices = list(self.mesh.devices.flat)
        return {"axes": {AXIS: self.n}, "devices": [_device_name(d) for d in devices],
                "processes": len({d.process_index for d in devices}),
                "kv_heads": "split" if self.kv_split else "one per device",
                "vocabulary": "split" if self.vocab_split else "replicated"}


def _device_name(d) -> str:
    return f"{d.platform}:{d.id}"


def refusal(config: Config, n: int, devices: int, platform: str, matrix_blocks: dict[str, int] | None = None
            ) -> str | None:
    """Why this model cannot run `n` ways on `devices` devices of `platform`, or None.

    matrix_blocks: the row-parallel matrices' block size in elements (device layout: a quantized
    matrix's block, which a shard must hold whole), by name; none for the packed and dense layouts.
    """
    if n < 1:
        return f"--tensor-parallel must be at least 1, got {n}"
    if n > devices:
        hint = (f" (XLA_FLAGS=--xla_force_host_platform_device_count={n} simulates {n} CPU devices)"
                if platform == "cpu" else "")
        return f"--tensor-parallel {n} needs {n} devices; this {platform} platform has {devices}{hint}"
    if n == 1:
        return None
    if config.n_head % n:
        return f"--tensor-parallel {n}: the model's {config.n_head} attention heads do not split {n} ways"
    if config.n_head_kv % n and n % config.n_head_kv:
        return (f"--tensor-parallel {n}: the model's {config.n_head_kv} KV heads neither split {n} ways nor "
                f"divide {n} (one KV head per device)")
    if config.n_ff % n:
        return f"--tensor-parallel {n}: the FFN's {config.n_ff} columns do not split {n} ways"
    widths = {"attn_output": config.n_head * config.head_dim, "ffn_down": config.n_ff}
    for name, block in (matrix_blocks or {}).items():
        if (widths[name] // n) % block:
            return (f"--tensor-parallel {n}: {name}'s {widths[name]} input columns split {n} ways give "
                    f"{widths[name] // n}, not whole blocks of {block}")
    return None


def make(config: Config, n: int, devices: list | None = None) -> Parallel:
    """The plan over the first `n` devices (all processes' devices, in JAX's order)."""
    devices = jax.devices() if devices is None else devices
    if why := refusal(config, n, len(devices), devices[0].platform):
        raise ValueError(why)
    mesh = Mesh(np.array(devices[:n]), (AXIS,))
    return Parallel(mesh, kv_split=config.n_head_kv % n == 0, vocab_split=config.n_vocab % n == 0)


# --- where each array's shards go --------------------------------------------------------------------


def _axis(field: str, par: Parallel) -> int | None:
    """The axis of a field's arrays (counted from the end) that is split, or None (replicated)."""
    if field in COLUMN or field in ("token_embd", "output") and par.vocab_split:
        return -2
    if field in ROW or field in COLUMN_BIASES:
        return -1
    return None


def _spec(leaf, axis: int | None) -> P:
    if axis is None:
        return P()
    parts = [None] * leaf.ndim
    parts[axis] = AXIS
    return P(*parts)


def _field_specs(value, field: str, par: Parallel):
    axis = _axis(field, par)
    if isinstance(value, QWeight):  # planes are [N, bytes of a row]
        spec = P() if axis is None else P(AXIS, None) if axis == -2 else P(None, AXIS)
        return QWeight(tuple(spec for _ in value.planes), value.ggml_type, value.shape)
    return jax.tree.map(lambda a: _spec(a, axis), value)


def weight_specs(weights) -> object:
    """The PartitionSpecs of a sharded `Weights`' arrays, in its tree's structure (shard_map's in_specs)."""
    par = weights.parallel
    layers = weights.layers

    def layer_specs(layer):
        return dataclasses.replace(layer, **{f.name: _field_specs(getattr(layer, f.name), f.name, par)
                                             for f in dataclasses.fields(layer)})

    out = {f.name: _field_specs(getattr(weights, f.name), f.name, par) for f in dataclasses.fields(weights)
           if f.name not in ("layers", "parallel")}
    out["layers"] = tuple(layer_specs(x) for x in layers) if isinstance(layers, tuple) else layer_specs(layers)
    return dataclasses.replace(weights, **out)


def pool_spec(pool):
    """The KV pool is split by KV head (axis 2 of every array)."""
    return jax.tree.map(lambda a: P(None, None, AXIS), pool)


# --- shards, made on the host -----------------------------------------------------------------------


def shard_weights(weights, config: Config, par: Parallel):
    """`weights` (any layout, on one device) laid out and placed for `par`: each array split as
    `weight_specs` says, each device's part from the host."""
    layers = weights.layers
    stacked = not isinstance(layers, tuple)

    def one_layer(layer):
        fields = {}
        for f in dataclasses.fields(layer):
            value = getattr(layer, f.name)
            if value is None:
                continue
            if f.name in KV and not par.kv_split:
                value = _kv_per_device(value, f.name, config, par)
            elif f.name in ROW:
                value = _row_split(value, par.n)
            elif f.name in COLUMN and isinstance(value, QWeight):
                value = QWeight(value.planes, value.ggml_type, (value.shape[0] // par.n, value.shape[1]))
            fields[f.name] = value
        return dataclasses.replace(layer, **fields)

    new_layers = one_layer(layers) if stacked else tuple(one_layer(x) for x in layers)
    vocab = {}
    for name in ("token_embd", "output"):
        m = getattr(weights, name)
        if isinstance(m, QWeight) and par.vocab_split:
            m = QWeight(m.planes, m.ggml_type, (m.shape[0] // par.n, m.shape[1]))
        vocab[name] = m
    laid_out = dataclasses.replace(weights, layers=new_layers, parallel=par, **vocab)
    specs = weight_specs(laid_out)
    return jax.tree.map(lambda a, s: _place(a, NamedSharding(par.mesh, s)), laid_out, specs)


def _place(a, sharding: NamedSharding) -> jax.Array:
    host = np.asarray(a)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _kv_per_device(value, field: str, config: Config, par: Parallel):
    """A K or V projection (or its bias) with device i's rows the KV head its query heads read,
    i * Hkv // N: the rows [Hkv * Dh, ...] become [N * Dh, ...], split N ways."""
    dh, n, hkv = config.head_dim, par.n, config.n_head_kv
    rows = np.concatenate([np.arange(h * dh, (h + 1) * dh) for h in (i * hkv // n for i in range(n))])
    if isinstance(value, QWeight):
        return QWeight(tuple(p[rows] for p in value.planes), value.ggml_type, (dh, value.shape[1]))
    axis = -1 if field.endswith("_bias") else -2
    return jax.tree.map(lambda a: jnp.take(a, rows, axis=axis), value)


def _row_split(value, n: int):
    """A row-parallel matrix laid out so that its last axis, cut in n equal parts, gives each device
    a matrix of its own columns: planes and plain arrays as they are (their columns are in order),
    a nibble-packed matrix packed again per shard."""
    if isinstance(value, QWeight):
        rows, cols = value.shape
        return QWeight(value.planes, value.ggml_type, (rows, cols // n))
    if not isinstance(value, Packed) or value.nibble_bias is None:
        return value
    c = np.asarray(value.q)
    codes = np.concatenate([c & np.uint8(15), c >> np.uint8(4)], axis=-1)  # [..., out, in] biased
    width = codes.shape[-1] // n
    if width % 64:  # a shard's half must hold whole groups: int8 codes instead
        log.warning("a row-parallel matrix's shard has %d columns, not a multiple of 64: its codes are held as "
                    "int8, twice the bytes of nibbles", width)
        q = jnp.asarray(codes.astype(np.int16) - value.nibble_bias).astype(jnp.int8)
        return dataclasses.replace(value, q=q, nibble_bias=None)
    shards = []
    for i in range(n):
        part = codes[..., i * width:(i + 1) * width]
        half = width // 2
        shards.append(part[..., :half] | (part[..., half:] << np.uint8(4)))
    return dataclasses.replace(value, q=jnp.asarray(np.concatenate(shards, axis=-1)))


def per_device_bytes(tree) -> dict[str, int]:
    """The bytes of `tree`'s arrays on each device they are on, by device name."""
    out: dict[str, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            name = _device_name(shard.device)
            out[name] = out.get(name, 0) + int(shard.data.nbytes)
    return out


def row_blocks(weights) -> dict[str, int]:
    """The block size (elements) of each quantized row-parallel matrix, the largest over the layers: a
    shard must hold whole blocks (device layout: the type's blocks; packed: its groups of constants)."""
    out: dict[str, int] = {}
    layers = weights.layers if isinstance(weights.layers, tuple) else (weights.layers,)
    for layer in layers:
        for name in ROW:
            m = getattr(layer, name)
            if isinstance(m, QWeight):
                out[name] = max(out.get(name, 1), BLOCK_LAYOUT[m.ggml_type][0])
            elif isinstance(m, Packed):
                out[name] = max(out.get(name, 1), m.group)
    return out
