"""Ollama's API on `bankml serve --native --registry DIR` with the real SmolLM2, through the `ollama` client.

One server for the module (compiling is the cost): the startup pin and a second pin in DIR (a copy of the
same file under another name, so its greedy answers must be the same text). Listing, show and ps; chat and
generate, plain and streamed; the options that must be honoured (seed, stop, num_predict, num_ctx) and one
that is refused by name; a derived model created from a Modelfile, copied and deleted; keep_alive 0
unloading; an unknown model's 404.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import time

import httpx
import ollama
import pytest
from gateway_helpers import CliServer

from bankml.pin import fork_record

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STARTUP = "smollm2-135m-instruct.q4_1"
SECOND = "smollm2-twin.q4_1"
HELLO = [{"role": "user", "content": "Say hello in one short sentence."}]
GREEDY = {"temperature": 0, "num_predict": 12}


def sha(data: str | bytes) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


@pytest.fixture(scope="module")
def served(bankml_cmd, smollm2_path, smollm2_fork, tmp_path_factory):
    registry = tmp_path_factory.mktemp("registry")
    twin = registry / "SmolLM2-Twin.Q4_1.gguf"
    shutil.copyfile(smollm2_path, twin)
    (registry / (twin.name + ".FORK.json")).write_text(json.dumps(fork_record(twin)))
    s = CliServer(bankml_cmd, str(smollm2_path), "--fork", str(smollm2_fork), "--registry", str(registry),
                  "--ctx", "512", "--config", "cpu")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(served):
    return ollama.Client(host=served.url(), timeout=600)


def _ps_names(client) -> list[str]:
    return [m.model for m in client.ps().models]


def test_list_show_and_ps(client):
    names = [m.model for m in client.list().models]
    assert names[:2] == [f"{STARTUP}:latest", f"{SECOND}:latest"]
    shown = client.show(STARTUP)
    assert "<|im_start|>" in shown.template and shown.details.format == "gguf"
    assert shown.capabilities == ["completion"]
    assert f"{STARTUP}:latest" in _ps_names(client)  # the startup model is resident from the start


def test_chat_plain_and_streamed_give_the_same_text_with_a_checkable_receipt(client, served):
    plain = client.chat(model=STARTUP, messages=HELLO, options=GREEDY)
    text = plain.message.content
    assert text.strip() and plain.done and plain.done_reason in ("stop", "length")
    assert plain.model == f"{STARTUP}:latest" and 0 < plain.eval_count <= 12
    assert all(isinstance(getattr(plain, k), int) for k in ("total_duration", "prompt_eval_duration",
                                                            "eval_duration"))
    parts = list(client.chat(model=STARTUP, messages=HELLO, options=GREEDY, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    assert "".join(p.message.content for p in parts) == text
    # the client drops what Ollama does not have: the receipt is read on the wire
    body = json.dumps({"model": STARTUP, "messages": HELLO, "options": GREEDY, "stream": False}).encode()
    r = httpx.post(served.url("/api/chat"), content=body, headers={"Content-Type": "application/json"}, timeout=600)
    receipt = r.json()["bankml_receipt"]
    assert r.json()["message"]["content"] == text and receipt["response_sha256"] == sha(text)
    assert receipt["request_sha256"] == sha(body) and receipt["completion_tokens"] == plain.eval_count
    assert receipt["prompt_tokens"] == plain.prompt_eval_count and receipt["model_sha256"]


def test_generate_plain_streamed_and_raw(client):
    plain = client.generate(model=STARTUP, prompt="The capital of France is", options=GREEDY)
    assert plain.response.strip() and plain.done
    streamed = list(client.generate(model=STARTUP, prompt="The capital of France is", options=GREEDY, stream=True))
    assert "".join(p.response for p in streamed) == plain.response
    chat = client.chat(model=STARTUP, messages=[{"role": "user", "content": "The capital of France is"}],
                       options=GREEDY)
    assert chat.message.content == plain.response  # generate is `user: prompt` through the template
    raw = client.generate(model=STARTUP, prompt="The capital of France is", raw=True, options=GREEDY)
    assert raw.prompt_eval_count < plain.prompt_eval_count  # no template around it


def test_seed_reproduces_and_stop_is_honoured(client):
    opts = {"temperature": 0.9, "seed": 1234, "num_predict": 12}
    a = client.chat(model=STARTUP, messages=HELLO, options=opts).message.content
    b = client.chat(model=STARTUP, messages=HELLO, options=opts).message.content
    assert a == b
    text = client.chat(model=STARTUP, messages=HELLO, options=GREEDY).message.content
    word = next(w for w in text.split()[1:] if w.strip(".,!"))
    cut = client.chat(model=STARTUP, messages=HELLO, options={**GREEDY, "stop": [word]})
    assert cut.message.content == text[:text.index(word)] and cut.done_reason == "stop"


def test_num_ctx_fits_the_conversation_or_refuses(client):
    long_history = [{"role": "user", "content": "Tell me about the sea. " * 8},
                    {"role": "assistant", "content": "The sea is wide and deep. " * 8}, *HELLO]
    whole = client.chat(model=STARTUP, messages=long_history, options={**GREEDY, "num_predict": 1})
    fitted = client.chat(model=STARTUP, messages=long_history, options={**GREEDY, "num_predict": 1, "num_ctx": 64})
    assert fitted.prompt_eval_count <= 64 < whole.prompt_eval_count
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=STARTUP, messages=HELLO, options={"num_ctx": 4})
    assert e.value.status_code == 400 and "more than num_ctx 4" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=STARTUP, messages=HELLO, options={"num_ctx": 8192})
    assert e.value.status_code == 400 and "restart bankml serve with --ctx 8192" in e.value.error


def test_an_option_bankml_does_not_reproduce_is_refused_by_name(client):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=STARTUP, messages=HELLO, options={"mirostat": 1})
    assert e.value.status_code == 400 and e.value.error.startswith("mirostat:")


def test_a_derived_model_from_a_modelfile_copy_and_delete(client, served):
    # a derived model's base is a pin of the registry directory (its manifest records the base's FORK.json there)
    modelfile = f"FROM {SECOND}\nSYSTEM You are a pirate. Answer like one.\nPARAMETER temperature 0\n" \
                "PARAMETER num_predict 6\n"
    r = httpx.post(served.url("/api/create"), json={"model": "pirate", "modelfile": modelfile, "stream": False},
                   timeout=120)
    assert r.status_code == 200, r.text
    pirate = client.chat(model="pirate", messages=HELLO)
    assert pirate.model == "pirate:latest" and pirate.eval_count <= 6  # the layer's num_predict
    # the same as its base asked with that SYSTEM and those parameters
    system = [{"role": "system", "content": "You are a pirate. Answer like one."}]
    by_hand = client.chat(model=SECOND, messages=system + HELLO, options={"temperature": 0, "num_predict": 6})
    assert (pirate.message.content, pirate.prompt_eval_count) == (by_hand.message.content, by_hand.prompt_eval_count)
    client.copy("pirate", "pirate-two")
    assert "pirate-two:latest" in [m.model for m in client.list().models]
    assert client.chat(model="pirate-two", messages=HELLO).message.content == pirate.message.content
    client.delete("pirate-two")
    assert "pirate-two:latest" not in [m.model for m in client.list().models]


def test_the_second_pin_answers_by_name_and_keep_alive_0_unloads_it(client):
    assert client.generate(model=SECOND, prompt="", keep_alive=0).done_reason == "unload"
    assert f"{SECOND}:latest" not in _ps_names(client)
    first = client.chat(model=STARTUP, messages=HELLO, options=GREEDY)
    twin = client.chat(model=SECOND, messages=HELLO, options=GREEDY)
    assert twin.model == f"{SECOND}:latest" and twin.message.content == first.message.content
    assert twin.load_duration > 0  # verified and loaded again for this request
    assert f"{SECOND}:latest" in _ps_names(client)
    # an answer with keep_alive 0: answered, then unloaded once idle; the other model stays
    assert client.chat(model=SECOND, messages=HELLO, options=GREEDY, keep_alive=0).message.content
    deadline = time.monotonic() + 30
    while f"{SECOND}:latest" in _ps_names(client) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert f"{SECOND}:latest" not in _ps_names(client)
    assert f"{STARTUP}:latest" in _ps_names(client)


def test_an_unknown_model_is_a_404(client):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="no-such-model", messages=HELLO)
    assert e.value.status_code == 404 and "not found" in e.value.error


def test_logprobs_match_v1_and_their_hash_covers_what_was_sent(served):
    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(served.url(path), content=json.dumps(body).encode(),
                          headers={"Content-Type": "application/json"}, timeout=600)

    ask = {"model": STARTUP, "messages": HELLO, "logprobs": True, "top_logprobs": 3}
    r = post("/api/chat", {**ask, "stream": False, "options": {"temperature": 0, "num_predict": 6}})
    obj = r.json()
    entries = obj["logprobs"]
    assert entries and all("id" not in e and len(e["top_logprobs"]) == 3 for e in entries)
    assert "".join(e["token"] for e in entries) == obj["message"]["content"]
    array = re.search(r'"logprobs": (\[.*\]), "bankml_receipt"', r.text).group(1)
    assert obj["bankml_receipt"]["logprobs_sha256"] == sha(array)
    v1 = post("/v1/chat/completions", {**ask, "temperature": 0, "max_tokens": 6}).json()
    v1_entries = v1["choices"][0]["logprobs"]["content"]
    assert [(e["token"], e["logprob"]) for e in entries] == [(e["token"], e["logprob"]) for e in v1_entries]
    assert [[t["token"] for t in e["top_logprobs"]] for e in entries] == \
        [[t["token"] for t in e["top_logprobs"]] for e in v1_entries]
    # streamed: each line carries its tokens' entries; the hash is over the lines' arrays joined
    r = post("/api/chat", {**ask, "options": {"temperature": 0, "num_predict": 6}})
    lines = r.text.splitlines()
    arrays = [m.group(1) for m in (re.search(r'"logprobs": (\[.*\])\}$', x) for x in lines[:-1]) if m]
    assert "[" + ", ".join(a[1:-1] for a in arrays) + "]" == array
    assert json.loads(lines[-1])["bankml_receipt"]["logprobs_sha256"] == sha(array)
    with pytest.raises(ollama.ResponseError, match="top_logprobs must be between 0 and 20"):
        ollama.Client(host=served.url()).chat(model=STARTUP, messages=HELLO, top_logprobs=21)
