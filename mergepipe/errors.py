"""Exceptions that carry the CLI's exit-code contract."""


class MergepipeError(Exception):
    """Anything that went wrong that is not the user's input (exit code 1)."""

    exit_code = 1


class BadInput(MergepipeError):
    """The user's input is at fault (exit code 2).

    The message must name the file, tensor or key at fault.
    """

    exit_code = 2
