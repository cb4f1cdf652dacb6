"""A batch-invariant decode step compared as a program across its row buckets.

Batch-invariant mode pads a decode step to the power-of-two bucket of its rows (`kernels.registry.decode_buckets`),
and a row must come out bitwise the same at every bucket. Shapes do not move numbers on a CPU, so what can be
checked here is that the program a GPU would compile computes a row alike at each bucket: `trace_decode_step`
traces the serving step (`glm_dsa.serving.runner.serving_step`: block-table changes, the model step, sampling) of a
decode step of T rows for a GPU, abstractly (`jax.make_jaxpr` while `kernels.registry.deciding_for("gpu")`: the
rules decide as on a GPU and the Pallas kernels' bodies are traced, nothing is lowered or run), and
`differences(a, b)` lists what parts two buckets' programs:

- the rules' decisions (`registry.record`) and the kernels' launch configs (`registry.record_launches`);
- the kernels (pallas_call, and the `mpmd_map` of a Mosaic GPU `pl.kernel`), in order: each one's compiler params
  (warps, stages, threads) as they are, and its block mappings, outputs and traced body, where a whole array's
  shape in global memory is no part of the code and any other number may differ only in proportion to the rows
  (a row mask's bound `rows < T`, a count of row groups); the grid (how many programs) may differ. Anything else,
  such as a masked body at one bucket and a plain one at the other (different code, which need not round a row
  alike), is a difference. A tile shape chosen in proportion to the rows would pass this text comparison; the
  launch configs are compared exactly above;
- the XLA program around the kernels: the same primitives in the same order, among them the same number of
  optimisation barriers (`glm_dsa.model.linear.at_decode_rows` puts its products between two);
- every floating-point reduction outside the kernels whose shape follows the bucket and whose result can depend
  on its order: a dot_general (cuBLAS picks tiles and split-K by M), a sum or product over an axis that follows the
  bucket, and also one over a row's own axes (an RMSNorm's sum over the hidden width). The last were allowed here
  at first, on the reasoning that XLA's reduction emitter schedules a row by the reduced width alone; on an H100 a
  row's RMSNorm at the 64-row bucket parted from the same row at 8-32 rows (BENCHMARKS.md, batch-invariant mode's
  cost), and the model now runs them at the decode rows too (`glm_dsa.model.layers._row_norm`). Exact ones (max,
  min, argmax, argmin: one result in any order) are allowed; `row_reductions` lists the per-row ones there are.
What a trace cannot see (XLA's own fusion and algorithm choices when it compiles the program) is what
tests/serving/test_gpu_batch_invariance.py checks on a GPU.

tests/model/test_invariant_buckets.py runs `differences` on neighbouring buckets;
benchmarks/diagnostics/invariant_xla_audit.py prints it for any two.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import re

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core

from kernels import registry

#: primitives whose jaxpr parameter is a kernel body (a Pallas Triton / Mosaic call, the per-core body of a Mosaic
#: GPU `pl.kernel`)
KERNEL_PRIMITIVES = ("pallas_call", "mpmd_map")

#: floating-point reductions whose order XLA chooses (by the whole shape for a product; by the reduced axes for the
#: others); max and min included, though exact, so that a reduction across rows is always named
REDUCTIONS = ("dot_general", "reduce_sum", "reduce_prod", "reduce_max", "reduce_min", "cumsum", "cumprod",
              "cumlogsumexp", "cummax", "cummin", "argmax", "argmin")
#: the REDUCTIONS whose result does not depend on the order of their operands (floating-point max and min are
#: exact): allowed over a row's own axes at the bucket's rows
EXACT_REDUCTIONS = ("reduce_max", "reduce_min", "cummax", "cummin", "argmax", "argmin")

# kernel parameters left out of the comparison: a cost hint for XLA's scheduler (it counts the flops of T rows),
# metadata for profiles
_IGNORED_KERNEL_PARAMS = ("cost_estimate", "metadata")


@dataclasses.dataclass(eq=False)
class StepProgram:
    """A traced serving step of `rows` rows: its jaxpr, the rules' decisions [(rule, choice, step kind)] and the
    launch configs [(kernel, config)], in trace order."""
    rows: int
    jaxpr: jex_core.ClosedJaxpr
    decisions: list
    launches: list

    @functools.cached_property
    def parts(self) -> tuple[list, list]:
        """(the XLA program's equations, the kernel calls), each in trace order (`_split`)."""
        xla, kernels = [], []
        _split(self.jaxpr.jaxpr, xla, kernels)
        return xla, kernels


def trace_decode_step(config, rows: int, *, requests: int = 8, context: int = 2048, block_size: int = 64,
                      prompt_rows: int | None = None, decode_rows: int | None = None, quantization="fp8",
                      kv_cache_dtype: str = "fp8_ds_mla", dtype="bfloat16", batch_invariant: bool = True,
                      trim: bool = True, platform: str = "gpu") -> StepProgram:
    """The serving step (`serving_step`, greedy) of a decode step padded to `rows` rows, traced for `platform` with
    impl "auto", in batch-invariant mode of (`prompt_rows`, `decode_rows`) (default the engine's,
    `runner.check_invariant_rows`) unless `batch_invariant` is False; `requests` block-table rows of `context`
    tokens' pages each, as the runner sets them (its n_out and max_num_seqs). `trim`: one layer of each kind
    (`kernel_table.trimmed`)."""
    from glm_dsa.model.kernel_table import abstract_step_inputs, trimmed
    from glm_dsa.model.step import resolve_parallel
    from glm_dsa.serving.runner import serving_step, check_invariant_rows, step_options

    cfg = trimmed(config) if trim else config
    parallel = resolve_parallel(None, cfg)
    invariant_rows = None
    if batch_invariant:
        given = None if prompt_rows is None and decode_rows is None else (
            registry.INVARIANT_PROMPT_ROWS if prompt_rows is None else prompt_rows,
            registry.INVARIANT_STEP_ROWS if decode_rows is None else decode_rows)
        invariant_rows = check_invariant_rows(given, True)
    options = step_options("auto", invariant_rows)
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    with registry.deciding_for(platform), registry.record() as log, registry.record_launches() as launches:
        params, caches, batch = abstract_step_inputs(cfg, parallel, rows=rows, requests=requests, context=context,
                                                     block_size=block_size, kv_cache_dtype=kv_cache_dtype,
                                                     dtype=dtype, quantization=quantization)
        pages = batch.block_tables.shape[1]
        # tables [S + 1, pages], rows [4, T], plan_rows [R], table_updates [3, T], table_resets [S + 1], samp_u32
        # [5, R], samp_f32 [2, R], prev_ids [n_out], with S = R = n_out = requests
        args = (params, caches, i32((requests + 1, pages)), i32((4, rows)), i32((requests,)), i32((3, rows)),
                i32((requests + 1,)), jax.ShapeDtypeStruct((5, requests), jnp.uint32),
                jax.ShapeDtypeStruct((2, requests), jnp.float32), i32((requests,)))
        fn = functools.partial(serving_step, config=cfg, parallel=parallel, options=options, n_out=requests,
                               block_size=block_size, width=pages, greedy=True)
        jaxpr = jax.make_jaxpr(fn)(*args)
    return StepProgram(rows, jaxpr, [(d.rule, d.choice, d.step_kind) for d in log],
                       [(name, repr(cfg_)) for name, cfg_ in launches])


def _inner_jaxprs(eqn):
    """The jaxprs an equation holds in its parameters (a jit's, a cond's branches, a scan's body, ...)."""
    for value in eqn.params.values():
        for sub in value if isinstance(value, (tuple, list)) else (value,):
            inner = getattr(sub, "jaxpr", sub)
            if isinstance(inner, jex_core.Jaxpr):
                yield inner


def _split(jaxpr, xla: list, kernels: list) -> None:
    """The equations of `jaxpr` and its inner jaxprs in trace order: kernel calls into `kernels` (their bodies not
    entered), every other equation into `xla`."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in KERNEL_PRIMITIVES:
            kernels.append(eqn)
            continue
        xla.append(eqn)
        for inner in _inner_jaxprs(eqn):
            _split(inner, xla, kernels)


def _where(eqn) -> str:
    """file:line (function) of the model or kernel code that traced `eqn`."""
    from jax._src import source_info_util
    frame = source_info_util.user_frame(eqn.source_info.traceback)
    if frame is None:
        return "?"
    return f"{frame.file_name.rsplit('/', 2)[-1]}:{frame.start_line} ({frame.function_name})"


def _text(value, skip=()) -> str:
    """A kernel parameter as text for comparison: dataclasses field by field (less the field names in `skip`),
    jaxprs pretty-printed, callables by name (no addresses)."""
    if isinstance(value, (jex_core.Jaxpr, jex_core.ClosedJaxpr)):
        return str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        leave = (*skip, "block_shape") if hasattr(value, "transformed_block_aval") and _whole_block(value) else skip
        fields = ", ".join(f"{f.name}={_text(getattr(value, f.name), skip)}" for f in dataclasses.fields(value)
                           if f.name not in leave)
        return f"{type(value).__name__}({fields})"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_text(v, skip) for v in value) + ")"
    if isinstance(value, dict) or hasattr(value, "items") and not isinstance(value, enum.Enum):
        return "{" + ", ".join(f"{k}: {_text(v, skip)}" for k, v in sorted(value.items(), key=str)) + "}"
    if callable(value) and not isinstance(value, enum.Enum):
        return getattr(value, "__qualname__", type(value).__name__)
    return re.sub(r" at 0x[0-9a-f]+", "", repr(value))


def kernel_name(eqn) -> str:
    """A kernel call's name (pallas_call's `name`; a Mosaic GPU `pl.kernel`'s, often 'anonymous')."""
    return f"{eqn.primitive.name}:{eqn.params.get('name')}"


#: a whole array's shape in a kernel's text (a ref in global memory, an operand's or output's aval): how many rows
#: an operand has is no part of the kernel's code (its tiles and loop bounds are, compared as they are)
_WHOLE_ARRAY = re.compile(r"(Ref<(?:any|gmem)>\{\w+|ShapedArray\(\w+)\[([\d,]*)\]")

# the parameters compared as they are: what the kernel is compiled with (warps, stages, threads, cluster)
_EXACT_PARAMS = ("compiler_params", "name", "input_output_aliases", "interpret", "debug", "meshes",
                 "external_meshes", "mesh")


def _whole_block(mapping) -> bool:
    """A BlockMapping of a whole array left in global memory (`pl.ANY`): its block shape is the array's."""
    return str(getattr(mapping.transformed_block_aval, "memory_space", "")) in ("any", "gmem")


def kernel_texts(eqn) -> tuple[str, str]:
    """A kernel call as text: (the parameters it is compiled with, compared as they are; the rest: block mappings,
    outputs and its body, pretty-printed, where whole arrays' shapes are '_' (`_WHOLE_ARRAY`)). The grid (the
    programs over the rows and columns) and `_IGNORED_KERNEL_PARAMS` are left out."""
    exact, sized = [], []
    for k, v in sorted(eqn.params.items()):
        if k in _IGNORED_KERNEL_PARAMS:
            continue
        text = f"{k}={_text(v, skip=('grid',))}"
        if k in _EXACT_PARAMS:
            exact.append(text)
        else:
            sized.append(_WHOLE_ARRAY.sub(lambda m: m[1] + "[" + re.sub(r"\d+", "_", m[2]) + "]", text))
    # one space for any whitespace: the printer breaks its lines by width, which the shapes' digits change
    return re.sub(r"\s+", " ", "\n".join(exact)), re.sub(r"\s+", " ", "\n".join(sized))


def _row_counts_only(text_a: str, text_b: str, a: int, b: int) -> str | None:
    """None when `text_a` and `text_b` differ only in numbers that follow the rows, x in one and y in the other
    with x / a == y / b (the buckets' rows, or a count of rows per program or of row groups); else the first
    difference, with some context."""
    ta, tb = re.split(r"(\d+)", text_a), re.split(r"(\d+)", text_b)
    pos = 0
    for i, (x, y) in enumerate(zip(ta, tb)):
        if x != y and not (i % 2 and int(x) * b == int(y) * a):
            around = slice(max(0, pos - 160), pos + 80)
            return f"at {pos}: ...{text_a[around]!r}... against ...{text_b[around]!r}..."
        pos += len(x)
    if len(ta) != len(tb):
        return f"one is longer, from {pos}"
    return None


def barriers(program: StepProgram) -> int:
    """How many optimisation barriers the XLA program holds."""
    return sum(eqn.primitive.name == "optimization_barrier" for eqn in program.parts[0])


def _reductions(program: StepProgram) -> list:
    """The floating-point `REDUCTIONS` of the XLA program (outside the kernels), in order: (eqn, reduced axes of
    the first operand, or None for a dot_general)."""
    out = []
    for eqn in program.parts[0]:
        name = eqn.primitive.name
        if name not in REDUCTIONS or not eqn.invars:
            continue
        if not jnp.issubdtype(eqn.invars[0].aval.dtype, jnp.floating):
            continue
        if name == "dot_general":
            axes = None
        elif "axes" in eqn.params:
            axes = tuple(eqn.params["axes"])
        else:
            axes = (eqn.params["axis"],)
        out.append((eqn, axes))
    return out


def _bucket_reductions(a: StepProgram, b: StepProgram) -> tuple[list[str], list[str], list[str]]:
    """(the reductions whose order can follow the bucket, the order-dependent per-row reductions whose shape does,
    the exact per-row ones whose shape does: `EXACT_REDUCTIONS`), each as a line 'primitive shapes at a -> at b,
    where'. Assumes the two XLA programs have the same primitives in order."""
    crossing, per_row, exact = [], [], []
    for (ea, axes), (eb, _) in zip(_reductions(a), _reductions(b)):
        sa = [tuple(v.aval.shape) for v in ea.invars]
        sb = [tuple(v.aval.shape) for v in eb.invars]
        if sa == sb:  # one shape at both (the products of at_decode_rows' region: the kind's rows)
            continue
        moving = {i for i, (x, y) in enumerate(zip(sa[0], sb[0])) if x != y} if len(sa[0]) == len(sb[0]) else {-1}
        line = f"{ea.primitive.name} {sa} at {a.rows} -> {sb} at {b.rows}, {_where(ea)}"
        if axes is None or moving & set(axes) or -1 in moving:
            crossing.append(line)
        else:
            (exact if ea.primitive.name in EXACT_REDUCTIONS else per_row).append(line)
    return crossing, per_row, exact


def row_reductions(a: StepProgram, b: StepProgram) -> list[str]:
    """The floating-point reductions outside the kernels over a row's own axes whose shape follows the bucket
    (`differences` allows the exact ones, `EXACT_REDUCTIONS`; see the module doc)."""
    _, per_row, exact = _bucket_reductions(a, b)
    return per_row + exact


def _first_difference(xs: list, ys: list) -> int | None:
    """The first index where `xs` and `ys` differ (one may end first); None when they are equal."""
    if xs == ys:
        return None
    return next(i for i, (x, y) in enumerate(zip(xs + [None], ys + [None])) if x != y)


def _body_primitives(eqn) -> collections.Counter:
    """How many of each primitive a kernel's body holds (its inner jaxprs included)."""
    counts = collections.Counter()
    todo = list(_inner_jaxprs(eqn))
    while todo:
        jaxpr = todo.pop()
        for inner_eqn in jaxpr.eqns:
            counts[inner_eqn.primitive.name] += 1
            todo.extend(_inner_jaxprs(inner_eqn))
    return counts


def _kernel_differences(a: StepProgram, b: StepProgram) -> list[str]:
    """The kernel calls of two buckets that are not one kernel (see the module doc), a line per kernel name: the
    first call's difference, how its body's primitives differ, how many calls of that name differ."""
    ka, kb = a.parts[1], b.parts[1]
    names, names_b = [kernel_name(e) for e in ka], [kernel_name(e) for e in kb]
    i = _first_difference(names, names_b)
    if i is not None:
        return [f"kernels: {len(names)} calls against {len(names_b)}, first difference #{i}: "
                f"{(names + [None])[i]} at {a.rows} against {(names_b + [None])[i]} at {b.rows}"]
    found: dict[str, list] = {}
    for i, (ea, eb) in enumerate(zip(ka, kb)):
        (exact_a, sized_a), (exact_b, sized_b) = kernel_texts(ea), kernel_texts(eb)
        diff = _row_counts_only(sized_a, sized_b, a.rows, b.rows) if exact_a == exact_b else (
            f"compiled with {exact_a!r} against {exact_b!r}")
        if diff is not None:
            found.setdefault(kernel_name(ea), []).append((i, ea, eb, diff))
    out = []
    for name, calls in found.items():
        i, ea, eb, diff = calls[0]
        pa, pb = _body_primitives(ea), _body_primitives(eb)
        counts = ", ".join(f"{p} {pa[p]} -> {pb[p]}" for p in sorted(set(pa) | set(pb)) if pa[p] != pb[p])
        out.append(f"kernel {name} (#{i} of {len(calls)} calls that differ, {_where(ea)}): "
                   f"{'body primitives ' + counts + '; ' if counts else ''}{diff}")
    return out


def differences(a: StepProgram, b: StepProgram) -> list[str]:
    """What parts the programs of two buckets (see the module doc), a line each; [] when a row is computed by one
    program at both."""
    out = []
    for what, xs, ys in (("rule decisions", a.decisions, b.decisions), ("launch configs", a.launches, b.launches)):
        i = _first_difference(xs, ys)
        if i is not None:
            out.append(f"{what}: #{i} {(xs + [None])[i]} at {a.rows} against {(ys + [None])[i]} at {b.rows}")
    out += _kernel_differences(a, b)
    if barriers(a) != barriers(b):
        out.append(f"optimization barriers: {barriers(a)} at {a.rows}, {barriers(b)} at {b.rows}")
    xa, xb = a.parts[0], b.parts[0]
    i = _first_difference([e.primitive.name for e in xa], [e.primitive.name for e in xb])
    if i is not None:
        at = lambda eqns: f"{eqns[i].primitive.name} ({_where(eqns[i])})" if i < len(eqns) else "the end"
        out.append(f"XLA program: {len(xa)} against {len(xb)} equations, first difference #{i}: {at(xa)} at "
                   f"{a.rows} against {at(xb)} at {b.rows}")
    else:
        crossing, per_row, _ = _bucket_reductions(a, b)
        out += [f"reduction over the bucket's rows: {line}" for line in crossing]
        out += [f"order-dependent reduction of a row at the bucket's rows: {line}" for line in per_row]
    return out
