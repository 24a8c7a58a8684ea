"""Multi-turn environments: the protocol and its one validation boundary (`protocol.py`, a leaf), specs ->
environments (`loading.py`), the built-ins, the TRL / TextArena adapters, token-in/token-out chat
rendering and the episodes a policy plays (`episodes.py`). Uses `lm/models` (the decoder, the sampler) and
`lm/data` (the spec query parser the built-ins share with `task:` prompts)."""
