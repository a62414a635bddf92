"""Errors the engine raises for bad user input.

`ParameterError` is a `ValueError` (library callers catch that) that also names the offending
request parameter, so the server can fill the `param` field of OpenAI's error body.
"""

from __future__ import annotations


class ParameterError(ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
