"""`StepOptions`: how a step computes (which op implementations, which MoE form, the DCP row chunk), as opposed
to what it computes (the config) and where (the ParallelConfig). Travels on the step context."""

from __future__ import annotations

import dataclasses

from kernels import IMPLS, default_impl, moe


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """impl: the kernels' implementation for every op (one of `kernels.IMPLS`); None: `kernels.default_impl()`,
    resolved here at construction. moe_mode: force one xla form of `kernels.moe` (one of `kernels.moe.MODES`;
    tests, benchmarks); None: the impl's own choice. dcp_row_chunk: query rows per gather/attend/merge round
    under DCP, a fixed workspace however long the prefill. batch_invariant: every kernel rule takes its fixed
    per-row choice for the step's static row count (`kernels.registry.batch_invariant`: forms, impls and launch
    configs chosen from the step's shape, never from its data), so a row's results do not depend on the other rows
    of its batch. invariant_prompt_rows (batch_invariant only): a step of at least this many rows (its static
    padded row count) takes the rules' prompt-step choices (the default mode's prefill forms), a smaller one their
    decode-step choices; None: `kernels.registry.INVARIANT_PROMPT_ROWS` (the serving runner passes its prompt-step
    rows). invariant_decode_rows (batch_invariant only): the most rows of the mode's decode steps (each padded to a
    bucket of at most these rows, `kernels.registry.decode_buckets`): the rows a decode step computes its XLA
    products at (`glm_dsa.model.linear.at_decode_rows`), whatever its bucket; None:
    `kernels.registry.INVARIANT_STEP_ROWS` (the serving runner passes its decode-step rows)."""

    impl: str | None = None
    moe_mode: str | None = None
    dcp_row_chunk: int = 256
    batch_invariant: bool = False
    invariant_prompt_rows: int | None = None
    invariant_decode_rows: int | None = None

    def __post_init__(self):
        if self.impl is None:
            object.__setattr__(self, "impl", default_impl())
        if self.impl not in IMPLS:
            raise ValueError(f"StepOptions.impl must be one of {IMPLS} (or None for the default), got {self.impl!r}")
        if self.moe_mode is not None and self.moe_mode not in moe.MODES:
            raise ValueError(f"StepOptions.moe_mode must be one of {moe.MODES} or None, got {self.moe_mode!r}")
        if not isinstance(self.batch_invariant, bool):
            raise TypeError(f"StepOptions.batch_invariant must be a bool, got {self.batch_invariant!r}")
        for name in ("invariant_prompt_rows", "invariant_decode_rows"):
            rows = getattr(self, name)
            if rows is not None and (not isinstance(rows, int) or isinstance(rows, bool) or rows < 1):
                raise ValueError(f"StepOptions.{name} must be None or an integer >= 1, got {rows!r}")
            if rows is not None and not self.batch_invariant:
                raise ValueError(f"StepOptions.{name}={rows!r} is for batch_invariant=True")
        chunk = self.dcp_row_chunk
        if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
            raise ValueError(f"StepOptions.dcp_row_chunk must be an integer >= 1, got {chunk!r}")


def resolve_options(impl: str | None = None, options: StepOptions | None = None) -> StepOptions:
    """The options of a step called with `impl=` (a shorthand for `StepOptions(impl=impl)`) and/or `options=`.
    Both given with different impls is an error (options.impl is already resolved: StepOptions() means the
    default impl, which an explicit different `impl=` contradicts)."""
    if options is None:
        return StepOptions(impl=impl)
    if not isinstance(options, StepOptions):
        raise TypeError(f"options must be a glm_dsa.StepOptions, got {type(options).__name__}")
    if impl is not None and impl != options.impl:
        raise ValueError(f"impl={impl!r} conflicts with options.impl={options.impl!r}; give the impl in one place "
                         "(StepOptions(impl=...) or impl=)")
    return options
