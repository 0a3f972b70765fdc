"""The ggml tensor types this engine loads: the one table (kernels/dequant.py dequantizes exactly these).

Its own module, free of jax, so the gateway can judge a model file's header (gateway/serving/registry.py)
without importing the numeric stack.
"""

from __future__ import annotations

# ggml type id -> name: the complete set this engine loads.
SUPPORTED_TYPES: dict[int, str] = {
    0: "F32",
    1: "F16",
    30: "BF16",
    2: "Q4_0",
    3: "Q4_1",
    6: "Q5_0",
    7: "Q5_1",
    8: "Q8_0",
    10: "Q2_K",
    11: "Q3_K",
    12: "Q4_K",
    13: "Q5_K",
    14: "Q6_K",
}
