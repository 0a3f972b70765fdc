"""GGUF -> `Weights`: the model's tensors in the layout the forward pass runs on.

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

Layouts (`load_weights(layout=...)`): "packed" (the CPU default) and "dense" (every matrix f32) stack the
layers for `lax.scan`; "device" (the default on a GPU backend) keeps every block-quantized matrix as a
`QWeight` (kernels/qlayout.py) built straight from the memory-mapped bytes -- nothing is dequantized on
the host -- F16/BF16 matrices 16-bit and F32 ones f32. Layers of one file mix types (a Q4_K_M file has
Q4_K and Q6_K blocks), so in this layout nothing is stacked: `Weights.layers` is a tuple of `Layer`s,
one per block, which the forward pass unrolls (kernels/ops.py picks each matmul's kernel by type).
`device_bytes` against `file_tensor_bytes` says what the layout costs over the file's own bytes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bankml.progress import stderr_progress
from kernels.dequant import check_supported, dequantize, type_name
from kernels.qlayout import QUANT_TYPES, QWeight, to_qweight
from model.actquant import ACT_KIND
from model.config import Config, UnsupportedModel
from model.packed import PACKABLE_TYPES, Packed, pack, type_group, unpack_affine
from model.tokenizer_gguf import _KVReader, read_kv

log = logging.getLogger(__name__)

Array = jax.Array
# f32 [out, in]; packed codes that expand to exactly the same values; or, in device layout, a QWeight or
# an F16/BF16/F32 array
Matrix = Array | Packed | QWeight
LAYOUTS = ("packed", "dense", "device")


@jax.tree_util.register_dataclass
@dataclass
class Layer:
    """One transformer block; under a stacked `Weights.layers` every field is [n_layer, ...]."""

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
    layers: Layer | tuple[Layer, ...]  # stacked, or one per block in device layout
    output: Matrix | None = None  # [V, D]; None: tied to token_embd (llama.cpp's TENSOR_DUPLICATED)
    rope_freqs: Array | None = None  # [n_rot/2] Llama 3.x rope factors: theta_i /= rope_freqs[i]
    # split over a mesh (model/parallel.py: its arrays are laid out per shard, and the forward pass runs
    # each device's share); None: on one device
    parallel: Any = field(default=None, metadata={"static": True})


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
_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
_QUANT_NAMES = frozenset(t if isinstance(t, str) else type_name(int(t)) for t in QUANT_TYPES)
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
                 activations: str = "f32", layout: str | None = None) -> tuple[Config, Weights]:
    """Read config and weights from a GGUF that `bankml.verify.verify` accepted (`verified=True`).

    layout: "packed", "dense" or "device" (module docstring); default: "packed" on the CPU backend,
    "device" on a GPU one. `packed` is the older switch: True is "packed", False "dense".
    activations: "f32", or "ggml" to round each packed matmul's input as llama.cpp's CPU backend does
    (model/actquant.py; bench/rounding.py measures what that changes; packed layout only).
    Raises `UnsupportedModel` / `UnsupportedTensorType` with the reason for anything we cannot run.
    """
    if not verified:
        raise PermissionError("refusing to load weights from a file that was not verified (bankml.verify)")
    if activations not in ("f32", "ggml"):
        raise ValueError(f"activations must be 'f32' or 'ggml', got {activations!r}")
    layout = _layout(layout, packed)
    if activations == "ggml" and layout != "packed":
        raise ValueError(f"activations='ggml' rounds the packed layout's matmul inputs; the {layout} layout has none")
    config = Config.from_gguf(_plain(read_kv(path, prefixes=())))
    reader = _tensor_table(path)
    tensors = {t.name: t for t in reader.tensors}
    for t in reader.tensors:  # refuse a bad type before spending time on the others
        check_supported(int(t.tensor_type), t.name)
    # a progress line on a terminal; the caller's log line gives the time
    with stderr_progress().step("bankml: loading weights", len(tensors), "tensors", final=False) as step:
        return config, _build(config, tensors, layout, activations == "ggml", step.advance)


def _layout(layout: str | None, packed: bool | None) -> str:
    if layout is None:
        if packed is not None:
            return "packed" if packed else "dense"
        return "packed" if jax.default_backend() == "cpu" else "device"
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if packed is not None and (layout == "packed") != packed:
        raise ValueError(f"packed={packed} contradicts layout={layout!r}")
    return layout


def layout_of(weights: Weights) -> str:
    """The layout `weights` were loaded in."""
    if isinstance(weights.layers, tuple):
        return "device"
    return "packed" if isinstance(weights.layers.attn_q, Packed) else "dense"


def device_bytes(weights: Weights) -> int:
    """What the weights take on the device: the sum of their arrays' bytes."""
    return sum(int(a.nbytes) for a in jax.tree.leaves(weights))


