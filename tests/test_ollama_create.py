"""POST /api/create, POST /api/copy and DELETE /api/delete over HTTP: raw bytes on the wire, then the real
`ollama` client (0.6.3: it sends create's structured form)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import ollama
import pytest
from gateway_helpers import FakeServer, tiny_model

from gateway.serving.derived import read_manifest

BASE = "Http-Base.Q8_0.gguf"

def RegistryServer(model: Path, fork: Path, directory: Path | None) -> FakeServer:
    """The fake server (the real gate, loopback rules, routes and registry, a fake engine) over `directory`."""
    return FakeServer(model, fork, registry=directory)


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
    # the layer is applied: its SYSTEM and MESSAGE are in the prompt (the fake engine's tokens are bytes)
    hi = [{"role": "user", "content": "hi"}]
    base = client.chat(model="http-base.q8_0", messages=hi, options={"num_predict": 2})
    persona = client.chat(model="persona", messages=hi, options={"num_predict": 2})
    assert persona.model == "persona:latest"
    assert persona.prompt_eval_count - base.prompt_eval_count >= len("You are a pirate.") + len("who?")
    v1 = httpx.post(server.url("/v1/chat/completions"), json={"model": "persona", "messages": hi, "max_tokens": 2},
                    timeout=30).json()
    v1_base = httpx.post(server.url("/v1/chat/completions"), json={"model": "http-base.q8_0", "messages": hi,
                                                                   "max_tokens": 2}, timeout=30).json()
    assert v1["usage"]["prompt_tokens"] - v1_base["usage"]["prompt_tokens"] >= len("You are a pirate.")
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


def test_tags_and_show_list_what_create_wrote(server, files):
    reg = files[2]
    post(server, "/api/create", {"model": "listed", "modelfile": "FROM http-base.q8_0\nSYSTEM hello\n"
                                 "PARAMETER temperature 0.25\n", "stream": False})
    d = read_manifest(str(reg / "listed.MODEL.json"))
    tags = json.loads(httpx.get(server.url("/api/tags"), timeout=30).content)["models"]
    entry = next(m for m in tags if m["name"] == "listed:latest")
    assert entry["digest"] == d.digest and entry["details"]["parent_model"] == "http-base.q8_0:latest"
    status, _, body = post(server, "/api/show", {"model": "listed"})
    show = json.loads(body)
    assert status == 200 and show["system"] == "hello" and show["bankml"]["layer"]["digest"] == d.digest
    assert "PARAMETER temperature 0.25" in show["modelfile"] and show["details"]["parent_model"] == (
        "http-base.q8_0:latest")


def test_the_bodies_are_parsed_off_the_event_loop(monkeypatch):
    # a 16 MiB structured create (half a million messages) took ~0.5 s of json.loads on the loop, and every
    # other client waited for it
    import asyncio
    import threading
    from types import SimpleNamespace

    from bankml.errors import InvalidRequest
    from gateway.ollama import create as ollama_create
    threads = []
    real = ollama_create.read_body

    def spy(raw):
        threads.append(threading.current_thread())
        return real(raw)

    monkeypatch.setattr(ollama_create, "read_body", spy)
    request, state = SimpleNamespace(body=b'{"model": "m", "source": "a", "destination": "b"}'), SimpleNamespace()
    for handler in (ollama_create.create, ollama_create.copy, ollama_create.delete):
        with pytest.raises(InvalidRequest, match="without --registry"):
            asyncio.run(handler(request, state))
    assert len(threads) == 3 and threading.main_thread() not in threads
