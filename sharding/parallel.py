"""`ParallelConfig` (vLLM meanings) and its resolution against a model's defaults and the environment."""

from __future__ import annotations

import dataclasses
import os

from .axes import DCP, TP

QREP_ENV = "GLM_DSA_DCP_Q_REPLICATE"
COMM_BACKENDS = ("ag_rs", "a2a")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """TP devices in all, split into DCP groups of N (TP % N == 0): heads and MLP widths are split over all
    TP devices, KV tokens over the N ranks of a DCP group. The mesh is {'tp': TP // N, 'dcp': N}.

    `dcp_q_replicate` and `dcp_comm_backend` left None take the model's defaults (`resolve`)."""

    tensor_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    dcp_q_replicate: bool | None = None
    dcp_comm_backend: str | None = None
    cp_kv_cache_interleave_size: int = 1

    def __post_init__(self):
        tp, n = self.tensor_parallel_size, self.decode_context_parallel_size
        for name, v in (("tensor_parallel_size", tp), ("decode_context_parallel_size", n),
                        ("cp_kv_cache_interleave_size", self.cp_kv_cache_interleave_size)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"ParallelConfig.{name} must be an integer >= 1, got {v!r}")
        if tp % n:
            raise ValueError(f"ParallelConfig: tensor_parallel_size ({tp}) must be a multiple of "
                             f"decode_context_parallel_size ({n})")
        if self.dcp_comm_backend not in (None,) + COMM_BACKENDS:
            raise ValueError(f"ParallelConfig.dcp_comm_backend must be one of {COMM_BACKENDS}, "
                             f"got {self.dcp_comm_backend!r}")
        if self.dcp_q_replicate not in (None, True, False):
            raise ValueError("ParallelConfig.dcp_q_replicate must be True, False or None, "
                             f"got {self.dcp_q_replicate!r}")

    @property
    def tp(self) -> int:
        return self.tensor_parallel_size

    @property
    def dcp(self) -> int:
        return self.decode_context_parallel_size

    @property
    def interleave(self) -> int:
        return self.cp_kv_cache_interleave_size

    @property
    def mesh_shape(self) -> dict[str, int]:
        return {TP: self.tp // self.dcp, DCP: self.dcp}

    @property
    def q_replicate(self) -> bool:
        """QREP in effect: requested and DCP > 1 (call on a resolved config)."""
        return bool(self.dcp_q_replicate) and self.dcp > 1

    def check_model(self, cfg) -> None:
        """Raise if the model's widths do not divide over the TP devices (names the field and numbers).

        The vocabulary is split as the LM head is stored, padded (`cfg.padded_vocab_size`, docs/math.md §14); heads
        and the MLP / expert widths are not padded and must divide."""
        tp = self.tp
        widths = {"num_attention_heads": cfg.num_attention_heads, "intermediate_size": cfg.intermediate_size,
                  "moe_intermediate_size": cfg.moe_intermediate_size}
        if cfg.n_shared_experts:
            widths["moe_intermediate_size * n_shared_experts"] = cfg.moe_intermediate_size * cfg.n_shared_experts
        for name, v in widths.items():
            if v % tp:
                raise ValueError(f"{name} ({v}) is not divisible by tensor_parallel_size ({tp}): heads and MLP / "
                                 "expert widths are split over the TP devices unpadded")
        padded = getattr(cfg, "padded_vocab_size", cfg.vocab_size)
        if padded % tp:
            raise ValueError(f"vocab_size ({cfg.vocab_size}, LM head padded to {padded} columns) is not divisible by "
                             f"tensor_parallel_size ({tp})")

    def resolve(self, model_defaults: dict | None = None, env: dict | None = None) -> "ParallelConfig":
        """Fill the unset fields: QREP = environment override if set, else the explicit field, else the model
        default; comm backend = the field, else the model default, else 'a2a' (docs/math.md §7). Idempotent while the
        environment is unchanged."""
        defaults = model_defaults or {}
        env = os.environ if env is None else env
        raw = env.get(QREP_ENV, "").strip().lower()
        if raw in ("1", "true", "on", "yes"):
            qrep = True
        elif raw in ("0", "false", "off", "no"):
            qrep = False
        elif raw == "":
            qrep = self.dcp_q_replicate if self.dcp_q_replicate is not None else bool(defaults.get("dcp_q_replicate"))
        else:
            raise ValueError(f"environment variable {QREP_ENV}={env[QREP_ENV]!r}: use 1 or 0")
        backend = self.dcp_comm_backend or defaults.get("dcp_comm_backend") or "a2a"
        return dataclasses.replace(self, dcp_q_replicate=qrep, dcp_comm_backend=backend)
