"""Pure tensor math for PPO: advantages, losses, KL, statistics. No models, no I/O."""
