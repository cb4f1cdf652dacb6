"""glm_dsa.serving.lockstep in one process: a leader engine (served through `submit`, as process 0's HTTP server does)
and a follower engine fed only the leader's published messages, over an in-memory key-value store with JAX's
client interface. Oracle: the leader's own request outputs, which the follower must reproduce token for token
(sampling seeds, prompt indices, aborts and their step included); plus the failure paths."""

import threading
import time

import pytest

import glm_dsa
from glm_dsa import SamplingParams
from glm_dsa.serving import lockstep

MAX_LEN = 64


class MemoryStore:
    """The key-value calls `lockstep.Channel` makes, in memory; `gone` makes every call fail as a lost
    coordinator does."""

    def __init__(self):
        self.data, self.cond, self.gone = {}, threading.Condition(), False

    def _check(self):
        if self.gone:
            raise RuntimeError("UNAVAILABLE: Stream removed (Socket closed)")

    def key_value_set_bytes(self, key, value):
        with self.cond:
            self._check()
            assert key not in self.data, key
            self.data[key] = value
            self.cond.notify_all()

    def blocking_key_value_get_bytes(self, key, timeout_ms):
        with self.cond:
            if not self.cond.wait_for(lambda: self.gone or key in self.data, timeout_ms / 1000):
                raise RuntimeError(f"DEADLINE_EXCEEDED: GetKeyValue() timed out with key: {key}")
            self._check()
            return self.data[key]

    def key_value_increment(self, key, n):
        with self.cond:
            self._check()
            self.data[key] = self.data.get(key, 0) + n
            return self.data[key]

    def key_value_delete(self, key):
        with self.cond:
            self.data.pop(key, None)

    def wait_at_barrier(self, name, timeout_ms):
        self._check()


def _engine(ckpt):
    return glm_dsa.load(ckpt, dtype="float32", max_model_len=MAX_LEN, max_num_seqs=4, max_num_batched_tokens=32,
                        progress=False)


@pytest.fixture(scope="module")
def engines(ckpt):
    return _engine(ckpt), _engine(ckpt)


def test_follower_reproduces_the_leader(engines):
    leader, follower = engines
    store = MemoryStore()
    channel = lockstep.Channel(store, 1, poll_ms=50)
    seen = []  # the follower's requests, as its scheduler receives them
    add = follower.scheduler.add
    follower.scheduler.add = lambda r: (seen.append(r), add(r))[1]
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("steps", lockstep.follow(follower, channel)))
    thread.start()
    loop = lockstep.LeaderLoop(leader, channel).start()
    try:
        time.sleep(0.2)  # idle: nothing is published
        assert loop.sent == 0
        params = [SamplingParams(max_tokens=6, stop_token_ids=[]),
                  SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=7, stop_token_ids=[]),
                  SamplingParams(temperature=1.0, seed=2**63 + 7, max_tokens=40, stop_token_ids=[])]
        prompts = [[5, 6, 7], list(range(9, 30)), [3, 1, 4, 1, 5]]
        streams = [leader.submit(p, sp, request_id=f"r{i}", prompt_index=i)
                   for i, (p, sp) in enumerate(zip(prompts, params))]
        for tok in streams[2]:  # abort the long one after its first token: it stops at whatever step that is
            streams[2].abort()
            break
        for s in streams[:2]:
            assert len(list(s)) == s.request.params.max_tokens
        deadline = time.monotonic() + 60
        while not streams[2].finished and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        loop.stop()
        thread.join(60)
    assert not thread.is_alive()
    assert result["steps"] == loop.sent - 1 > 0  # every published step ran; the last message said stop
    assert [s.finish_reason for s in streams] == ["length", "length", "abort"]
    assert len(streams[2].output) < 40
    assert [r.request_id for r in seen] == ["r0", "r1", "r2"]
    for s, r in zip(streams, seen):
        assert (r.output, r.finish_reason, r.prompt, r.params, r.prompt_index, r.stop) == (
            s.output, s.finish_reason, s.request.prompt, s.request.params, s.request.prompt_index, s.request.stop)
    assert follower.allocator.free == leader.allocator.free == leader.num_pages - 1
    assert store.data == {}  # every message was read and removed
    follower.scheduler.add = add


def test_a_lost_coordinator_ends_the_follower(engines):
    store = MemoryStore()
    channel = lockstep.Channel(store, 1, poll_ms=50, where="the coordinator at 10.0.0.1:1234 (process 0)")
    store.gone = True
    with pytest.raises(lockstep.LockstepError, match=r"lost the coordinator at 10\.0\.0\.1:1234 .*step 0"):
        lockstep.follow(engines[1], channel)
    assert engines[1].step_sync is None


def test_a_failed_step_is_fatal_in_the_leader(engines):
    leader = engines[0]
    channel = lockstep.Channel(MemoryStore(), 1)
    fatal = []
    loop = lockstep.LeaderLoop(leader, channel, on_fatal=fatal.append)
    real_step = leader.step

    def failing_step():  # the step that admits the request runs; the next one fails as with a dead peer
        if leader.scheduler.has_work:
            raise RuntimeError("Gloo all-reduce failed: Connection reset by peer")
        return real_step()
    leader.step = failing_step
    try:
        loop.start()
        s = leader.submit([1, 2, 3], SamplingParams(max_tokens=4), request_id="x")
        deadline = time.monotonic() + 30
        while not fatal and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        del leader.step
        loop.stop()
    assert fatal and "step" in fatal[0] and "Connection reset by peer" in fatal[0] and "peer process" in fatal[0]
    assert loop.error == fatal[0]
    assert s.finished and s.finish_reason == "error" and s.error == fatal[0]
