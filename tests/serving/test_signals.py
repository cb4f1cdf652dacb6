"""SIGTERM / SIGINT stop the real `python -m glm_dsa serve` (a subprocess, tiny random checkpoint on CPU) within
its `--shutdown-timeout`: it stops accepting, lets requests in flight run for the grace period (one that ends in
it ends normally), then aborts the rest (a stream ends with finish_reason "abort" and `data: [DONE]`, a plain
request answers with what it has), and exits 0. Oracle: the responses' finish reasons and token counts, the exit
status, the clock for the grace period's lower bound; every wait bounded."""

import json
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_process import KEY, MODEL, ServeProcess, wait_for  # noqa: E402

MAX_LEN = 2048
LONG = MAX_LEN - 48  # new tokens of a request that outlasts the grace period (tens of seconds of decoding)
GRACE = 3.0
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture
def server(ckpt, tmp_path):
    s = ServeProcess(ckpt, tmp_path / "serve.log", "--shutdown-timeout", str(GRACE), max_len=MAX_LEN)
    try:
        yield s.wait_up()
    finally:
        s.stop()


class Stream(threading.Thread):
    """One streamed completion read in a thread: `events` are (monotonic time, parsed chunk or "[DONE]")."""

    def __init__(self, base, max_tokens, prompt):
        super().__init__(daemon=True)
        self.base, self.body = base, {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                                      "ignore_eos": True, "temperature": 0, "return_token_ids": True}
        self.events, self.error, self.first = [], None, threading.Event()

    def run(self):
        try:
            with httpx.stream("POST", self.base + "/v1/completions", json=self.body, headers=AUTH,
                              timeout=120) as r:
                for ln in r.iter_lines():
                    if ln.startswith("data: "):
                        data = ln[6:]
                        self.events.append((time.monotonic(), "[DONE]" if data == "[DONE]" else json.loads(data)))
                        self.first.set()
        except httpx.HTTPError as e:  # a cut stream: the test fails on what it misses
            self.error = e

    def tokens(self, after=None) -> int:
        return sum(len(c["choices"][0]["token_ids"]) for t, c in self.events
                   if c != "[DONE]" and (after is None or t > after))

    def finish(self):
        """(finish_reason of the last chunk, whether [DONE] followed it)."""
        chunks = [c for _, c in self.events if c != "[DONE]"]
        return chunks[-1]["choices"][0]["finish_reason"] if chunks else None, self.events[-1][1] == "[DONE]"


def test_sigterm_finishes_a_short_stream_and_aborts_a_long_one_then_exits_0(server):
    long = Stream(server.base, LONG, [5, 6, 7])
    long.start()
    assert long.first.wait(60), server.log[-3000:]
    short = Stream(server.base, 12, [8, 9, 10])
    short.start()
    assert short.first.wait(60), server.log[-3000:]
    t_signal = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    try:  # no new requests once shutting down: the listening socket is closed (or, on a kept connection, 503)
        r = httpx.post(server.base + "/v1/completions", json={"prompt": [1], "max_tokens": 1}, headers=AUTH,
                       timeout=10)
        assert r.status_code == 503, r.text
    except httpx.TransportError:
        pass
    code = server.wait_exit(GRACE + 30)
    long.join(timeout=30)
    short.join(timeout=30)
    assert code == 0, server.log[-3000:]
    assert "stopped serving" in server.log
    assert short.error is None and short.finish() == ("length", True) and short.tokens() == 12
    assert long.error is None and long.finish() == ("abort", True), long.events[-3:]
    t_abort = long.events[-2][0]
    assert t_abort - t_signal >= GRACE - 0.5  # the grace period was given ...
    assert long.tokens(after=t_signal) > 0  # ... and the stream decoded on in it
    assert long.tokens() < LONG


def test_sigint_aborts_a_plain_request_after_the_grace_and_exits_0(server):
    got = {}

    def plain():
        got["r"] = httpx.post(server.base + "/v1/completions", headers=AUTH, timeout=120, json={
            "model": MODEL, "prompt": [5, 6, 7], "max_tokens": LONG, "ignore_eos": True, "temperature": 0,
            "return_token_ids": True})
    t = threading.Thread(target=plain, daemon=True)
    t.start()
    wait_for(lambda: server.metrics()["generated_tokens"] >= 2, 60, "the request to be decoding")
    server.proc.send_signal(signal.SIGINT)
    code = server.wait_exit(GRACE + 30)
    t.join(timeout=30)
    assert code == 0, server.log[-3000:]
    r = got["r"]
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "abort" and 0 < len(choice["token_ids"]) < LONG
