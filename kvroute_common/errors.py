"""The one error base of the services: a refusal with the HTTP status the client gets and the message
it reads. The JSON services answer ``{"error": message}``, the OpenAI routes wrap it in OpenAI's
shape (``OpenAIError`` adds the offending ``param``); the cores raise their own subclass so each
layer can tell its refusals apart, and every adapter handles them alike.
"""

from __future__ import annotations


class ServiceError(Exception):
    """A refused operation: ``status`` is the HTTP status, ``message`` what the client is told."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
