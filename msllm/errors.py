"""The base of every error a user can fix (bad file, bad key, missing device).

Kept free of heavy imports so the CLI can catch these without loading MindSpore or torch:
each module defines its own subclass next to the code that raises it.
"""


class UserError(Exception):
    """str(e) is one line naming the file / key and what to do; the CLI prints it and exits 2."""


def names_line(names, most: int = 8) -> str:
    """Names (tensors, keys) for a one-line error, sorted and cut after `most`."""
    names = sorted(map(str, names))
    more = f", ... {len(names) - most} more" if len(names) > most else ""
    return f"[{', '.join(names[:most])}{more}]"
