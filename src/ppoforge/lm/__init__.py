"""PPO RLHF for causal language models: model loading, prompts, rewards, sampling, training."""
