"""GGUF -> `Weights`: the model's tensors, dequantized once at load, stacked per layer for `lax.scan`.

Precondition: the file has passed `bankml.verify.verify` (guard + pin). gguf-py's reader is not safe
on a crafted header, so `load_weights` refuses to open a file unless the caller says it was verified.

Flow: `Config.from_gguf` reads the keys (model/tokenizer_gguf.py's reader) -> gguf-py's `GGUFReader`
memory-maps the file for its tensor table -> every tensor is checked against the names this
architecture uses (anything unexpected is refused, never ignored) and against the supported types ->
each tensor goes into its slot of a stacked [n_layer, ...] array:
dequantized to f32 (kernels.dequant), or, with `packed` (the default on CPU), kept as int8 codes with
per-group constants (model/packed.py) when every layer's tensor is a block-quantized type -- the same
values, at a third of the bytes a decode step streams. Matrices keep GGUF's row layout, [out, in],
and GGUF's tensor names become the field names.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from bankml.progress import stderr_progress
from kernels.dequant import check_supported, dequantize
from model.actquant import ACT_KIND
from model.config import Config, UnsupportedModel
from model.packed import PACKABLE_TYPES, Packed, pack, type_group, unpack_affine
from model.tokenizer_gguf import _KVReader, read_kv

log = logging.getLogger(__name__)

Array = jax.Array
Matrix = Array | Packed  # f32 [out, in], or packed codes that expand to exactly the same values


@jax.tree_util.register_dataclass
@dataclass
class Layer:
    """One transformer block; under `Weights.layers` every field is stacked: [n_layer, ...]."""

    attn_norm: Array  # [D]
    attn_q: Matrix  # [H*Dh, D]
    attn_k: Matrix  # [Hkv*Dh, D]
    attn_v: Matrix  # [Hkv*Dh, D]
    attn_output: Matrix  # [D, H*Dh]
    ffn_norm: Array  # [D]
    ffn_gate: Matrix  # [F, D]
    ffn_up: Matrix  # [F, D]
    ffn_down: Matrix  # [D, F]
    attn_q_bias: Array | None = None  # qwen2 (optional elsewhere)
    attn_k_bias: Array | None = None
    attn_v_bias: Array | None = None
    attn_output_bias: Array | None = None
    attn_q_norm: Array | None = None  # [Dh] qwen3, gemma3
    attn_k_norm: Array | None = None
    post_attention_norm: Array | None = None  # [D] gemma3
    post_ffw_norm: Array | None = None


@jax.tree_util.register_dataclass
@dataclass
class Weights:
    token_embd: Matrix  # [V, D]
    output_norm: Array  # [D]
    layers: Layer
    output: Matrix | None = None  # [V, D]; None: tied to token_embd (llama.cpp's TENSOR_DUPLICATED)
    rope_freqs: Array | None = None  # [n_rot/2] Llama 3.x rope factors: theta_i /= rope_freqs[i]


# GGUF tensor name within a block -> Layer field.
_LAYER_TENSORS = {
    "attn_norm.weight": "attn_norm",
    "attn_q.weight": "attn_q",
    "attn_k.weight": "attn_k",
    "attn_v.weight": "attn_v",
    "attn_output.weight": "attn_output",
    "ffn_norm.weight": "ffn_norm",
    "ffn_gate.weight": "ffn_gate",
    "ffn_up.weight": "ffn_up",
    "ffn_down.weight": "ffn_down",
    "attn_q.bias": "attn_q_bias",
    "attn_k.bias": "attn_k_bias",
    "attn_v.bias": "attn_v_bias",
    "attn_output.bias": "attn_output_bias",
    "attn_q_norm.weight": "attn_q_norm",
    "attn_k_norm.weight": "attn_k_norm",
    "post_attention_norm.weight": "post_attention_norm",
    "post_ffw_norm.weight": "post_ffw_norm",
}
_OPTIONAL_BIASES = ("attn_q_bias", "attn_k_bias", "attn_v_bias", "attn_output_bias")


def _layer_fields(config: Config) -> tuple[set[str], set[str]]:
    """(required, allowed) Layer fields for this architecture, as llama.cpp's loader has them."""
    required = {f.name for f in dataclasses.fields(Layer) if f.default is dataclasses.MISSING}
    if config.arch == "qwen2":
        required |= {"attn_q_bias", "attn_k_bias", "attn_v_bias"}
    if config.qk_norm:
        required |= {"attn_q_norm", "attn_k_norm"}
    if config.post_norms:
        required |= {"post_attention_norm", "post_ffw_norm"}
    allowed = required | set(_OPTIONAL_BIASES) if config.arch in ("llama", "qwen2") else set(required)
    return required, allowed


