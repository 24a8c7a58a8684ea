"""The one exception type for bad user input.

Anything a user can get wrong (a config value, a data file, a model path, a reward function's output)
raises `UserError` with a single line naming what is wrong and what is allowed. The CLI turns it into
that line on stderr and exit code 2 — never a traceback.
"""


class UserError(Exception):
    """Bad input from the user; the message is the whole story (one line)."""
