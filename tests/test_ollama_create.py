"""POST /api/create, POST /api/copy and DELETE /api/delete over HTTP: raw bytes on the wire, then the real
`ollama` client (0.6.3: it sends create's structured form)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import httpx
import ollama
import pytest
from gateway_helpers import _Server, tiny_model

from gateway.derived import read_manifest

HERE = Path(__file__).resolve().parent
BASE = "Http-Base.Q8_0.gguf"

# the gateway's app (routes, loopback rules, error rendering) over a registry and no engine: create, copy and
# delete never touch one
HARNESS = r"""
import sys, types
from sanic import Sanic
from bankml.config import load_config
from bankml.verify import gate_model
from gateway.app import ROUTES, routes_text
from gateway.loopback import make_protocol
from gateway.registry import Registry
from gateway.sanic_app import bind, sanic_app

model, fork, directory = sys.argv[1:4]
gated = gate_model(model, open(fork).read())
state = types.SimpleNamespace(registry=Registry(gated, directory or None),
                              residency=types.SimpleNamespace(n_ctx=4096))
limits = load_config(None).limits
app = sanic_app("create_test", limits, ROUTES, routes_text(), state)
socks = [bind("127.0.0.1", 0), bind("127.0.0.1", 0)]
for s in socks:
    app.prepare(sock=s, protocol=make_protocol(limits), single_process=True, motd=False, access_log=False)
ports = [s.getsockname()[1] for s in socks]
print(f"listening on http://127.0.0.1:{ports[0]} and, for llama-server's clients, http://127.0.0.1:{ports[1]}",
      file=sys.stderr, flush=True)