def _expected_shapes(config: Config) -> dict[str, tuple[int, ...]]:
    d, dh, f = config.n_embd, config.head_dim, config.n_ff
    q, kv = config.n_head * dh, config.n_head_kv * dh
    return {
        "attn_norm": (d,), "attn_q": (q, d), "attn_k": (kv, d), "attn_v": (kv, d), "attn_output": (d, q),
        "ffn_norm": (d,), "ffn_gate": (f, d), "ffn_up": (f, d), "ffn_down": (d, f),
        "attn_q_bias": (q,), "attn_k_bias": (kv,), "attn_v_bias": (kv,), "attn_output_bias": (d,),
        "attn_q_norm": (dh,), "attn_k_norm": (dh,), "post_attention_norm": (d,), "post_ffw_norm": (d,),
    }


def tensor_array(tensor) -> np.ndarray:
    """One GGUF tensor as f32 in numpy order ([out, in] for a matrix); unsupported types are refused."""
    return np.asarray(dequantize(tensor.data, int(tensor.tensor_type), tensor.shape, name=tensor.name))


def load_weights(path: str | os.PathLike, *, verified: bool, packed: bool | None = None,
                 activations: str = "f32") -> tuple[Config, Weights]:
    """Read config and weights from a GGUF that `bankml.verify.verify` accepted (`verified=True`).

    packed: keep block-quantized matrices packed (model/packed.py); default: on the CPU backend.
    activations: "f32", or "ggml" to round each packed matmul's input as llama.cpp's CPU backend does
    (model/actquant.py; bench/rounding.py measures what that changes).
    Raises `UnsupportedModel` / `UnsupportedTensorType` with the reason for anything we cannot run.
    """
    if not verified:
        raise PermissionError("refusing to load weights from a file that was not verified (bankml.verify)")
    if activations not in ("f32", "ggml"):
        raise ValueError(f"activations must be 'f32' or 'ggml', got {activations!r}")
    config = Config.from_gguf(_plain(read_kv(path, prefixes=())))
    reader = _tensor_table(path)
    tensors = {t.name: t for t in reader.tensors}
    for t in reader.tensors:  # refuse a bad type before spending time on the others
        check_supported(int(t.tensor_type), t.name)
    if packed is None:
        packed = jax.default_backend() == "cpu"
    # a progress line on a terminal; the caller's log line gives the time
    with stderr_progress().step("bankml: loading weights", len(tensors), "tensors", final=False) as step:
        return config, _build(config, tensors, packed, activations == "ggml", step.advance)


def _plain(kv: dict) -> dict:
    """Numeric arrays as lists, as gguf-py's `contents()` gives them (Config reads per-layer lists)."""
    return {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in kv.items()}


def _tensor_table(path: str | os.PathLike):
    """gguf-py's reader for the tensor table alone. Its parse of the key/value section builds a numpy
    view per element of every array (7 of SmolLM2's 8 s of loading, tens of seconds on a 262k
    vocabulary); model/tokenizer_gguf.py's reader only walks that section to where the tensors begin,
    and hands over the one key gguf-py itself reads there, `general.alignment`."""
    import importlib.metadata

    from gguf import GGUFReader, GGUFValueType
    from gguf.gguf_reader import ReaderField

    class TensorTable(GGUFReader):  # gguf-py touches the file only after the guard and pin accepted it
        def _build_fields(self, offs: int, count: int) -> int:
            kv = _KVReader(memoryview(self.data))
            alignment = kv.read(("general.alignment",)).get("general.alignment")
            if alignment is not None:
                if isinstance(alignment, bool) or not isinstance(alignment, int) or not 0 < alignment < 1 << 32:
                    raise UnsupportedModel(f"general.alignment {alignment!r} is not a 32-bit unsigned integer")
                self._push_field(ReaderField(offs, "general.alignment", [np.array([alignment], np.uint32)], [0],
                                             [GGUFValueType.UINT32]), skip_sum=True)
            return kv.o

    try:
        return TensorTable(os.fspath(path))
    except UnsupportedModel:
        raise
    except Exception as e:  # _build_fields is gguf-py's private API: another version may differ
        log.warning("gguf-py %s: the fast tensor-table read failed (%s: %s); reading the whole header",
                    importlib.metadata.version("gguf"), type(e).__name__, e)
        return GGUFReader(os.fspath(path))


