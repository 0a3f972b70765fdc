"""Compute kernels. Each op has a plain reference (the CPU path and the test oracle) and, later, a
Triton twin for GPU. One module per op picks between them and refuses what it cannot do.

- dequant_ref.py: GGUF block dequantizers. Pure JAX, plus numpy twins for CPU load time; all are
  bit-identical to gguf-py.
- dequant.py: `dequantize(raw, ggml_type, shape)`, `SUPPORTED_TYPES`, `UnsupportedTensorType`. It is the
  only place that chooses a path per platform.
- triton/: the GPU twins (placeholder).

Importing this package imports nothing heavy. jax comes in with the submodules.
"""
