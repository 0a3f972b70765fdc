"""Triton twins of the kernels/ references. Placeholder: nothing lives here yet.

A later issue brings two kernel families here:
- dequant GEMV/GEMM (`dequant_matmul.py`): reads GGUF weights kept packed on the device and
  dequantizes a tile in registers before the dot. The first types are Q4_0, Q8_0, Q4_K and Q6_K.
  Weights are repacked at load into power-of-two struct-of-arrays (research/kernels.md §3c). Nibbles
  stay in ggml's lo/hi order, and the activation is split rather than the nibbles interleaved.
  Its twin, with the same signature, is the JAX reference in kernels/dequant_ref.py followed by a
  plain dot.
- attention (`attention.py`): flash-decoding over the KV cache, with split-KV and an LSE merge, sliding
  window and GQA. Its twin is a plain-JAX attention with the same signature.

How they will be selected: kernels/dequant.py (and an attention counterpart) stays the single chooser.
Its PATH_FOR_BACKEND table maps "gpu"/"cuda" to the Triton twin, through Pallas' Triton backend or
jax_triton.triton_call. That choice is made at load time, or with jax.lax.platform_dependent. The
GPU-only imports (jax_triton, triton) happen lazily inside the GPU branch, never at import time,
because `import jax_triton` fails on a CPU jaxlib. A type or shape a kernel cannot handle is refused
there explicitly; it never falls back silently.

Tests (habit 4 in STYLE.md) compare each twin with gguf.quants on CPU. They run each kernel under
Triton's interpreter (TRITON_INTERPRET=1 with a numpy tensor wrapper) and AOT-compile it for sm_90
on CPU. With a GPU, the kernel is checked against its twin under the `gpu` marker.
"""
