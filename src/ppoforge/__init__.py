"""ppoforge: PPO that runs — classic control and RLHF for language models, on CPU or CUDA."""

__version__ = "0.2.0"
