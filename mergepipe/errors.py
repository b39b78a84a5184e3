"""Exceptions that carry the CLI's exit-code contract."""


class MergepipeError(Exception):
    """Anything that went wrong that is not the user's input (exit code 1)."""

    exit_code = 1


class DeterminedError(MergepipeError):
    """A failure that running the same merge again would meet again, or that leaves its staged
    bytes untrustworthy (a check of the merge against its plan, a replay that does not reproduce
    its digest). Like bad input, and unlike a crash or an error of storage that outlasted its
    retries, it discards the merge's staging (exit code 1)."""


class BadInput(MergepipeError):
    """The user's input is at fault (exit code 2).

    The message must name the file, tensor or key at fault.
    """

    exit_code = 2
