"""TRL's config names for what `RLHFConfig` already is, so `from ppoforge import GRPOConfig` works as a TRL user
expects: one trainer and one config (`advantage` chooses the estimator), not a class per algorithm. `PPOConfig` is
`RLHFConfig` itself (its defaults follow TRL's PPOConfig); `GRPOConfig(...)` is the `grpo` preset
(configs/rlhf/grpo.yaml) with the fields given on top, an `RLHFConfig`."""

from __future__ import annotations

from ppoforge.lm.rl.config import RLHFConfig

PPOConfig = RLHFConfig


def GRPOConfig(**fields) -> RLHFConfig:  # TRL's name (a class there): the grpo preset, as `--preset grpo`
    """`RLHFConfig.from_preset("grpo", **fields)`: GRPO's settings (8 completions per prompt, group-scaled
    advantages, the k3 KL in the loss, no critic) with `fields` on top, checked as every config is."""
    return RLHFConfig.from_preset("grpo", **fields)
