"""Errors a user can act on. The CLI prints them as one line, never a traceback."""


class PacerError(Exception):
    """A problem with the user's input or environment, stated in one line."""


class ModelLoadError(PacerError):
    """The model path, format, architecture or quantization cannot be served."""


class InvalidRequestError(PacerError):
    """A request that can never be served as given (bad parameters, prompt too long)."""
