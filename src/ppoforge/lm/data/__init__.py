"""Where the rows come from: prompt sets (a file, a `datasets` name, the built-in demo prompts), reasoning-gym
tasks with their checkers, the one data-file reader (one-line errors naming the file) and the shipped demo
files (demo_prompts.jsonl, demo_pairs.jsonl). Imports nothing else of `lm/`."""
