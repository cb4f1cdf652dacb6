"""An OpenAI-compatible HTTP server over the continuous-batching engine (`python -m glm_dsa serve`).

FastAPI + uvicorn (the optional extra `serve`). Endpoints: `POST /v1/completions` (prompt: text, token ids, or a
list of either; one choice per prompt), `POST /v1/chat/completions` (messages through the tokenizer's chat
template), `stream: true` as server-sent events ending in `data: [DONE]`, `return_token_ids: true` (vLLM's field:
`token_ids` on each choice; always there when the checkpoint has no tokenizer, whose texts are then empty),
`GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus text). Bad requests get 400 (404 for an unknown
model, 401 without the `--api-key` bearer token) with an OpenAI-style body `{"error": {"message", "type",
"param", "code"}}`. A client that disconnects mid-stream aborts its request (its pages are freed); a request
that fails never stops the server.

Sampling follows OpenAI's defaults (temperature 1, top_p 1, max_tokens 16 for completions, up to max_model_len
for chat); `seed` (default: a random one per request), `stop_token_ids` and `ignore_eos` are vLLM's extensions.
"""

# no `from __future__ import annotations`: FastAPI reads the handlers' annotations (fastapi.Request, imported
# inside create_app so that this module imports without the extra) as objects
import contextlib
import json
import math
import secrets
import time
import uuid

from .sampling import SamplingParams
from .streaming import BackgroundLoop

#: the fields of the request bodies this server understands (others are refused with 400, not ignored)
COMPLETION_FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "seed", "stream", "stop_token_ids",
                     "ignore_eos", "return_token_ids", "n", "user", "stream_options", "stop", "logprobs", "echo"}
CHAT_FIELDS = (COMPLETION_FIELDS - {"prompt", "echo"}) | {"messages", "max_completion_tokens"}


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


