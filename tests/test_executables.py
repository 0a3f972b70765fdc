"""Executables kept beside JAX's compile cache (model/executables.py): a restart loads them instead of
tracing and lowering, answers the same tokens, and never loads one built from anything else."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tiny_gguf import write_tiny_gguf

from model import executables

ROOT = Path(__file__).resolve().parent.parent

# Loads the engine with `cache`, optionally with lowering forbidden, and prints its greedy tokens and how
# many programs were lowered.
_START = """
import json, sys
from model.compiled import ProgramCache
from model.engine import Engine
from model.messages import SamplingParams
lowered = []
lower = ProgramCache.lower
def counting(self, *key):
    lowered.append(key)
    return lower(self, *key)
ProgramCache.lower = counting
engine = Engine.load(sys.argv[1], verified=True, n_ctx=256, max_seqs=1, prefill_chunk=16,
                     compile_cache_dir=sys.argv[2])
params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
tokens = [out.token for out in engine.generate([1, 5, 9, 14, 3, 7], params)]
print(json.dumps({"tokens": tokens, "lowered": len(lowered),
                  "programs": len(engine.programs.keys())}))
"""


def _start(model: Path, cache: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", _START, str(model), str(cache)], cwd=ROOT, capture_output=True,
                          text=True, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def test_a_restart_loads_the_stored_programs_and_answers_the_same_tokens(tmp_path):
    model = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", n_layer=1)
    cache = tmp_path / "xla"
    first = _start(model, cache)
    assert first["lowered"] == first["programs"]
    stored = sorted((cache / executables.SUBDIR).iterdir())
    assert len(stored) == first["programs"]
    again = _start(model, cache)
    assert again["lowered"] == 0
    assert again["tokens"] == first["tokens"]
    # a damaged entry is ignored: that program is lowered again, and the answer is the same
    stored[0].write_bytes(b"not an executable")
    damaged = _start(model, cache)
    assert damaged["lowered"] == 1 and damaged["tokens"] == first["tokens"]


def test_another_model_lowers_its_own_programs(tmp_path):
    cache = tmp_path / "xla"
    _start(write_tiny_gguf(tmp_path / "a.gguf", "llama", n_layer=1), cache)
    other = _start(write_tiny_gguf(tmp_path / "b.gguf", "llama", n_layer=2), cache)
    assert other["lowered"] == other["programs"]


def test_the_name_covers_every_part():
    assert executables.digest(("decode", 1, 16), "config") == executables.digest(("decode", 1, 16), "config")
    assert executables.digest(("decode", 1, 16), "config") != executables.digest(("decode", 1, 32), "config")
    assert executables.digest(("decode", 1, 16), "config") != executables.digest(("decode", 1, 16), "other")
