"""glm-dsa: GLM-5.2 inference in JAX with DeepSeek Sparse Attention and decode context parallelism.

    import glm_dsa
    eng = glm_dsa.load("path/to/hf_checkpoint", dtype="bfloat16")
    eng.generate([[1, 2, 3]], max_new_tokens=16)

The functional layer (`step`, `forward`) takes and returns plain pytrees for research code under `jax.jit`.
Subpackages: `glm_dsa.model` (the model as pure functions), `glm_dsa.serving` (the engine and the server),
`glm_dsa.debug` (activation traces and their diff).
"""

import sys

from sharding import ParallelConfig

from .model import presets as configs
from .model.config import ConfigError, GlmDsaConfig
from .model.layers import StepBatch
from .model.options import StepOptions
from .model.random_init import init_params
from .model.step import forward, step
from .serving import sampling, text
from .serving.engine import Completion, Engine, load
from .serving.sampling import SamplingParams

# The paths the README and docs/ name from before the model and serving subpackages: `glm_dsa.configs` (the
# presets, `from glm_dsa.configs import glm52`), `glm_dsa.sampling` and `glm_dsa.text` stay importable as modules.
for _name, _module in (("configs", configs), ("sampling", sampling), ("text", text)):
    sys.modules[f"{__name__}.{_name}"] = _module
del _name, _module

__all__ = ["Completion", "ConfigError", "Engine", "GlmDsaConfig", "ParallelConfig", "SamplingParams", "StepBatch",
           "StepOptions", "configs", "forward", "init_params", "load", "step"]
__version__ = "0.1.0"
