"""What can be wrong with a model name; the HTTP edge and the CLI show the message as is."""


class ModelNotFoundError(ValueError):
    """The model name is neither a local directory, a GGUF file nor a hub id that resolves."""
