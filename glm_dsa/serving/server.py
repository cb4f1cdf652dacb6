"""An OpenAI-compatible HTTP server over the continuous-batching engine (`python -m glm_dsa serve`).

FastAPI + uvicorn (the optional extra `serve`). Endpoints: `POST /v1/completions` (prompt: text, token ids, or a
list of either; one choice per prompt), `POST /v1/chat/completions` (messages through the tokenizer's chat
template), `stream: true` as server-sent events ending in `data: [DONE]`, `return_token_ids: true` (vLLM's field:
`token_ids` on each choice; always there when the checkpoint has no tokenizer, whose texts are then empty),
`GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus text). Bad requests get 400 (404 for an unknown
model, 401 without the `--api-key` bearer token, 413 for a body over the size limit, 503 while shutting down)
with an OpenAI-style body `{"error": {"message", "type", "param", "code"}}`; a request that fails never stops the
server.

Request fields are checked in one table, `glm_dsa.serving.request_fields` (its module doc has the rules). Beyond the
fields: a body over `max_request_bytes` is refused while it is read (at once when its Content-Length says so);
a prompt with max_tokens that cannot fit in max_model_len is refused with both numbers, as vLLM does. JSON
decoding, tokenisation, the chat template and detokenisation run in worker threads, so the event loop (and
`/health`) answers while a large prompt is handled.

A client that goes away aborts its requests and frees their pages: a stream when its next chunk cannot be sent,
a plain request when the server sees the connection closed (polled every DISCONNECT_POLL_S while it waits).
Shutdown (SIGTERM / SIGINT, `serve`): the server stops accepting connections and new requests get 503, requests
in flight get `shutdown_timeout` seconds to finish, then they are aborted (streams end with finish_reason
"abort" and `data: [DONE]`); the engine loop stops and `serve` returns.

Logprobs (`logprobs` N on completions, `logprobs: true` with `top_logprobs` N on chat) are the model's
distribution, log_softmax of the logits before temperature and top_p (vLLM's default), in OpenAI's shapes:
completions `{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}` (text_offset counts the
token strings before each one), chat `{content: [{token, logprob, bytes, top_logprobs: [{token, logprob,
bytes}]}]}`; streamed chunks carry their own tokens' entries. A token's string is its own decoding, or
"token_id:N" (vLLM's form) when the checkpoint has no tokenizer.

Sampling follows OpenAI's defaults (temperature 1, top_p 1, max_tokens 16 for completions capped at the room
the prompt leaves, that room for chat); `seed` (default: a random one per request), `stop_token_ids` and
`ignore_eos` are vLLM's extensions.
"""

# no `from __future__ import annotations`: FastAPI reads the handlers' annotations (fastapi.Request, imported
# inside create_app so that this module imports without the extra) as objects
import asyncio
import contextlib
import json
import secrets
import signal
import threading
import time
import uuid

from . import request_fields as rf
from .sampling import SamplingParams
from .streaming import BackgroundLoop

#: seconds between two checks, while a plain (non-streaming) request waits for its tokens, that its client is
#: still connected
DISCONNECT_POLL_S = 0.25
#: body bytes allowed per token of max_model_len: token ids as JSON text take up to 8 bytes each ("151552, "),
#: a text token a few bytes, or 6 per character where JSON escapes it (\uXXXX); 16 covers any of them
REQUEST_BYTES_PER_TOKEN = 16
#: room in the body beyond the prompt's: the other fields, chat messages' roles and template text
REQUEST_BYTES_MARGIN = 4 << 20


def default_max_request_bytes(max_model_len: int) -> int:
    """The default body size limit: room for a prompt of max_model_len tokens in any form, plus a margin."""
    return REQUEST_BYTES_PER_TOKEN * max_model_len + REQUEST_BYTES_MARGIN


