"""The one place that chooses an impl: a registry of implementations per op, and of the rules that choose.

Each op package registers its impls at import: "xla" (the plain-jnp oracle), "triton" (the Pallas Triton
kernel, compiled natively) and "triton_interpret" (the SAME kernel function run by the Pallas interpreter:
the registry passes `interpret=True`, nothing else differs); an op with a Pallas Mosaic GPU kernel adds
"mosaic" and "mosaic_interpret" the same way. A kernel impl names its function as "module:function" and is
imported on first use, so dispatching to "xla" never imports Pallas. Each impl may carry a
`supports(*args, **kwargs)` check that returns why it cannot take the given shapes/dtypes (None when it can).

Every choice made per shape is a named `Rule` registered here: "<op>.auto" (which impl "auto" runs: the GPU
default) and the forms an impl or the model picks ("moe.fp8_form", "indexer.scores_form", "topk.auto",
"fp8_linear.model_form", "cache_offsets", ...). A rule is a function of the platform and the op's arguments
(shapes and dtypes only), so `deciding_for("gpu")` makes a CPU answer for a GPU, and `record()` collects the
decisions a traced step takes (`glm_dsa.model.kernel_table`, `python -m glm_dsa info --kernels`).

Batch-invariant mode (`batch_invariant()`, set by a step traced with `StepOptions(batch_invariant=True)`): every
rule declares what it chooses there (`register_rule(..., invariant=..., invariant_prompt=...)`), as a function of
the step's kind only, never of how many of its rows are real, how they spread over requests or experts, or where a
row sits. The serving steps of the mode are of two kinds: prompt steps (prompt tokens only) of one fixed shape
(`INVARIANT_PROMPT_ROWS` rows), and decode steps padded to the power-of-two bucket of their rows (`decode_buckets`:
`INVARIANT_MIN_DECODE_ROWS` up to the kind's most rows, `INVARIANT_STEP_ROWS` by default). A token is always
computed in a step of its kind, so a choice may differ between the kinds; within the decode kind every choice and
every launch config must be the same at every bucket, so that a row's arithmetic (its reduction orders) does not
follow the bucket. `batch_invariant(rows=T, prompt_rows=P, decode_rows=D)` names the step kind by its rows: a step
of at least P rows (the engine's prompt-step rows) is a prompt step, fewer a decode step, whose kind has at most D
rows (`invariant_decode_rows`).
- Decode steps take `invariant`: one fixed, per-row schedule tuned for decode-sized steps (a form without
  reductions across rows, a fixed split count), never a function of T, or `ROW_FREE` where the rule's choice never
  depends on the rows or the batch. The rule "launch_rows" fixes the row count every kernel's default launch config
  (tiles, split counts, split-K) is chosen for (`config_rows`: `INVARIANT_CONFIG_ROWS`), whatever the bucket.
  tests/kernels/test_registry.py checks, by tracing a decode step at every bucket for a GPU, that the decisions and
  the launch configs (`launch`, recorded by `record_launches`) are the same at all of them.
- Prompt steps take `invariant_prompt`: `DEFAULT` (the default mode's choice at the same static shapes: the
  prefill forms, for rules whose default choice is batch-independent at a fixed shape; each such rule says why),
  a function of its own, or None (the decode steps' choice, for a rule whose default is not batch-independent
  at a fixed shape). "launch_rows" is `DEFAULT` there: the launch configs are the default mode's for the op's rows.
So in that mode a row's arithmetic depends on its own inputs and its step's kind only, not on how many rows share
its step or where it sits. What the rules cannot fix is XLA's own choice of algorithm by shape (cuBLAS picks split-K
by M, and compiles a row's sum by the rows it reduces): the model computes its XLA products and RMSNorms over a
decode step's rows at the kind's most rows (`glm_dsa.model.linear.at_decode_rows`).

`dispatch(op, impl, *args, **kwargs)` raises ValueError for an unknown impl (naming the op and the available
impls) and for an impl that does not support the inputs (naming the constraint): never a silent fallback.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib
import os
from typing import Callable


@dataclasses.dataclass(frozen=True)
class Impl:
    """One implementation of an op. `target`: the function, or "module:function" imported on first use.
    `supports`: None (takes every input the op takes) or a function (or "module:function") of the op's
    arguments returning None or the reason it cannot take them. `interpret`: None for non-Pallas impls, else
    the `interpret=` value the function is called with."""
    op: str
    name: str
    target: Callable | str
    supports: Callable[..., str | None] | str | None = None
    interpret: bool | None = None

    def function(self) -> Callable:
        """The callable, with `interpret=` bound for Pallas impls."""
        fn = _load(self.target) if isinstance(self.target, str) else self.target
        return fn if self.interpret is None else functools.partial(fn, interpret=self.interpret)


@functools.cache
def _load(target: str) -> Callable:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


_OPS: dict[str, dict[str, Impl]] = {}  # op -> impl name -> Impl; filled by the op modules at import


def register(op: str, name: str, target: Callable | str, *, supports=None, interpret: bool | None = None) -> Impl:
    """Register impl `name` of `op` (see `Impl`). Registering a name twice is an error."""
    impls_of = _OPS.setdefault(op, {})
    if name in impls_of:
        raise ValueError(f"registry: op {op!r} already has an impl {name!r}")
    impl = Impl(op, name, target, supports, interpret)
    impls_of[name] = impl
    return impl


def register_triton(op: str, target: str, *, supports=None) -> None:
    """Register `target` as "triton" (native) and "triton_interpret" (the same function, interpreted)."""
    register(op, "triton", target, supports=supports, interpret=False)
    register(op, "triton_interpret", target, supports=supports, interpret=True)


def register_mosaic(op: str, target: str, *, supports=None) -> None:
    """Register `target` as "mosaic" (native Mosaic GPU) and "mosaic_interpret" (the same function, run by the
    Pallas GPU interpreter)."""
    register(op, "mosaic", target, supports=supports, interpret=False)
    register(op, "mosaic_interpret", target, supports=supports, interpret=True)


#: A rule's `invariant` when its choice never depends on the rows or the batch (by platform, dtypes, cache size).
ROW_FREE = "row_free"

#: A rule's `invariant_prompt` when prompt steps take the default mode's choice at the same static shapes (the
#: prefill forms): for rules whose default choice is a function of static shapes that leaves each row's arithmetic
#: independent of the other rows at a fixed step shape (fixed tiles and split counts, a fixed K order per row).
DEFAULT = "default"

#: The row count the kernels' launch configs are chosen for in the decode steps of batch-invariant mode (see
#: `config_rows`), at every decode bucket: a decode-sized count, so the fixed tiles and split counts suit the few real
#: rows of a decode batch (sparse MLA's splits a row, the indexer's keys a program, the FP8 linears' 64 x 64 tiles and
#: split-K). Prompt steps take the default mode's configs for their ops' rows instead (rule "launch_rows": `DEFAULT`
#: there), as invariant, since each token is computed in one shape (checked on the GPU at both kinds by
#: tests/serving/test_gpu_batch_invariance.py).
INVARIANT_CONFIG_ROWS = 64

#: The most rows of a decode step in batch-invariant mode (the engine's default `invariant_step_rows[1]`; its
#: scheduler puts at most this many rows in one). A decode step of n rows is padded to the power-of-two bucket of n,
#: from `INVARIANT_MIN_DECODE_ROWS` up to these rows (`decode_step_rows`), so a small batch does not pay for 256
#: rows. The bucket must change no row's numbers: every rule's choice and every launch config in a decode step is
#: the kind's, never the bucket's (`config_rows`), and XLA's products over the step's rows run at these rows
#: whatever the bucket (`glm_dsa.model.linear.at_decode_rows`: XLA picks an algorithm, and with it a row's
#: reduction order, by the computation's shape). The serving steps' two kinds (glm_dsa.serving.scheduler): decode
#: steps (decode rows, and the generated tokens of a preempted request when it is recomputed) and prompt steps
#: (prompt tokens only) of `INVARIANT_PROMPT_ROWS`. 256: a decode batch of up to 256 requests is one step.
INVARIANT_STEP_ROWS = 256

#: The smallest decode-step bucket of batch-invariant mode (`decode_buckets`).
INVARIANT_MIN_DECODE_ROWS = 8


def decode_buckets(decode_rows: int | None = None) -> tuple[int, ...]:
    """The row counts a batch-invariant decode step may have: the powers of two from `INVARIANT_MIN_DECODE_ROWS`
    below `decode_rows` (None: `INVARIANT_STEP_ROWS`), then `decode_rows` itself (the kind's most rows, a
    power of two or not)."""
    most = INVARIANT_STEP_ROWS if decode_rows is None else int(decode_rows)
    out, b = [], INVARIANT_MIN_DECODE_ROWS
    while b < most:
        out.append(b)
        b *= 2
    return (*out, most)


def decode_step_rows(n: int, decode_rows: int | None = None) -> int:
    """The padded rows of a batch-invariant decode step of `n` real rows: the smallest of `decode_buckets` that
    holds them (ValueError past the kind's most rows)."""
    for b in decode_buckets(decode_rows):
        if n <= b:
            return b
    raise ValueError(f"a decode step of {n} rows, over the kind's {decode_buckets(decode_rows)[-1]}")


#: The rows of a prompt step in batch-invariant mode (see `INVARIANT_STEP_ROWS`): prefill chunks pad to it, so a
#: long prefill takes as many steps (each reading every weight once) as in the default mode at
#: max_num_batched_tokens = 8192, with the same kernels (the rules' `invariant_prompt` choices). A constant, not
#: the engine's max_num_batched_tokens (which still caps a step's rows): a request's numbers must not follow that
#: setting. Every prompt step has this many rows' activations. Also the default `prompt_rows` of
#: `batch_invariant`: a step of at least this many rows decides as a prompt step.
INVARIANT_PROMPT_ROWS = 8192


@dataclasses.dataclass(frozen=True)
class Rule:
    """One choice the kernels make per shape: which impl "auto" runs (rule "<op>.auto") or which form an impl
    takes ("moe.fp8_form", "topk.auto", ...). `choose(platform, *args, **kwargs)` returns one of `choices` (None:
    any registered impl of `op`); `platform` is "gpu" or another jax backend name, an input of the rule so that
    the table of choices for a GPU can be computed anywhere (`deciding_for`). `invariant`: the choice in the
    decode steps of batch-invariant mode, a function of the same arguments returning a fixed per-row schedule, or
    `ROW_FREE` (the rule's choice never depends on the rows or the batch: `choose` serves both modes and both step
    kinds). `invariant_prompt`: the choice in the mode's prompt steps: `DEFAULT` (`choose`, the default mode's
    choice at the same static shapes), a function, or None (`invariant`, as in decode steps)."""
    name: str
    op: str
    choose: Callable[..., str]
    choices: tuple[str, ...] | None = None
    invariant: Callable[..., str] | str = ROW_FREE
    invariant_prompt: Callable[..., str] | str | None = None

    @property
    def summary(self) -> str:
        """The first line of the rule's docstring."""
        return (self.choose.__doc__ or "").strip().split("\n")[0]

    def chooser(self, kind: str | None) -> Callable[..., str]:
        """The function that decides for a step of `kind`: None (the default mode), "decode" or "prompt" (the
        step kinds of batch-invariant mode)."""
        if kind is None or self.invariant == ROW_FREE:
            return self.choose
        if kind == "prompt" and self.invariant_prompt is not None:
            return self.choose if self.invariant_prompt == DEFAULT else self.invariant_prompt
        return self.invariant


@dataclasses.dataclass(frozen=True)
class Decision:
    """One decision taken while `record` was on: the rule, what it chose, on which platform, and the shapes and
    dtypes of the array arguments it was asked about; `step_kind` the batch-invariant step kind it was taken in
    ("prompt" or "decode"; None in the default mode)."""
    rule: str
    choice: str
    platform: str
    shapes: tuple
    batch_invariant: bool = False
    step_kind: str | None = None


_RULES: dict[str, Rule] = {}  # rule name -> Rule; filled by the op modules at import
_PLATFORM: contextvars.ContextVar[str | None] = contextvars.ContextVar("kernels_platform", default=None)
_RECORD: contextvars.ContextVar[list | None] = contextvars.ContextVar("kernels_record", default=None)
# None: the default mode; "prompt" / "decode": batch-invariant mode, in a step of that kind
_INVARIANT: contextvars.ContextVar[str | None] = contextvars.ContextVar("kernels_batch_invariant", default=None)
# the most rows of a batch-invariant decode step (its kind's; set with _INVARIANT)
_DECODE_ROWS: contextvars.ContextVar[int] = contextvars.ContextVar("kernels_decode_rows", default=INVARIANT_STEP_ROWS)
_LAUNCHES: contextvars.ContextVar[list | None] = contextvars.ContextVar("kernels_launches", default=None)


def step_kind(rows: int | None, prompt_rows: int | None = None) -> str:
    """The batch-invariant step kind of a step of `rows` rows (its static padded row count): "prompt" from
    `prompt_rows` rows (None: `INVARIANT_PROMPT_ROWS`), else "decode"; `rows` None (a kernel run outside a
    step): "decode"."""
    threshold = INVARIANT_PROMPT_ROWS if prompt_rows is None else prompt_rows
    return "prompt" if rows is not None and rows >= threshold else "decode"


@contextlib.contextmanager
def batch_invariant(on: bool = True, *, rows: int | None = None, prompt_rows: int | None = None,
                    decode_rows: int | None = None):
    """Within the block (while a step traces) every rule decides in batch-invariant mode when `on` (see the
    module doc), for a step of `rows` rows (its static padded row count; `step_kind` with `prompt_rows` names its
    kind: None, a decode step); `decode_rows`: the most rows of the mode's decode steps (None:
    `INVARIANT_STEP_ROWS`), what `invariant_decode_rows` says in a decode step. `on=False` leaves the current mode
    as it is."""
    if not on:
        yield
        return
    kind = step_kind(rows, prompt_rows)
    most = INVARIANT_STEP_ROWS if decode_rows is None else int(decode_rows)
    token, token_rows = _INVARIANT.set(kind), _DECODE_ROWS.set(most)
    try:
        yield
    finally:
        _INVARIANT.reset(token)
        _DECODE_ROWS.reset(token_rows)


def invariant_decode_rows() -> int | None:
    """In a batch-invariant decode step, the most rows of its kind (`batch_invariant`'s `decode_rows`), the row
    count every decode bucket computes its XLA products at; None elsewhere (the default mode, prompt steps)."""
    return _DECODE_ROWS.get() if _INVARIANT.get() == "decode" else None


def batch_invariant_mode() -> bool:
    """Whether the rules decide in batch-invariant mode here (inside `batch_invariant()`)."""
    return _INVARIANT.get() is not None


def invariant_step_kind() -> str | None:
    """The step kind the rules decide for in batch-invariant mode ("prompt" or "decode"), None in the default
    mode."""
    return _INVARIANT.get()


def on_gpu() -> bool:
    """Whether jax's default backend is a GPU (where the Pallas kernels run natively)."""
    import jax
    return jax.default_backend() == "gpu"


def _platform() -> str:
    return platform()


def platform() -> str:
    """The platform the rules decide for: the one `deciding_for` set, else "gpu" on a GPU backend, else "cpu"."""
    forced = _PLATFORM.get()
    if forced is not None:
        return forced
    return "gpu" if on_gpu() else "cpu"


@contextlib.contextmanager
def deciding_for(name: str):
    """Within the block every rule decides for platform `name` ("gpu", "cpu"): what "auto" would run there. Used
    to print or test the GPU's dispatch table on a CPU (tracing only: a kernel chosen for the GPU cannot run on
    the CPU)."""
    if name not in ("gpu", "cpu"):
        raise ValueError(f"registry: platform {name!r} must be 'gpu' or 'cpu'")
    token = _PLATFORM.set(name)
    try:
        yield
    finally:
        _PLATFORM.reset(token)


@contextlib.contextmanager
def record():
    """Collect every `decide` taken within the block (also inside traced functions) as a list of `Decision`s."""
    log: list[Decision] = []
    token = _RECORD.set(log)
    try:
        yield log
    finally:
        _RECORD.reset(token)


@contextlib.contextmanager
def record_launches():
    """Collect every kernel launch config chosen within the block (also inside traced functions) as a list of
    (kernel name, config) pairs (`launch`): what a test compares across a decode step's buckets."""
    log: list[tuple[str, object]] = []
    token = _LAUNCHES.set(log)
    try:
        yield log
    finally:
        _LAUNCHES.reset(token)


def launch(kernel: str, config):
    """`config` (a kernel's launch config, as the kernel will run it), recorded under `kernel` when
    `record_launches` is on; returns it."""
    log = _LAUNCHES.get()
    if log is not None:
        log.append((kernel, config))
    return config


def register_rule(name: str, op: str, choose: Callable[..., str], choices: tuple[str, ...] | None = None, *,
                  invariant: Callable[..., str] | str,
                  invariant_prompt: Callable[..., str] | str | None = None) -> Rule:
    """Register rule `name` of `op` (see `Rule`); `invariant` (required: each rule says what batch-invariant mode
    does with it) is its fixed per-row choice in decode steps, or `ROW_FREE`; `invariant_prompt` its choice in
    prompt steps (`DEFAULT`: `choose`; a function; None: `invariant`; nothing for a `ROW_FREE` rule).
    Registering a name twice is an error."""
    if name in _RULES:
        raise ValueError(f"registry: rule {name!r} is already registered")
    if invariant != ROW_FREE and not callable(invariant):
        raise ValueError(f"registry: rule {name!r}: invariant must be a function or ROW_FREE, got {invariant!r}")
    if invariant == ROW_FREE and invariant_prompt is not None:
        raise ValueError(f"registry: rule {name!r}: a ROW_FREE rule decides alike in every step (no invariant_prompt)")
    if invariant_prompt not in (None, DEFAULT) and not callable(invariant_prompt):
        raise ValueError(f"registry: rule {name!r}: invariant_prompt must be a function, DEFAULT or None, got "
                         f"{invariant_prompt!r}")
    rule = Rule(name, op, choose, choices, invariant, invariant_prompt)
    _RULES[name] = rule
    return rule


def rules() -> tuple[Rule, ...]:
    """Every registered rule."""
    return tuple(_RULES.values())


def _shapes(args, kwargs) -> tuple:
    out = []
    for a in (*args, *kwargs.values()):
        if hasattr(a, "shape") and hasattr(a, "dtype"):
            out.append((tuple(a.shape), str(a.dtype)))
    return tuple(out)


def decide(name: str, *args, platform: str | None = None, **kwargs) -> str:
    """What rule `name` chooses for these arguments on `platform` (None: `platform()`; a kernel running natively
    passes "gpu"), recorded when `record` is on."""
    if name not in _RULES:
        raise ValueError(f"registry: unknown rule {name!r} (registered: {', '.join(_RULES)})")
    rule = _RULES[name]
    where = platform or _platform()
    kind = _INVARIANT.get()
    choice = rule.chooser(kind)(where, *args, **kwargs)
    allowed = rule.choices if rule.choices is not None else tuple(i for i in impls(rule.op) if i != "auto")
    if choice not in allowed:
        raise AssertionError(f"{rule.op}: the rule {name!r} chose {choice!r}, which is not one of "
                             f"{', '.join(map(repr, allowed))}")
    log = _RECORD.get()
    if log is not None:
        log.append(Decision(name, choice, where, _shapes(args, kwargs), kind is not None, kind))
    return choice


def triton_on_gpu(platform: str, *args, **kwargs) -> str:
    """The Triton kernel on a GPU, the xla reference elsewhere."""
    del args, kwargs
    return "triton" if platform == "gpu" else "xla"


def register_auto(op: str, choose: Callable[..., str] | None = None, *,
                  invariant: Callable[..., str] | str | None = None,
                  invariant_prompt: Callable[..., str] | str | None = None) -> None:
    """Register "auto" for `op`: the rule "<op>.auto", `choose(platform, *args, **kwargs)` returning the impl to
    run for these arguments (default `triton_on_gpu`); `invariant` and `invariant_prompt` as for `register_rule`
    (a `choose` that reads the rows must give `invariant`)."""
    if invariant is None:
        if choose is not None:
            raise ValueError(f"registry: {op}.auto with its own choose must say what batch-invariant mode runs "
                             "(invariant=a function, or ROW_FREE)")
        invariant = ROW_FREE  # triton_on_gpu: by platform alone
    register_rule(f"{op}.auto", op, choose or triton_on_gpu, invariant=invariant, invariant_prompt=invariant_prompt)
    register(op, "auto", _auto_placeholder)


def _launch_rows(platform: str, t: int) -> str:
    """The kernels' default launch configs are chosen for the op's rows ("rows"; "fixed" in batch-invariant
    decode steps: `INVARIANT_CONFIG_ROWS` at every bucket)."""
    del platform, t
    return "rows"


def _launch_rows_invariant(platform: str, t: int) -> str:
    """Batch-invariant decode steps: every kernel's launch config is chosen for `INVARIANT_CONFIG_ROWS` rows, at
    every decode bucket (never for the bucket's rows: tiles, split counts and split-K set a row's K order). Prompt
    steps (`DEFAULT`): for the op's rows, as in the default mode. Either way a launch config is a function
    of static shapes (the op's rows are the step's padded rows, or a static chunk of them), never of the data: at
    one step shape every kernel runs one schedule (tiles, K steps, split counts), and each kernel computes a row
    from that row alone in a K order the config fixes (the grouped-GEMM tiles' rows, sparse MLA's and the
    indexer's per-row splits, split-K partials summed in split order)."""
    del platform, t
    return "fixed"


register_rule("launch_rows", "launch", _launch_rows, ("rows", "fixed"), invariant=_launch_rows_invariant,
              invariant_prompt=DEFAULT)


def config_rows(t: int) -> int:
    """The row count a kernel's default launch config (tiles, splits, warps) is chosen for: `t`, or
    `INVARIANT_CONFIG_ROWS` in batch-invariant decode steps (rule "launch_rows"), so a row's schedule does not
    change with the batch or the decode bucket (in prompt steps `t`, a static shape too)."""
    return t if decide("launch_rows", t) == "rows" else INVARIANT_CONFIG_ROWS


#: The row classes a kernel switch names (`switched_rows`): "prefill" and "decode" rows, as each rule counts them.
ROW_CLASSES = ("prefill", "decode")


def switched_rows(env: str, default: frozenset, what: str) -> frozenset:
    """The row classes a kernel switch turns on: the environment variable `env` if set ("prefill", "decode",
    "prefill,decode" or "none"; read when a rule decides, i.e. when a step is traced), else `default` (the
    module's frozenset, the in-code switch). ValueError naming `what` and `env` for another name."""
    value = os.environ.get(env)
    if value is None or not value.strip():
        return frozenset(default)
    names = {n.strip() for n in value.split(",") if n.strip()} - {"none"}
    if not names <= set(ROW_CLASSES):
        raise ValueError(f"{what}: {env}={value!r}: name row classes among {', '.join(ROW_CLASSES)} (or 'none')")
    return frozenset(names)


def _auto_placeholder(*args, **kwargs):  # never called: `resolve` replaces "auto" before a call
    raise AssertionError("the 'auto' impl is resolved by registry.resolve")


def resolve(op: str, impl: str, *args, **kwargs) -> str:
    """`impl`, or for "auto" the impl that op's rule picks for these arguments (which must be registered)."""
    if impl != "auto":
        return impl
    get(op, impl)
    return decide(f"{op}.auto", *args, **kwargs)


def ops() -> tuple[str, ...]:
    """Every registered op name."""
    return tuple(_OPS)


def impls(op: str) -> tuple[str, ...]:
    """The impl names registered for `op`."""
    if op not in _OPS:
        raise ValueError(f"registry: unknown op {op!r} (registered: {', '.join(_OPS)})")
    return tuple(_OPS[op])


def get(op: str, impl: str) -> Impl:
    """The `Impl` named `impl` of `op`; ValueError naming the op and the available impls if there is none."""
    available = impls(op)
    if impl not in available:
        raise ValueError(f"{op}: unknown impl {impl!r} (available: {', '.join(repr(a) for a in available)})")
    return _OPS[op][impl]


def check(op: str, impl: str, *args, **kwargs) -> Impl:
    """`get(op, impl)`, then its `supports` check on the arguments: ValueError naming the constraint."""
    entry = get(op, impl)
    if entry.supports is not None:
        supports = _load(entry.supports) if isinstance(entry.supports, str) else entry.supports
        why = supports(*args, **kwargs)
        if why:
            raise ValueError(f"{op}: impl {impl!r} does not support these inputs: {why}")
    return entry


def takes(op: str, impl: str, *args, **kwargs) -> bool:
    """Whether impl `impl` of `op` takes these arguments (`check` passes): what an "auto" rule asks of a kernel
    before it picks it."""
    try:
        check(op, impl, *args, **kwargs)
    except ValueError:
        return False
    return True


def dispatch(op: str, impl: str, *args, **kwargs):
    """Run impl `impl` of `op` on the arguments ("auto": the impl `resolve` picks), after `check`."""
    impl = resolve(op, impl, *args, **kwargs)
    return check(op, impl, *args, **kwargs).function()(*args, **kwargs)
