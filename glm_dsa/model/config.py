"""Model configuration (docs/math.md §1, §13): a frozen dataclass read from, and written to, HF `config.json`, for
GLM-5.x (`glm_moe_dsa`) and DeepSeek-V3.2 (`deepseek_v32`), which share one sparse-attention path."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

from checkpoints.layout import padded_vocab_size
from kernels.common.rope import YarnRope

MODEL_TYPE = "glm_moe_dsa"
DEEPSEEK_V32 = "deepseek_v32"
MODEL_TYPES = (MODEL_TYPE, DEEPSEEK_V32)
ARCHITECTURES = {MODEL_TYPE: "GlmMoeDsaForCausalLM", DEEPSEEK_V32: "DeepseekV32ForCausalLM"}

#: HF `DeepseekV32Config` defaults, used for the fields a `deepseek_v32` config.json leaves out (our dataclass
#: defaults are GLM-5's).
DEEPSEEK_V32_DEFAULTS: dict[str, Any] = dict(
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
    num_attention_heads=128, n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512,
    q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4,
    num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=163840, rms_norm_eps=1e-6, bos_token_id=0,
    eos_token_id=1, pad_token_id=None, tie_word_embeddings=False, index_topk=2048, index_head_dim=128,
    index_n_heads=64, first_k_dense_replace=3, rope_theta=10000.0,
)


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


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction `0.1 mscale ln(factor) + 1` (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """HF `rope_parameters` of `rope_type: yarn` (DeepSeek-V3.2: factor 40 over 4096 original positions).

    Frequencies: `kernels.common.rope.YarnRope`. Attention: the softmax scale is multiplied by
    `yarn_mscale(factor, mscale_all_dim)^2` when `mscale_all_dim` is set; cos / sin would be multiplied by
    `attention_factor` (given, else `yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)` when both
    are set, else `yarn_mscale(factor)`), which must come out as 1 here (DeepSeek-V3.2: mscale = mscale_all_dim)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    @classmethod
    def from_hf(cls, rope: dict, max_position_embeddings: int) -> "YarnScaling":
        """From an HF rope dict (`rope_parameters` / `rope_scaling`); ConfigError naming a bad or missing key."""
        known = {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
                 "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate"}
        unknown = sorted(set(rope) - known)
        if unknown:
            raise ConfigError(f"field 'rope_parameters' has keys {unknown} that YaRN does not take")
        orig = rope.get("original_max_position_embeddings")
        if not isinstance(orig, int) or isinstance(orig, bool) or orig <= 0:
            raise ConfigError("field 'rope_parameters.original_max_position_embeddings' must be a positive integer "
                              f"for YaRN, got {orig!r}")
        factor = rope.get("factor")
        if factor is None:  # as HF: the ratio of the extended to the original context
            factor = max_position_embeddings / orig
        return cls(factor=factor, original_max_position_embeddings=orig,
                   beta_fast=rope.get("beta_fast") or 32.0, beta_slow=rope.get("beta_slow") or 1.0,
                   mscale=rope.get("mscale"), mscale_all_dim=rope.get("mscale_all_dim"),
                   attention_factor=rope.get("attention_factor"), truncate=rope.get("truncate", True))

    def __post_init__(self):
        for name in ("factor", "beta_fast", "beta_slow"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ConfigError(f"field 'rope_parameters.{name}' must be a positive number, got {v!r}")
        for name in ("mscale", "mscale_all_dim", "attention_factor"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise ConfigError(f"field 'rope_parameters.{name}' must be a number, got {v!r}")
        if not isinstance(self.truncate, bool):
            raise ConfigError(f"field 'rope_parameters.truncate' must be true or false, got {self.truncate!r}")
        af = self.cos_sin_factor
        if af != 1.0:
            raise ConfigError(f"field 'rope_parameters': YaRN attention_factor {af:.6g} (from factor {self.factor}, "
                              f"mscale {self.mscale}, mscale_all_dim {self.mscale_all_dim}) scales cos / sin; only 1 "
                              "(mscale = mscale_all_dim, as DeepSeek-V3.2) is supported")

    @property
    def cos_sin_factor(self) -> float:
        """HF's `attention_factor`: what cos and sin are multiplied by."""
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    @property
    def softmax_scale_factor(self) -> float:
        """What the attention softmax scale is multiplied by: `yarn_mscale(factor, mscale_all_dim)^2`, or 1."""
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2 if self.mscale_all_dim else 1.0

    def to_hf(self, theta: float) -> dict[str, Any]:
        d = {"rope_type": "yarn", "rope_theta": theta, "factor": self.factor,
             "original_max_position_embeddings": self.original_max_position_embeddings,
             "beta_fast": self.beta_fast, "beta_slow": self.beta_slow}
        for name in ("mscale", "mscale_all_dim", "attention_factor"):
            if getattr(self, name) is not None:
                d[name] = getattr(self, name)
        if not self.truncate:
            d["truncate"] = False
        return d


@dataclasses.dataclass(frozen=True)
class GlmDsaConfig:
    """Geometry and hyper-parameters of a GLM-5 / GLM-5.2 (`glm_moe_dsa`) or DeepSeek-V3.2 (`deepseek_v32`) model.

    Field names follow HF `config.json`. `indexer_types` and `mlp_layer_types` are always explicit
    per-layer tuples here; `from_dict` derives them from the schedule fields when a config omits them.
    `rope_scaling` is None (plain RoPE) or a `YarnScaling` (an HF YaRN rope dict is accepted and converted).
    DeepSeek-V3.2 differs in data only (docs/math.md §13): an indexer on every layer, the indexer's rope
    half-split (`indexer_rope_interleave=False`), YaRN, and QREP off by default (`parallel_defaults`).
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
    model_type: str = MODEL_TYPE
    rope_scaling: YarnScaling | None = None

    def __post_init__(self):
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", YarnScaling.from_hf(self.rope_scaling,
                                                                         self.max_position_embeddings))
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
        """`qk_head_dim^-0.5`, times YaRN's `mscale^2` correction when the rope is YaRN (docs/math.md §13)."""
        scale = self.qk_head_dim ** -0.5
        return scale * self.rope_scaling.softmax_scale_factor if self.rope_scaling is not None else scale

    @property
    def rope(self) -> float | YarnRope:
        """The rope frequencies as `kernels.common.rope` takes them: the base theta, or a `YarnRope`."""
        y = self.rope_scaling
        if y is None:
            return self.rope_theta
        return YarnRope(theta=float(self.rope_theta), factor=float(y.factor),
                        original_max_position_embeddings=y.original_max_position_embeddings,
                        beta_fast=float(y.beta_fast), beta_slow=float(y.beta_slow), truncate=y.truncate)

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the LM head as stored (`checkpoints.layout.padded_vocab_size`): vocab_size rounded up so that
        the tensor-parallel devices split it evenly; the model returns exactly vocab_size logits (docs/math.md §14)."""
        return padded_vocab_size(self.vocab_size)

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
        """Model defaults for the unset ParallelConfig fields (docs/math.md §7): GLM-5.x replicates queries (QREP),
        DeepSeek-V3.2 does not (its 128 heads make the replicated q_b_proj / kv_b_proj costly); both use a2a."""
        return {"dcp_q_replicate": self.model_type == MODEL_TYPE, "dcp_comm_backend": "a2a"}

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.is_full(i))

    # ---- validation -------------------------------------------------------------------------
    def validate(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise ConfigError(f"config field 'model_type' is {self.model_type!r}; glm-dsa supports {MODEL_TYPES}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, YarnScaling):
            raise ConfigError(f"config field 'rope_scaling' must be None, a YarnScaling or an HF YaRN rope dict, "
                              f"got {self.rope_scaling!r}")
        if self.rope_scaling is not None and self.model_type != DEEPSEEK_V32:
            raise ConfigError(f"config field 'rope_scaling': YaRN is supported for {DEEPSEEK_V32!r} only, not "
                              f"{self.model_type!r} (GLM-5.x uses plain RoPE)")
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
        if self.model_type == DEEPSEEK_V32 and "shared" in self.indexer_types:
            raise ConfigError("config field 'indexer_types': DeepSeek-V3.2 has an indexer on every layer, got "
                              f"{list(self.indexer_types)}")
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
        if mt not in MODEL_TYPES:
            raise ConfigError(f"{source}: field 'model_type' is {mt!r}; glm-dsa supports {MODEL_TYPES}")
        if mt == DEEPSEEK_V32:
            d = {**DEEPSEEK_V32_DEFAULTS, **d}
        for name in ("hidden_act",):
            if d.get(name, "silu") != "silu":
                raise ConfigError(f"{source}: field '{name}' is {d[name]!r}; only 'silu' is supported")
        for name in ("attention_bias", "mlp_bias"):
            if d.get(name, False):
                raise ConfigError(f"{source}: field '{name}' is true; GLM-5 / DeepSeek-V3.2 have no biases and "
                              "none are supported")
        if d.get("scoring_func", "sigmoid") != "sigmoid":
            raise ConfigError(f"{source}: field 'scoring_func' is {d['scoring_func']!r}; only 'sigmoid' is supported")
        if d.get("topk_method", "noaux_tc") != "noaux_tc":
            raise ConfigError(f"{source}: field 'topk_method' is {d['topk_method']!r}; only 'noaux_tc' is supported")

        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise ConfigError(f"{source}: field 'rope_parameters' must be an object, got {rope!r}")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        allowed = ("default", "yarn") if mt == DEEPSEEK_V32 else ("default",)
        if rope_type not in allowed:
            raise ConfigError(f"{source}: field 'rope_parameters.rope_type' is {rope_type!r}; {mt} supports "
                              f"{' and '.join(repr(a) for a in allowed)} RoPE (YaRN: DeepSeek-V3.2 only)")
        theta = rope.get("rope_theta", d.get("rope_theta", 1e6))
        if isinstance(theta, bool) or not isinstance(theta, (int, float)):
            raise ConfigError(f"{source}: field 'rope_theta' must be a number, got {theta!r}")

        fields = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in fields}
        kw["rope_theta"] = float(theta)
        kw["model_type"] = mt
        kw.pop("rope_scaling", None)
        if rope_type == "yarn":
            max_pos = kw.get("max_position_embeddings") or cls.max_position_embeddings
            try:
                kw["rope_scaling"] = YarnScaling.from_hf(rope, max_pos)
            except ConfigError as e:
                raise ConfigError(f"{source}: {e}") from None
        if mt == DEEPSEEK_V32:  # an indexer on every layer; its rope half-split, MLA's interleaved (HF modeling)
            for name in ("indexer_types", "index_topk_pattern", "index_topk_freq", "index_skip_topk_offset"):
                kw.pop(name, None)
            d = {k: v for k, v in d.items() if k not in ("indexer_types", "index_topk_pattern")}
            kw.setdefault("rope_interleave", True)
            kw.setdefault("indexer_rope_interleave", False)
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
        d: dict[str, Any] = {"model_type": self.model_type, "architectures": [ARCHITECTURES[self.model_type]]}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            d[f.name] = list(v) if isinstance(v, tuple) else v
        d.pop("rope_theta")
        d.pop("rope_scaling")
        d["rope_parameters"] = ({"rope_type": "default", "rope_theta": self.rope_theta} if self.rope_scaling is None
                                else self.rope_scaling.to_hf(self.rope_theta))
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
