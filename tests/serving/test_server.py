"""`python -m glm_dsa serve` as a real subprocess on a free loopback port (tiny random checkpoint, float32, CPU),
talked to with the real `openai` client and httpx. Oracle: `Engine.generate` of the same prompts in this process.
Every wait is bounded."""

import json
import socket
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import glm_dsa
from glm_dsa import configs
from glm_dsa.serving import text

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_process import KEY, MODEL, serve_process  # noqa: E402

MAX_LEN = 512  # room for a stream long enough to be still running when a request arrives mid-decode


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    with serve_process(ckpt, tmp_path_factory, "--max-num-seqs", "16", "--max-num-batched-tokens", "64",
                       max_len=MAX_LEN) as s:
        yield s.base


@pytest.fixture(scope="module")
def eng(ckpt):
    return glm_dsa.load(ckpt, dtype="float32", max_model_len=MAX_LEN, max_num_seqs=16, progress=False)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, timeout=120, max_retries=0)


def _prompts(seed, lengths):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, configs.tiny.vocab_size, n).tolist() for n in lengths]


GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True, "return_token_ids": True})


def test_sixteen_concurrent_requests_give_generate_tokens(client, eng):
    ps = _prompts(0, [3 + (5 * i) % 23 for i in range(16)])
    want = eng.generate(ps, max_new_tokens=8, stop_token_ids=[])
    got = [None] * 16

    def one(i):
        r = client.completions.create(model=MODEL, prompt=ps[i], max_tokens=8, **GREEDY)
        got[i] = r.choices[0].model_extra["token_ids"]
    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert got == want
    # a list of prompts in one request: one choice each, in order
    r = client.completions.create(model=MODEL, prompt=ps[:3], max_tokens=8, **GREEDY)
    assert [c.model_extra["token_ids"] for c in r.choices] == want[:3] and r.usage.completion_tokens == 24


def test_streaming_yields_the_same_tokens_and_text(client, eng, ckpt):
    tok = text.load_tokenizer(ckpt)
    p = _prompts(1, [9])[0]
    want = eng.generate([p], max_new_tokens=7, stop_token_ids=[])[0]
    ids, pieces, reasons = [], [], []
    for chunk in client.completions.create(model=MODEL, prompt=p, max_tokens=7, stream=True, **GREEDY):
        c = chunk.choices[0]
        ids += c.model_extra["token_ids"]
        pieces.append(c.text)
        reasons.append(c.finish_reason)
    assert ids == want and reasons[-1] == "length" and set(reasons[:-1]) == {None}
    assert "".join(pieces) == tok.decode(want)
    # text prompts and chat: the tokenizer and the checkpoint's chat template
    r = client.completions.create(model=MODEL, prompt="hello world", max_tokens=4, **GREEDY)
    assert r.choices[0].model_extra["token_ids"] == eng.generate([tok.encode("hello world")], 4,
                                                                 stop_token_ids=[])[0]
    chat_ids = tok.encode("user : hello ; assistant :", add_special_tokens=False)
    want = eng.generate([chat_ids], 5, stop_token_ids=[])[0]
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=5,
                                       **GREEDY)
    assert r.choices[0].model_extra["token_ids"] == want and r.choices[0].message.content == tok.decode(want)
    got = []
    for chunk in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}],
                                                max_tokens=5, stream=True, **GREEDY):
        got += chunk.choices[0].model_extra["token_ids"]
    assert got == want
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_the_openai_client_reads_logprobs(client, eng, ckpt):
    """Completions and chat, plain and streamed: each token's logprob and its alternatives as `generate(...,
    logprobs=N)` reports them for the same prompt (the oracle of those is a float64 log-softmax of the logits:
    test_logprobs.py), in OpenAI's shapes."""
    tok = text.load_tokenizer(ckpt)
    p = _prompts(2, [6])[0]
    want = eng.generate([p], 4, stop_token_ids=[], logprobs=3)[0]
    names = [tok.decode([t], skip_special_tokens=False) for t in want.token_ids]

    def close(a, b):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    r = client.completions.create(model=MODEL, prompt=p, max_tokens=4, logprobs=3, **GREEDY)
    lp = r.choices[0].logprobs
    assert lp.tokens == names and lp.text_offset == [sum(map(len, names[:j])) for j in range(4)]
    close(lp.token_logprobs, want.logprobs)
    for got, top in zip(lp.top_logprobs, want.top_logprobs):
        assert list(got) == [tok.decode([t], skip_special_tokens=False) for t in top]
        close(list(got.values()), list(top.values()))
    streamed = [c.choices[0].logprobs for c in client.completions.create(model=MODEL, prompt=p, max_tokens=4,
                                                                          logprobs=3, stream=True, **GREEDY)]
    streamed = [x for x in streamed if x is not None]  # the final chunk (finish_reason) carries none
    assert [t for x in streamed for t in x.tokens] == names
    assert [o for x in streamed for o in x.text_offset] == lp.text_offset
    close([v for x in streamed for v in x.token_logprobs], want.logprobs)

    chat_ids = tok.encode("user : hello ; assistant :", add_special_tokens=False)
    want = eng.generate([chat_ids], 3, stop_token_ids=[], logprobs=2)[0]
    msgs = [{"role": "user", "content": "hello"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, logprobs=True, top_logprobs=2,
                                       **GREEDY)
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == [tok.decode([t], skip_special_tokens=False) for t in want.token_ids]
    assert all(c.bytes == list(c.token.encode()) for c in content)
    close([c.logprob for c in content], want.logprobs)
    for c, top in zip(content, want.top_logprobs):
        assert len(c.top_logprobs) == 2
        close([a.logprob for a in c.top_logprobs], list(top.values()))
    streamed = [c.choices[0].logprobs for c in client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=3, logprobs=True, stream=True, **GREEDY)]
    entries = [e for x in streamed if x is not None for e in x.content]
    close([e.logprob for e in entries], want.logprobs)
    assert all(e.top_logprobs == [] for e in entries)  # top_logprobs absent: 0 alternatives
    # without logprobs the choices carry none
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, **GREEDY)
    assert r.choices[0].logprobs is None


