"""Errors a user can act on: the CLI prints these as one line, without a traceback."""


class RuvLLMError(Exception):
    """Base for every error whose message is meant for the user as it stands."""


class PackageError(RuvLLMError):
    """A model package is missing, corrupt, or was not made by this exporter."""


class UnsupportedModelError(RuvLLMError):
    """The source model's architecture (or a feature of it) is not supported."""


class DeviceError(RuvLLMError):
    """The requested device's execution provider is not available."""


class RequestError(RuvLLMError):
    """A request cannot be served as given (for example, a prompt longer than the context).

    param names the request field at fault, when one is."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextLengthError(RequestError):
    """A prompt longer than the model's context, or than the whole KV cache."""
