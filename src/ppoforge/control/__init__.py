"""PPO for gymnasium control tasks (discrete and continuous actions)."""
