"""Derived models: the manifest and its digest, the tamper and base checks, create/copy/delete over a real
Registry of tiny pinned GGUFs, and how a layer is applied to /api and /v1 requests."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import struct
from pathlib import Path

import gguf
import pytest
from gateway_helpers import tiny_model
from tiny_gguf import write_tiny_gguf

from bankml.errors import InvalidRequest, ModelNotFound
from bankml.pin import fork_record
from bankml.verify import gate_model
from gateway.serving.derived import (
    Layer,
    check_name,
    copy,
    create,
    delete,
    layer_digest,
    layer_text,
    read_manifest,
)
from gateway.serving.layer import apply_ollama, apply_openai, layer_num_ctx, show_fields
from gateway.serving.modelfile import parse_modelfile
from gateway.serving.registry import Registry

TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
BASE = "Base-Model.Q8_0.gguf"


def f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


@pytest.fixture(scope="module")
def base_file(tmp_path_factory) -> Path:
    """A tiny Q8_0 model with a chat template (written once; tests copy it)."""
    path = tmp_path_factory.mktemp("src") / BASE
    orig = gguf.GGUFWriter.write_header_to_file

    def with_template(self, *a, **k):
        self.add_string("tokenizer.chat_template", TEMPLATE)
        return orig(self, *a, **k)

    gguf.GGUFWriter.write_header_to_file = with_template
    try:
        return write_tiny_gguf(path, matrix_type=gguf.GGMLQuantizationType.Q8_0)
    finally:
        gguf.GGUFWriter.write_header_to_file = orig


@pytest.fixture(scope="module")
def startup_gated(tmp_path_factory):
    model, fork = tiny_model(tmp_path_factory.mktemp("start"), "Startup-Model.Q8_0.gguf")
    return gate_model(str(model), fork.read_text())


@pytest.fixture
def reg_dir(tmp_path, base_file) -> Path:
    d = tmp_path / "reg"
    d.mkdir()
    shutil.copyfile(base_file, d / BASE)
    (d / f"{BASE}.FORK.json").write_text(json.dumps(fork_record(d / BASE)))
    return d


@pytest.fixture
def registry(reg_dir, startup_gated) -> Registry:
    return Registry(startup_gated, str(reg_dir))


def run(registry, name, spec, **kw) -> list[str]:
    return list(create(registry, name, spec, **kw))


def manifest(reg_dir: Path, name: str) -> dict:
    return json.loads((reg_dir / f"{name}.MODEL.json").read_text(), object_pairs_hook=lambda kv: kv)


# --- the digest ------------------------------------------------------------------------------------------


def test_a_known_layer_gives_a_known_digest():
    layer = Layer("ab" * 32, system='Say "hi"\\\n\tand é', parameters={"temperature": f32(0.7), "num_ctx": 2048},
                  stop=("<|im_end|>",), license=("MIT",), messages=({"role": "user", "content": "q"},))
    by_hand = ('{"base_sha256": "' + "ab" * 32 + '", "system": "Say \\"hi\\"\\\\\\n\\u0009and é", '
               '"parameters": {"temperature": 0.7, "num_ctx": 2048}, "stop": ["<|im_end|>"], '
               '"template_sha256": null, "license": ["MIT"], "messages": [{"role": "user", "content": "q"}], '
               '"requires": null}')
    assert layer_text(layer) == by_hand
    assert layer_digest(layer) == "sha256:" + hashlib.sha256(by_hand.encode()).hexdigest()
    assert layer_digest(Layer("ab" * 32, parameters={"temperature": f32(0.7000001)})) != layer_digest(
        Layer("ab" * 32, parameters={"temperature": f32(0.7)}))


# --- create -------------------------------------------------------------------------------------------------


def test_create_streams_the_status_lines_and_writes_the_manifest(registry, reg_dir):
    sha = registry.pin("base-model.q8_0").sha256
    lines = run(registry, "Persona:latest", "FROM base-model.q8_0\nSYSTEM be brief\nPARAMETER num_ctx 1024\n"
                "PARAMETER temperature 0.7\nPARAMETER stop END\nLICENSE MIT\nMESSAGE user hi\n")
    d = registry.derived.get("persona")
    assert lines == ["parsing modelfile",
                     f"verifying {BASE} (the guard, then its sha256 against {BASE}.FORK.json)",
                     f"using existing layer sha256:{sha}",
                     "creating system layer", "creating parameters layer", "creating license layer",
                     "creating messages layer",
                     f"writing manifest persona.MODEL.json (digest {d.digest})", "success"]
    pairs = manifest(reg_dir, "persona")
    assert [k for k, _ in pairs] == ["kind", "bankml", "name", "created_at", "base", "layer", "digest"]
    doc = dict(pairs)
    assert [k for k, _ in doc["base"]] == ["name", "file", "sha256", "fork", "path"]
    assert [k for k, _ in doc["layer"]] == ["base_sha256", "system", "parameters", "stop", "template_sha256",
                                             "license", "messages", "requires"]
    # parameters keep the manifest's order, whatever the Modelfile's
    assert [k for k, _ in dict(doc["layer"])["parameters"]] == ["temperature", "num_ctx"]
    text = (reg_dir / "persona.MODEL.json").read_text()
    layer = text.split('"layer": ', 1)[1].rsplit(',\n "digest"', 1)[0]
    assert d.digest == doc["digest"] == "sha256:" + hashlib.sha256(layer.encode()).hexdigest()
    assert d.layer == Layer(sha, "be brief", {"temperature": f32(0.7), "num_ctx": 1024}, ("END",), "", ("MIT",),
                            ({"role": "user", "content": "hi"},))
    assert (d.base_name, d.base_file, d.base_sha256, d.tag) == ("base-model.q8_0", BASE, sha, "persona:latest")
    assert not list(reg_dir.glob("*.part"))
    assert [x.name for x in registry.derived.all()] == ["persona"]
    # the registry resolves it to its base, answering as itself
    r = registry.resolve("persona:latest")
    assert (r.pin.name, r.tag, r.derived.digest) == ("base-model.q8_0", "persona:latest", d.digest)


def test_a_part_file_symlinked_outside_the_registry_is_not_followed(registry, reg_dir, tmp_path):
    # write_manifest opened `<name>.MODEL.json.part` with open(..., "w"): a symlink there was followed, and the
    # manifest overwrote a file outside the registry directory
    outside = tmp_path / "outside.txt"
    outside.write_text("keep me")
    (reg_dir / "evil.MODEL.json.part").symlink_to(outside)
    assert run(registry, "evil", "FROM base-model.q8_0\n")[-1] == "success"
    assert outside.read_text() == "keep me"
    manifest_file = reg_dir / "evil.MODEL.json"
    assert not manifest_file.is_symlink() and registry.derived.get("evil").name == "evil"
    assert not os.path.lexists(reg_dir / "evil.MODEL.json.part")


def test_the_same_layer_is_the_same_digest_and_a_copy_keeps_it(registry):
    run(registry, "a", "FROM base-model.q8_0\nSYSTEM s\nPARAMETER seed 3\n")
    run(registry, "b", {"from": "base-model.q8_0", "system": "s", "parameters": {"seed": 3}})
    copy(registry, "a:latest", "c")
    digests = {n: registry.derived.get(n).digest for n in "abc"}
    assert len(set(digests.values())) == 1
    # a pin's copy is an empty layer
    copy(registry, "base-model.q8_0", "plain")
    plain = registry.derived.get("plain")
    assert plain.layer == Layer(plain.base_sha256) and plain.digest != digests["a"]


def test_from_a_derived_model_inherits_its_layer(registry):
    run(registry, "parent", "FROM base-model.q8_0\nSYSTEM one\nPARAMETER temperature 0.5\nPARAMETER top_k 20\n"
        "PARAMETER stop A\nPARAMETER stop B\nLICENSE MIT\nMESSAGE user hi\n")
    run(registry, "child", "FROM parent\nPARAMETER top_k 5\nPARAMETER stop C\nLICENSE MIT\nLICENSE BSD\n")
    child = registry.derived.get("child").layer
    assert child.system == "one" and child.messages == ({"role": "user", "content": "hi"},)
    assert dict(child.parameters) == {"temperature": 0.5, "top_k": 5}
    assert child.stop == ("C",) and child.license == ("MIT", "BSD")


def test_from_a_pinned_path_and_refused_paths(registry, reg_dir, tmp_path):
    """`bankml create` (a base_dir: the user's own machine) takes a pinned GGUF's path; the server's routes
    never do (tests/test_registry_hygiene.py)."""
    here = str(tmp_path)
    assert run(registry, "by-path", f"FROM {reg_dir / BASE}\n", base_dir=here)[-1] == "success"
    assert run(registry, "relative", f"FROM ./{BASE}\n", base_dir=str(reg_dir))[-1] == "success"
    other = tmp_path / "Other.gguf"
    shutil.copyfile(reg_dir / BASE, other)
    (tmp_path / "st").mkdir()
    cases = {f"FROM {other}": "Other.gguf is not pinned in the registry",
             f"FROM {tmp_path / 'st'}": "converting safetensors is out of scope for bankml serve",
             f"FROM {tmp_path / 'missing.gguf'}": "no such file",
             "FROM nobody": "FROM nobody: model 'nobody' not found"}
    for text, why in cases.items():
        with pytest.raises(InvalidRequest) as e:
            run(registry, "x", text, base_dir=here)
        assert why in e.value.message, text
    for value in ("~a\0b.gguf", "/x\0y.gguf"):  # the structured form keeps a NUL (a Modelfile drops it)
        with pytest.raises(InvalidRequest, match="no such file"):
            run(registry, "x", {"from": value}, base_dir=here)
    assert not (reg_dir / "x.MODEL.json").exists()


def test_template_only_byte_equal_to_the_bases(registry):
    run(registry, "templated", {"from": "base-model.q8_0", "template": TEMPLATE})
    assert registry.derived.get("templated").layer.template_sha256 == hashlib.sha256(TEMPLATE.encode()).hexdigest()
    with pytest.raises(InvalidRequest, match="TEMPLATE: bankml renders the base's own chat template"):
        run(registry, "other", {"from": "base-model.q8_0", "template": TEMPLATE + " "})


def test_the_base_is_verified_before_anything_is_written(registry, reg_dir):
    with open(reg_dir / BASE, "r+b") as f:  # same size, other bytes: the guard passes, the sha256 does not
        f.seek(-4, 2)
        f.write(b"\x00\x01\x02\x03")
    gen = create(registry, "late", "FROM base-model.q8_0\n")
    assert next(gen) == "parsing modelfile" and next(gen).startswith("verifying ")
    with pytest.raises(InvalidRequest, match=r"FROM base-model.q8_0: refuse: .*sha256 .* != pinned"):
        next(gen)
    assert not (reg_dir / "late.MODEL.json").exists()


def test_names(registry):
    assert check_name(" Mindx-Gen39:latest ") == "mindx-gen39"
    for bad in ["a:b", "", "x.gguf", "a/b", "-x", ".x", "sp ace", "x" * 129, "ü"]:
        with pytest.raises(InvalidRequest):
            check_name(bad)
    assert check_name("x" * 128)
    with pytest.raises(InvalidRequest, match="base-model.q8_0 is a pinned model's name"):
        run(registry, "Base-Model.Q8_0", "FROM base-model.q8_0\n")
    with pytest.raises(InvalidRequest, match="without --registry"):
        run(Registry(registry_startup(registry), None), "x", "FROM base-model.q8_0\n")


def registry_startup(registry):
    p = registry.startup
    return gate_model(p.path, p.fork_text)


def test_the_startup_model_is_a_base_its_fork_recorded_by_path(reg_dir, startup_gated, tmp_path_factory):
    """bankml serve's own model (its FORK.json given with --fork, outside DIR) can be layered on: the
    manifest names that FORK.json by its path."""
    fork = tmp_path_factory.mktemp("forks") / "Startup-Model.Q8_0.gguf.FORK.json"
    fork.write_text(startup_gated.fork_text)
    registry = Registry(dataclasses.replace(startup_gated, fork_path=str(fork)), str(reg_dir))
    lines = run(registry, "s", "FROM startup-model.q8_0\nSYSTEM hi\n")
    assert f"verifying Startup-Model.Q8_0.gguf (the guard, then its sha256 against {fork})" in lines
    assert dict(manifest(reg_dir, "s")[4][1])["fork"] == str(fork)
    assert registry.derived.get("s").base_name == "startup-model.q8_0"


def test_a_base_with_no_known_fork_is_refused(registry):
    with pytest.raises(InvalidRequest, match="its FORK.json is not in the registry directory"):
        run(registry, "s", "FROM startup-model.q8_0\n")


# --- reading back -------------------------------------------------------------------------------------------


def test_a_hand_edited_manifest_is_refused(registry, reg_dir, caplog):
    run(registry, "edited", "FROM base-model.q8_0\nSYSTEM be brief\n")
    path = reg_dir / "edited.MODEL.json"
    path.write_text(path.read_text().replace("be brief", "be loose"))
    with pytest.raises(InvalidRequest, match="edited.MODEL.json was edited by hand, refused — create it again"):
        registry.derived.get("edited")
    with caplog.at_level(logging.WARNING, logger="bankml.gateway"):
        assert registry.derived.all() == []
    assert "edited by hand" in caplog.text
    # the digest edited to match the layer's text too: still refused unless it is the layer's sha256
    doc = json.loads(path.read_text())
    doc["digest"] = "sha256:" + "0" * 64
    path.write_text(json.dumps(doc))
    with pytest.raises(InvalidRequest, match="edited by hand"):
        read_manifest(str(path))


def test_from_a_tampered_derived_model_is_refused(registry, reg_dir):
    run(registry, "src", "FROM base-model.q8_0\nSYSTEM x\n")
    path = reg_dir / "src.MODEL.json"
    path.write_text(path.read_text().replace('"system": "x"', '"system": "y"'))
    with pytest.raises(InvalidRequest, match="FROM src: src.MODEL.json was edited by hand"):
        run(registry, "dst", "FROM src\n")


def test_a_base_whose_pin_changed_is_refused_naming_both(registry, reg_dir, startup_gated):
    run(registry, "bound", "FROM base-model.q8_0\n")
    old = registry.pin("base-model.q8_0").sha256
    new = "cd" * 32
    fork = reg_dir / f"{BASE}.FORK.json"
    doc = json.loads(fork.read_text())
    doc["files"][0]["sha256"] = new
    fork.write_text(json.dumps(doc))
    later = Registry(startup_gated, str(reg_dir))
    with pytest.raises(InvalidRequest) as e:
        later.derived.get("bound")
    assert old in e.value.message and new in e.value.message
    assert later.derived.all() == []


def test_a_rust_written_empty_string_checks_against_its_own_digest(registry, reg_dir):
    run(registry, "rusty", "FROM base-model.q8_0\n")
    path = reg_dir / "rusty.MODEL.json"
    text = path.read_text().replace('"system": null', '"system": ""')
    layer = text.split('"layer": ', 1)[1].rsplit(',\n "digest"', 1)[0]
    digest = "sha256:" + hashlib.sha256(layer.encode()).hexdigest()
    text = text.rsplit('"digest": ', 1)[0] + f'"digest": "{digest}"\n}}\n'
    path.write_text(text)
    assert registry.derived.get("rusty").digest == digest


# --- delete -------------------------------------------------------------------------------------------------


def test_delete(registry, reg_dir):
    run(registry, "gone", "FROM base-model.q8_0\n")
    delete(registry, "Gone:latest")
    assert not (reg_dir / "gone.MODEL.json").exists() and registry.derived.get("gone") is None
    with pytest.raises(ModelNotFound, match="model 'gone' not found"):
        delete(registry, "gone")
    for name in ("base-model.q8_0", "Base-Model.Q8_0:latest"):
        with pytest.raises(InvalidRequest, match="bankml does not delete pins over HTTP"):
            delete(registry, name)
    assert (reg_dir / BASE).exists()


# --- applying the layer --------------------------------------------------------------------------------------

LAYER = Layer("ab" * 32, system="You are terse.", parameters={"temperature": f32(0.5), "num_ctx": 2048,
                                                                "num_predict": 64},
              stop=("END",), messages=({"role": "user", "content": "who?"}, {"role": "assistant", "content": "me"}))


def roles(messages) -> list[str]:
    return [f"{m['role']}:{m['content']}" for m in messages]


def test_apply_ollama_chat():
    body = {"model": "p", "messages": [{"role": "user", "content": "hi"}]}
    out = apply_ollama(LAYER, "chat", body)
    assert roles(out["messages"]) == ["system:You are terse.", "user:who?", "assistant:me", "user:hi"]
    assert out["options"] == {"temperature": f32(0.5), "num_ctx": 2048, "num_predict": 64, "stop": ["END"]}
    assert body == {"model": "p", "messages": [{"role": "user", "content": "hi"}]}  # a new body
    own = apply_ollama(LAYER, "chat", {"messages": [{"role": "system", "content": "mine"},
                                                    {"role": "user", "content": "hi"}],
                                       "options": {"temperature": 0, "stop": ["X"], "top_k": 3}})
    assert roles(own["messages"]) == ["user:who?", "assistant:me", "system:mine", "user:hi"]
    assert own["options"] == {"num_ctx": 2048, "num_predict": 64, "temperature": 0, "stop": ["X"], "top_k": 3}
    # an empty conversation only loads: left as it is
    assert apply_ollama(LAYER, "chat", {"messages": []})["messages"] == []


def test_apply_ollama_generate():
    out = apply_ollama(LAYER, "generate", {"prompt": "hi", "bankml_messages": "injected"})
    assert roles(out["bankml_messages"]) == ["system:You are terse.", "user:who?", "assistant:me", "user:hi"]
    own = apply_ollama(LAYER, "generate", {"prompt": "hi", "system": "mine"})
    assert roles(own["bankml_messages"])[0] == "system:mine"
    raw = apply_ollama(LAYER, "generate", {"prompt": "hi", "raw": True, "options": {"seed": 1}})
    assert "bankml_messages" not in raw and raw["options"]["seed"] == 1 and raw["options"]["num_ctx"] == 2048
    assert apply_ollama(LAYER, "generate", {"prompt": "x", "options": "bad"})["options"] == "bad"


def test_apply_openai():
    out = apply_openai(LAYER, {"messages": [{"role": "user", "content": "hi"}], "temperature": None})
    assert roles(out["messages"]) == ["system:You are terse.", "user:who?", "assistant:me", "user:hi"]
    assert (out["temperature"], out["max_tokens"], out["stop"]) == (f32(0.5), 64, ["END"])
    assert "num_ctx" not in out and "num_predict" not in out and layer_num_ctx(LAYER) == 2048
    own = apply_openai(LAYER, {"messages": [], "temperature": 1, "n_predict": 5, "stop": "Z"})
    assert (own["temperature"], own["stop"], "max_tokens" in own) == (1, "Z", False)
    unlimited = Layer("ab" * 32, parameters={"num_predict": -1})
    assert "max_tokens" not in apply_openai(unlimited, {"messages": []})


# --- /api/show ------------------------------------------------------------------------------------------------


def test_show_fields_regenerate_the_modelfile(registry):
    run(registry, "shown", 'FROM base-model.q8_0\nSYSTEM """two\nlines "q" """\nPARAMETER temperature 0.7\n'
        "PARAMETER stop <|im_end|>\nLICENSE MIT\nMESSAGE user hi\n")
    d = registry.derived.get("shown")
    f = show_fields(d)
    spec = parse_modelfile(f["modelfile"])
    assert f["modelfile"].startswith("# bankml ") and spec.from_ == "base-model.q8_0"
    assert (spec.system, spec.parameters, spec.stop, spec.license) == (d.layer.system, dict(d.layer.parameters),
                                                                        ["<|im_end|>"], ["MIT"])
    assert f["parameters"] == "temperature                    0.7\nstop                           \"<|im_end|>\""
    assert f["system"] == 'two\nlines "q" ' and f["license"] == "MIT"
    assert f["messages"] == [{"role": "user", "content": "hi"}] and f["modified_at"] == d.created_at
    assert "details" not in f  # /api/show sets details.parent_model over the base's details
    assert f["bankml"]["layer"] == {"derived": True, "digest": d.digest, "base_sha256": d.base_sha256,
                                    "base_fork": f"{BASE}.FORK.json"}


# --- the real model -------------------------------------------------------------------------------------------


def test_over_the_real_smollm2_its_own_template_is_accepted(smollm2_path, smollm2_fork, tmp_path):
    reg = tmp_path / "reg"
    reg.mkdir()
    shutil.copyfile(smollm2_fork, reg / smollm2_fork.name)  # the startup model's pin, in the registry
    registry = Registry(gate_model(str(smollm2_path), smollm2_fork.read_text()), str(reg))
    pin = registry.startup
    template = pin.info.chat_template
    assert template and "<|im_start|>" in template
    lines = run(registry, "smol-persona", {"from": pin.name, "template": template, "system": "Be brief.",
                                           "parameters": {"temperature": 0.2}})
    assert lines[1] == f"verifying {pin.file_name} (the guard, then its sha256 against {smollm2_fork.name})"
    assert lines[2] == f"using existing layer sha256:{pin.sha256}"
    d = registry.derived.get("smol-persona")
    assert d.layer.template_sha256 == hashlib.sha256(template.encode()).hexdigest()
    with pytest.raises(InvalidRequest, match="TEMPLATE"):
        run(registry, "smol-other", {"from": pin.name, "template": template.replace("<|im_start|>", "<s>")})


def test_a_megabyte_name_is_a_short_400(registry):
    with pytest.raises(InvalidRequest) as e:
        run(registry, "/" * (1 << 20), "FROM base-model.q8_0\n")
    assert len(e.value.message) < 400 and "(1048576 characters)" in e.value.message
