"""`glm_dsa.distributed.exit_now`'s handshake, with a stand-in key-value client: in a multi-process run process 0
(the coordination service's host) leaves only after every other process has reported its exit, so no peer loses
the service while it is still on its way out (JAX then aborts it with SIGABRT instead of its own status: seen in
CI as `test_cli_bench_mesh_leaving_out_a_process_is_an_error`, process 1 exiting -6 instead of 2)."""

from __future__ import annotations

import time

import jax
import pytest
from jax._src import distributed as jax_distributed

from glm_dsa import distributed


class _Store:
    """The key-value calls `exit_now` makes, recorded in order; `present` keys are there at once, others never."""

    def __init__(self, present=()):
        self.present = set(present)
        self.calls = []

    def key_value_set(self, key, value, allow_overwrite=False):
        self.calls.append(("set", key, value))

    def blocking_key_value_get(self, key, timeout_in_ms):
        self.calls.append(("get", key, timeout_in_ms))
        if key not in self.present:
            time.sleep(timeout_in_ms / 1000)
            raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
        return "2"


@pytest.fixture
def run(monkeypatch):
    def go(me, n, store, wait_s=1.0):
        monkeypatch.setattr(jax_distributed.global_state, "client", store)
        monkeypatch.setattr(distributed, "is_multiprocess", lambda: True)
        monkeypatch.setattr(jax, "process_index", lambda: me)
        monkeypatch.setattr(jax, "process_count", lambda: n)
        exits = []

        def fake_exit(status):
            exits.append((status, list(store.calls)))
        monkeypatch.setattr(distributed.os, "_exit", fake_exit)
        t0 = time.monotonic()
        distributed.exit_now(2, wait_s=wait_s)
        return exits, time.monotonic() - t0
    return go


def test_a_follower_reports_its_exit_before_it_goes(run):
    store = _Store()
    exits, _ = run(2, 3, store)
    assert exits == [(2, [("set", "glm_dsa/exit/2", "2")])]


def test_process_zero_goes_after_every_peer_has_reported(run):
    store = _Store(present={"glm_dsa/exit/1", "glm_dsa/exit/2"})
    exits, took = run(0, 3, store, wait_s=30.0)
    assert [(c[0], c[1]) for c in exits[0][1]] == [("get", "glm_dsa/exit/1"), ("get", "glm_dsa/exit/2")]
    assert exits[0][0] == 2 and took < 10.0  # no wait beyond the reports (and the short grace after them)


def test_process_zero_waits_a_bounded_time_for_a_peer_that_never_reports(run):
    store = _Store(present={"glm_dsa/exit/1"})  # process 2 is still inside a collective, say
    exits, took = run(0, 3, store, wait_s=0.5)
    assert exits[0][0] == 2
    assert 0.4 < took < 8.0, took  # the given bound, not exit_now's default of 10 s
    assert [c[1] for c in exits[0][1]] == ["glm_dsa/exit/1", "glm_dsa/exit/2"]


def test_one_process_exits_without_the_store(monkeypatch):
    store = _Store()
    monkeypatch.setattr(distributed, "is_multiprocess", lambda: False)
    monkeypatch.setattr(jax_distributed.global_state, "client", store)
    exits = []
    monkeypatch.setattr(distributed.os, "_exit", lambda status: exits.append(status))
    distributed.exit_now(3)
    assert exits == [3] and store.calls == []
