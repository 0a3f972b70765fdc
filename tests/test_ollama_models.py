"""GET /api/version, /api/tags, /api/ps, POST /api/show and /v1/models' data: shapes, key orders, values."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import gguf
import ollama
import pytest
from gateway_helpers import FakeServer, exchange, registry_dir, request_bytes, split_response, tiny_model
from tiny_gguf import write_tiny_gguf

from bankml import __version__
from bankml.errors import BankmlError, ModelNotFound
from bankml.pin import fork_record
from bankml.verify import gate_model
from gateway.http.errors import Api, status_of
from gateway.http.timestamps import created_at
from gateway.ollama import models as ollama_models
from gateway.serving.derived import create
from gateway.serving.registry import Registry, v1_models_data

RFC3339_NS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{9}Z$")
DETAILS_KEYS = ["parent_model", "format", "family", "families", "parameter_size", "quantization_level"]


@pytest.fixture(scope="module")
def registry(tmp_path_factory) -> Registry:
    root = tmp_path_factory.mktemp("reg")
    model, fork = tiny_model(root / "start", "Start-Model.Q8_0.gguf")
    gated = gate_model(str(model), fork.read_text())
    reg_dir = root / "dir"
    reg_dir.mkdir()
    q8 = write_tiny_gguf(reg_dir / "Other-Q8_0.gguf", matrix_type=gguf.GGMLQuantizationType.Q8_0)
    entries = [fork_record(q8)["files"][0], {"path": "Gone.gguf", "bytes": 5, "sha256": "cd" * 32}]
    (reg_dir / "x.FORK.json").write_text(json.dumps({"files": entries}))
    return Registry(gated, str(reg_dir))


class FakeResidency:
    def __init__(self, records=(), ctx=2048):
        self.records = list(records)
        self.ctx = ctx

    def ps(self):
        return self.records


def record(pin, shown_as=None, expires_at=None, n_ctx=512):
    loaded = SimpleNamespace(pin=pin, size_bytes=123456, vram_bytes=7890, model=SimpleNamespace(n_ctx=n_ctx))
    return SimpleNamespace(loaded=loaded, shown_as=shown_as or pin.tag, context_length=n_ctx,
                           expires_at=expires_at)


def call(handler, state, body: bytes = b""):
    response = asyncio.run(handler(SimpleNamespace(body=body), state))
    assert response.status == 200 and response.content_type.startswith("application/json")
    return response.body.decode()


def state_of(registry, residency=None):
    return SimpleNamespace(registry=registry, residency=residency or FakeResidency())


def show_error(registry, body: bytes) -> BankmlError:
    with pytest.raises(BankmlError) as e:
        call(ollama_models.show, state_of(registry), body)
    return e.value


# --- small pieces -----------------------------------------------------------------------------------


def test_created_at_is_rfc3339_utc_with_nine_digits():
    assert created_at(0) == "1970-01-01T00:00:00.000000000Z"
    assert created_at(1_700_000_000.25) == "2023-11-14T22:13:20.250000000Z"
    assert RFC3339_NS.match(created_at(time.time() + ollama_models.FOREVER_S))


def test_version(registry):
    assert call(ollama_models.version, state_of(registry)) == f'{{"version": "{__version__}", "bankml": true}}'


def test_v1_models_data_lists_every_pin(registry):
    assert v1_models_data(registry) == [
        {"id": "Start-Model.Q8_0.gguf", "object": "model", "owned_by": "bankML"},
        {"id": "Other-Q8_0.gguf", "object": "model", "owned_by": "bankML"},
        {"id": "Gone.gguf", "object": "model", "owned_by": "bankML"},
    ]


# --- /api/tags --------------------------------------------------------------------------------------


def test_tags_shape_and_values(registry):
    text = call(ollama_models.tags, state_of(registry))
    models = json.loads(text)["models"]
    assert [m["name"] for m in models] == ["start-model.q8_0:latest", "other-q8_0:latest", "gone:latest"]
    start, other, gone = models
    assert list(start) == ["name", "model", "modified_at", "size", "digest", "details", "bankml"]
    assert list(start["details"]) == DETAILS_KEYS and list(start["bankml"]) == ["native", "reason", "file", "found"]
    pin = registry.pin("other-q8_0")
    assert other == {
        "name": "other-q8_0:latest", "model": "other-q8_0:latest",
        "modified_at": created_at(pin.modified_at), "size": Path(pin.path).stat().st_size,
        "digest": pin.sha256,
        "details": {"parent_model": "", "format": "gguf", "family": "llama", "families": ["llama"],
                    "parameter_size": pin.info.parameter_size, "quantization_level": "Q8_0"},
        "bankml": {"native": True, "reason": None, "file": "Other-Q8_0.gguf", "found": True},
    }
    assert RFC3339_NS.match(other["modified_at"]) and re.fullmatch(r"[0-9a-f]{64}", other["digest"])
    assert start["details"]["quantization_level"] == "F32"
    assert gone["size"] == 0 and gone["digest"] == "cd" * 32
    assert gone["modified_at"] == "1970-01-01T00:00:00.000000000Z"
    assert gone["bankml"] == {"native": False, "reason": "Gone.gguf is pinned but not on this machine",
                              "file": "Gone.gguf", "found": False}
    assert '"families": ["llama"]' in text  # the writer is jstr's: ": " and ", "


def test_tags_parse_as_the_ollama_client_reads_them(registry):
    listed = ollama.ListResponse.model_validate_json(call(ollama_models.tags, state_of(registry)))
    assert [m.model for m in listed.models] == ["start-model.q8_0:latest", "other-q8_0:latest", "gone:latest"]
    assert listed.models[1].details.family == "llama" and listed.models[1].modified_at.year >= 2026


# --- /api/show --------------------------------------------------------------------------------------


def test_show_a_pin(registry):
    text = call(ollama_models.show, state_of(registry), b'{"model": "Other-Q8_0:latest"}')
    out = json.loads(text)
    assert list(out) == ["modelfile", "parameters", "template", "details", "model_info", "capabilities",
                         "modified_at", "bankml"]
    pin = registry.pin("other-q8_0")
    params = 'temperature 0.8\ntop_k 40\ntop_p 0.95\nmin_p 0.05\nstop "<|im_end|>"'
    assert out["parameters"] == params
    assert out["modelfile"] == (
        f"# bankml {__version__}: a pinned model (sha256 {pin.sha256}), verified before every load; not "
        f"editable\nFROM {pin.path}\n" + "".join(f"PARAMETER {line}\n" for line in params.split("\n")))
    assert out["template"] == ""  # the tiny GGUF has none
    assert out["details"] == json.loads(call(ollama_models.tags, state_of(registry)))["models"][1]["details"]
    assert out["model_info"]["general.architecture"] == "llama" and "tokenizer.ggml.tokens" not in out["model_info"]
    assert list(out["model_info"]) == sorted(out["model_info"])
    assert out["capabilities"] == ["completion"]
    assert out["bankml"] == {"sha256": pin.sha256, "native": True, "n_ctx": 2048}  # not resident: --ctx
    shown = ollama.ShowResponse.model_validate_json(text)
    assert shown.modelinfo["llama.context_length"] == 4096 and shown.details.quantization_level == "Q8_0"


def test_show_by_name_and_resident_context(registry):
    pin = registry.pin("other-q8_0")
    state = state_of(registry, FakeResidency([record(pin, n_ctx=1024)]))
    out = json.loads(call(ollama_models.show, state, b'{"name": "other"}'))  # the alias, by `name`
    assert out["bankml"]["n_ctx"] == 1024


def test_show_an_absent_pin_says_what_it_knows(registry):
    out = json.loads(call(ollama_models.show, state_of(registry), b'{"model": "gone"}'))
    assert out["capabilities"] == [] and out["model_info"] == {} and out["bankml"]["native"] is False
    assert "\nFROM Gone.gguf\n" in out["modelfile"]


@pytest.mark.parametrize("body, message", [
    (b'{"model": "nope"}', "model 'nope' not found: bankml serves pinned models only "
                           "(start-model.q8_0, other-q8_0, gone)"),
    (b"{}", "model is required"),
    (b'{"model": ""}', "model is required"),
    (b'{"model": 7}', "model is required"),
    (b"[1]", "body is not a JSON object"),
])
def test_show_failures_are_404(registry, body, message):
    e = show_error(registry, body)
    assert isinstance(e, ModelNotFound) and status_of(e, Api.OLLAMA) == 404 and e.message == message


def test_show_bad_json_is_404(registry):
    e = show_error(registry, b"{not json")
    assert isinstance(e, ModelNotFound) and status_of(e, Api.OLLAMA) == 404


# --- /api/ps ----------------------------------------------------------------------------------------


def test_ps_empty(registry):
    assert call(ollama_models.ps, state_of(registry)) == '{"models": []}'


def test_ps_entries(registry):
    other, start = registry.pin("other-q8_0"), registry.startup
    expires = time.time() + 300
    state = state_of(registry, FakeResidency([record(other, expires_at=expires, n_ctx=512), record(start)]))
    before = time.time()
    text = call(ollama_models.ps, state)
    first, second = json.loads(text)["models"]
    assert list(first) == ["name", "model", "size", "digest", "details", "expires_at", "size_vram",
                           "context_length"]
    assert first == {"name": "other-q8_0:latest", "model": "other-q8_0:latest", "size": 123456,
                     "digest": other.sha256, "details": ollama_models.details(other),
                     "expires_at": created_at(expires), "size_vram": 7890, "context_length": 512}
    kept = ollama.ProcessResponse.model_validate_json(text).models[1]  # kept forever: 292 years from now
    assert kept.model == "start-model.q8_0:latest"
    assert abs(kept.expires_at.timestamp() - (before + ollama_models.FOREVER_S)) < 5


def test_ps_a_record_naming_other_weights_shows_the_pin(registry):
    other = registry.pin("other-q8_0")
    text = call(ollama_models.ps, state_of(registry, FakeResidency([record(other, shown_as="unknown:latest")])))
    entry = json.loads(text)["models"][0]
    assert entry["name"] == "other-q8_0:latest" and entry["details"]["parent_model"] == ""


def test_copied_startup_file_keeps_one_listing(tmp_path, registry):
    # a FORK.json that pins the startup model's own name again does not list it twice
    model, fork = tiny_model(tmp_path / "s", "Same.gguf")
    (tmp_path / "d").mkdir()
    shutil.copyfile(fork, tmp_path / "d" / "Same.gguf.FORK.json")
    reg = Registry(gate_model(str(model), fork.read_text()), str(tmp_path / "d"))
    assert [m["name"] for m in ollama_models.tags_body(reg)["models"]] == ["same:latest"]


# --- derived models ---------------------------------------------------------------------------------


@pytest.fixture()
def with_derived(tmp_path) -> Registry:
    model, fork = tiny_model(tmp_path / "start", "Start.gguf")
    reg_dir = tmp_path / "dir"
    base, base_fork = tiny_model(reg_dir, "Base-Q8_0.gguf")
    reg = Registry(gate_model(str(model), fork.read_text()), str(reg_dir))
    steps = list(create(reg, "persona", 'FROM base-q8_0\nSYSTEM "be brief"\nPARAMETER temperature 0.25\n'
                                        "LICENSE MIT\n"))
    assert steps[-1] == "success"
    return reg


def test_tags_and_v1_list_a_derived_model_after_the_pins(with_derived):
    reg = with_derived
    base, d = reg.pin("base-q8_0"), reg.derived.get("persona")
    models = json.loads(call(ollama_models.tags, state_of(reg)))["models"]
    assert [m["name"] for m in models] == ["start:latest", "base-q8_0:latest", "persona:latest"]
    pin_entry, entry = models[1], models[2]
    assert list(entry) == list(pin_entry)
    assert entry["modified_at"] == d.created_at and RFC3339_NS.match(entry["modified_at"])
    assert entry["size"] == base.size and entry["digest"] == d.digest and d.digest.startswith("sha256:")
    assert entry["details"] == {**pin_entry["details"], "parent_model": "base-q8_0:latest"}
    assert entry["bankml"] == pin_entry["bankml"]  # only the four fields differ
    assert {k for k in entry if entry[k] != pin_entry[k]} == {"name", "model", "modified_at", "digest", "details"}
    assert v1_models_data(reg)[-1] == {"id": "persona:latest", "object": "model", "owned_by": "bankML"}


def test_show_a_derived_model(with_derived):
    reg = with_derived
    d = reg.derived.get("persona")
    base_out = json.loads(call(ollama_models.show, state_of(reg), b'{"model": "base-q8_0"}'))
    text = call(ollama_models.show, state_of(reg), b'{"model": "persona:latest"}')
    out = json.loads(text)
    assert list(out) == ["license", "modelfile", "parameters", "template", "system", "details", "model_info",
                         "capabilities", "modified_at", "bankml"]
    assert out["system"] == "be brief" and out["license"] == "MIT"
    assert out["parameters"] == "temperature                    0.25"  # keys padded to 30
    assert out["modelfile"].startswith("# bankml") and "FROM base-q8_0" in out["modelfile"]
    assert out["details"] == {**base_out["details"], "parent_model": "base-q8_0:latest"}
    assert out["model_info"] == base_out["model_info"] and out["template"] == base_out["template"]
    assert out["modified_at"] == d.created_at
    assert out["bankml"] == {**base_out["bankml"], "layer": {"derived": True, "digest": d.digest,
                                                            "base_sha256": d.base_sha256, "base_fork": d.base_fork}}
    shown = ollama.ShowResponse.model_validate_json(text)
    assert shown.license == "MIT" and shown.details.parent_model == "base-q8_0:latest"


def test_ps_shows_the_derived_name_the_last_request_used(with_derived):
    reg = with_derived
    base, d = reg.pin("base-q8_0"), reg.derived.get("persona")
    rec = record(base, shown_as="persona:latest")
    entry = json.loads(call(ollama_models.ps, state_of(reg, FakeResidency([rec]))))["models"][0]
    assert (entry["name"], entry["model"], entry["digest"]) == ("persona:latest", "persona:latest", d.digest)
    assert entry["details"]["parent_model"] == "base-q8_0:latest"
    # the same record over other weights falls back to that pin's tag
    other = record(reg.startup, shown_as="persona:latest")
    entry = json.loads(call(ollama_models.ps, state_of(reg, FakeResidency([other]))))["models"][0]
    assert (entry["name"], entry["digest"]) == ("start:latest", reg.startup.sha256)


# --- over HTTP, with the real ollama client ---------------------------------------------------------


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    root = tmp_path_factory.mktemp("live")
    model, fork = tiny_model(root / "start", "Start-Model.Q8_0.gguf")
    reg_dir = registry_dir(root / "reg", ["Model-B.Q8_0.gguf"])
    (reg_dir / "Gone.gguf.FORK.json").write_text(json.dumps(
        {"files": [{"path": "Gone.gguf", "bytes": 5, "sha256": "cd" * 32}]}))
    server = FakeServer(model, fork, registry=reg_dir)
    try:
        yield server, ollama.Client(host=f"http://127.0.0.1:{server.port}")
    finally:
        server.stop()


def test_the_ollama_client_lists_shows_and_ps(live):
    server, client = live
    listed = client.list()
    assert [m.model for m in listed.models] == ["start-model.q8_0:latest", "gone:latest", "model-b.q8_0:latest"]
    assert listed.models[2].details.family == "llama" and listed.models[2].size > 0
    shown = client.show("Model-B.Q8_0")
    assert shown.modelinfo["llama.context_length"] == 4096 and shown.capabilities == ["completion"]
    assert shown.parameters.startswith("temperature 0.8\ntop_k 40\n")
    with pytest.raises(ollama.ResponseError) as e:
        client.show("nope")
    assert e.value.status_code == 404
    assert e.value.error == ("model 'nope' not found: bankml serves pinned models only "
                             "(start-model.q8_0, gone, model-b.q8_0)")
    running = client.ps().models
    assert [m.model for m in running] == ["start-model.q8_0:latest"]  # the startup model, kept forever
    assert running[0].expires_at.year >= time.gmtime().tm_year + 291


def test_version_and_tags_bytes_on_the_wire(live):
    server, _ = live
    status, headers, body = split_response(exchange(server.port, request_bytes("GET", "/api/version")))
    assert (status, body) == (200, f'{{"version": "{__version__}", "bankml": true}}'.encode())
    assert headers["content-type"].startswith("application/json")
    status, _, body = split_response(exchange(server.port, request_bytes("GET", "/api/tags")))
    assert status == 200 and body.startswith(b'{"models": [{"name": "start-model.q8_0:latest", "model": ')
    status, _, body = split_response(exchange(server.port, request_bytes("POST", "/api/show", body=b"{bad")))
    assert status == 404 and json.loads(body)["error"]


def test_a_derived_model_through_the_client(live):
    # runs after the listing tests above: it adds a derived model and loads its base
    server, client = live
    assert client.create(model="persona", from_="model-b.q8_0", system="be brief").status == "success"
    listed = {m.model: m for m in client.list().models}
    entry, base = listed["persona:latest"], listed["model-b.q8_0:latest"]
    assert list(listed)[-1] == "persona:latest" and entry.digest.startswith("sha256:")
    assert entry.size == base.size and entry.details.parent_model == "model-b.q8_0:latest"
    shown = client.show("persona")
    assert shown.details.parent_model == "model-b.q8_0:latest" and "be brief" in shown.modelfile
    status, _, body = split_response(exchange(server.port, request_bytes("GET", "/v1/models")))
    assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == [
        "Start-Model.Q8_0.gguf", "Gone.gguf", "Model-B.Q8_0.gguf", "persona:latest"]
    client.generate(model="persona", prompt="", keep_alive="10m")  # an empty prompt only loads
    running = {m.model: m for m in client.ps().models}
    assert running["persona:latest"].digest == entry.digest
    assert running["persona:latest"].details.parent_model == "model-b.q8_0:latest"
    left_s = running["persona:latest"].expires_at.timestamp() - time.time()
    assert 500 < left_s <= 600