Sanic.serve_single(app)
"""


class RegistryServer(_Server):
    def __init__(self, model: Path, fork: Path, directory: Path | None):
        super().__init__([sys.executable, "-c", HARNESS, str(model), str(fork), str(directory or "")], 60,
                         env={"PYTHONPATH": f"{HERE.parent}:{HERE}"})


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("http")
    model, fork = tiny_model(root / "start", "Startup.Q8_0.gguf")
    reg = root / "reg"
    base, base_fork = tiny_model(reg, BASE)
    return model, fork, reg


@pytest.fixture(scope="module")
def server(files):
    model, fork, reg = files
    s = RegistryServer(model, fork, reg)
    yield s
    s.stop()


def post(server, path: str, body, method: str = "POST") -> tuple[int, dict, bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.request(method, server.url(path), content=data, headers={"Content-Type": "application/json"},
                      timeout=30)
    return r.status_code, dict(r.headers), r.content


def test_create_streams_ndjson_status_lines(server, files):
    reg = files[2]
    status, headers, body = post(server, "/api/create", {"model": "brief", "modelfile":
                                                         "FROM http-base.q8_0\nSYSTEM be brief\n"})
    assert status == 200 and headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(x) for x in body.decode().splitlines()]
    d = read_manifest(str(reg / "brief.MODEL.json"))
    assert lines == [{"status": s} for s in [
        "parsing modelfile", f"verifying {BASE} (the guard, then its sha256 against {BASE}.FORK.json)",
        f"using existing layer sha256:{d.base_sha256}", "creating system layer",
        f"writing manifest brief.MODEL.json (digest {d.digest})", "success"]]


def test_create_not_streamed_and_its_refusals(server, files):
    status, _, body = post(server, "/api/create", {"name": "quiet", "from": "http-base.q8_0", "stream": False})
    assert (status, json.loads(body)) == (200, {"status": "success"})
    refusals = [
        ({"model": "x", "from": "http-base.q8_0", "quantize": "q4_0"}, "quantize: bankml serves the weights"),
        ({"model": "x", "modelfile": "FROM http-base.q8_0", "files": {"a.gguf": "sha256:00"}}, "files:"),
        ({"model": "x", "from": "http-base.q8_0", "adapters": {"a": "sha256:00"}}, "adapters:"),
        ({"model": "x", "modelfile": "FROM http-base.q8_0\nPARAMETER mirostat 2"}, "PARAMETER mirostat"),
        ({"model": "bad name", "from": "http-base.q8_0"}, "model name"),
        ({"from": "http-base.q8_0"}, "model: name the model to create"),
        ({"model": "http-base.q8_0", "from": "http-base.q8_0"}, "is a pinned model's name"),
    ]
    for body_in, why in refusals:
        status, headers, body = post(server, "/api/create", body_in)
        assert status == 400 and why in json.loads(body)["error"], (body_in, body)
    status, _, body = post(server, "/api/create", b"{not json")
    assert (status, json.loads(body)) == (400, {"error": "body is not JSON"})
    assert not (files[2] / "x.MODEL.json").exists()


def test_a_refusal_after_the_first_status_is_an_error_line(server, files):
    status, _, body = post(server, "/api/create", {"model": "nobase", "modelfile": "FROM nobody\n"})
    lines = [json.loads(x) for x in body.decode().splitlines()]
    assert status == 200 and lines[0] == {"status": "parsing modelfile"}
    assert list(lines[-1]) == ["error"] and "FROM nobody: model 'nobody' not found" in lines[-1]["error"]
    status, _, body = post(server, "/api/create", {"model": "nobase", "modelfile": "FROM nobody\n",
                                                   "stream": False})
    assert status == 400 and "model 'nobody' not found" in json.loads(body)["error"]


def test_copy_and_delete(server, files):
    reg = files[2]
    post(server, "/api/create", {"model": "orig", "from": "http-base.q8_0", "system": "s", "stream": False})
    status, headers, body = post(server, "/api/copy", {"source": "orig", "destination": "Twin"})
    assert (status, body) == (200, b"")
    assert read_manifest(str(reg / "twin.MODEL.json")).digest == read_manifest(str(reg / "orig.MODEL.json")).digest
    assert post(server, "/api/copy", {"source": "nobody", "destination": "t2"})[0] == 400
    assert post(server, "/api/delete", {"model": "twin:latest"}, "DELETE")[:3:2] == (200, b"")
    assert not (reg / "twin.MODEL.json").exists()
    status, _, body = post(server, "/api/delete", {"model": "twin"}, "DELETE")
    assert (status, json.loads(body)) == (404, {"error": "model 'twin' not found"})
    status, _, body = post(server, "/api/delete", {"model": "http-base.q8_0"}, "DELETE")
    assert status == 400 and "bankml does not delete pins over HTTP" in json.loads(body)["error"]


def test_the_ollama_client(server, files):
    reg = files[2]
    client = ollama.Client(host=server.url())
    r = client.create(model="persona", from_="http-base.q8_0", system="You are a pirate.",
                      parameters={"temperature": 0.5, "num_ctx": 1024, "stop": ["END"]},
                      messages=[{"role": "user", "content": "who?"}], license="MIT")
    assert r.status == "success"
    d = read_manifest(str(reg / "persona.MODEL.json"))
    assert (d.layer.system, dict(d.layer.parameters), d.layer.stop, d.layer.license) == (
        "You are a pirate.", {"temperature": 0.5, "num_ctx": 1024}, ("END",), ("MIT",))
    assert d.layer.messages == ({"role": "user", "content": "who?"},)
    streamed = [p.status for p in client.create(model="persona2", from_="persona", stream=True)]
    assert streamed[0] == "parsing modelfile" and streamed[-1] == "success"
    assert client.copy("persona", "persona3").status == "success"
    assert client.delete("persona3").status == "success"
    with pytest.raises(ollama.ResponseError) as e:
        client.delete("persona3")
    assert e.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as e:
        client.create(model="p4", from_="http-base.q8_0", quantize="q4_K_M")
    assert e.value.status_code == 400 and "quantize" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.delete("http-base.q8_0")
    assert e.value.status_code == 400


def test_without_a_registry_create_and_copy_are_refused(files, tmp_path):
    model, fork, _ = files
    s = RegistryServer(model, fork, None)
    try:
        for path, body in (("/api/create", {"model": "x", "from": "startup.q8_0"}),
                           ("/api/copy", {"source": "startup.q8_0", "destination": "y"})):
            status, _, out = post(s, path, body)
            assert status == 400 and "without --registry" in json.loads(out)["error"]
    finally:
        s.stop()


def test_a_manifest_survives_a_restart(files, tmp_path):
    model, fork, reg = files
    reg2 = tmp_path / "reg2"
    shutil.copytree(reg, reg2)
    s = RegistryServer(model, fork, reg2)
    try:
        assert post(s, "/api/create", {"model": "kept", "from": "http-base.q8_0", "stream": False})[0] == 200
    finally:
        s.stop()
    s = RegistryServer(model, fork, reg2)
    try:
        assert post(s, "/api/copy", {"source": "kept", "destination": "kept2"})[0] == 200
    finally:
        s.stop()
