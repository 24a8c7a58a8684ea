"""Device, precision, checkpoints, metrics and signals shared by every trainer."""
