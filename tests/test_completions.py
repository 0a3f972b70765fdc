"""/completion (and its alias /completions), /v1/completions, /infill, the aliases, and chat's `n` and
timings_per_token, over the fake engine: shapes and key order as llama-server writes them, statuses and
messages, receipts, the SSE events. The real model's answers against llama-server's recording are in
tests/test_completions_smollm2.py."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import httpx
import openai
import pytest
from fake_engine import REPLY, REPLY_PIECES
from gateway_helpers import FakeServer, sse_data, tiny_model

from bankml.errors import InvalidRequest, NotSupported
from gateway.openai.completion_request import parse_completion, prompt_tokens
from gateway.openai.completion_writer import nested_values
from model.messages import SamplingParams

pytestmark = pytest.mark.timeout(120)

HI = [{"role": "user", "content": "Say hello."}]
# llama-server's /completion answer, in its order (server-task.cpp to_json_non_oaicompat)
FINAL_KEYS = ["index", "content", "tokens", "id_slot", "stop", "model", "tokens_predicted", "tokens_evaluated",
              "generation_settings", "prompt", "has_new_line", "truncated", "stop_type", "stopping_word",
              "tokens_cached", "timings"]
PARTIAL_KEYS = ["index", "content", "tokens", "stop", "id_slot", "tokens_predicted", "tokens_evaluated"]
OAI_KEYS = ["choices", "created", "model", "system_fingerprint", "object", "usage", "id", "timings"]


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


RECORDED = json.loads((Path(__file__).parent / "fixtures" / "completions_smollm2.json").read_text())
VOLATILE = ("created", "id", "system_fingerprint")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = FakeServer(*tiny_model(tmp_path_factory.mktemp("cmpl")), engine={"max_seqs": 2})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def fixture_server(tmp_path_factory):
    """As the recording's llama-server: two sequences, its slot's context."""
    s = FakeServer(*tiny_model(tmp_path_factory.mktemp("cmpl_rec")), engine={"max_seqs": RECORDED["n_parallel"]},
                   ctx=RECORDED["n_ctx"] // RECORDED["n_parallel"])
    yield s
    s.stop()


def post(server, path: str, body) -> httpx.Response:
    content = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    return httpx.post(server.url(path), content=content, headers={"Content-Type": "application/json"}, timeout=30)


# --- /completion ---------------------------------------------------------------------------------


def test_completion_answers_in_llama_servers_shape_with_a_receipt(server):
    r = post(server, "/completion", {"prompt": "hi", "n_predict": 3})
    assert r.status_code == 200
    body = r.json()
    assert list(body) == [*FINAL_KEYS, "bankml_receipt"]
    assert body["content"] == "".join(REPLY_PIECES[:3]) and body["tokens"] == []
    assert (body["stop"], body["tokens_predicted"], body["tokens_evaluated"]) == (True, 3, 2)
    assert body["prompt"] == "hi" and body["model"] == "Tiny-Model.Q8_0.gguf"
    assert body["generation_settings"]["n_predict"] == 3 and body["generation_settings"]["seed"] == 4294967295
    assert body["timings"]["predicted_n"] == 3 and body["timings"]["prompt_n"] == 2
    assert body["bankml_receipt"]["response_sha256"] == sha(body["content"])


def test_return_tokens_gives_the_generated_ids(server):
    body = post(server, "/completion", {"prompt": "hi", "n_predict": 2, "return_tokens": True}).json()
    assert body["tokens"] == [1000, 1001]


def test_a_list_of_prompts_is_a_list_of_answers_each_with_its_receipt(server):
    r = post(server, "/completion", {"prompt": ["hi", [104, 105], [104, "i"]], "n_predict": 2})
    assert r.status_code == 200
    answers = r.json()
    assert [a["index"] for a in answers] == [0, 1, 2]
    assert [a["prompt"] for a in answers] == ["hi", "hi", "hi"]
    assert all(a["content"] == "Savante" and a["bankml_receipt"]["response_sha256"] == sha("Savante")
               for a in answers)


def test_n_gives_n_sequences_per_prompt_up_to_the_engines_sequences(server):
    answers = post(server, "/completion", {"prompt": ["ab", "cd"], "n_predict": 1, "n": 2}).json()
    assert [(a["index"], a["prompt"]) for a in answers] == [(0, "ab"), (1, "ab"), (2, "cd"), (3, "cd")]
    r = post(server, "/completion", {"prompt": "hi", "n": 3})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "Field 'n': Value must be between 1 <= value <= 2, but got 3"
    r = post(server, "/completion", {"prompt": "hi", "n": 0})
    assert r.json()["error"]["message"] == "Field 'n': Value must be between 1 <= value <= 2, but got 0"


def test_response_fields_cut_the_answer_to_the_named_paths(server):
    body = post(server, "/completion", {"prompt": "hi", "n_predict": 2,
                                        "response_fields": ["content", "generation_settings/n_predict", "no/such"]}).json()
    assert list(body) == ["content", "generation_settings/n_predict", "bankml_receipt"]
    assert body["generation_settings/n_predict"] == 2
    assert nested_values(["a/b", "c"], {"a": {"b": 1}, "c": 2}) == {"a/b": 1, "c": 2}


def test_completion_streams_one_event_per_token_then_the_final_one_and_the_receipt(server):
    r = post(server, "/completion", {"prompt": "hi", "n_predict": 3, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    evs = sse_data(r.text)
    assert "[DONE]" not in evs  # llama-server's own route sends none
    assert len(evs) == 4 and all("stop" in e for e in evs)  # llama-server's clients read it on every event
    partials, final = evs[:3], evs[3]
    assert all(list(e) == PARTIAL_KEYS and e["stop"] is False for e in partials)
    assert [e["tokens"] for e in partials] == [[1000], [1001], [1002]]
    assert list(final) == [*FINAL_KEYS, "bankml_receipt"] and final["stop"] is True and final["content"] == ""
    assert final["bankml_receipt"]["response_sha256"] == sha("".join(e["content"] for e in partials))


def test_timings_per_token_puts_timings_on_every_event(server):
    evs = sse_data(post(server, "/completion", {"prompt": "hi", "n_predict": 3, "stream": True,
                                              "timings_per_token": True}).text)
    assert [e["timings"]["predicted_n"] for e in evs[:3]] == [1, 2, 3]
    assert all(e["timings"]["prompt_n"] == 2 and e["timings"]["predicted_ms"] >= 0 for e in evs[:3])
    assert evs[3]["generation_settings"]["timings_per_token"] is True


# recorded refusals we answer differently on purpose: b11434 takes these and ignores them (echo,
# suffix, best_of) or honours what this engine does not (post_sampling_probs); ours are 400s naming
# them, but for echo, which ours honours
DIFFERENT = {"oai_echo": "echo", "oai_suffix": "suffix", "oai_best_of": "best_of",
             "post_sampling_probs": "post_sampling_probs"}


@pytest.mark.parametrize("name", sorted(RECORDED["refusals"]))
def test_each_recorded_refusal_is_llama_servers(fixture_server, name):
    case = RECORDED["refusals"][name]
    body = case["request"]
    r = post(fixture_server, case["route"], body)
    if name == "oai_echo":  # b11434 ignores echo; ours echoes the prompt first (OpenAI's legacy echo)
        assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith(body["prompt"]), r.text
        return
    if name in DIFFERENT:
        assert r.status_code == 400 and f"'{DIFFERENT[name]}'" in r.json()["error"]["message"], r.text
        return
    assert r.status_code == case["status"], r.text
    ours, theirs = r.json(), case["body"]
    if case["status"] == 200:  # taken: the same shape (an empty prompt's empty answer among them)
        ours = ours[0] if isinstance(ours, list) else ours
        assert [k for k in ours if k not in ("bankml_receipt", *VOLATILE)] == list(theirs)
        if name == "prompt_list_of_empty":
            assert (ours["content"], ours["tokens_predicted"], ours["stop_type"]) == ("", 0, "none")
        return
    if name == "not_json":  # the JSON library's own wording of where it stopped is not ours
        prefix = "[json.exception.parse_error.101] parse error at line 1, column "
        assert ours["error"]["message"].startswith(prefix) and theirs["error"]["message"].startswith(prefix)
        ours["error"]["message"] = theirs["error"]["message"]
    if theirs["error"]["type"] == "exceed_context_size_error":  # the fake tokenizer counts bytes
        assert ours["error"]["n_ctx"] == theirs["error"]["n_ctx"] and ours["error"]["type"] == theirs["error"]["type"]
        return
    assert ours == theirs


def test_a_prompt_over_the_context_is_the_exceed_context_400(server):
    r = post(server, "/completion", {"prompt": "a" * 5000})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "exceed_context_size_error" and err["n_prompt_tokens"] == 5000 and err["n_ctx"] == 4096


def test_refused_fields_are_400s_naming_them(server):
    r = post(server, "/completion", {"prompt": "hi", "n_probs": 2, "post_sampling_probs": True})
    assert r.status_code == 400 and "post_sampling_probs" in r.json()["error"]["message"]
    r = post(server, "/completion", {"prompt": "hi", "mirostat": 2})
    assert r.status_code == 400 and "'mirostat'" in r.json()["error"]["message"]


class _Tok:
    n_vocab = 1000

    def __init__(self):
        self.calls = []

    def encode(self, text, add_special, parse_special, limit=None):
        self.calls.append((text, add_special, parse_special))
        return ([1] if add_special else []) + [ord(c) for c in text]


class _Model:
    def __init__(self):
        self.tokenizer = _Tok()

    def tokenize(self, text, add_special, parse_special):
        return self.tokenizer.encode(text, add_special, parse_special)


def test_prompts_are_tokenized_as_llama_server_does():
    m = _Model()
    assert prompt_tokens(m, "ab") == [[1, 97, 98]]
    assert prompt_tokens(m, [5, "ab", 6, "c"]) == [[5, 97, 98, 6, 99]]  # BOS only before a first string
    assert prompt_tokens(m, ["a", 7]) == [[1, 97, 7]]
    assert prompt_tokens(m, [[3, 4], "b", ["c", 9]]) == [[3, 4], [1, 98], [1, 99, 9]]
    assert prompt_tokens(m, [3, 4]) == [[3, 4]]
    assert prompt_tokens(m, [{"prompt_string": "a"}]) == [[1, 97]]
    assert prompt_tokens(m, [[]]) == [[]]  # answered empty, as llama-server does
    assert all(parse for _, _, parse in m.tokenizer.calls)  # special tokens parsed in every string
    for bad in ([True], [1.5, 2], None, 5, {"a": 1}, [[1], {"a": 1}], []):
        with pytest.raises(InvalidRequest):
            prompt_tokens(m, bad)


def test_the_openai_layer_reads_what_llama_server_reads_and_refuses_what_it_ignores():
    req = parse_completion({"prompt": "x", "stop": "y", "max_tokens": 3, "logprobs": 2, "echo": False},
                           SamplingParams(), oai=True)
    assert (req.params.stop, req.params.max_tokens, req.params.n_probs) == (("y",), 3, 2)
    assert parse_completion({"prompt": "x", "logprobs": True}, SamplingParams(), oai=True).params.n_probs == 1
    assert parse_completion({"prompt": "x", "best_of": 1}, SamplingParams(), oai=True).n == 1
    for field, value in (("suffix", "y"), ("best_of", 2)):
        with pytest.raises(NotSupported, match=f"'{field}'"):
            parse_completion({"prompt": "x", field: value}, SamplingParams(), oai=True)
    assert parse_completion({"prompt": "x", "echo": True}, SamplingParams(), oai=True).echo
    with pytest.raises(NotSupported, match="'echo' with 'stream'"):
        parse_completion({"prompt": "x", "echo": True, "stream": True}, SamplingParams(), oai=True)
    with pytest.raises(NotSupported, match="'echo'"):  # llama-server's own /completion has no echo
        parse_completion({"prompt": "x", "echo": True}, SamplingParams(), oai=False)


# --- /v1/completions and /completions ------------------------------------------------------------


def test_v1_completions_with_the_openai_client_plain_and_streamed(server):
    c = openai.OpenAI(base_url=server.url("/v1"), api_key="none", max_retries=0)
    plain = c.completions.create(model="Tiny-Model.Q8_0.gguf", prompt="hi", max_tokens=3)
    assert plain.object == "text_completion" and plain.choices[0].text == "".join(REPLY_PIECES[:3])
    assert plain.choices[0].finish_reason == "length" and plain.system_fingerprint.startswith("b")
    assert (plain.usage.prompt_tokens, plain.usage.completion_tokens) == (2, 3)
    assert plain.model_extra["bankml_receipt"]["response_sha256"] == sha(plain.choices[0].text)
    # every chunk has a choice (llama.cpp's own test reads choices[0] on each), the receipt on the last
    chunks = list(c.completions.create(model="Tiny-Model.Q8_0.gguf", prompt="hi", stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == REPLY
    assert chunks[-1].model_extra["bankml_receipt"]["response_sha256"] == sha(REPLY)


def test_v1_completions_body_and_stream_in_llama_servers_shape(server):
    body = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).json()
    assert list(body) == [*OAI_KEYS, "bankml_receipt"]
    assert body["choices"] == [{"text": "Savante", "index": 0, "logprobs": None, "finish_reason": "length"}]
    assert list(body["usage"]) == ["completion_tokens", "prompt_tokens", "total_tokens", "prompt_tokens_details"]
    # b11434's /completions is its /completion (recorded), not OpenAI's route
    alias = post(server, "/completions", {"prompt": "hi", "n_predict": 2}).json()
    assert list(alias) == [*FINAL_KEYS, "bankml_receipt"] and alias["content"] == "Savante"
    evs = sse_data(post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream": True}).text)
    assert [e["choices"][0]["text"] for e in evs[:3]] == ["Sav", "ante", ""]
    assert [e["choices"][0]["finish_reason"] for e in evs[:3]] == [None, None, "length"]
    assert "timings" not in evs[0] and evs[2]["usage"]["completion_tokens"] == 2
    assert evs[2]["bankml_receipt"]["response_sha256"] == sha("Savante")  # on the last chunk: every one has choices
    assert len(evs) == 4 and evs[3] == "[DONE]"


def test_v1_completions_n_and_a_list_of_prompts_are_choices_by_index(server):
    body = post(server, "/v1/completions", {"prompt": ["ab", "cd"], "max_tokens": 1}).json()
    assert [ch["index"] for ch in body["choices"]] == [0, 1]
    assert all(ch["bankml_receipt"]["response_sha256"] == sha("Sav") for ch in body["choices"])
    body = post(server, "/v1/completions", {"prompt": "ab", "max_tokens": 1, "n": 2}).json()
    assert [ch["index"] for ch in body["choices"]] == [0, 1]


def test_v1_completions_of_a_one_model_server_answer_any_model_name(server):
    # llama-server's clients send "davinci-002"; with one model (no registry) that model answers
    r = post(server, "/v1/completions", {"prompt": "hi", "model": "davinci-002"})
    assert r.status_code == 200 and r.json()["model"] == httpx.get(server.url("/v1/models")).json()["data"][0]["id"]


# --- aliases, chat's n and timings_per_token, /infill ----------------------------------------------


def test_the_aliases_answer_as_their_v1_routes(server):
    a = post(server, "/chat/completions", {"messages": HI, "max_tokens": 2}).json()
    assert a["object"] == "chat.completion" and a["choices"][0]["message"]["content"] == "Savante"
    assert httpx.get(server.url("/models")).json() == httpx.get(server.url("/v1/models")).json()


def test_chat_n_gives_choices_each_its_own_sequence_and_receipt(server):
    body = post(server, "/v1/chat/completions", {"messages": HI, "max_tokens": 2, "n": 2}).json()
    assert [ch["index"] for ch in body["choices"]] == [0, 1]
    assert all(ch["message"]["content"] == "Savante" and ch["bankml_receipt"]["response_sha256"] == sha("Savante")
               for ch in body["choices"])
    evs = sse_data(post(server, "/v1/chat/completions", {"messages": HI, "max_tokens": 2, "n": 2, "stream": True}).text)
    chunks = [e for e in evs if e != "[DONE]" and e["choices"]]
    text = {0: "", 1: ""}
    for e in chunks:
        ch = e["choices"][0]
        text[ch["index"]] += ch["delta"].get("content") or ""
    assert text == {0: "Savante", 1: "Savante"}
    receipts = [e for e in evs if e != "[DONE]" and "bankml_receipt" in e]
    assert sorted(e["index"] for e in receipts) == [0, 1] and evs[-1] == "[DONE]"
    r = post(server, "/v1/chat/completions", {"messages": HI, "n": 5})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("Field 'n': Value must be between 1 <=")


def test_chat_timings_per_token(server):
    evs = sse_data(post(server, "/v1/chat/completions", {"messages": HI, "max_tokens": 2, "stream": True,
                                                       "timings_per_token": True}).text)
    content = [e for e in evs if e != "[DONE]" and e["choices"] and e["choices"][0]["delta"].get("content")]
    assert [e["timings"]["predicted_n"] for e in content] == [1, 2]
    # llama.cpp's own test reads `timings` on every event whose choices are empty: the receipt's too
    empty = [e for e in evs[1:] if e != "[DONE]" and not e["choices"]]
    assert empty and all(e["timings"]["predicted_n"] == 2 for e in empty)
    assert "bankml_receipt" in empty[-1]


def test_infill_on_a_model_without_fim_tokens_is_llama_servers_501(server):
    r = post(server, "/infill", {"input_prefix": "a", "input_suffix": "b"})
    assert r.status_code == 501
    assert r.json()["error"]["type"] == "not_supported_error"
    assert r.json()["error"]["message"].startswith("Infill is not supported by this model: ")


def test_a_whole_reply_and_stop_from_the_fake(server):
    body = post(server, "/completion", {"prompt": "hi"}).json()
    assert body["content"] == REPLY and body["tokens_predicted"] == len(REPLY_PIECES)


def test_the_shapes_are_the_recorded_ones(server):
    """Keys and their order, nested ones too, as b11434 wrote them for the same requests."""
    answers = RECORDED["answers"]
    ours = post(server, "/completion", {"prompt": "hi", "n_predict": 2}).json()
    theirs = answers["string"]["body"]
    assert [k for k in ours if k != "bankml_receipt"] == list(theirs)
    assert list(ours["generation_settings"]) == list(theirs["generation_settings"])
    assert list(ours["timings"]) == list(theirs["timings"])
    ours = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).json()
    theirs = answers["oai"]["body"]
    assert [k for k in ours if k not in ("bankml_receipt", *VOLATILE)] == list(theirs)
    assert list(ours["usage"]) == list(theirs["usage"])
    evs = sse_data(post(server, "/completion", {"prompt": "hi", "n_predict": 2, "stream": True}).text)
    theirs = answers["stream"]["events"]
    assert list(evs[0]) == list(theirs[0]) and list(evs[2]) == [*theirs[-1], "bankml_receipt"]
    evs = sse_data(post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream": True}).text)
    theirs = answers["oai_stream"]["events"]
    assert [k for k in evs[0] if k not in VOLATILE] == list(theirs[0])
    assert [k for k in evs[2] if k not in VOLATILE] == [*theirs[-2], "bankml_receipt"]
    assert evs[-1] == theirs[-1] == "[DONE]"
    chat = post(server, "/v1/chat/completions", {"messages": HI, "max_tokens": 2, "n": 2}).json()
    theirs = answers["chat_n2"]["body"]
    assert [k for k in chat["choices"][1] if k != "bankml_receipt"] == list(theirs["choices"][1])


def test_infill_builds_llama_servers_prompt_and_reads_completions_fields(smollm2_path):
    """The route's /infill step on a SmolLM2 whose header names FIM tokens (as helper C's recording):
    the FIM refusal first, the body checks, /completion's fields, then llama-server's logged prompt."""
    from gateway.openai.completion import _infill_prompts
    from gateway.serving.native_model import NativeModel
    from model.tokenizer import Tokenizer, gguf_fields

    small = json.loads((Path(__file__).parent / "fixtures" / "llama_small_smollm2.json").read_text())
    fields = {**gguf_fields(smollm2_path, ("tokenizer.", "general.")), **small["fim_keys"], **small["fim_sep_key"]}
    model = NativeModel(Tokenizer.from_gguf(fields), 2048, None, SamplingParams())
    case = small["infill_fim_sep"]["prompt"]
    req, [ids] = _infill_prompts(model, {**case["request"], "n_predict": 3, "temperature": 0}, SamplingParams(),
                                 2048)
    assert ids == case["logged_prompt"]
    assert (req.params.max_tokens, req.params.temperature, req.stream) == (3, 0.0, False)
    with pytest.raises(InvalidRequest):
        _infill_prompts(model, {"input_suffix": "x", "top_k": "no"}, SamplingParams(), 2048)
