"""Exceptions a user can act on. The CLI prints them as one line (exit code 2), the server maps
them to OpenAI-shaped 4xx errors. Formats raise plain ValueError (the codecs are library code)."""


class RadianceError(Exception):
    """Base of every error whose message is meant for the user."""


class CheckpointError(RadianceError, ValueError):
    """A checkpoint is unreadable or inconsistent; the message names the file and the tensor."""

    def __init__(self, message: str, file: str | None = None, tensor: str | None = None):
        where = ", ".join(p for p in (f"file {file}" if file else "", f"tensor {tensor}" if tensor else "") if p)
        super().__init__(f"{message} ({where})" if where else message)
        self.file = file
        self.tensor = tensor


class ConfigError(RadianceError, ValueError):
    """An option or model configuration is invalid or unsupported."""


class StructuredOutputError(RadianceError, ValueError):
    """A structured-output constraint that cannot be served (it does not compile, would not be enforced, or the
    model has no tokenizer): a 400."""
