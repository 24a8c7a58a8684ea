"""Supervised training, the stages before RL: SFT and reward models. Rows -> token ids with loss masks,
packing, one shared loop (accumulation, evaluation, exact resume) that an objective plugs into. Uses
`lm/models` and `lm/data`."""
