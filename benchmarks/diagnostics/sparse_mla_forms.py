"""Timing-only forms of the Mosaic sparse MLA kernel: each leaves part of the work out (`kernels.sparse_mla.mosaic
.Hooks`) so that the rest can be timed alone. Their results are wrong by design; only the probe times them.

"no_mask": the consumers neither read the slot ids nor mask -1 slots. "gather_only": the consumers only hand each
tile back (the producer alone). The rest are the fp8_ds_mla producer's: "no_convert" stores the loaded e4m3 words
without converting them (and so loads no scales), "no_load" converts and stores words it did not load (it reads
the slot ids, no cache bytes), "compute_only" only hands tiles to the consumers (the consumers alone, on whatever
the tiles hold); "gather_only_no_convert" / "gather_only_no_load" both at once. The "gather_only" forms need
share_p=False (the idle consumers are the plain schedule's).
"""

from __future__ import annotations

from kernels.sparse_mla.mosaic import Hooks

FORMS = {
    "none": Hooks(),
    "no_mask": Hooks(consumers="no_mask"),
    "gather_only": Hooks(consumers="idle"),
    "no_convert": Hooks(fp8_producer="no_convert"),
    "no_load": Hooks(fp8_producer="no_load"),
    "compute_only": Hooks(fp8_producer="idle"),
    "gather_only_no_convert": Hooks(consumers="idle", fp8_producer="no_convert"),
    "gather_only_no_load": Hooks(consumers="idle", fp8_producer="no_load"),
}


def form(name: str) -> Hooks:
    """The hooks of timing-only form `name` (ValueError naming the forms for another name)."""
    if name not in FORMS:
        raise ValueError(f"sparse MLA form {name!r} is not one of {', '.join(map(repr, FORMS))}")
    return FORMS[name]


def fp8_only(hooks: Hooks) -> bool:
    """Whether the form leaves out part of the fp8_ds_mla producer (a bf16 cache refuses it)."""
    return hooks.fp8_producer != "full"