BAD = [  # (body, status, words of the message)
    (b"{not json", 400, "not valid JSON"),
    ({"model": "gpt-9", "prompt": [1, 2]}, 404, "does not exist"),
    ({"model": MODEL, "prompt": []}, 400, "prompt"),
    ({"model": MODEL, "prompt": [[]]}, 400, "prompt 0 is empty"),
    ({"model": MODEL, "prompt": ""}, 400, "prompt 0 is empty"),
    ({"model": MODEL, "prompt": [1] * (MAX_LEN + 1)}, 400, f"longer than max_model_len={MAX_LEN}"),
    ({"model": MODEL, "prompt": [1, 2], "max_tokens": -1}, 400, "max_tokens must be >= 0"),
    ({"model": MODEL, "prompt": [1, 2], "temperature": -0.5}, 400, "temperature"),
    (b'{"model": "tiny-test", "prompt": [1, 2], "temperature": NaN}', 400, "temperature"),
    ({"model": MODEL, "prompt": [1, 256]}, 400, "outside the vocabulary"),
    ({"model": MODEL, "prompt": [1, 2], "max_tokens": "many"}, 400, "max_tokens"),
]


def test_bad_requests_get_openai_errors_and_the_server_goes_on(server, client):
    url = server + "/v1/completions"
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    for body, status, words in BAD:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = httpx.post(url, content=data, headers=auth, timeout=30)
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert words in err["message"] and err["type"], (body, err)
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(url, json={"model": MODEL, "prompt": [1]}, headers=headers, timeout=30)
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    r = httpx.post(server + "/v1/chat/completions", json={"model": MODEL, "messages": "hi"}, headers=auth, timeout=30)
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    assert httpx.get(server + "/health", timeout=10).json() == {"status": "ok"}
    r = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=2, **GREEDY)
    assert len(r.choices[0].model_extra["token_ids"]) == 2


def test_an_idle_keep_alive_connection_outlives_the_clients_reuse_window(server):
    """A connection idle for 6 s (past httpx's and the openai client's 5 s) still answers its next request. At
    uvicorn's default keep-alive of 5 s the server had closed it by then, and a client reusing it in that instant
    got "Server disconnected without sending a response" (CI, the test below)."""
    host, port = server.removeprefix("http://").split(":")
    request = f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()

    def answer(sock):
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                return data  # the server closed the connection
            data += chunk
        head, body = data.split(b"\r\n\r\n", 1)
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        while len(body) < length:
            body += sock.recv(4096)
        return head
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(request)
        assert answer(sock).startswith(b"HTTP/1.1 200")
        time.sleep(6)
        sock.sendall(request)
        assert answer(sock).startswith(b"HTTP/1.1 200")


def test_a_request_arriving_mid_decode_finishes_before_the_running_one(server, client):
    # the running stream is long (400 tokens: hundreds of steps) so that on a loaded machine the short request's
    # round trip still fits inside it; with 58 it was once outrun on 2 busy cores
    long_tokens = 400
    arrivals = []  # (time, what)
    first_two = threading.Event()

    def long_stream():
        n = 0
        for chunk in client.completions.create(model=MODEL, prompt=[3, 1, 4, 1, 5], max_tokens=long_tokens,
                                               stream=True, **GREEDY):
            n += len(chunk.choices[0].model_extra["token_ids"])
            if n == 2:
                first_two.set()
        arrivals.append((time.monotonic(), "long done"))
    t = threading.Thread(target=long_stream)
    t.start()
    assert first_two.wait(timeout=120)
    r = client.completions.create(model=MODEL, prompt=[2, 7, 1, 8], max_tokens=2, **GREEDY)
    arrivals.append((time.monotonic(), "short done"))
    t.join(timeout=120)
    assert len(r.choices[0].model_extra["token_ids"]) == 2
    assert [w for _, w in sorted(arrivals)] == ["short done", "long done"]
