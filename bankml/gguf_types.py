"""ggml tensor type ids: the names the guard prints and the block layouts it sizes tensors with.

Ids follow ggml.h at llama.cpp b11192, as the Rust bankml's `gguf.rs` does; the
byte layouts are ggml's type traits (`blck_size`, `type_size`), the same table as gguf-py's
`GGML_QUANT_SIZES`, plus bankML's own Q2_0 (group 64). A test keeps the two tables equal.
"""

from __future__ import annotations

# GGML_TYPE_COUNT at b11192: every id at or above it is unknown, except the PrismML fork's two.
MAINLINE_COUNT = 43
FORK_ONLY = (142, 143)  # PQ2_0, PTQ1_0

# The original's names. Ids without one (4, 5, 31-33, 36-38, 40) print as their decimal number.
TYPE_NAMES: dict[int, str] = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    6: "Q5_0",
    7: "Q5_1",
    8: "Q8_0",
    9: "Q8_1",
    10: "Q2_K",
    11: "Q3_K",
    12: "Q4_K",
    13: "Q5_K",
    14: "Q6_K",
    15: "Q8_K",
    16: "IQ2_XXS",
    17: "IQ2_XS",
    18: "IQ3_XXS",
    19: "IQ1_S",
    20: "IQ4_NL",
    21: "IQ3_S",
    22: "IQ2_S",
    23: "IQ4_XS",
    24: "I8",
    25: "I16",
    26: "I32",
    27: "I64",
    28: "F64",
    29: "IQ1_M",
    30: "BF16",
    34: "TQ1_0",
    35: "TQ2_0",
    39: "MXFP4",
    41: "Q1_0",
    42: "Q2_0",
    142: "PQ2_0",
    143: "PTQ1_0",
}

# (elements per block, bytes per block). Ids 4 and 5 (Q4_2, Q4_3), 31-33 and 36-38 (the removed
# repacked Q4_0_x_y / IQ4_NL_x_y types) have no layout in ggml any more, and the fork types' layouts
# are not public: a tensor of any of these cannot be sized, so the guard refuses it.
BLOCK_LAYOUT: dict[int, tuple[int, int]] = {
    0: (1, 4),  # F32
    1: (1, 2),  # F16
    2: (32, 18),  # Q4_0
    3: (32, 20),  # Q4_1
    6: (32, 22),  # Q5_0
    7: (32, 24),  # Q5_1
    8: (32, 34),  # Q8_0
    9: (32, 40),  # Q8_1
    10: (256, 84),  # Q2_K
    11: (256, 110),  # Q3_K
    12: (256, 144),  # Q4_K
    13: (256, 176),  # Q5_K
    14: (256, 210),  # Q6_K
    15: (256, 292),  # Q8_K
    16: (256, 66),  # IQ2_XXS
    17: (256, 74),  # IQ2_XS
    18: (256, 98),  # IQ3_XXS
    19: (256, 50),  # IQ1_S
    20: (32, 18),  # IQ4_NL
    21: (256, 110),  # IQ3_S
    22: (256, 82),  # IQ2_S
    23: (256, 136),  # IQ4_XS
    24: (1, 1),  # I8
    25: (1, 2),  # I16
    26: (1, 4),  # I32
    27: (1, 8),  # I64
    28: (1, 8),  # F64
    29: (256, 56),  # IQ1_M
    30: (1, 2),  # BF16
    34: (256, 54),  # TQ1_0
    35: (256, 66),  # TQ2_0
    39: (32, 17),  # MXFP4
    40: (64, 36),  # NVFP4 in gguf-py 0.19; the Rust bankml prints the id as "40"
    41: (128, 18),  # Q1_0
    42: (64, 18),  # Q2_0, bankML's group-64 ternary layout (64 trits in 18 bytes)
}


def type_name(type_id: int) -> str:
    return TYPE_NAMES.get(type_id, str(type_id))
