"""User-facing errors.

Anything a user can get wrong (a file, a key, a value) raises :class:`MoesimError` with a
one-paragraph message that names the file, key or row and says how to fix it. The CLI prints
the message and exits with code 2, without a traceback.
"""

from __future__ import annotations


class MoesimError(Exception):
    """An error caused by user input: bad file, bad key, bad value.

    The message is shown to the user as is, so it must name what is wrong (file, key path,
    row) and the fix or the valid choices.
    """

    exit_code = 2


def did_you_mean(word: str, choices: list[str] | tuple[str, ...]) -> str:
    """Return ``" (did you mean 'x'?)"`` for the closest choice, or an empty string."""
    import difflib

    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""
