"""The request fields of the server's `/v1/completions` and `/v1/chat/completions`: one table, read by both.

Every field a body may carry is a row of `FIELDS`: which endpoints take it, its JSON type, the rule on its
value and its default. `parse_body` checks a decoded body against the table and returns the values with the
defaults filled in; the first field at fault raises `FieldError` naming it (the server answers HTTP 400 with
OpenAI's error body, `param` set to the field). The rules:

- Types are JSON's, strictly: a boolean is not an integer or a number (`"n": true` is refused), a string is
  not a boolean (`"stream": "false"` is refused), a number is not a list (`"stop_token_ids": 5` is refused),
  an integer-valued float is not an integer (`"max_tokens": 8.0` is refused), NaN and infinities are not
  numbers. `null` means "not given": the default applies (`prompt` / `messages` are required).
- A field no row names is refused (400 naming it), not ignored: a client that sends `best_of` or `logit_bias`
  learns that it has no effect here instead of getting output that silently ignores it.
- Ranges: `max_tokens` / `max_completion_tokens` >= 0 (and prompt + max_tokens <= max_model_len, checked by the
  server once the prompt is tokenised: a request that cannot fit is refused with both numbers, as vLLM does);
  `temperature` finite and >= 0; `top_p` in [`sampling.TOP_P_MIN`, 1] (float32's smallest normal number:
  the device flushes smaller values to 0, which keeps no token); `seed` in [0, 2**64); `n` 1;
  `stop_token_ids` a list of ids >= 0; `stream_options` an object `{"include_usage": bool}`, only with
  `"stream": true`.
- Logprobs: completions' `logprobs` is an integer in [0, `sampling.MAX_LOGPROBS`] (the alternatives per token);
  chat's `logprobs` is a boolean and its `top_logprobs` an integer in the same range, allowed only with
  `"logprobs": true` (OpenAI's rule).
- Accepted but unsupported, refused when they ask for something: `stop` (non-empty), `echo` (true), `n` (not 1).

What bounds a request besides its fields (the server's): the body's size (`serve --max-request-bytes`; 413),
its JSON nesting (`MAX_JSON_DEPTH`), the prompt's length (max_model_len).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

from .sampling import MAX_LOGPROBS, TOP_P_MIN

COMPLETIONS, CHAT = "completions", "chat"
BOTH = frozenset({COMPLETIONS, CHAT})

#: the deepest JSON nesting a request body may have. The deepest legitimate body is a chat message's content
#: parts (body > messages > message > content > part > field: 5 levels); a bound far below Python's recursion
#: limit keeps every later walk over the body safe
MAX_JSON_DEPTH = 32


class FieldError(ValueError):
    """A request field is missing, of the wrong type or out of range: `param` names it."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param


