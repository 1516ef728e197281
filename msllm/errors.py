"""The base of every error a user can fix (bad file, bad key, missing device).

Kept free of heavy imports so the CLI can catch these without loading MindSpore or torch:
each module defines its own subclass next to the code that raises it.
"""


class UserError(Exception):
    """str(e) is one line naming the file / key and what to do; the CLI prints it and exits 2."""
