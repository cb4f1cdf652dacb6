"""One dispatch rule for every op: a registry of implementations per op name.

Each op module registers its impls at import: "xla" (the plain-jnp oracle), "triton" (the Pallas Triton
kernel, compiled natively) and "triton_interpret" (the SAME kernel function run by the Pallas interpreter:
the registry passes `interpret=True`, nothing else differs); an op with a Pallas Mosaic GPU kernel adds
"mosaic" and "mosaic_interpret" the same way. "auto" is every op's per-shape choice (`register_auto`): a
function of the op's arguments naming the impl measured fastest for them (the GPU default). A
kernel impl names its function as "module:function" and is imported on first use, so dispatching to "xla"
never imports Pallas Triton. Each impl may carry a `supports(*args, **kwargs)` check that returns why it
cannot take the given shapes/dtypes (None when it can).

`dispatch(op, impl, *args, **kwargs)` raises ValueError for an unknown impl (naming the op and the available
impls) and for an impl that does not support the inputs (naming the constraint): never a silent fallback.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
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


_CHOOSERS: dict[str, Callable[..., str]] = {}  # op -> the "auto" rule; filled by the op modules at import


def on_gpu() -> bool:
    """Whether jax's default backend is a GPU (where the Pallas kernels run natively)."""
    import jax
    return jax.default_backend() == "gpu"


def register_auto(op: str, choose: Callable[..., str] | None = None) -> None:
    """Register "auto" for `op`: `choose(*args, **kwargs)` returns the impl to run for these arguments.
    The default rule: "triton" on a GPU, "xla" elsewhere."""
    _CHOOSERS[op] = choose or (lambda *a, **k: "triton" if on_gpu() else "xla")
    register(op, "auto", _auto_placeholder)


def _auto_placeholder(*args, **kwargs):  # never called: `resolve` replaces "auto" before a call
    raise AssertionError("the 'auto' impl is resolved by registry.resolve")


def resolve(op: str, impl: str, *args, **kwargs) -> str:
    """`impl`, or for "auto" the impl that op's rule picks for these arguments (which must be registered)."""
    if impl != "auto":
        return impl
    get(op, impl)
    chosen = _CHOOSERS[op](*args, **kwargs)
    if chosen == "auto" or chosen not in impls(op):
        raise AssertionError(f"{op}: the auto rule chose {chosen!r}, which is not a registered impl")
    return chosen


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


def dispatch(op: str, impl: str, *args, **kwargs):
    """Run impl `impl` of `op` on the arguments ("auto": the impl `resolve` picks), after `check`."""
    impl = resolve(op, impl, *args, **kwargs)
    return check(op, impl, *args, **kwargs).function()(*args, **kwargs)