class APIError(Exception):
    """A request error: HTTP `status` with an OpenAI-style error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def chat_template(checkpoint: str | None) -> str | None:
    """The checkpoint's chat template (`chat_template.jinja`, else `tokenizer_config.json`'s "chat_template"),
    or None."""
    import os
    if checkpoint is None:
        return None
    path = os.path.join(checkpoint, "chat_template.jinja")
    if os.path.isfile(path):
        with open(path) as f:
            return f.read()
    path = os.path.join(checkpoint, "tokenizer_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            t = json.load(f).get("chat_template")
        if isinstance(t, list):  # [{"name": "default", "template": ...}, ...]
            t = next((x.get("template") for x in t if x.get("name") == "default"), None)
        return t if isinstance(t, str) else None
    return None


class _Detokenizer:
    """Incremental text of a growing token list: each call returns the new text, holding back an unfinished
    UTF-8 sequence (decoded as U+FFFD) until its next token completes it."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.sent = tokenizer, [], ""

    def add(self, tokens, final: bool = False) -> str:
        if self.tokenizer is None:
            return ""
        self.ids.extend(tokens)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd") and not final:
            return ""
        new, self.sent = text[len(self.sent):], text
        return new


class InFlight:
    """The streams of the requests a server is answering, so that shutdown can abort them; and whether it is
    shutting down (new requests are then refused)."""

    def __init__(self):
        self.streams: set = set()
        self.closing = False

    def abort_all(self) -> int:
        """Abort every request in flight (each finishes with reason "abort"); returns how many."""
        streams = [s for s in self.streams if not s.finished]
        for s in streams:
            s.abort()
        return len(streams)


