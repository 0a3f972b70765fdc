"""The registry: which pins exist, what their headers say, and which pin a client's `model` name finds."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
from gateway_helpers import tiny_model
from tiny_gguf import write_tiny_gguf

from bankml.errors import InvalidRequest, ModelNotFound
from bankml.pin import fork_record
from bankml.verify import gate_model
from gateway.serving.derived import create, write_manifest
from gateway.serving.registry import Registry, human_number


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory) -> Path:
    """One tiny Q8_0 model; tests copy it under the names they need (writing one is the slow part)."""
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf",
                           matrix_type=gguf.GGMLQuantizationType.Q8_0)


def startup(directory: Path, name: str = "Startup-Model.Q8_0.gguf", source: Path | None = None):
    """The gated startup model: a tiny F32 one, or a copy of `source`."""
    if source is None:
        model, fork = tiny_model(directory, name)
    else:
        directory.mkdir(parents=True, exist_ok=True)
        model = Path(shutil.copyfile(source, directory / name))
        fork = directory / (name + ".FORK.json")
        fork.write_text(json.dumps(fork_record(model)))
    return gate_model(str(model), fork.read_text())


def pin_files(registry_dir: Path, fork_name: str, files: dict[str, Path | None]) -> dict:
    """Write DIR/<fork_name>.FORK.json pinning each file; a None source is pinned but not written."""
    registry_dir.mkdir(parents=True, exist_ok=True)
    entries = []
    for name, source in files.items():
        if source is None:
            entries.append({"path": name, "bytes": 1, "sha256": "ab" * 32})
            continue
        target = registry_dir / name
        shutil.copyfile(source, target)
        entries.append(fork_record(target)["files"][0])
    doc = {"kind": "test", "files": entries}
    (registry_dir / f"{fork_name}.FORK.json").write_text(json.dumps(doc))
    return doc


def write_with(path: Path, overrides: dict[str, str], **kw) -> Path:
    """A tiny model whose header has these string keys set (replaced, or added)."""
    orig = gguf.GGUFWriter.write_header_to_file

    def patched(self, *a, **k):
        for key, value in overrides.items():
            for shard in self.kv_data:
                shard.pop(key, None)
            self.add_string(key, value)
        return orig(self, *a, **k)

    gguf.GGUFWriter.write_header_to_file = patched
    try:
        return write_tiny_gguf(path, **kw)
    finally:
        gguf.GGUFWriter.write_header_to_file = orig


# --- building ---------------------------------------------------------------------------------------


def test_startup_then_sorted_forks_first_name_wins(tmp_path, tiny_file):
    gated = startup(tmp_path / "start")
    reg_dir = tmp_path / "reg"
    b = pin_files(reg_dir, "b", {"Beta-Q8_0.gguf": tiny_file, "README.md": tiny_file})
    pin_files(reg_dir, "a", {"Alpha.gguf": tiny_file})
    # a later FORK.json pinning a name already taken (by the startup model and by b) loses
    pin_files(reg_dir, "c", {"Startup-Model.Q8_0.gguf": tiny_file, "beta-q8_0.gguf": tiny_file})

    reg = Registry(gated, str(reg_dir))
    assert reg.names() == ["startup-model.q8_0", "alpha", "beta-q8_0"]
    start, alpha, beta = reg.pins
    assert reg.startup is start and start.path == gated.path and start.fork_path is None
    assert start.sha256 == gated.verified.model_sha256 and start.fork_text == gated.fork_text
    assert start.file_name == "Startup-Model.Q8_0.gguf" and start.tag == "startup-model.q8_0:latest"
    assert beta.file_name == "Beta-Q8_0.gguf" and beta.sha256 == b["files"][0]["sha256"]
    assert beta.fork_path == str(reg_dir / "b.FORK.json")
    assert beta.fork_text == (reg_dir / "b.FORK.json").read_text()
    assert beta.path == str(reg_dir / "Beta-Q8_0.gguf") and beta.size == tiny_file.stat().st_size
    assert beta.modified_at == pytest.approx((reg_dir / "Beta-Q8_0.gguf").stat().st_mtime)
    assert all(p.native and p.reason is None for p in reg.pins)
    assert reg.pin("alpha") is alpha and reg.pin("Alpha") is None


def test_file_beside_the_startup_model_is_taken_first(tmp_path, tiny_file):
    gated = startup(tmp_path / "start")
    pin_files(tmp_path / "reg", "x", {"Both.gguf": tiny_file})
    shutil.copyfile(tiny_file, tmp_path / "start" / "Both.gguf")
    reg = Registry(gated, str(tmp_path / "reg"))
    assert reg.pin("both").path == str(tmp_path / "start" / "Both.gguf")


def test_absent_and_unpinned_files_are_listed_with_their_reason(tmp_path, tiny_file):
    gated = startup(tmp_path / "start")
    pin_files(tmp_path / "reg", "x", {"Gone.gguf": None, "Bad-Sha.gguf": tiny_file})
    doc = json.loads((tmp_path / "reg" / "x.FORK.json").read_text())
    doc["files"][1]["sha256"] = "not-hex"
    (tmp_path / "reg" / "x.FORK.json").write_text(json.dumps(doc))
    reg = Registry(gated, str(tmp_path / "reg"))
    gone, bad = reg.pin("gone"), reg.pin("bad-sha")
    assert (gone.path, gone.size, gone.modified_at, gone.info, gone.native) == (None, 0, 0, None, False)
    assert gone.reason == "Gone.gguf is pinned but not on this machine"
    assert gone.sha256 == "ab" * 32
    assert not bad.native and bad.sha256 == ""
    assert bad.reason == "Bad-Sha.gguf has no sha256 record in FORK.json: unpinned, refused"
    assert bad.info is not None  # the header is still described


def test_records_are_matched_by_basename_and_bad_forks_skipped(tmp_path, tiny_file):
    gated = startup(tmp_path / "start")
    reg_dir = tmp_path / "reg"
    reg_dir.mkdir()
    shutil.copyfile(tiny_file, reg_dir / "Deep.gguf")
    sha = fork_record(reg_dir / "Deep.gguf")["files"][0]["sha256"]
    # a path with a folder names the file by its basename; its record must be under the basename (what a
    # load pins), so this one is listed as unpinned
    (reg_dir / "a.FORK.json").write_text(json.dumps({"files": [{"path": "sub/Deep.gguf", "sha256": sha}]}))
    (reg_dir / "b.FORK.json").write_text("{not json")
    (reg_dir / "c.FORK.json").write_bytes(b"\xff\xfe")
    reg = Registry(gated, str(reg_dir))
    assert reg.names() == ["startup-model.q8_0", "deep"]
    deep = reg.pin("deep")
    assert deep.path == str(reg_dir / "Deep.gguf") and not deep.native and "unpinned" in deep.reason


def test_guard_refused_file_is_never_read_further(tmp_path):
    gated = startup(tmp_path / "start")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"NOPE" + b"\0" * 64)
    pin_files(tmp_path / "reg", "x", {"Junk.gguf": junk})
    p = Registry(gated, str(tmp_path / "reg")).pin("junk")
    assert (p.native, p.info, p.reason) == (False, None, "guard refused: not a GGUF file")


def test_unsupported_architecture_tensor_type_tokenizer_template(tmp_path):
    gated = startup(tmp_path / "start")
    src = tmp_path / "src"
    src.mkdir()
    iq4_nl = gguf.GGMLQuantizationType.IQ4_NL
    files = {
        "Arch.gguf": write_tiny_gguf(src / "a.gguf", "gpt2"),
        "Types.gguf": write_tiny_gguf(src / "t.gguf", raw_tensors={
            "blk.0.attn_q.weight": (np.zeros((64, 36), np.uint8), iq4_nl)}),
        "Tok.gguf": write_with(src / "k.gguf", {"tokenizer.ggml.model": "bert"}),
        "Pre.gguf": write_with(src / "p.gguf", {"tokenizer.ggml.pre": "no-such-pre"}),
        "Tmpl.gguf": write_with(src / "m.gguf", {"tokenizer.chat_template": "{% for m in messages %}"}),
        "Good.gguf": write_with(src / "g.gguf", {"tokenizer.chat_template": "{{ messages[0].content }}"}),
    }
    pin_files(tmp_path / "reg", "x", files)
    reg = Registry(gated, str(tmp_path / "reg"))
    why = {p.name: p.reason for p in reg.pins[1:]}
    assert why["arch"].startswith("unsupported architecture 'gpt2': this engine runs llama, qwen2")
    assert why["types"].startswith("tensor blk.0.attn_q.weight has type IQ4_NL, which bankml's engine does not")
    assert why["tok"].startswith("unsupported tokenizer model 'bert'")
    assert why["pre"].startswith("unsupported pre-tokenizer 'no-such-pre'")
    assert why["tmpl"].startswith("chat template syntax error at line 1")
    assert why["good"] is None and reg.pin("good").native
    assert reg.pin("good").info.chat_template == "{{ messages[0].content }}"
    assert all(not reg.pin(n).native and reg.pin(n).info is not None for n in ("arch", "types", "tok", "tmpl"))


def test_header_info_of_a_tiny_model(tmp_path, tiny_file):
    gated = startup(tmp_path / "start", source=tiny_file)
    info = Registry(gated, None).startup.info
    reader = gguf.GGUFReader(gated.path)  # an independent count (the guard passed this file)
    n = sum(int(t.n_elements) for t in reader.tensors)
    assert (info.arch, info.n_params, info.context_length) == ("llama", n, 4096)
    assert info.parameter_size == human_number(n) and info.parameter_size.endswith("K")
    assert info.quantization_level == "Q8_0"  # the matrices; the F32 norms do not count
    assert info.chat_template is None
    assert Registry(startup(tmp_path / "f32"), None).startup.info.quantization_level == "F32"  # nothing else
    keys = list(info.model_info)
    assert keys == sorted(keys) and "tokenizer.ggml.tokens" not in keys and "tokenizer.ggml.merges" not in keys
    assert info.model_info["llama.attention.layer_norm_rms_epsilon"] == 1e-05  # the f32, shown shortest
    assert info.model_info["general.architecture"] == "llama"
    assert info.sampling.temperature == pytest.approx(0.8)


def test_header_info_of_smollm2(smollm2_path, smollm2_fork):
    gated = gate_model(str(smollm2_path), Path(smollm2_fork).read_text())
    p = Registry(gated, None).startup
    assert p.native and p.name == "smollm2-135m-instruct.q4_1"
    i = p.info
    assert (i.arch, i.quantization_level, i.parameter_size, i.context_length) == ("llama", "Q4_1", "135M", 8192)
    assert "<|im_start|>" in i.chat_template and "tokenizer.chat_template" not in i.model_info
    assert i.model_info["general.size_label"] == "135M" and i.model_info["llama.block_count"] == 30


def test_human_number_as_ollama():
    assert [human_number(n) for n in (134_515_008, 1_711_376_384, 8_030_261_248, 999, 26_900_000)] == [
        "135M", "1.7B", "8.0B", "999", "26.9M"]


def test_twenty_pins_build_from_headers_only(tmp_path, tiny_file):
    gated = startup(tmp_path / "start")
    pin_files(tmp_path / "reg", "many", {f"M{i:02d}.gguf": tiny_file for i in range(20)})
    t = time.perf_counter()
    reg = Registry(gated, str(tmp_path / "reg"))
    assert time.perf_counter() - t < 0.5
    assert len(reg.pins) == 21 and all(p.native for p in reg.pins)


def test_judging_headers_imports_no_jax():
    code = "import sys, gateway.serving.registry, gateway.ollama.models; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# --- resolution -------------------------------------------------------------------------------------


@pytest.fixture()
def reg(tmp_path, tiny_file) -> Registry:
    gated = startup(tmp_path / "start", "Start.gguf")
    pin_files(tmp_path / "reg", "x", {n: tiny_file for n in (
        "Solo.gguf", "Solo-Q8_0.gguf", "Tiny-A-Q8_0.gguf", "Other-Q4_K_M.gguf", "Other-F16.gguf",
        "SmolLM2-135M-Instruct-Q4_K_M.gguf")})
    return Registry(gated, str(tmp_path / "reg"))


@pytest.mark.parametrize("text", [None, "", "   ", 5, ["start"], {"a": 1}])
def test_empty_or_not_a_string_is_the_startup_model(reg, text):
    r = reg.resolve(text)
    assert (r.pin, r.derived, r.tag) == (reg.startup, None, "start:latest")


@pytest.mark.parametrize("text, name", [
    ("Tiny-A-Q8_0", "tiny-a-q8_0"),
    ("  tiny-a-q8_0:latest ", "tiny-a-q8_0"),
    ("TINY-A-Q8_0.GGUF", "tiny-a-q8_0"),
    ("/models/dir/Tiny-A-Q8_0.gguf", "tiny-a-q8_0"),
    ("hf.co/someone/tiny-a-q8_0:latest", "tiny-a-q8_0"),
    ("solo", "solo"),  # exact beats the alias of solo-q8_0
    ("solo-q8_0", "solo-q8_0"),
    ("tiny-a", "tiny-a-q8_0"),  # alias: the name without its suffix
    ("tiny-a-f16:latest", "tiny-a-q8_0"),  # alias: the same base under another suffix
    ("smollm2-135m-instruct", "smollm2-135m-instruct-q4_k_m"),
    ("start.gguf", "start"),
])
def test_resolution(reg, text, name):
    r = reg.resolve(text)
    assert r.pin is reg.pin(name) and r.derived is None and r.tag == f"{name}:latest"


@pytest.mark.parametrize("text", ["other", "other-q8_0", "solo-f16", "nope", "tiny-a:v2", "tiny-a-q8_0:latest:latest"])
def test_unknown_or_ambiguous_is_404(reg, text):
    with pytest.raises(ModelNotFound) as e:
        reg.resolve(text)
    assert e.value.message == (
        f"model '{text}' not found: bankml serves pinned models only (start, solo, solo-q8_0, tiny-a-q8_0, "
        "other-q4_k_m, other-f16, smollm2-135m-instruct-q4_k_m)")


def test_openai_names_resolve_strictly_with_several_models_and_to_the_one_model_otherwise(reg, tmp_path,
                                                                                          tiny_file):
    with pytest.raises(ModelNotFound):
        reg.resolve_openai("gpt-3.5-turbo")  # several pins: the name must say which
    assert reg.resolve_openai("solo").pin is reg.pin("solo")
    alone = Registry(startup(tmp_path / "alone", source=tiny_file), None)
    for text in ("gpt-3.5-turbo", "davinci-002", None, ""):
        assert alone.resolve_openai(text).pin is alone.startup
    with pytest.raises(ModelNotFound):
        alone.resolve("gpt-3.5-turbo")  # Ollama's API still names models strictly


def test_404_cuts_a_long_name(reg):
    with pytest.raises(ModelNotFound) as e:
        reg.resolve("x" * 5000)
    assert e.value.message.startswith("model '" + "x" * 200 + "' not found: bankml serves pinned models only (")


# --- derived names --------------------------------------------------------------------------------


def derive(reg: Registry, name: str, modelfile: str) -> None:
    assert list(create(reg, name, modelfile))[-1] == "success"


def test_derived_between_exact_and_alias(reg, tmp_path):
    derive(reg, "persona", "FROM tiny-a-q8_0\nSYSTEM be brief\n")
    derive(reg, "tiny-a", "FROM tiny-a-q8_0:latest\n")  # a derived model named like an alias of its pin
    d = reg.derived.get("persona")
    # a manifest named like a pin (create refuses one; written by hand here, digest intact) loses to the pin
    write_manifest(dataclasses.replace(d, name="solo", manifest_path=str(tmp_path / "reg" / "solo.MODEL.json")))
    assert reg.derived.get("solo") is not None

    r = reg.resolve("Persona:latest")
    assert (r.pin, r.tag, r.derived.name, r.derived.digest) == (reg.pin("tiny-a-q8_0"), "persona:latest", "persona",
                                                                d.digest)
    r = reg.resolve("tiny-a")
    assert (r.pin, r.tag, r.derived.name) == (reg.pin("tiny-a-q8_0"), "tiny-a:latest", "tiny-a")
    r = reg.resolve("solo")
    assert (r.pin, r.derived, r.tag) == (reg.pin("solo"), None, "solo:latest")
    assert reg.resolve("tiny-a-f16").derived is None  # the alias is a pin's, not a derived model's
    with pytest.raises(ModelNotFound, match=r"\(start, solo, .*, smollm2-135m-instruct-q4_k_m, persona, solo, "
                                            r"tiny-a\)$"):
        reg.resolve("nope")


def test_a_derived_model_whose_base_pin_is_gone_is_a_400(reg, tmp_path):
    derive(reg, "persona", "FROM solo\n")
    (tmp_path / "reg2").mkdir()
    shutil.copyfile(tmp_path / "reg" / "persona.MODEL.json", tmp_path / "reg2" / "persona.MODEL.json")
    later = Registry(startup(tmp_path / "start", "Start.gguf"), str(tmp_path / "reg2"))
    with pytest.raises(InvalidRequest, match="persona: its base Solo.gguf .* is not pinned in the registry"):
        later.resolve("persona")


def test_no_directory_means_an_empty_derived_store(tmp_path):
    reg = Registry(startup(tmp_path / "start"), None)
    assert reg.derived.all() == [] and reg.derived.get("anything") is None
    with pytest.raises(ModelNotFound):
        reg.resolve("anything")


def test_a_derived_whose_base_the_registry_lacks_is_a_400(reg, monkeypatch):
    class D:  # what a store bound to other pins could hand back
        name, base_name, base_file, tag = "mine", "vanished", "Vanished.gguf", "mine:latest"

    monkeypatch.setattr(reg.derived, "get", lambda name: D() if name == "mine" else None)
    with pytest.raises(InvalidRequest, match="derived model 'mine' is built on 'vanished', which is not in the"):
        reg.resolve("Mine:latest")
