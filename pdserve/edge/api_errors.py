"""OpenAI's error shape, `{"error": {"message", "type", "param", "code"}}`, for every error the
workers and the router answer: their own, and those the HTTP framework answers by itself (an
unknown path, a wrong method, a body too large, a crash). Torch-free and framework-free: both
apps build their error responses from it.
"""

from __future__ import annotations

import http

# OpenAI's `type` by status; any other 4xx is an invalid request and any 5xx a server error.
_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}
# `code` for the errors the framework answers by itself.
FRAMEWORK_CODES = {
    404: "not_found",
    405: "method_not_allowed",
    413: "body_too_large",
    500: "internal_error",
}
# A path quoted in a message is cut to this many characters.
MAX_QUOTED_PATH = 200


def error_type(status: int) -> str:
    if status in _TYPES:
        return _TYPES[status]
    return "invalid_request_error" if 400 <= status < 500 else "server_error"


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict:
    # NOTE: a message may quote client input; keep it encodable whatever that held.
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


def framework_error_body(
    status: int, detail: str, method: str, path: str, allowed: str | None
) -> dict:
    """The body of an error the framework answered by itself (`allowed`: a 405's Allow)."""
    message = _framework_message(status, detail, method, path, allowed)
    return error_body(status, message, code=FRAMEWORK_CODES.get(status))


def internal_error_body(who: str) -> dict:
    """A bug in `who` (the worker, the router): the traceback goes to its log only."""
    message = f"internal error in the {who}; its log has the traceback"
    return error_body(500, message, code=FRAMEWORK_CODES[500])


def _framework_message(
    status: int, detail: str, method: str, path: str, allowed: str | None
) -> str:
    """The framework's own words ("Not Found", "Method Not Allowed") say neither which path
    nor what to do: say both. A detail of its own (a 413's) is kept."""
    if len(path) > MAX_QUOTED_PATH:
        path = path[:MAX_QUOTED_PATH] + "..."
    if detail != _phrase(status):
        return detail
    if status == 404:
        return f"no such endpoint: {method} {path}"
    if status == 405:
        use = f"; use {allowed}" if allowed else ""
        return f"{method} is not allowed on {path}{use}"
    return detail


def _phrase(status: int) -> str:
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return ""
