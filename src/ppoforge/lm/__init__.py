"""The language-model domain, by concern (imports run down this list, never up, never in a circle;
tests/test_layering.py holds it):

- `data/`        prompt sets, reasoning-gym tasks, the data-file reader and the shipped files
- `models/`      loading, the built-in models, decoding and sampling, log-probs, masks, the shared model
                 parts (LoRA, export, trunks, value head) and the RLHF layouts
- `envs/`        multi-turn environments: the protocol, specs, built-ins, adapters, chat, episodes
- `supervised/`  SFT and reward-model training: rows -> token ids, packing, the shared loop
- `rl/`          RLHF: config, building a run, collectors, estimators, rewards, the PPO trainer
"""
