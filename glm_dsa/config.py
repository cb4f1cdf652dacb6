"""GLM-5.x model configuration (docs/math.md §1): a frozen dataclass read from, and written to, HF `config.json`."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

MODEL_TYPE = "glm_moe_dsa"


class ConfigError(ValueError):
    """A config.json field is missing, malformed or unsupported; the message names the field."""


def _token_ids(name: str, value) -> tuple[int, ...]:
    """An HF token-id field (None, an int or a list of ints) as a tuple of non-negative ints."""
    if value is None:
        return ()
    items = (value,) if isinstance(value, int) else value
    if isinstance(value, (str, bytes, float)) or not hasattr(items, "__iter__"):
        raise ConfigError(f"config field '{name}' must be an integer or a list of integers, got {value!r}")
    items = tuple(items)
    for v in items:
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ConfigError(f"config field '{name}' must hold non-negative integer token ids, got {value!r}")
    return items


def indexer_schedule(num_layers: int, freq: int = 1, offset: int = 2) -> tuple[str, ...]:
    """IndexShare schedule: layer i owns an indexer ("full") iff max(i - offset + 1, 0) % freq == 0."""
    freq = max(int(freq), 1)
    return tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers))


@dataclasses.dataclass(frozen=True)
class GlmDsaConfig:
    """Geometry and hyper-parameters of a GLM-5 / GLM-5.2 (`glm_moe_dsa`) model.

    Field names follow HF `config.json`. `indexer_types` and `mlp_layer_types` are always explicit
    per-layer tuples here; `from_dict` derives them from the schedule fields when a config omits them.
    """

    vocab_size: int = 154880
    hidden_size: int = 6144
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 78
    num_attention_heads: int = 64
    q_lora_rank: int = 2048
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 192
    qk_rope_head_dim: int = 64
    v_head_dim: int = 256
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 3
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 2048
    index_topk_freq: int = 1  # IndexShare schedule (docs/math.md §1): used when indexer_types is not given
    index_skip_topk_offset: int = 2
    indexer_types: tuple[str, ...] = ()
    mlp_layer_types: tuple[str, ...] = ()
    rope_theta: float = 1e6
    rope_interleave: bool = True
    indexer_rope_interleave: bool = True
    max_position_embeddings: int = 202752
    rms_norm_eps: float = 1e-5
    num_nextn_predict_layers: int = 1
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: tuple[int, ...] = (154820, 154827, 154829)
    pad_token_id: int | None = 154820

    def __post_init__(self):
        for name in ("num_hidden_layers", "index_topk_freq", "index_skip_topk_offset", "first_k_dense_replace"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ConfigError(f"config field '{name}' must be an integer, got {v!r}")
        if not self.indexer_types:
            object.__setattr__(self, "indexer_types", self.scheduled_indexer_types(self.num_hidden_layers))
        if not self.mlp_layer_types:
            object.__setattr__(self, "mlp_layer_types", self.scheduled_mlp_layer_types(self.num_hidden_layers))
        if isinstance(self.indexer_types, str) or isinstance(self.mlp_layer_types, str):
            raise ConfigError("config fields 'indexer_types' and 'mlp_layer_types' are lists of strings, "
                              f"got {self.indexer_types!r} / {self.mlp_layer_types!r}")
        object.__setattr__(self, "indexer_types", tuple(self.indexer_types))
        object.__setattr__(self, "mlp_layer_types", tuple(self.mlp_layer_types))
        object.__setattr__(self, "eos_token_id", _token_ids("eos_token_id", self.eos_token_id))
        self.validate()

    # ---- layer schedules (one rule for every depth) -----------------------------------------------
    def scheduled_indexer_types(self, num_layers: int) -> tuple[str, ...]:
        """The IndexShare schedule of this config's `index_topk_freq` / `index_skip_topk_offset` at a depth."""
        return indexer_schedule(num_layers, self.index_topk_freq, self.index_skip_topk_offset)

    def scheduled_mlp_layer_types(self, num_layers: int) -> tuple[str, ...]:
        """'dense' for the first `first_k_dense_replace` layers, then 'sparse' (MoE)."""
        n_dense = min(max(self.first_k_dense_replace, 0), num_layers)
        return ("dense",) * n_dense + ("sparse",) * (num_layers - n_dense)

    # ---- derived geometry -------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim ** -0.5

    @property
    def mla_row_dim(self) -> int:
        """Width of one absorbed query / MLA cache row: kv latent + rope key (576 for GLM-5)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_full(self, layer: int) -> bool:
        """Whether `layer` owns an indexer (else it reuses the top-k of the last full layer)."""
        return self.indexer_types[layer] == "full"

    def is_moe(self, layer: int) -> bool:
        return self.mlp_layer_types[layer] == "sparse"

    @property
    def parallel_defaults(self) -> dict:
        """Model defaults for the unset ParallelConfig fields (docs/math.md §7): GLM-5.x replicates queries, uses a2a."""
        return {"dcp_q_replicate": True, "dcp_comm_backend": "a2a"}

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.is_full(i))

    # ---- validation -------------------------------------------------------------------------
    def validate(self) -> None:
        positive = ["vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                    "num_hidden_layers", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
                    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
                    "num_experts_per_tok", "n_group", "topk_group", "index_n_heads", "index_head_dim",
                    "index_topk", "max_position_embeddings"]
        for name in positive:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"config field '{name}' must be a positive integer, got {v!r}")
        if self.n_shared_experts < 0:
            raise ConfigError(f"config field 'n_shared_experts' must be >= 0, got {self.n_shared_experts}")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"config field 'qk_rope_head_dim' must be even for RoPE, got {self.qk_rope_head_dim}")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ConfigError(f"config field 'index_head_dim' ({self.index_head_dim}) must be >= "
                              f"'qk_rope_head_dim' ({self.qk_rope_head_dim}): the indexer ropes its first dims")
        if self.n_routed_experts % self.n_group:
            raise ConfigError(f"config field 'n_routed_experts' ({self.n_routed_experts}) must be divisible by "
                              f"'n_group' ({self.n_group})")
        if self.topk_group > self.n_group:
            raise ConfigError(f"config field 'topk_group' ({self.topk_group}) must be <= 'n_group' ({self.n_group})")
        if self.n_group > 1 and self.n_routed_experts // self.n_group < 2:
            raise ConfigError("config field 'n_group': each expert group needs >= 2 experts (group score = top-2 sum)")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError(f"config field 'num_experts_per_tok' ({self.num_experts_per_tok}) exceeds "
                              f"'n_routed_experts' ({self.n_routed_experts})")
        if self.num_experts_per_tok > self.topk_group * (self.n_routed_experts // self.n_group):
            raise ConfigError("config field 'num_experts_per_tok' exceeds the experts of the 'topk_group' groups")
        for name, allowed in (("indexer_types", ("full", "shared")), ("mlp_layer_types", ("dense", "sparse"))):
            v = getattr(self, name)
            if len(v) != self.num_hidden_layers:
                raise ConfigError(f"config field '{name}' has {len(v)} entries for "
                                  f"num_hidden_layers={self.num_hidden_layers}")
            bad = [x for x in v if x not in allowed]
            if bad:
                raise ConfigError(f"config field '{name}' has unknown entries {sorted(set(bad))}; allowed {allowed}")
        if self.indexer_types[0] != "full":
            raise ConfigError("config field 'indexer_types': layer 0 must be 'full' (a shared layer reuses the "
                              "top-k of an earlier full layer)")
        if not self.rms_norm_eps > 0:
            raise ConfigError(f"config field 'rms_norm_eps' must be > 0, got {self.rms_norm_eps}")
        if not self.rope_theta > 0:
            raise ConfigError(f"config field 'rope_theta' must be > 0, got {self.rope_theta}")

    # ---- HF config.json ---------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any], *, source: str = "config") -> "GlmDsaConfig":
        """Build from an HF config dict; `source` names the file in error messages."""
        mt = d.get("model_type")
        if mt != MODEL_TYPE:
            raise ConfigError(f"{source}: field 'model_type' is {mt!r}; glm-dsa supports only {MODEL_TYPE!r}")
        for name in ("hidden_act",):
            if d.get(name, "silu") != "silu":
                raise ConfigError(f"{source}: field '{name}' is {d[name]!r}; only 'silu' is supported")
        for name in ("attention_bias", "mlp_bias"):
            if d.get(name, False):
                raise ConfigError(f"{source}: field '{name}' is true; GLM-5 has no biases and none are supported")
        if d.get("scoring_func", "sigmoid") != "sigmoid":
            raise ConfigError(f"{source}: field 'scoring_func' is {d['scoring_func']!r}; only 'sigmoid' is supported")
        if d.get("topk_method", "noaux_tc") != "noaux_tc":
            raise ConfigError(f"{source}: field 'topk_method' is {d['topk_method']!r}; only 'noaux_tc' is supported")

        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"{source}: field 'rope_parameters.rope_type' is {rope_type!r}; only 'default' RoPE "
                              "(no YaRN) is supported, as in GLM-5 / GLM-5.2")
        theta = rope.get("rope_theta", d.get("rope_theta", 1e6))

        fields = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in fields}
        kw["rope_theta"] = float(theta)
        if "num_local_experts" in d and "n_routed_experts" not in d:
            kw["n_routed_experts"] = d["num_local_experts"]
        n_layers = kw.get("num_hidden_layers", cls.num_hidden_layers)
        if not isinstance(n_layers, int) or n_layers <= 0:
            raise ConfigError(f"{source}: field 'num_hidden_layers' must be a positive integer, got {n_layers!r}")
        if d.get("indexer_types"):
            kw["indexer_types"] = tuple(d["indexer_types"])
        elif d.get("index_topk_pattern") is not None:
            pat = d["index_topk_pattern"]
            if isinstance(pat, str):
                bad = set(pat) - {"F", "S"}
                if bad:
                    raise ConfigError(f"{source}: field 'index_topk_pattern' has characters {sorted(bad)}; use F/S")
                kw["indexer_types"] = tuple({"F": "full", "S": "shared"}[c] for c in pat)
            else:
                kw["indexer_types"] = tuple(pat)
        else:
            kw.pop("indexer_types", None)  # derived from index_topk_freq / index_skip_topk_offset
        if not d.get("mlp_layer_types"):
            kw.pop("mlp_layer_types", None)
        else:
            kw["mlp_layer_types"] = tuple(d["mlp_layer_types"])
        for name in ("max_position_embeddings", "num_nextn_predict_layers", "index_topk_freq",
                     "index_skip_topk_offset"):
            if name in kw and kw[name] is None:
                kw.pop(name)
        try:
            return cls(**kw)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None
        except TypeError as e:
            raise ConfigError(f"{source}: {e}") from None

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "GlmDsaConfig":
        """Read `config.json` from a checkpoint directory (or the file itself)."""
        path = os.fspath(path)
        file = os.path.join(path, "config.json") if os.path.isdir(path) else path
        if not os.path.exists(file):
            raise FileNotFoundError(f"no config.json at {file}")
        try:
            with open(file) as f:
                d = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{file}: not valid JSON ({e})") from None
        if not isinstance(d, dict):
            raise ConfigError(f"{file}: expected a JSON object")
        return cls.from_dict(d, source=file)

    def to_dict(self) -> dict[str, Any]:
        """HF `config.json` contents for this config (round-trips through `from_dict`)."""
        d: dict[str, Any] = {"model_type": MODEL_TYPE, "architectures": ["GlmMoeDsaForCausalLM"]}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            d[f.name] = list(v) if isinstance(v, tuple) else v
        d.pop("rope_theta")
        d["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta}
        d["num_key_value_heads"] = self.num_attention_heads
        d["hidden_act"] = "silu"
        d["head_dim"] = self.qk_rope_head_dim
        d["eos_token_id"] = list(self.eos_token_id)
        return d

    def save_pretrained(self, path: str | os.PathLike) -> None:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(self.to_dict(), f, indent=2)

    def replace(self, **kw) -> "GlmDsaConfig":
        """A copy with fields changed. When the depth changes, each per-layer tuple not given in `kw` follows the
        one rule of `with_depth`: a tuple that is this config's schedule is re-derived from the schedule fields
        (the new ones, if `kw` changes them), an explicit pattern keeps its first layers (a deeper model than
        an explicit pattern covers is a ConfigError: give the pattern)."""
        n = kw.get("num_hidden_layers", self.num_hidden_layers)
        if n != self.num_hidden_layers:
            if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
                raise ConfigError(f"config field 'num_hidden_layers' must be a positive integer, got {n!r}")
            for name, scheduled in (("indexer_types", self.scheduled_indexer_types),
                                    ("mlp_layer_types", self.scheduled_mlp_layer_types)):
                if name in kw:
                    continue
                current = getattr(self, name)
                if current == scheduled(self.num_hidden_layers):
                    kw[name] = ()  # re-derived by __post_init__ from the (new) schedule fields
                elif n <= len(current):
                    kw[name] = current[:n]
                else:
                    raise ConfigError(f"config field '{name}' is an explicit {len(current)}-layer pattern "
                                      f"{list(current)}; give '{name}' for num_hidden_layers={n}")
        return dataclasses.replace(self, **kw)

    def with_depth(self, num_layers: int) -> "GlmDsaConfig":
        """This model at `num_layers` layers (benchmarks, tests, `random-checkpoint --num-layers`): the same
        schedules cut or extended (see `replace`)."""
        return self.replace(num_hidden_layers=num_layers)
