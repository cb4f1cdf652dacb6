"""A client that goes away aborts its request in the real `python -m glm_dsa serve` (a subprocess, tiny random
checkpoint on CPU), streaming or not: /metrics shows it aborted (not finished), nothing running and the KV pages
back where they were, well before the request would have ended. Oracle: /metrics before and after; every wait
bounded."""

import json
import socket
import sys
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_process import KEY, MODEL, serve_process, wait_for  # noqa: E402

MAX_LEN = 512  # room for a request long enough to be still running when its client goes
LONG = {"model": MODEL, "prompt": [5, 6, 7, 8, 9], "max_tokens": MAX_LEN - 6, "ignore_eos": True,
        "temperature": 0}


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    with serve_process(ckpt, tmp_path_factory, max_len=MAX_LEN) as s:
        yield s


def _aborted_and_freed(server, before):
    """/metrics once the gone client's request is aborted and its pages are back (else None)."""
    m = server.metrics()
    if (m["requests_aborted"] == before["requests_aborted"] + 1 and m["running"] == 0 and m["waiting"] == 0
            and m["kv_pages_used"] == before["kv_pages_used"]):
        return m
    return None


def _check_aborted(server, before):
    m = wait_for(lambda: _aborted_and_freed(server, before), 30, "the request aborted and its pages freed")
    assert m["kv_pages_free"] == m["kv_pages_total"]
    # counted as aborted, not as a request that finished; and it stopped well short of its max_tokens
    assert m["requests_finished"] - m["requests_aborted"] == before["requests_finished"] - before["requests_aborted"]
    assert m["generated_tokens"] - before["generated_tokens"] < LONG["max_tokens"] // 2


def test_a_client_gone_mid_stream_aborts_and_frees_its_pages(server):
    before = server.metrics()
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", server.base + "/v1/completions", json={**LONG, "stream": True},
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
            got = []
            for ln in r.iter_lines():
                if ln.startswith("data:"):
                    got.append(ln)
                if len(got) == 2:
                    break
    # the connection is closed: the server aborts the request and its pages come back
    _check_aborted(server, before)


def test_a_client_gone_while_waiting_for_a_plain_response_aborts_it(server):
    """Not streaming: the server sends nothing until the end, so it must notice the closed connection itself."""
    before = server.metrics()
    body = json.dumps(LONG).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        wait_for(lambda: (lambda m: m["running"] == 1 and m["generated_tokens"] >= before["generated_tokens"] + 2)(
            server.metrics()), 60, "the request to be running", poll=0.05)
    _check_aborted(server, before)
    # the server goes on: a request after it is answered
    r = server.post("/v1/completions", {**LONG, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
