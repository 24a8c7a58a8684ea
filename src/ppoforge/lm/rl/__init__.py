"""RLHF: the config, building a run from it (models, prompts, reward), collecting rollouts (single- and
multi-turn), the estimators (GAE and the critic-free ones), the forward passes over a rollout, rewards,
and the PPO trainer that composes them; the demo. Uses every other `lm/` package; nothing uses it."""
