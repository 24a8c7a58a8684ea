"""Where the rows come from: prompt sets (a file, a `datasets` name, the built-in demo prompts), reasoning-gym
tasks with their checkers, and the one data-file reader (one-line errors naming the file). Imports nothing
else of `lm/`."""
