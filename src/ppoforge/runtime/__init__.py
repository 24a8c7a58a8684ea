"""What every trainer shares, below the two domains: device and precision, checkpoints (atomic, exact
resume) and the run guard, run dirs and the trust a resume needs, metrics and progress, distributed runs
(torchrun, FSDP2), signals, time limits and OOM retries, the user-code boundary, and malloc tuning."""
