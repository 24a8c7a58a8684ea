"""ppoforge: PPO that runs — classic control and RLHF for language models, on CPU or CUDA.

The Python API (docs/api.md): the trainers and their configs, imported on first use, so `import ppoforge`
(and the CLI's start-up) loads no torch or transformers.
"""

import importlib

__version__ = "0.2.0"

_LAZY = {"RLHFTrainer": "ppoforge.api", "SFTTrainer": "ppoforge.api", "RewardTrainer": "ppoforge.api",
         "ControlTrainer": "ppoforge.api", "RLHFConfig": "ppoforge.lm.rl.config",
         "GRPOConfig": "ppoforge.lm.rl.trl_configs", "PPOConfig": "ppoforge.lm.rl.trl_configs",
         "SFTConfig": "ppoforge.lm.supervised.config", "RewardConfig": "ppoforge.lm.supervised.config",
         "ControlConfig": "ppoforge.control.config", "UserError": "ppoforge.errors", "Fault": "ppoforge.errors"}
__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'ppoforge' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
