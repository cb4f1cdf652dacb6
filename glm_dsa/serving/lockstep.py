"""Serving across processes: process 0 decides, the others follow, one engine step at a time.

Under JAX's multi-controller runtime every process must launch the same compiled steps in the same order, or
their collectives pair up wrongly (or wait forever). The engine's scheduling is a deterministic function of what
it is asked (`Engine.generate` in every process needs no help), but a server is asked by HTTP clients, and only
process 0 answers HTTP. So:

- Process 0 runs `LeaderLoop` (in place of `streaming.BackgroundLoop`). Before each engine step that does
  anything, the step's submits and aborts (everything that reached `Engine.submit` / `Engine.abort` since the
  last step, and `Engine.reset_prefix_cache`) are published as one numbered message: request ids, prompts,
  sampling parameters (the seed included: a server's default seed is drawn once, on process 0), stop ids.
- Every other process runs `follow`: it reads message n, hands its events to its engine at step n (through
  `Engine.step_sync`) and steps. Same events at the same steps give the same plans, the same compiled steps and
  the same sampled ids (the sampler runs on the device, on replicated logits) in every process.
- Steps that would do nothing (no work, no events) are not published, so an idle server sends nothing.

The messages travel through the runtime's key-value store (the coordination service that
`jax.distributed.initialize` starts in process 0), not through a device collective: reading a device array
would wait for the step in flight, and the host builds step n + 1 while the device runs step n. The last
reader of a message deletes it, so the store does not grow.

Ends: process 0 stopping (Ctrl-C, SIGTERM) publishes a stop message and every follower returns from `follow`.
Process 0 gone any other way: the followers' next read fails (the coordination service lived in it) and
`follow` raises `LockstepError` naming the coordinator; JAX also ends them. A follower gone: process 0's next
step fails (its collectives lose a peer) and `LeaderLoop` fails the requests in flight and ends the process
with one line saying so; if the step waits instead, JAX's heartbeat ends every process after
`--distributed-heartbeat-timeout` seconds, naming the task that died.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

from .sampling import SamplingParams
from .scheduler import Request
from .streaming import BackgroundLoop

#: where the messages live in the key-value store: PREFIX/<n>, and PREFIX/<n>/reads counts their readers
PREFIX = "glm_dsa/serve/step"


class LockstepError(RuntimeError):
    """Serving across processes cannot go on: a process is gone, or a step failed in a follower."""


def runtime_client():
    """The key-value client of JAX's multi-controller runtime (`jax.distributed.initialize` must have run)."""
    # not public API: the same object orbax and multihost_utils reach for; jax has no public key-value store
    from jax._src import distributed
    client = distributed.global_state.client
    if client is None:
        raise LockstepError("serving across processes needs the JAX distributed runtime: call "
                            "glm_dsa.distributed.initialize(...) (or pass --coordinator-address ...) first")
    return client


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"


