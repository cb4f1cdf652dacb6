"""Per-request token streams and the background engine loop of a server.

`Engine.submit` returns a `RequestStream`: iterate it (`for tok in s`) or, in asyncio code, `async for tok in s`.
Without a background loop, iterating drives the engine itself (one `Engine.step` at a time, which also advances
every other queued request); with one (`BackgroundLoop`, as `serve` runs it), iterating waits for the loop.
"""

from __future__ import annotations

import asyncio
import collections
import threading


class RequestStream:
    """The tokens of one request as they are sampled. `output` holds all of them so far; `finish_reason` is None
    while the request runs, then "stop" | "length" | "abort" | "error" (with `error` saying why)."""

    def __init__(self, engine, request):
        self._engine = engine
        self.request = request
        self._cond = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self._done = False
        self._waker = None  # (event loop, asyncio.Event) of an async iteration
        request.on_token = self._on_token
        request.on_finish = self._on_finish

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def output(self) -> list[int]:
        return list(self.request.output)

    @property
    def finish_reason(self) -> str | None:
        return self.request.finish_reason if self._done else None

    @property
    def error(self) -> str | None:
        return self.request.error

    @property
    def finished(self) -> bool:
        return self._done

    # called on the engine loop's thread
    def _on_token(self, request, token: int) -> None:
        with self._cond:
            self._queue.append(token)
            self._cond.notify_all()
        self._wake()

    def _on_finish(self, request) -> None:
        with self._cond:
            self._done = True
            self._cond.notify_all()
        self._wake()

    def _wake(self) -> None:
        waker = self._waker
        if waker is not None:
            loop, event = waker
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # the event loop has closed: nobody is listening any more
                pass

    def abort(self) -> None:
        """Stop the request; its pages are freed at the engine's next step."""
        self._engine.abort(self.request_id)

    def __iter__(self):
        while True:
            with self._cond:
                if self._queue:
                    tok = self._queue.popleft()
                elif self._done:
                    return
                else:
                    tok = None
                    if self._engine.serving_in_background:
                        self._cond.wait(timeout=0.1)
            if tok is not None:
                yield tok
            elif not self._engine.serving_in_background:
                self._engine.step()

    async def __aiter__(self):
        if not self._engine.serving_in_background:
            raise RuntimeError("async iteration needs the engine loop running in the background "
                               "(BackgroundLoop(engine).start()); iterate synchronously instead")
        event = asyncio.Event()
        self._waker = (asyncio.get_running_loop(), event)
        try:
            while True:
                with self._cond:
                    tokens = list(self._queue)
                    self._queue.clear()
                    done = self._done
                    event.clear()
                for tok in tokens:
                    yield tok
                if done and not tokens:
                    return
                if not tokens:
                    try:
                        await asyncio.wait_for(event.wait(), timeout=1.0)
                    except asyncio.TimeoutError:
                        pass
        finally:
            self._waker = None


class BackgroundLoop:
    """Runs `engine.step()` on a daemon thread while there is work, sleeping until `Engine.submit` wakes it.
    A step that raises is logged by the engine (its requests finish with an error); the loop goes on."""

    THREAD_NAME = "glm-dsa-engine"

    def __init__(self, engine, idle_wait_s: float = 0.05):
        self.engine = engine
        self.idle_wait_s = idle_wait_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> BackgroundLoop:
        """Start the thread (the engine then serves only through `submit`; `generate` refuses)."""
        if self._thread is not None:
            raise RuntimeError("the background loop is already running")
        self.engine.attach_background(self)
        self._thread = threading.Thread(target=self._run, name=self.THREAD_NAME, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        wake = self.engine.wake_event
        while not self._stop.is_set():
            if not self.engine.step():
                wake.wait(self.idle_wait_s)
                wake.clear()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread after its current step and give the engine back to the caller."""
        self._stop.set()
        self.engine.wake_event.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.engine.attach_background(None)
        self._thread = None