def file_tensor_bytes(path: str | os.PathLike) -> int:
    """What the file's tensors take in it (their data, not the header)."""
    return sum(int(t.n_bytes) for t in _tensor_table(path).tensors)


def matrix_types(weights: Weights) -> list[str]:
    """The types of the matrices, as kernels.ops names them ("Q4_K", "F16", ...): the report's rows."""
    from kernels.ops import matrix_type

    layers = weights.layers if isinstance(weights.layers, tuple) else (weights.layers,)
    mats = [weights.token_embd, weights.output] + [getattr(layer, f) for layer in layers for f in _MATRICES]
    return sorted({matrix_type(m) for m in mats if m is not None and not isinstance(m, Packed)})


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


def _build(config: Config, tensors: dict, layout: str, ggml_rounding: bool,
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
    d, v = config.n_embd, config.n_vocab
    out_w = tensors.get("output.weight")
    rope_freqs = tensors.get("rope_freqs.weight")
    if layout == "device":
        layers = []
        for il in range(config.n_layer):
            layers.append(Layer(**{name: _device(tensors[f"blk.{il}.{gguf_name[name]}"], shapes[name])
                                   for name in sorted(fields)}))
            advance(len(fields))
        token_embd = _device(tensors["token_embd.weight"], (v, d))
        output = None if out_w is None else _device(out_w, (v, d))
        layers = tuple(layers)
    else:
        packed = layout == "packed"
        stacked = {}
        for name in sorted(fields):
            blocks = [tensors[f"blk.{il}.{gguf_name[name]}"] for il in range(config.n_layer)]
            stacked[name] = _stack(blocks, shapes[name], packed, ggml_rounding)
            advance(len(blocks))
        token_embd = _unstack(_stack([tensors["token_embd.weight"]], (v, d), packed, ggml_rounding))
        output = None if out_w is None else _unstack(_stack([out_w], (v, d), packed, ggml_rounding))
        layers = Layer(**stacked)
    return Weights(
        token_embd=token_embd,
        output_norm=jnp.asarray(_checked(tensors["output_norm.weight"], (d,))),
        layers=layers,
        output=output,
        rope_freqs=None if rope_freqs is None else jnp.asarray(_checked(rope_freqs, (config.n_rot // 2,))),
    )


def _device(tensor, shape: tuple[int, ...]):
    """One tensor in device layout: a block-quantized matrix as a QWeight from its raw bytes, a 16-bit
    matrix as it is, anything else (vectors, F32, a quantized type without a QWeight layout) as f32."""
    got = tuple(int(n) for n in reversed(tensor.shape))
    if got != shape:
        raise UnsupportedModel(f"tensor {tensor.name!r} has shape {got}, expected {shape}")
    t = int(tensor.tensor_type)
    if len(shape) == 2 and type_name(t) in _QUANT_NAMES:
        return to_qweight(np.asarray(tensor.data), t, *shape)
    if len(shape) == 2 and t in (1, 30):  # F16, BF16: their own bits, 16 a weight
        bits = np.ascontiguousarray(tensor.data).view(np.float16 if t == 1 else jnp.bfloat16)
        return jnp.asarray(bits.reshape(shape))
    if len(shape) == 2 and t != 0:
        log.warning("tensor %s: %s has no device layout (kernels/qlayout.py); it is held as f32", tensor.name,
                    type_name(t))
    return jnp.asarray(_checked(tensor, shape))


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
