"""Models and decoding: loading tokenizers and models (a path, a hub id or a built-in), the built-in models,
the decoders and the sampler, log-probs, attention masks and padding, the parts the trainers share (value
head, trunks, LoRA) and the three RLHF model layouts. Imports nothing else of `lm/`."""
