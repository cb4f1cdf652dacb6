"""What bounds a request in the real `python -m glm_dsa serve` (a subprocess, tiny random checkpoint on CPU): the
body size (`--max-request-bytes`; refused with 413 before the body is read, whether its Content-Length says so or
it comes chunked), the event loop kept free while a large prompt is tokenised (`/health` answers meanwhile), and
prompt + max_tokens within max_model_len (refused with both numbers, as vLLM refuses it; the default max_tokens
capped at the room the prompt leaves). Oracle: byte counts and token counts computed here; every wait bounded."""

import json
import select
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_process import KEY, MODEL, serve_process  # noqa: E402

from glm_dsa import configs  # noqa: E402
from glm_dsa.serving.server import default_max_request_bytes  # noqa: E402

MAX_LEN = 64
LIMIT = 6_000_000  # room for a text prompt that takes the tokenizer seconds
#: how long /health may take while the server handles a large request: generous for a loaded machine, far below
#: the seconds the tokenizer takes over the prompt below
HEALTH_S = 2.0


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    with serve_process(ckpt, tmp_path_factory, "--max-request-bytes", str(LIMIT), max_len=MAX_LEN) as s:
        yield s


def _connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=30)


def _head(path: str, extra: str) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\n{extra}\r\n").encode()