def _build(config: Config, tensors: dict, packed: bool, ggml_rounding: bool,
           advance: Callable[[int], None] = lambda n: None) -> Weights:
    required, allowed = _layer_fields(config)
    shapes = _expected_shapes(config)
    present: dict[str, int] = {}  # Layer field -> in how many blocks
    unexpected = []
    for name in tensors:
        if name.startswith("blk."):
            _, il, local = name.split(".", 2)
            slot = _LAYER_TENSORS.get(local)
            if slot is None or slot not in allowed or not il.isdigit() or int(il) >= config.n_layer:
                unexpected.append(name)
            else:
                present[slot] = present.get(slot, 0) + 1
        elif name not in ("token_embd.weight", "output_norm.weight", "output.weight", "rope_freqs.weight"):
            unexpected.append(name)
        elif name == "rope_freqs.weight" and config.arch != "llama":
            unexpected.append(name)
    if unexpected:
        raise UnsupportedModel(f"unexpected tensors for {config.arch}: {', '.join(sorted(unexpected)[:8])}")
    fields = required | {f for f in present if f in allowed}
    for name in sorted(fields):
        if present.get(name, 0) != config.n_layer:
            raise UnsupportedModel(f"tensor {name} is present in {present.get(name, 0)} of {config.n_layer} blocks")

    gguf_name = {v: k for k, v in _LAYER_TENSORS.items()}
    stacked = {}
    for name in sorted(fields):
        blocks = [tensors[f"blk.{il}.{gguf_name[name]}"] for il in range(config.n_layer)]
        stacked[name] = _stack(blocks, shapes[name], packed, ggml_rounding)
        advance(len(blocks))

    d, v = config.n_embd, config.n_vocab
    out_w = tensors.get("output.weight")
    rope_freqs = tensors.get("rope_freqs.weight")
    return Weights(
        token_embd=_unstack(_stack([tensors["token_embd.weight"]], (v, d), packed, ggml_rounding)),
        output_norm=jnp.asarray(_checked(tensors["output_norm.weight"], (d,))),
        layers=Layer(**stacked),
        output=None if out_w is None else _unstack(_stack([out_w], (v, d), packed, ggml_rounding)),
        rope_freqs=None if rope_freqs is None else jnp.asarray(_checked(rope_freqs, (config.n_rot // 2,))),
    )


def _stack(tensors: list, shape: tuple[int, ...], packed: bool, ggml_rounding: bool) -> Matrix:
    """Per-layer tensors -> one [n, *shape] array, packed when asked and every tensor allows it."""
    types = [int(t.tensor_type) for t in tensors]
    if packed and len(shape) == 2 and all(t in PACKABLE_TYPES for t in types):
        for t in tensors:
            if tuple(int(n) for n in reversed(t.shape)) != shape:
                raise UnsupportedModel(f"tensor {t.name!r} has shape {tuple(reversed(t.shape))}, expected {shape}")
        group = min(type_group(t) for t in types)  # layers of a finer-grouped type set the group size
        parts = [unpack_affine(t.data, int(t.tensor_type), *shape, group) for t in tensors]
        offset = np.stack([p[2] for p in parts]) if any(p[2].any() for p in parts) else None
        return pack(np.stack([p[0] for p in parts]), np.stack([p[1] for p in parts]), offset,
                    tuple(ACT_KIND[t] if ggml_rounding else "f32" for t in types))
    out = np.empty((len(tensors), *shape), dtype=np.float32)
    for i, t in enumerate(tensors):
        out[i] = _checked(t, shape)
    return jnp.asarray(out)


def _unstack(m: Matrix) -> Matrix:
    return jax.tree.map(lambda a: a[0], m)  # Packed.act keeps its one entry


def _checked(tensor, shape: tuple[int, ...]) -> np.ndarray:
    array = tensor_array(tensor)
    if array.shape != shape:
        raise UnsupportedModel(f"tensor {tensor.name!r} has shape {array.shape}, expected {shape}")
    return array