class Channel:
    """Numbered messages (JSON objects) from process 0 to the `num_readers` other processes, through a key-value
    store with JAX's client interface (`key_value_set_bytes`, `blocking_key_value_get_bytes`,
    `key_value_increment`, `key_value_delete`, `wait_at_barrier`). `where` names the store in errors."""

    def __init__(self, client, num_readers: int, *, where: str = "the coordinator", prefix: str = PREFIX,
                 poll_ms: int = 1000):
        if num_readers < 1:
            raise ValueError(f"a channel needs at least one reader, got num_readers={num_readers}")
        self.client, self.num_readers, self.where, self.prefix, self.poll_ms = (client, num_readers, where, prefix,
                                                                                 poll_ms)

    @classmethod
    def from_runtime(cls, **kw) -> Channel:
        """The channel of the running multi-process runtime: every process but 0 reads."""
        import jax
        from jax._src import distributed
        where = f"the coordinator at {distributed.global_state.coordinator_address} (process 0)"
        return cls(runtime_client(), jax.process_count() - 1, where=where, **kw)

    def send(self, n: int, message: dict) -> None:
        """Publish message `n` (process 0; n counts from 0, each once)."""
        self.client.key_value_set_bytes(f"{self.prefix}/{n}", json.dumps(message).encode())

    def receive(self, n: int) -> dict:
        """Message `n`, waiting as long as it takes to be published; `LockstepError` when the store is gone."""
        key = f"{self.prefix}/{n}"
        while True:
            try:
                raw = self.client.blocking_key_value_get_bytes(key, self.poll_ms)
                break
            except Exception as e:  # a deadline means nothing was published yet: an idle server; wait on
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise LockstepError(f"lost {self.where} while waiting for step {n}'s message ({_first_line(e)})"
                                        "; process 0 has stopped or died") from e
        try:  # the last reader removes it
            if self.client.key_value_increment(f"{key}/reads", 1) >= self.num_readers:
                self.client.key_value_delete(f"{key}/reads")
                self.client.key_value_delete(key)
        except Exception as e:
            raise LockstepError(f"lost {self.where} after step {n}'s message ({_first_line(e)})") from e
        return json.loads(raw)

    def barrier(self, name: str, timeout_s: float) -> None:
        """Wait until every process has reached `name` (at most `timeout_s`; then a `LockstepError`)."""
        try:
            self.client.wait_at_barrier(f"{self.prefix}/{name}", int(timeout_s * 1000))
        except Exception as e:
            raise LockstepError(f"not every process reached '{name}' within {timeout_s:g} s at {self.where} "
                                f"({_first_line(e)})") from e


def encode_events(events) -> list[dict]:
    """The engine inbox's events (("add", Request) | ("abort", request id) | ("reset_prefix_cache", None)) as
    JSON-able objects."""
    out = []
    for kind, x in events:
        if kind == "add":
            p = x.params
            out.append({"add": {"id": x.request_id, "prompt": [int(t) for t in x.prompt], "index": x.prompt_index,
                                "temperature": p.temperature, "top_p": p.top_p, "seed": p.seed,
                                "max_tokens": p.max_tokens, "stop": sorted(int(t) for t in x.stop),
                                "stop_token_ids": None if p.stop_token_ids is None else list(p.stop_token_ids),
                                "logprobs": p.logprobs}})
        elif kind == "abort":
            out.append({"abort": x})
        elif kind == "reset_prefix_cache":
            out.append({"reset_prefix_cache": True})
        else:
            raise ValueError(f"unknown engine event {kind!r}")
    return out


def decode_events(items: list[dict]) -> list[tuple[str, object]]:
    """`encode_events`' inverse: fresh `Request`s (no callbacks) equal to process 0's in what the engine uses."""
    out = []
    for item in items:
        if "add" in item:
            a = item["add"]
            params = SamplingParams(temperature=a["temperature"], top_p=a["top_p"], seed=a["seed"],
                                    max_tokens=a["max_tokens"], stop_token_ids=a["stop_token_ids"],
                                    logprobs=a.get("logprobs"))
            out.append(("add", Request(a["id"], list(a["prompt"]), params, frozenset(a["stop"]), a["index"])))
        elif "reset_prefix_cache" in item:
            out.append(("reset_prefix_cache", None))
        else:
            out.append(("abort", item["abort"]))
    return out


