"""glm-dsa: GLM-5.2 inference in JAX with DeepSeek Sparse Attention and decode context parallelism.

    import glm_dsa
    eng = glm_dsa.load("path/to/hf_checkpoint", dtype="bfloat16")
    eng.generate([[1, 2, 3]], max_new_tokens=16)

The functional layer (`step`, `forward`) takes and returns plain pytrees for research code under `jax.jit`.
"""

from sharding import ParallelConfig

from . import configs
from .config import ConfigError, GlmDsaConfig
from .engine import Engine, load
from .init import init_params
from .sampling import SamplingParams
from .model import StepBatch
from .options import StepOptions
from .step import forward, step

__all__ = ["ConfigError", "Engine", "GlmDsaConfig", "ParallelConfig", "SamplingParams", "StepBatch", "StepOptions",
           "configs", "forward", "init_params", "load", "step"]
__version__ = "0.1.0"