def _json_type(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "object" if isinstance(v, dict) else type(v).__name__


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _want(name: str, what: str, v) -> FieldError:
    return FieldError(f"{name} must be {what}, got {_json_type(v)} {v!r}"[:300], name)


# ---- the types: each returns the value (converted where needed) or raises FieldError ----------------------
def integer(name, v):
    """An integer, not a boolean nor an integer-valued float."""
    if not _is_int(v):
        raise _want(name, "an integer", v)
    return v


def number(name, v):
    """A finite number (integer or float), not a boolean; as a float."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _want(name, "a finite number", v)
    return float(v)


def boolean(name, v):
    """true or false, not a string or a number."""
    if not isinstance(v, bool):
        raise _want(name, "a boolean (true or false)", v)
    return v


def string(name, v):
    """A string."""
    if not isinstance(v, str):
        raise _want(name, "a string", v)
    return v


def token_id_list(name, v):
    """A list of integer token ids >= 0."""
    if not isinstance(v, list):
        raise _want(name, "a list of integer token ids", v)
    for j, t in enumerate(v):
        if not _is_int(t):
            raise FieldError(f"{name}[{j}] must be an integer token id, got {_json_type(t)} {t!r}", name)
        if t < 0:
            raise FieldError(f"{name}[{j}] must be a token id >= 0, got {t}", name)
    return v


def stream_options(name, v):
    """An object whose only key is include_usage (a boolean)."""
    if not isinstance(v, dict):
        raise _want(name, 'an object ({"include_usage": true | false})', v)
    unknown = sorted(set(v) - {"include_usage"})
    if unknown:
        raise FieldError(f"{name}: unsupported key(s) {', '.join(map(repr, unknown))} (only include_usage)", name)
    if v.get("include_usage") is not None:
        boolean(f"{name}.include_usage", v["include_usage"])
    return v


def stop_strings(name, v):
    """A string or a list of strings."""
    if isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v)):
        return v
    raise _want(name, "a string or a list of strings", v)


def prompt(name, v):
    """A completions prompt: text, token ids, or a non-empty list of either; returns the list of prompts."""
    if isinstance(v, str) or (isinstance(v, list) and v and _is_int(v[0])):
        v = [v]
    if not isinstance(v, list) or not v:
        raise FieldError(f"{name} must be a string, a list of token ids, or a non-empty list of either, got "
                         f"{_json_type(v)}", name)
    for i, p in enumerate(v):
        if isinstance(p, str) or (isinstance(p, list) and all(_is_int(t) for t in p)):
            if not p:
                raise FieldError(f"prompt {i} is empty", name)
            continue
        if isinstance(p, list):
            j, t = next((j, t) for j, t in enumerate(p) if not _is_int(t))
            raise FieldError(f"prompt {i}, position {j}: token id {t!r} ({_json_type(t)}) is not an integer", name)
        raise FieldError(f"prompt {i} must be a string or a list of token ids, got {_json_type(p)}", name)
    return v


def messages(name, v):
    """A non-empty list of {role: string, content: string | list of parts | null} objects."""
    if not isinstance(v, list) or not v:
        raise FieldError(f"{name} must be a non-empty list of {{role, content}} objects, got {_json_type(v)}", name)
    for i, m in enumerate(v):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise FieldError(f"{name}[{i}] must be a {{role, content}} object with a string role", name)
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise FieldError(f"{name}[{i}].content must be a string, a list of content parts or null, got "
                             f"{_json_type(content)}", name)
    return v


# ---- the ranges ---------------------------------------------------------------------------------------------
def at_least(low):
    """The range check value >= low."""
    def check(name, v):
        if v < low:
            raise FieldError(f"{name} must be >= {low}, got {v}", name)
    return check


def between(low, high, what: str = ""):
    """The range check low <= value <= high (`what` explains the bounds in the message)."""
    def check(name, v):
        if not low <= v <= high:
            raise FieldError(f"{name} must be in [{low:.8g}, {high:.8g}]{what}, got {v!r}", name)
    return check


def equal(want, why: str):
    """The check value == want (`why` says why in the message)."""
    def check(name, v):
        if v != want:
            raise FieldError(f"{name} must be {want}, got {v!r} ({why})", name)
    return check


def unsupported(why: str):
    """Refuses a value that asks for something (truthy: non-empty, non-zero, true)."""
    def check(name, v):
        if v:
            raise FieldError(f"{name} is not supported{why}", name)
    return check


def seed_range(name, v):
    """The seed's range, [0, 2**64): what the sampler's two 32-bit key words hold."""
    if not 0 <= v < 2**64:
        raise FieldError(f"{name} must be an integer in [0, 2**64), got {v}", name)


@dataclasses.dataclass(frozen=True)
class Field:
    """One request field: its type (a function (name, value) -> value raising FieldError), an optional range
    check (name, value) -> None, the default when absent or null (REQUIRED: must be given), and the endpoints
    that take it."""
    type: Callable
    check: Callable | None = None
    default: object = None
    endpoints: frozenset = BOTH


REQUIRED = object()

#: field name -> Field; see the module doc
FIELDS: dict[str, Field] = {
    "model": Field(string),
    "prompt": Field(prompt, default=REQUIRED, endpoints=frozenset({COMPLETIONS})),
    "messages": Field(messages, default=REQUIRED, endpoints=frozenset({CHAT})),
    # None: the server's default (completions: 16, chat: the room the prompt leaves), both capped at that room
    "max_tokens": Field(integer, at_least(0)),
    "max_completion_tokens": Field(integer, at_least(0), endpoints=frozenset({CHAT})),
    "temperature": Field(number, at_least(0), 1.0),
    "top_p": Field(number, between(TOP_P_MIN, 1.0, " (the low end is float32's smallest normal number: the "
                                                   "device flushes smaller values to 0, which keeps no token)"),
                   1.0),
    "seed": Field(integer, seed_range),  # None: a random seed per request
    "stream": Field(boolean, default=False),
    "stream_options": Field(stream_options),
    "stop_token_ids": Field(token_id_list),
    "ignore_eos": Field(boolean, default=False),
    "return_token_ids": Field(boolean, default=False),
    "n": Field(integer, equal(1, "one choice per prompt: give several prompts instead"), 1),
    "user": Field(string),
    "stop": Field(stop_strings, unsupported("; give stop_token_ids")),
    "logprobs": Field(integer, between(0, MAX_LOGPROBS), endpoints=frozenset({COMPLETIONS})),
    "top_logprobs": Field(integer, between(0, MAX_LOGPROBS), endpoints=frozenset({CHAT})),
    "echo": Field(boolean, unsupported(""), False, endpoints=frozenset({COMPLETIONS})),
}
# chat's logprobs is a boolean (OpenAI's chat API): whether to report the sampled tokens' logprobs
CHAT_LOGPROBS = Field(boolean, None, False, endpoints=frozenset({CHAT}))


def fields_of(endpoint: str) -> dict[str, Field]:
    """The table's rows for `endpoint` (COMPLETIONS or CHAT)."""
    rows = {k: f for k, f in FIELDS.items() if endpoint in f.endpoints}
    if endpoint == CHAT:
        rows["logprobs"] = CHAT_LOGPROBS
    return rows


def json_depth(value) -> int:
    """How deeply `value` (decoded JSON) nests lists and objects (a scalar: 0), walked without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, dict):
            v = v.values()
        elif not isinstance(v, list):
            continue
        deepest = max(deepest, d)
        todo.extend((x, d + 1) for x in v if isinstance(x, (list, dict)))
    return deepest


def parse_body(body, endpoint: str) -> dict:
    """`body` (a decoded JSON request) checked against the table for `endpoint`: every field the endpoint takes,
    with its default where absent or null. FieldError names the first field at fault."""
    if not isinstance(body, dict):
        raise FieldError(f"the request body must be a JSON object, got {_json_type(body)}", None)
    rows = fields_of(endpoint)
    unknown = sorted(set(body) - set(rows))
    if unknown:
        raise FieldError(f"unsupported field(s): {', '.join(unknown)}", unknown[0])
    out = {}
    for name, f in rows.items():
        v = body.get(name)
        if v is None:
            if f.default is REQUIRED:
                raise FieldError(f"{name} is required", name)
            out[name] = f.default
            continue
        v = f.type(name, v)
        if f.check is not None:
            f.check(name, v)
        out[name] = v
    if out.get("top_logprobs") is not None and not out["logprobs"]:
        raise FieldError('top_logprobs is only allowed with "logprobs": true', "top_logprobs")
    if out.get("stream_options") is not None and not out["stream"]:
        raise FieldError("stream_options is only allowed with \"stream\": true", "stream_options")
    return out