def _exit_now(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    time.sleep(1.0)  # the failed requests' responses go out first
    os._exit(1)


class LeaderLoop(BackgroundLoop):
    """Process 0's engine loop when serving across processes (a `streaming.BackgroundLoop` that publishes).
    Publishes each step's events on `channel` before the step (see the module doc). A step that raises is fatal,
    since the processes can no longer be assumed to agree: the requests in flight fail with the reason, and
    `on_fatal(message)` runs (default: print `error: message` and end the process with status 1)."""

    def __init__(self, engine, channel: Channel, *, idle_wait_s: float = 0.05, on_fatal=None):
        super().__init__(engine, idle_wait_s)
        self.channel = channel
        self.on_fatal = _exit_now if on_fatal is None else on_fatal
        self.sent = 0  # messages published
        self.error: str | None = None
        self._idle = True  # the last step left nothing to do: a step without events is not published
        self._lock = threading.Lock()  # numbering: the loop thread publishes steps, `stop` the last message
        self._stopped = False

    def _send(self, message: dict) -> None:
        with self._lock:
            if self._stopped:
                raise LockstepError("the serving loop has stopped")
            self.channel.send(self.sent, message)
            self.sent += 1

    def _sync(self, events):
        if events or not self._idle:
            self._send({"events": encode_events(events)})
        return events

    THREAD_NAME = "glm-dsa-engine-leader"

    def start(self) -> LeaderLoop:
        """Start the loop thread (the engine then serves only through `submit`); every step publishes first."""
        if self._thread is not None:
            raise RuntimeError("the serving loop is already running")
        self.engine.step_sync = self._sync
        return super().start()

    def _run(self) -> None:
        wake = self.engine.wake_event
        try:
            while not self._stop.is_set():
                self._idle = not self.engine.step()
                if self._idle:
                    wake.wait(self.idle_wait_s)
                    wake.clear()
        except BaseException as e:  # noqa: BLE001 - any failure here leaves the processes out of step
            if self._stop.is_set():  # a step that outlived `stop`: the process is on its way out anyway
                return
            self.error = (f"serving across processes stopped: step {self.sent} failed in process 0 "
                          f"({_first_line(e)}); a peer process may have died")
            sch = self.engine.scheduler
            sch.fail(list(sch.running) + list(sch.waiting), self.error)
            self.on_fatal(self.error)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop after its current step, then tell the followers to stop (the last message)."""
        super().stop(timeout)
        self.engine.step_sync = None
        with self._lock:
            if not self._stopped:
                self._stopped = True
                self.channel.send(self.sent, {"stop": True})
                self.sent += 1


def follow(engine, channel: Channel) -> int:
    """Run `engine`'s steps as process 0 publishes them on `channel` until it stops; returns the steps run.
    `LockstepError` when process 0 is gone or a step fails here (the message names the step)."""
    box: list = []

    def events_of_this_step(local):
        if local:  # nothing submits here: only process 0 serves
            raise LockstepError(f"{len(local)} requests were submitted to a process other than 0; only process 0 "
                                "takes requests when serving across processes")
        return box.pop()

    engine.step_sync = events_of_this_step
    n = 0
    try:
        while True:
            message = channel.receive(n)
            if message.get("stop"):
                return n
            box.append(decode_events(message["events"]))
            try:
                engine.step()
            except LockstepError:
                raise
            except Exception as e:
                raise LockstepError(f"step {n} failed in this process ({_first_line(e)}); a peer process may "
                                    "have died") from e
            n += 1
    finally:
        engine.step_sync = None


def serve_in_lockstep(engine, serve, *, timeout_s: float = 300, channel: Channel | None = None) -> int:
    """Serve `engine` across the runtime's processes; returns the exit status (0: process 0 stopped cleanly).

    Every process waits (at most `timeout_s`) until all have loaded, so process 0's `/health` answers only when
    all of them can step. Then process 0 calls `serve(loop)` with a `LeaderLoop` (it returns when the server
    stops) and the others `follow`. At the end all of them meet once more before leaving, so that JAX's own
    shutdown (which waits for every process) finds them all; the signal that stopped process 0's server ends it
    through that path rather than killing it at once (uvicorn raises the signal again after its shutdown)."""
    import jax
    me = jax.process_index()
    channel = Channel.from_runtime() if channel is None else channel
    try:
        channel.barrier("ready", timeout_s)
        if me != 0:
            steps = follow(engine, channel)
            print(f"process {me}: process 0 stopped serving after {steps} steps; stopping", file=sys.stderr)
        else:
            import signal
            caught = {s: signal.signal(s, lambda sig, frame: None) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                serve(LeaderLoop(engine, channel))
            finally:
                for s, handler in caught.items():
                    signal.signal(s, handler)
        channel.barrier("stopped", timeout_s)
    except LockstepError as e:
        print(f"error: process {me}: {e}", file=sys.stderr, flush=True)
        return 1
    return 0
