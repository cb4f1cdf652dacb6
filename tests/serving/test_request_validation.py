"""Every request field checked with its type and range by the real `python -m glm_dsa serve` (a subprocess, tiny
random checkpoint on CPU): a bad field is an HTTP 400 with OpenAI's error body naming it in `param`, never a 500
or a request that runs on with the field misread; the server goes on answering. Oracle: the field rules of
`glm_dsa.serving.request_fields` written out here as literal cases (what OpenAI's and vLLM's APIs accept), and for top_p
at its low end, the server's own greedy tokens."""

import json
import sys
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_process import KEY, MODEL, serve_process  # noqa: E402

MAX_LEN = 64
P = [5, 6, 7]


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    with serve_process(ckpt, tmp_path_factory, max_len=MAX_LEN) as s:
        yield s


def _body(**fields):
    return {"model": MODEL, "prompt": P, "max_tokens": 2, **fields}


def _chat(**fields):
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, **fields}


# (endpoint, body, the param the error must name)
BAD_FIELDS = [
    ("/v1/completions", _body(stream="false"), "stream"),
    ("/v1/completions", _body(stream=1), "stream"),
    ("/v1/completions", _body(n=True), "n"),
    ("/v1/completions", _body(n=2), "n"),
    ("/v1/completions", _body(n=1.0), "n"),
    ("/v1/completions", _body(stop_token_ids=5), "stop_token_ids"),
    ("/v1/completions", _body(stop_token_ids=[True]), "stop_token_ids"),
    ("/v1/completions", _body(stop_token_ids=["1"]), "stop_token_ids"),
    ("/v1/completions", _body(stop_token_ids=[-1]), "stop_token_ids"),
    ("/v1/completions", _body(stream=True, stream_options=[1]), "stream_options"),
    ("/v1/completions", _body(stream=True, stream_options="x"), "stream_options"),
    ("/v1/completions", _body(stream=True, stream_options={"include_usage": "yes"}), "stream_options.include_usage"),
    ("/v1/completions", _body(stream=True, stream_options={"bogus": True}), "stream_options"),
    ("/v1/completions", _body(stream_options={"include_usage": True}), "stream_options"),  # without stream
    ("/v1/completions", _body(top_p=1e-39), "top_p"),  # subnormal in float32: flushed to 0 on the device
    ("/v1/completions", _body(top_p=1.17e-38), "top_p"),
    ("/v1/completions", _body(top_p=0), "top_p"),
    ("/v1/completions", _body(top_p=1.5), "top_p"),
    ("/v1/completions", _body(top_p=True), "top_p"),
    ("/v1/completions", _body(top_p="0.9"), "top_p"),
    ("/v1/completions", _body(temperature="1"), "temperature"),
    ("/v1/completions", _body(temperature=False), "temperature"),
    ("/v1/completions", _body(max_tokens=True), "max_tokens"),
    ("/v1/completions", _body(max_tokens=2.0), "max_tokens"),
    ("/v1/completions", _body(max_tokens=[2]), "max_tokens"),
    ("/v1/completions", _body(seed=-1), "seed"),
    ("/v1/completions", _body(seed=2**64), "seed"),
    ("/v1/completions", _body(seed="7"), "seed"),
    ("/v1/completions", _body(seed=True), "seed"),
    ("/v1/completions", _body(ignore_eos="true"), "ignore_eos"),
    ("/v1/completions", _body(return_token_ids=1), "return_token_ids"),
    ("/v1/completions", _body(echo=True), "echo"),
    ("/v1/completions", _body(echo="no"), "echo"),
    ("/v1/completions", _body(logprobs=-1), "logprobs"),
    ("/v1/completions", _body(logprobs=21), "logprobs"),
    ("/v1/completions", _body(logprobs=1.5), "logprobs"),
    ("/v1/completions", _body(logprobs=2.0), "logprobs"),
    ("/v1/completions", _body(logprobs=True), "logprobs"),
    ("/v1/completions", _body(top_logprobs=2), "top_logprobs"),  # a chat-only field
    ("/v1/completions", _body(stop="x"), "stop"),
    ("/v1/completions", _body(stop=[1]), "stop"),
    ("/v1/completions", _body(user=5), "user"),
    ("/v1/completions", _body(model=5), "model"),
    ("/v1/completions", _body(best_of=2), "best_of"),  # unknown fields are refused, not ignored
    ("/v1/completions", _body(prompt=[1, True]), "prompt"),
    ("/v1/completions", _body(prompt={"text": "hi"}), "prompt"),
    ("/v1/completions", _body(prompt=[[1, 2], "hello", 3]), "prompt"),
    ("/v1/completions", _body(prompt=None), "prompt"),
    ("/v1/completions", {"model": MODEL}, "prompt"),
    ("/v1/chat/completions", _chat(stream="false"), "stream"),  # both endpoints read the one table
    ("/v1/chat/completions", _chat(n=True), "n"),
    ("/v1/chat/completions", _chat(top_p=1e-40), "top_p"),
    ("/v1/chat/completions", _chat(max_completion_tokens=-1), "max_completion_tokens"),
    ("/v1/chat/completions", _chat(logprobs=1), "logprobs"),  # chat's logprobs is a boolean
    ("/v1/chat/completions", _chat(logprobs=True, top_logprobs=-1), "top_logprobs"),
    ("/v1/chat/completions", _chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("/v1/chat/completions", _chat(logprobs=True, top_logprobs=3.0), "top_logprobs"),
    ("/v1/chat/completions", _chat(logprobs=True, top_logprobs=False), "top_logprobs"),
    ("/v1/chat/completions", _chat(top_logprobs=2), "top_logprobs"),  # only with "logprobs": true
    ("/v1/chat/completions", _chat(echo=False), "echo"),  # a completions-only field
    ("/v1/chat/completions", _chat(messages=[{"role": 1, "content": "x"}]), "messages"),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": 5}]), "messages"),
    ("/v1/chat/completions", _chat(messages=[]), "messages"),
]


@pytest.mark.parametrize("path,body,param", BAD_FIELDS, ids=[f"{p.rsplit('/', 1)[1]}-{param}-{i}" for i, (p, _, param)
                                                             in enumerate(BAD_FIELDS)])
def test_a_bad_field_is_a_400_naming_it(server, path, body, param):
    r = server.post(path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert param in err["message"] or param == "best_of" and "unsupported" in err["message"], err


@pytest.mark.parametrize("depth", [40, 100_000])
def test_deeply_nested_json_is_a_400_not_a_500(server, depth):
    """40 levels parse (under Python's recursion limit) but exceed MAX_JSON_DEPTH; 100,000 levels would be a
    RecursionError in the decoder."""
    raw = b'{"model": "tiny-test", "prompt": [5, 6], "user": ' + b"[" * depth + b"]" * depth + b"}"
    r = server.post("/v1/completions", raw)
    assert r.status_code == 400, r.text[:500]
    assert "deeper than" in r.json()["error"]["message"]


def test_a_body_that_is_not_an_object_is_a_400(server):
    for raw in (b"[1, 2]", b'"prompt"', b"null"):
        r = server.post("/v1/completions", raw)
        assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"], (raw, r.text)


def test_valid_forms_and_nulls_are_accepted(server):
    """The strict types do not refuse what the APIs allow: explicit defaults, nulls (not given), integers as
    numbers, an empty stop list, `stream: false`, top_p at its low end."""
    for fields in ({"stream": False, "n": 1, "stop_token_ids": [], "temperature": 0, "top_p": 1},
                   {"stream": None, "n": None, "seed": None, "temperature": None, "top_p": None, "stop": None,
                    "logprobs": None, "echo": False, "user": "u", "stop_token_ids": None, "stream_options": None},
                   {"logprobs": 0, "stop": [], "ignore_eos": True, "return_token_ids": True}, {"stop": ""}):
        r = server.post("/v1/completions", _body(**fields))
        assert r.status_code == 200, (fields, r.text)
        assert len(r.json()["choices"]) == 1 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")
    r = server.post("/v1/chat/completions", _chat(max_completion_tokens=2, logprobs=False, return_token_ids=True))
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) <= 2, r.text


def test_top_p_at_its_low_end_keeps_the_top_token(server):
    """top_p = float32's smallest normal number keeps exactly the most likely token: sampled at temperature 1,
    the tokens are the greedy ones. Below it (where the bug sampled token 0 every time) is a 400, above."""
    greedy = server.post("/v1/completions", _body(max_tokens=6, temperature=0, ignore_eos=True,
                                                  return_token_ids=True)).json()["choices"][0]["token_ids"]
    for seed in (1, 2):
        r = server.post("/v1/completions", _body(max_tokens=6, temperature=1.0, top_p=1.1754944e-38, seed=seed,
                                                 ignore_eos=True, return_token_ids=True))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == greedy
    assert greedy != [0] * 6


def test_stream_options_include_usage_ends_with_usage_and_done(server):
    """A valid stream_options object is honoured (the check is not a blanket refusal)."""
    with httpx.stream("POST", server.base + "/v1/completions", timeout=60, headers={"Authorization": f"Bearer {KEY}"},
                  json=_body(max_tokens=3, stream=True, ignore_eos=True, stream_options={"include_usage": True})) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    usage = json.loads(lines[-2][5:])["usage"]
    assert usage == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    assert httpx.get(server.base + "/health", timeout=10).json() == {"status": "ok"}


def test_without_the_flag_the_body_limit_is_the_default(server):
    """No --max-request-bytes: a body one byte over default_max_request_bytes(max_model_len) is a 413 (the server
    refuses it from its Content-Length, before reading it)."""
    from glm_dsa.serving.server import default_max_request_bytes
    limit = default_max_request_bytes(MAX_LEN)
    raw = json.dumps(_body()).encode()
    raw = raw[:-1] + b" " * (limit + 1 - len(raw)) + b"}"
    r = server.post("/v1/completions", raw)
    assert r.status_code == 413 and str(limit) in r.json()["error"]["message"], r.text[:300]
