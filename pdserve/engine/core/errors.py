"""Request-level errors the engine raises; the HTTP edge maps each to one status code."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """The request itself is wrong (empty prompt, token id outside the vocabulary, ...)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidRequestError):
    """The prompt leaves no room for a generated token within the context length."""
