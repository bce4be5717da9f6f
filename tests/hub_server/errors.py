"""The loopback Hub's error answer: raised anywhere below a request (the store, an endpoint), sent by Request."""

from __future__ import annotations

from typing import Any


class HubError(Exception):
    """An answer other than success: its status, message, the Hub's X-Error-Code, extra headers and a JSON body."""

    def __init__(self, status: int, message: str, error_code: str | None = None, headers: dict | None = None,
                 body: Any = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_code = error_code
        self.headers = headers or {}
        self.body = body
