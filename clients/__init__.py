"""Celeris clients: the Python client library, the CLI views, batch and bench tools, the web page.

Never imports `engine` or `server` and never pulls in torch (see DESIGN.md).
"""

from celeris_client.client import AsyncCelerisClient, CelerisClient
from celeris_client.errors import (CelerisError, DeadlineExceeded, FieldViolation, InvalidArgument, Overloaded,
                            RetryPolicy, Unauthenticated, Unavailable)
from celeris_client.types import (Defaults, Limits, ModelInfo, Result, Snapshot, Token, Tokenization, ToolCall,
                                  Usage)

__all__ = [
    "AsyncCelerisClient", "CelerisClient", "CelerisError", "DeadlineExceeded", "Defaults", "FieldViolation",
    "InvalidArgument", "Limits", "ModelInfo", "Overloaded", "Result", "RetryPolicy", "Snapshot", "Token",
    "Tokenization", "ToolCall", "Unauthenticated", "Unavailable", "Usage",
]
