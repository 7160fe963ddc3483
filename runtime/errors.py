"""The one exception type users see: a clear message, no traceback."""


class SpecDeployError(Exception):
    """A problem the user can fix (bad config, missing file, bad parameter).

    The CLI prints `error: <message>` and exits non-zero; the server answers 4xx.
    """