def create_app(engine, *, model_name: str, tokenizer=None, template: str | None = None, api_key: str | None = None,
               loop=None):
    """The FastAPI app serving `engine` as `model_name`. The engine runs on `loop` (anything with `start()` and
    `stop()`; default a `BackgroundLoop`, across processes a `glm_dsa.serving.lockstep.LeaderLoop`), started with the
    app and stopped with it. `tokenizer`: a `glm_dsa.serving.text.TextTokenizer` or None (token ids only); `template`: a
    Jinja chat template (None: chat completions are refused with 400)."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    loop = BackgroundLoop(engine) if loop is None else loop
    started = time.time()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loop.start()
        try:
            yield
        finally:
            loop.stop()

    app = FastAPI(title="glm-dsa", lifespan=lifespan)

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

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        if api_key is not None and request.url.path.startswith("/v1"):
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                err = APIError(401, "invalid or missing API key (Authorization: Bearer KEY)", code="invalid_api_key")
                return JSONResponse(err.body(), status_code=401)
        return await call_next(request)

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

    async def body_of(request: Request, fields: set) -> dict:
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as e:
            raise _bad(f"the request body is not valid JSON ({e})")
        if not isinstance(body, dict):
            raise _bad("the request body must be a JSON object")
        unknown = sorted(set(body) - fields)
        if unknown:
            raise _bad(f"unsupported field(s): {', '.join(unknown)}", unknown[0])
        model = body.get("model")
        if model is not None and model != model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")
        for name in ("logprobs", "echo"):
            if body.get(name):
                raise _bad(f"{name} is not supported", name)
        if body.get("stop"):
            raise _bad("stop strings are not supported; give stop_token_ids", "stop")
        n = body.get("n", 1)
        if n != 1:
            raise _bad(f"n must be 1, got {n!r} (give several prompts instead)", "n")
        return body

    def params_of(body: dict, default_max: int) -> SamplingParams:
        stop = body.get("stop_token_ids")
        if body.get("ignore_eos"):
            stop = list(stop or [])
        elif stop is not None:
            stop = list(stop) + list(engine.config.eos_token_id)
        max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
        seed = body.get("seed")
        temperature = body.get("temperature", 1.0)
        try:
            if isinstance(temperature, float) and math.isnan(temperature):
                raise ValueError("temperature must be a finite number >= 0, got nan")
            return SamplingParams(temperature=1.0 if temperature is None else temperature,
                                  top_p=1.0 if body.get("top_p") is None else body["top_p"],
                                  seed=secrets.randbits(63) if seed is None else seed,
                                  max_tokens=default_max if max_tokens is None else max_tokens,
                                  stop_token_ids=stop)
        except (TypeError, ValueError) as e:
            raise _bad(str(e), str(e).split(" ", 1)[0])

    def prompts_of(prompt) -> list[list[int]]:
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not isinstance(prompt, list) or not prompt:
            raise _bad("prompt must be a string, a list of token ids, or a non-empty list of either", "prompt")
        out = []
        for i, p in enumerate(prompt):
            if isinstance(p, str):
                if tokenizer is None:
                    raise _bad("this checkpoint has no tokenizer.json: give prompts as token ids", "prompt")
                if not p:
                    raise _bad(f"prompt {i} is empty", "prompt")
                try:
                    p = tokenizer.encode(p)
                except ValueError as e:
                    raise _bad(str(e), "prompt")
            elif not isinstance(p, list):
                raise _bad(f"prompt {i} must be a string or a list of token ids, got {type(p).__name__}", "prompt")
            out.append(p)
        return out

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

    def finish_reason(s) -> str:
        if s.finish_reason == "error":
            raise APIError(500, f"the request failed: {s.error}", "internal_error")
        return s.finish_reason

    async def respond(request: Request, body: dict, prompts, chat: bool):
        default_max = 16 if not chat else engine.max_model_len - max(len(p) for p in prompts)
        params = params_of(body, max(default_max, 0))
        streams = submit_all(prompts, params)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        want_ids = bool(body.get("return_token_ids")) or tokenizer is None
        usage = {"prompt_tokens": sum(map(len, prompts))}
        if body.get("stream"):
            return StreamingResponse(sse(rid, created, streams, chat, want_ids, usage, body),
                                     media_type="text/event-stream")
        try:
            for s in streams:
                async for _ in s:
                    pass
        finally:
            for s in streams:
                if not s.finished:
                    s.abort()
        choices = []
        for i, s in enumerate(streams):
            text = tokenizer.decode(s.output) if tokenizer is not None else ""
            c = {"index": i, "finish_reason": finish_reason(s), "logprobs": None}
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

    async def sse(rid, created, streams, chat, want_ids, usage, body):
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(i, text, ids, reason, role=False):
            if chat:
                delta = {"role": "assistant", "content": text} if role else {"content": text}
                c = {"index": i, "delta": delta, "finish_reason": reason, "logprobs": None}
            else:
                c = {"index": i, "text": text, "finish_reason": reason, "logprobs": None}
            if want_ids:
                c["token_ids"] = ids
            return "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": model_name,
                                          "choices": [c]}) + "\n\n"
        try:
            for i, s in enumerate(streams):  # prompts stream one after another; all of them run concurrently
                detok = _Detokenizer(tokenizer)
                first = True
                async for tok in s:
                    yield chunk(i, detok.add([tok]), [tok], None, role=first)
                    first = False
                try:
                    reason = finish_reason(s)
                except APIError as e:
                    yield "data: " + json.dumps(e.body()) + "\n\n"
                    return
                yield chunk(i, detok.add([], final=True), [], reason, role=first)
            if (body.get("stream_options") or {}).get("include_usage"):
                n = sum(len(s.output) for s in streams)
                yield "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": model_name,
                                              "choices": [], "usage": {**usage, "completion_tokens": n,
                                                                       "total_tokens": usage["prompt_tokens"] + n}}) \
                    + "\n\n"
            yield "data: [DONE]\n\n"
        finally:  # a client gone mid-stream cancels this generator: its requests are aborted, their pages freed
            for s in streams:
                if not s.finished:
                    s.abort()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await body_of(request, COMPLETION_FIELDS)
        if "prompt" not in body:
            raise _bad("prompt is required", "prompt")
        return await respond(request, body, prompts_of(body["prompt"]), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await body_of(request, CHAT_FIELDS)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise _bad("messages must be a non-empty list of {role, content} objects", "messages")
        if tokenizer is None or template is None:
            raise _bad("this checkpoint has no tokenizer chat template: use /v1/completions", "messages")
        text = render_chat(template, messages)
        try:
            ids = tokenizer.encode(text, add_special_tokens=False)
        except ValueError as e:
            raise _bad(str(e), "messages")
        return await respond(request, body, [ids], chat=True)

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


def serve(engine, *, model_name: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          tokenizer=None, template: str | None = None, log=print, loop=None) -> None:
    """Run the server until interrupted (uvicorn on `host`:`port`, idle connections kept KEEP_ALIVE_S seconds);
    `loop`: see `create_app`."""
    try:
        import uvicorn
    except ImportError:
        raise ImportError("serve needs FastAPI and uvicorn: pip install 'glm-dsa[serve]'") from None
    app = create_app(engine, model_name=model_name, tokenizer=tokenizer, template=template, api_key=api_key,
                     loop=loop)
    log(f"serving {model_name} on http://{host}:{port} (OpenAI API at /v1)", flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_keep_alive=KEEP_ALIVE_S)
