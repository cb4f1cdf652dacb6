"""`ParallelConfig`: tensor parallelism and decode context parallelism, with the vLLM meanings."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """TP devices in all, split into DCP groups of N (TP % N == 0): heads and MLP widths are split over all
    TP devices, KV tokens over the N ranks of a DCP group. The mesh is {'tp': TP // N, 'dcp': N}."""

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
        if self.dcp_comm_backend not in (None, "ag_rs", "a2a"):
            raise ValueError(f"ParallelConfig.dcp_comm_backend must be 'ag_rs' or 'a2a', got {self.dcp_comm_backend!r}")

    @property
    def tp(self) -> int:
        return self.tensor_parallel_size

    @property
    def dcp(self) -> int:
        return self.decode_context_parallel_size

    @property
    def mesh_shape(self) -> dict[str, int]:
        return {"tp": self.tp // self.dcp, "dcp": self.dcp}

    def check_model(self, cfg) -> None:
        """Raise if the model's widths do not divide over the TP devices (names the field and numbers)."""
        tp = self.tp
        widths = {"num_attention_heads": cfg.num_attention_heads, "intermediate_size": cfg.intermediate_size,
                  "moe_intermediate_size": cfg.moe_intermediate_size, "vocab_size": cfg.vocab_size}
        if cfg.n_shared_experts:
            widths["moe_intermediate_size * n_shared_experts"] = cfg.moe_intermediate_size * cfg.n_shared_experts
        for name, v in widths.items():
            if v % tp:
                raise ValueError(f"{name} ({v}) is not divisible by tensor_parallel_size ({tp})")
        if self.dcp > 1:
            raise NotImplementedError(
                f"decode_context_parallel_size={self.dcp}: decode context parallelism is not implemented yet; "
                "use decode_context_parallel_size=1")
