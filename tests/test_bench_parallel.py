"""bench/synth_gguf.py --layers: a shape cut to fewer layers keeps its widths, vocabulary and mix, and
passes the gate; bench/parallel.py counts the collectives a while loop's body runs per step."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import synth_gguf  # noqa: E402

from bankml.verify import verify  # noqa: E402

Q = gguf.GGMLQuantizationType


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


parallel = _load("bankml_test_bench_parallel", BENCH / "parallel.py")  # not model.parallel


def test_a_cut_llama3_8b_keeps_the_widths_and_the_mix_of_its_layer_count():
    whole, cut = synth_gguf.SHAPES["llama3-8b"], synth_gguf.shape_of("llama3-8b", 2)
    assert cut.n_layer == 2 and cut.n_embd == whole.n_embd and cut.n_ff == whole.n_ff
    assert cut.n_vocab == whole.n_vocab == 128256
    plan = synth_gguf.tensor_plan(cut)
    assert len(plan) == 3 + 9 * 2
    types = {name: q for name, _, q in plan}
    assert [types[f"blk.{il}.ffn_down.weight"] for il in range(2)] == [Q.Q4_K, Q.Q6_K]  # use_more_bits(il, 2)
    assert 0.98e9 < sum(synth_gguf.nbytes(s, q) for _, s, q in plan) < 1.0e9
    assert synth_gguf.shape_of("llama3-8b") is whole
    with pytest.raises(ValueError, match="1..32"):
        synth_gguf.shape_of("llama3-8b", 33)


def test_the_cli_writes_a_cut_tiny_that_passes_the_gate(tmp_path):
    out = tmp_path / "tiny-1l.gguf"
    done = subprocess.run([sys.executable, str(BENCH / "synth_gguf.py"), "tiny", str(out), "--layers", "1"],
                          capture_output=True, text=True, check=True)
    assert json.loads(done.stdout)["layers"] == 1
    verified = verify(out, out.with_name(out.name + ".FORK.json").read_text())
    assert verified.types == {"F32": 3, "Q4_K": 6, "Q6_K": 3}  # one layer: use_more_bits(0, 1)
    reader = gguf.GGUFReader(str(out))
    assert int(reader.fields["llama.block_count"].parts[-1][0]) == 1
    assert len(reader.tensors) == 3 + 9


def test_collectives_count_a_while_bodys_ops_its_trip_count_times():
    hlo = "\n".join([
        "%body.1 (p: (s32[], f32[4])) -> (s32[], f32[4]) {",
        "  %a = f32[4]{0} all-reduce(f32[4]{0} %x), to_apply=%add",
        "  %b = f32[4]{0} all-reduce(f32[4]{0} %a), to_apply=%add",
        "}",
        "ENTRY %main.2 (w: f32[4]) -> f32[8] {",
        "  %c = f32[4]{0} all-reduce(f32[4]{0} %w), to_apply=%add",
        '  %l = (s32[], f32[4]) while((s32[], f32[4]) %t), condition=%cond.1, body=%body.1, '
        'backend_config={"known_trip_count":{"n":"32"}}',
        "  ROOT %g = f32[8]{0} all-gather(f32[4]{0} %c), dimensions={0}",
        "}",
    ])
    assert parallel.collectives(hlo, "all-reduce") == (3, 1 + 2 * 32)
    assert parallel.collectives(hlo, "all-gather") == (1, 1)