def _read_response(sock) -> tuple[int, dict]:
    """Status and JSON body of one HTTP/1.1 response (Content-Length framed)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection without a response: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    length = next((int(ln.split(":", 1)[1]) for ln in lines if ln.lower().startswith("content-length")), None)
    assert length is not None, head
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk
        body += chunk
    return int(lines[0].split()[1]), json.loads(body[:length])


def _health_s(server) -> float:
    t0 = time.monotonic()
    assert httpx.get(server.base + "/health", timeout=30).status_code == 200
    return time.monotonic() - t0


def test_a_declared_20_mb_body_is_refused_before_it_is_sent(server):
    """Content-Length 20 MB: the 413 comes back while 19.9 MB of it were never sent, and /health answers."""
    with _connect(server) as sock:
        sock.sendall(_head("/v1/completions", "Content-Length: 20000000\r\n") + b'{"prompt": [' + b"1, " * 20000)
        assert _health_s(server) < HEALTH_S
        status, body = _read_response(sock)
    assert status == 413, body
    err = body["error"]
    assert err["code"] == "request_too_large" and str(LIMIT) in err["message"] and "20000000" in err["message"]


def test_a_chunked_body_is_refused_once_it_passes_the_limit(server):
    """No Content-Length: the server counts what it reads and answers 413 as soon as it passes the limit, before
    the client has finished (the body, if sent in full, would be twice the limit)."""
    piece = b"1, " * 50_000  # 150 kB a chunk
    sent = 0
    with _connect(server) as sock:
        sock.sendall(_head("/v1/completions", "Transfer-Encoding: chunked\r\n") + b'c\r\n{"prompt": [\r\n')
        while sent < 2 * LIMIT:
            if select.select([sock], [], [], 0.05)[0]:
                break  # the server has answered
            try:
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += len(piece)
        assert sent < 2 * LIMIT, "the server read twice its limit without answering"
        status, body = _read_response(sock)
    assert status == 413 and body["error"]["code"] == "request_too_large", body
    assert sent + 12 > LIMIT, sent  # it was not refused before passing the limit (12: the first chunk)
    assert _health_s(server) < HEALTH_S


def test_a_body_under_the_limit_is_read(server):
    """Just under the limit (spaces inside the JSON): read and handled as a request, here a prompt too long."""
    prompt = json.dumps([5] * (MAX_LEN + 1))
    raw = b'{"model": "%s", "prompt": %s, "max_tokens": 1}' % (MODEL.encode(), prompt.encode())
    raw = raw[:-1] + b" " * (LIMIT - len(raw)) + b"}"
    assert len(raw) == LIMIT
    r = server.post("/v1/completions", raw)
    assert r.status_code == 400 and f"longer than max_model_len={MAX_LEN}" in r.json()["error"]["message"], r.text


def test_health_answers_while_a_large_text_prompt_is_tokenised(server):
    """A ~6 MB text prompt takes the tokenizer seconds; meanwhile /health answers within HEALTH_S each time (on
    the event loop, tokenising blocked it for the whole time)."""
    text = "hello world w12 " * ((LIMIT - 1000) // 16)
    done = {}

    def big():
        done["r"] = server.post("/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": 1}, timeout=300)
    t = threading.Thread(target=big)
    t.start()
    waits = []
    while t.is_alive() and len(waits) < 2000:
        waits.append(_health_s(server))
        time.sleep(0.05)
    t.join(timeout=300)
    r = done["r"]
    assert r.status_code == 400 and "longer than max_model_len" in r.json()["error"]["message"], r.text[:300]
    assert len(r.content) < 2000  # the error names the prompt, it does not echo 6 MB of it
    assert len(waits) >= 3 and max(waits) < HEALTH_S, waits


def _complete(server, **fields):
    return server.post("/v1/completions", {"model": MODEL, "ignore_eos": True, "return_token_ids": True,
                                           "temperature": 0, **fields})


def test_a_request_that_cannot_fit_is_refused_with_the_numbers(server):
    r = _complete(server, prompt=[5, 6, 7], max_tokens=10**9)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "max_tokens"
    assert (f"maximum context length is {MAX_LEN} tokens" in err["message"]
            and f"you requested {10**9 + 3} tokens (3 in the prompt, {10**9} in the completion)" in err["message"])
    p = [5] * (MAX_LEN - 4)
    r = _complete(server, prompt=p, max_tokens=5)
    assert r.status_code == 400 and f"requested {MAX_LEN + 1} tokens" in r.json()["error"]["message"], r.text
    r = _complete(server, prompt=p, max_tokens=4)  # exactly max_model_len: fits
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 4, r.text
    # several prompts share max_tokens: the longest decides, and is named
    r = _complete(server, prompt=[[5] * 10, p], max_tokens=5)
    assert r.status_code == 400 and "(prompt 1)" in r.json()["error"]["message"], r.text
    # chat: max_completion_tokens counts the same way
    r = server.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hello"}],
                                             "max_completion_tokens": MAX_LEN})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens", r.text
    assert "in the messages" in r.json()["error"]["message"]


def test_the_default_max_tokens_is_what_fits(server):
    """Omitted max_tokens: completions take OpenAI's 16, capped at the room the prompt leaves; chat takes the
    room; a prompt that leaves no room is refused."""
    r = _complete(server, prompt=[5] * (MAX_LEN - 3))
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 3, r.text
    r = _complete(server, prompt=[5, 6])
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 16, r.text
    r = server.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hello"}],
                                             "ignore_eos": True, "temperature": 0})
    usage = r.json()["usage"]
    assert r.status_code == 200 and usage["prompt_tokens"] + usage["completion_tokens"] == MAX_LEN, r.text
    r = _complete(server, prompt=[5] * MAX_LEN)
    assert r.status_code == 400 and "no room for the completion" in r.json()["error"]["message"], r.text


def test_the_default_body_limit_holds_the_longest_prompt_in_any_form():
    """default_max_request_bytes(n) fits n of the largest token ids as JSON and n tokens of text escaped by JSON
    at 6 bytes a character, with room for the other fields; and it stays a few MB, not unbounded."""
    for n in (64, 4096, 202752):
        ids = json.dumps({"model": MODEL, "prompt": [configs.glm52.vocab_size - 1] * n, "max_tokens": 1})
        escaped = json.dumps({"model": MODEL, "prompt": "\u4e2d" * (2 * n)})  # 2 characters a token, each \uXXXX
        limit = default_max_request_bytes(n)
        assert len(ids) < limit and len(escaped) < limit, n
        assert limit < 2 * max(len(ids), len(escaped)) + (8 << 20), n