def create_app(engine, *, model_name: str, tokenizer=None, template: str | None = None, api_key: str | None = None,
               loop=None, max_request_bytes: int | None = None):
    """The FastAPI app serving `engine` as `model_name`. The engine runs on `loop` (anything with `start()` and
    `stop()`; default a `BackgroundLoop`, across processes a `glm_dsa.serving.lockstep.LeaderLoop`), started with the app
    and stopped with it. `tokenizer`: a `glm_dsa.serving.text.TextTokenizer` or None (token ids only); `template`: a
    Jinja chat template (None: chat completions are refused with 400). `max_request_bytes`: the largest request
    body (default `default_max_request_bytes(engine.max_model_len)`). `app.state.in_flight` is the `InFlight` of
    the requests being answered (`serve` aborts them at shutdown)."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    loop = BackgroundLoop(engine) if loop is None else loop
    limit = default_max_request_bytes(engine.max_model_len) if max_request_bytes is None else max_request_bytes
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"max_request_bytes must be a positive integer, got {limit!r}")
    started = time.time()
    in_flight = InFlight()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loop.start()
        try:
            yield
        finally:
            loop.stop()

    app = FastAPI(title="glm-dsa", lifespan=lifespan)
    app.state.in_flight = in_flight

    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc):
        code = "not_found" if exc.status_code == 404 else None
        return JSONResponse(APIError(exc.status_code, str(exc.detail), code=code).body(), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc):
        return JSONResponse(_bad(str(exc)).body(), status_code=400)

    @app.exception_handler(Exception)
    async def internal_error(request, exc):
        return JSONResponse(APIError(500, f"{type(exc).__name__}: {exc}", "internal_error").body(), status_code=500)

    class CheckKey:
        """The bearer token on /v1 requests, as plain ASGI middleware: it leaves the endpoints the server's own
        `receive`, so that a plain request sees its client disconnect (`Request.is_disconnected`)."""

        def __init__(self, app):
            self.app = app

        async def __call__(self, scope, receive, send):
            if (api_key is not None and scope["type"] == "http" and scope["path"].startswith("/v1")
                    and dict(scope["headers"]).get(b"authorization", b"") != f"Bearer {api_key}".encode()):
                err = APIError(401, "invalid or missing API key (Authorization: Bearer KEY)", code="invalid_api_key")
                await JSONResponse(err.body(), status_code=401)(scope, receive, send)
                return
            await self.app(scope, receive, send)

    app.add_middleware(CheckKey)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(started),
                                            "owned_by": "glm-dsa", "max_model_len": engine.max_model_len}]}

    @app.get("/metrics")
    async def metrics():
        m = engine.metrics()
        lines = []
        for k, v in m.items():
            lines.append(f"# TYPE glm_dsa:{k} gauge")
            lines.append(f"glm_dsa:{k} {float(v):.6g}")
        return PlainTextResponse("\n".join(lines) + "\n")

    def too_large(n: str) -> APIError:
        return APIError(413, f"the request body is {n} bytes, over this server's limit of {limit} bytes "
                             "(serve --max-request-bytes)", param=None, code="request_too_large")

    async def read_body(request: Request) -> bytes:
        """The body, refused (413) at once when its Content-Length is over the limit, else as soon as the bytes
        read pass it (a chunked body has no Content-Length): never more than the limit held in memory."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_large(declared)
        chunks, n = [], 0
        async for chunk in request.stream():
            n += len(chunk)
            if n > limit:
                raise too_large(f"more than {limit}")
            chunks.append(chunk)
        return b"".join(chunks)

    def decode(raw: bytes):
        try:
            body = json.loads(raw)
        except RecursionError:  # nested deeper than the interpreter's stack allows
            raise _bad(f"the request body nests JSON deeper than {rf.MAX_JSON_DEPTH} levels")
        except (ValueError, UnicodeDecodeError) as e:
            raise _bad(f"the request body is not valid JSON ({e})")
        if rf.json_depth(body) > rf.MAX_JSON_DEPTH:
            raise _bad(f"the request body nests JSON deeper than {rf.MAX_JSON_DEPTH} levels")
        return body

    async def body_of(request: Request, endpoint: str) -> dict:
        if in_flight.closing:
            raise APIError(503, "the server is shutting down", "server_error", code="shutting_down")
        raw = await read_body(request)
        body = await asyncio.to_thread(decode, raw)
        try:
            fields = rf.parse_body(body, endpoint)
        except rf.FieldError as e:
            raise _bad(str(e), e.param)
        model = fields["model"]
        if model is not None and model != model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")
        return fields

    def encode_prompts(prompts: list) -> list[list[int]]:
        """Text prompts through the tokenizer (in a worker thread: a long text takes a while)."""
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                if tokenizer is None:
                    raise _bad("this checkpoint has no tokenizer.json: give prompts as token ids", "prompt")
                try:
                    p = tokenizer.encode(p)
                except ValueError as e:
                    raise _bad(str(e), "prompt")
            out.append(p)
        return out

    def max_tokens_of(f: dict, prompts, chat: bool) -> int:
        """The new-token budget (the same for every prompt). An explicit one that cannot fit with the longest
        prompt in max_model_len is refused as vLLM refuses it; the default is capped at the room the longest
        prompt leaves."""
        name = "max_completion_tokens" if chat and f.get("max_completion_tokens") is not None else "max_tokens"
        asked = f.get(name)
        n_max = engine.max_model_len
        where = "messages" if chat else "prompt"
        i, longest = max(enumerate(map(len, prompts)), key=lambda x: x[1])
        which = "" if len(prompts) == 1 else f" (prompt {i})"
        if longest > n_max:  # the engine's own message, naming the prompt
            return 0
        if asked is None:
            if longest >= n_max:
                raise _bad(f"This model's maximum context length is {n_max} tokens. However, you requested "
                           f"{longest} tokens in the {where}{which}, which leaves no room for the completion. "
                           f"Please reduce the length of the {where}.", where)
            return (n_max - longest) if chat else min(16, n_max - longest)
        if longest + asked > n_max:
            raise _bad(f"This model's maximum context length is {n_max} tokens. However, you requested "
                       f"{longest + asked} tokens ({longest} in the {where}{which}, {asked} in the completion). "
                       f"Please reduce the length of the {where} or completion.", name)
        return asked

    def logprobs_of(f: dict) -> int | None:
        """The alternatives per token a request asks for (None: no logprobs): completions' `logprobs`, or chat's
        `top_logprobs` (0 when absent) under `"logprobs": true`."""
        if "top_logprobs" in f:  # chat
            return (f["top_logprobs"] or 0) if f["logprobs"] else None
        return f["logprobs"]

    def token_text(t: int) -> str:
        return tokenizer.decode([t], skip_special_tokens=False) if tokenizer is not None else f"token_id:{t}"

    def logprobs_body(request, start: int, stop: int, chat: bool, offset: int = 0):
        """OpenAI's logprobs object of output tokens [start, stop) of `request` (None when it asked for none);
        `offset`: text_offset of its first token (completions)."""
        if request.params.logprobs is None:
            return None
        ids = request.output[start:stop]
        lps = request.logprobs[start:stop]
        tops = request.top_logprobs[start:stop]
        if chat:
            def entry(t, lp):
                text = token_text(t)
                return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
            return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, v) for a, v in top.items()]}
                                for t, lp, top in zip(ids, lps, tops)]}
        texts = [token_text(t) for t in ids]
        offsets = []
        for text in texts:
            offsets.append(offset)
            offset += len(text)
        return {"tokens": texts, "token_logprobs": lps,
                "top_logprobs": [{token_text(a): v for a, v in top.items()} for top in tops],
                "text_offset": offsets}

    def params_of(f: dict, max_tokens: int) -> SamplingParams:
        stop = f["stop_token_ids"]
        if f["ignore_eos"]:
            stop = list(stop or [])
        elif stop is not None:
            stop = list(stop) + list(engine.config.eos_token_id)
        seed = f["seed"]
        try:
            return SamplingParams(temperature=f["temperature"], top_p=f["top_p"],
                                  seed=secrets.randbits(63) if seed is None else seed, max_tokens=max_tokens,
                                  stop_token_ids=stop, logprobs=logprobs_of(f))
        except (TypeError, ValueError) as e:  # the table checks these first; kept as the last word
            raise _bad(str(e), str(e).split(" ", 1)[0])

    def submit_all(prompts, params) -> list:
        streams = []
        try:
            for i, p in enumerate(prompts):
                streams.append(engine.submit(p, params, prompt_index=i, request_id=f"{uuid.uuid4().hex}-{i}"))
        except (TypeError, ValueError) as e:
            for s in streams:
                s.abort()
            raise _bad(str(e).replace("prompt 0", f"prompt {len(streams)}"), "prompt")
        return streams

    class EventStream(StreamingResponse):
        """Server-sent events that abort their requests however the response ends: also when the client went
        away before the first event, where the events' generator never started (so its own cleanup never ran)."""

        def __init__(self, events, streams):
            super().__init__(events, media_type="text/event-stream")
            self.streams = streams

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                in_flight.streams.difference_update(self.streams)
                for s in self.streams:
                    if not s.finished:
                        s.abort()

    def finish_reason(s) -> str:
        if s.finish_reason == "error":
            raise APIError(500, f"the request failed: {s.error}", "internal_error")
        return s.finish_reason

    def detokenize(ids) -> str:
        return tokenizer.decode(ids) if tokenizer is not None else ""

    async def wait_or_abort(request: Request, streams) -> bool:
        """Wait until every stream finishes (True), or abort them all when the client goes away (False)."""
        async def drain():
            for s in streams:
                async for _ in s:
                    pass
        task = asyncio.ensure_future(drain())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    task.result()
                    return True
                if await request.is_disconnected():
                    return False
        finally:
            task.cancel()
            for s in streams:
                if not s.finished:
                    s.abort()

    async def respond(request: Request, f: dict, prompts, chat: bool):
        max_tokens = max_tokens_of(f, prompts, chat)
        params = params_of(f, max_tokens)
        streams = await asyncio.to_thread(submit_all, prompts, params)  # checks every id of a long prompt
        in_flight.streams.update(streams)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        want_ids = f["return_token_ids"] or tokenizer is None
        usage = {"prompt_tokens": sum(map(len, prompts))}
        if f["stream"]:
            return EventStream(sse(rid, created, streams, chat, want_ids, usage, f), streams)
        try:
            if not await wait_or_abort(request, streams):
                return Response(status_code=499)  # nobody reads it: the client is gone
        finally:
            in_flight.streams.difference_update(streams)
        choices = []
        for i, s in enumerate(streams):
            text = await asyncio.to_thread(detokenize, s.output)
            lp = await asyncio.to_thread(logprobs_body, s.request, 0, len(s.output), chat)
            c = {"index": i, "finish_reason": finish_reason(s), "logprobs": lp}
            if chat:
                c["message"] = {"role": "assistant", "content": text}
            else:
                c["text"] = text
            if want_ids:
                c["token_ids"] = s.output
                c["prompt_token_ids"] = prompts[i]
            choices.append(c)
        n = sum(len(s.output) for s in streams)
        usage.update(completion_tokens=n, total_tokens=usage["prompt_tokens"] + n)
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": model_name, "choices": choices, "usage": usage}

    async def sse(rid, created, streams, chat, want_ids, usage, f):
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(i, text, ids, reason, role=False, lp=None):
            if chat:
                delta = {"role": "assistant", "content": text} if role else {"content": text}
                c = {"index": i, "delta": delta, "finish_reason": reason, "logprobs": lp}
            else:
                c = {"index": i, "text": text, "finish_reason": reason, "logprobs": lp}
            if want_ids:
                c["token_ids"] = ids
            return "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": model_name,
                                          "choices": [c]}) + "\n\n"
        try:
            for i, s in enumerate(streams):  # prompts stream one after another; all of them run concurrently
                detok = _Detokenizer(tokenizer)
                first = True
                k = 0  # output tokens sent; a token's logprobs are recorded before the stream yields it
                offset = 0
                async for tok in s:
                    text = await asyncio.to_thread(detok.add, [tok])  # decodes the whole output so far
                    lp = await asyncio.to_thread(logprobs_body, s.request, k, k + 1, chat, offset)
                    if lp is not None and not chat:
                        offset += sum(map(len, lp["tokens"]))
                    yield chunk(i, text, [tok], None, role=first, lp=lp)
                    first = False
                    k += 1
                try:
                    reason = finish_reason(s)
                except APIError as e:
                    yield "data: " + json.dumps(e.body()) + "\n\n"
                    return
                yield chunk(i, await asyncio.to_thread(detok.add, [], True), [], reason, role=first)
            if (f["stream_options"] or {}).get("include_usage"):
                n = sum(len(s.output) for s in streams)
                yield "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": model_name,
                                              "choices": [], "usage": {**usage, "completion_tokens": n,
                                                                       "total_tokens": usage["prompt_tokens"] + n}}) \
                    + "\n\n"
            yield "data: [DONE]\n\n"
        finally:  # a client gone mid-stream cancels this generator: its requests are aborted, their pages freed
            in_flight.streams.difference_update(streams)
            for s in streams:
                if not s.finished:
                    s.abort()

    @app.post("/v1/completions")
    async def completions(request: Request):
        f = await body_of(request, rf.COMPLETIONS)
        prompts = await asyncio.to_thread(encode_prompts, f["prompt"])
        return await respond(request, f, prompts, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        f = await body_of(request, rf.CHAT)
        if tokenizer is None or template is None:
            raise _bad("this checkpoint has no tokenizer chat template: use /v1/completions", "messages")

        def encode_chat():
            text = render_chat(template, f["messages"])
            try:
                return tokenizer.encode(text, add_special_tokens=False)
            except ValueError as e:
                raise _bad(str(e), "messages")
        return await respond(request, f, [await asyncio.to_thread(encode_chat)], chat=True)

    return app


def render_chat(template: str, messages: list[dict]) -> str:
    """The prompt text of `messages` under a Jinja chat template (as transformers renders it: sandboxed, with
    `add_generation_prompt=True`)."""
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ImportError("chat templates need jinja2: pip install 'glm-dsa[serve]'") from None
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    try:
        return env.from_string(template).render(messages=messages, add_generation_prompt=True)
    except Exception as e:  # a template error is the request's (or the checkpoint's) fault, not the server's
        raise _bad(f"the chat template failed on these messages: {e}", "messages")


#: seconds an idle keep-alive connection stays open. Longer than HTTP clients keep an idle connection for reuse
#: (httpx and the openai client: 5 s): at uvicorn's default of 5 s a client could send a request on a connection in
#: the instant the server closed it, and get "Server disconnected without sending a response" (seen in a clean-clone
#: run of the test suite)
KEEP_ALIVE_S = 75
#: seconds, after the in-flight requests are aborted at shutdown, that their responses get to end before their
#: connections are cut
ABORT_GRACE_S = 5.0


def listen_socket(host: str, port: int):
    """A socket bound to `host`:`port` (not yet listening), or OSError naming the address and the flag.

    `serve` binds before the model loads, so that a port in use fails at once instead of after the load, and
    keeps the socket, so that no other process can take the port in between."""
    import socket
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a port in TIME_WAIT is free
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from None
    return sock


def serve(engine, *, model_name: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          tokenizer=None, template: str | None = None, log=print, loop=None, max_request_bytes: int | None = None,
          shutdown_timeout: float = 5.0, sock=None) -> None:
    """Run the server until SIGTERM / SIGINT (uvicorn on `host`:`port`, or on the bound socket `sock` from
    `listen_socket`; idle connections kept KEEP_ALIVE_S seconds), then shut down and return: stop accepting,
    give the requests in flight `shutdown_timeout` seconds, abort those still running (streams end with
    finish_reason "abort"), stop the engine loop. A second SIGINT cuts the wait short. `loop`,
    `max_request_bytes`: see `create_app`."""
    try:
        import uvicorn
    except ImportError:
        raise ImportError("serve needs FastAPI and uvicorn: pip install 'glm-dsa[serve]'") from None
    app = create_app(engine, model_name=model_name, tokenizer=tokenizer, template=template, api_key=api_key,
                     loop=loop, max_request_bytes=max_request_bytes)
    in_flight = app.state.in_flight

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            in_flight.closing = True
            aborter = asyncio.get_running_loop().call_later(shutdown_timeout, in_flight.abort_all)
            try:
                await super().shutdown(sockets)
            finally:
                aborter.cancel()

    # uvicorn cancels what is still running at timeout_graceful_shutdown: later than the abort, so that aborted
    # streams end with their last chunk and [DONE] rather than being cut
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_keep_alive=KEEP_ALIVE_S,
                            timeout_graceful_shutdown=shutdown_timeout + ABORT_GRACE_S)
    server = Server(config)
    log(f"serving {model_name} on http://{host}:{port} (OpenAI API at /v1)", flush=True)
    # uvicorn raises the signal that stopped it again once it is done, under the handlers it found: ignore it
    # here, so that a shutdown by signal returns (exit status 0) instead of dying of the signal afterwards
    main = threading.current_thread() is threading.main_thread()  # only the main thread may set handlers
    caught = {s: signal.signal(s, lambda sig, frame: None) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
    try:
        server.run(sockets=None if sock is None else [sock])
    finally:
        for s, handler in caught.items():
            signal.signal(s, handler)
    log(f"stopped serving {model_name}", flush=True)
