"""The project's errors and the one place that maps them to HTTP status codes and gRPC status codes.

Every layer raises these; the gateway turns them into OpenAI's error JSON, the gRPC servicers into a
status with the message, and a gRPC error crossing a service boundary back into the same class.

Refusals a client can act on, and how it should act:
- 400 / INVALID_ARGUMENT: the request itself is wrong (a value out of range, a count over a limit); it
  names the parameter. 413 for a body over --max-body-bytes.
- 429 / RESOURCE_EXHAUSTED, with Retry-After: the service works but its waiting queue is full; the same
  request succeeds once load drops (OverloadedError).
- 503 / UNAVAILABLE, with Retry-After: the service cannot serve now at all (no healthy worker, the
  scheduler unreachable, shutting down); retry later or elsewhere (UnavailableError).
- 504 / DEADLINE_EXCEEDED: the request ran past --request-timeout or the gRPC caller's deadline; the
  engine request was aborted (RequestTimeoutError).
"""

from __future__ import annotations

from http import HTTPStatus

import grpc


class PagedServeError(Exception):
    """Base class: a message for the client, and the parameter it is about, when there is one."""

    http_status: HTTPStatus = HTTPStatus.INTERNAL_SERVER_ERROR
    grpc_code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    # OpenAI's error "type" field.
    error_type: str = "internal_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidRequestError(PagedServeError):
    http_status = HTTPStatus.BAD_REQUEST
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    error_type = "invalid_request_error"


class ModelNotFoundError(PagedServeError):
    http_status = HTTPStatus.NOT_FOUND
    grpc_code = grpc.StatusCode.NOT_FOUND
    error_type = "invalid_request_error"

    def __init__(self, model: str):
        super().__init__(f"The model `{model}` does not exist.", param="model", code="model_not_found")


class NotFoundError(PagedServeError):
    """What the request names does not exist (a stored response's id)."""

    http_status = HTTPStatus.NOT_FOUND
    grpc_code = grpc.StatusCode.NOT_FOUND
    error_type = "invalid_request_error"


class AuthenticationError(PagedServeError):
    http_status = HTTPStatus.UNAUTHORIZED
    grpc_code = grpc.StatusCode.UNAUTHENTICATED
    error_type = "authentication_error"


class PayloadTooLargeError(PagedServeError):
    http_status = HTTPStatus.REQUEST_ENTITY_TOO_LARGE
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    error_type = "invalid_request_error"


class OverloadedError(PagedServeError):
    """The waiting queue is full: the client should retry later (429, as OpenAI answers a rate limit)."""

    http_status = HTTPStatus.TOO_MANY_REQUESTS
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    error_type = "server_overloaded"
    # Seconds a client should wait before retrying (HTTP Retry-After).
    retry_after = 1


class UnavailableError(PagedServeError):
    """No worker (or no scheduler) is there to serve the request right now, or it is shutting down."""

    http_status = HTTPStatus.SERVICE_UNAVAILABLE
    grpc_code = grpc.StatusCode.UNAVAILABLE
    error_type = "service_unavailable"
    retry_after = 2


class RequestTimeoutError(PagedServeError):
    """The request ran past its deadline (--request-timeout, or the gRPC caller's own); it was aborted."""

    http_status = HTTPStatus.GATEWAY_TIMEOUT
    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED
    error_type = "timeout"


def retry_after_seconds(error: PagedServeError) -> int | None:
    """The Retry-After (seconds) to send with error, or None when retrying as is cannot help."""
    return getattr(error, "retry_after", None)


_BY_GRPC_CODE: dict[grpc.StatusCode, type[PagedServeError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: OverloadedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: RequestTimeoutError,
}


def openai_error_body(error: PagedServeError) -> dict:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    return {
        "error": {
            "message": error.message,
            "type": error.error_type,
            "param": error.param,
            "code": error.code if error.code is not None else int(error.http_status),
        }
    }


def from_grpc_error(error: grpc.RpcError) -> PagedServeError:
    """The project error for a gRPC error received from another service."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    if code == grpc.StatusCode.NOT_FOUND:
        err = PagedServeError(details or "not found")
        err.http_status, err.grpc_code, err.error_type = HTTPStatus.NOT_FOUND, code, "invalid_request_error"
        return err
    cls = _BY_GRPC_CODE.get(code, PagedServeError)
    return cls(details or code.name.lower())


async def abort_with(context: grpc.aio.ServicerContext, error: PagedServeError) -> None:
    """End a gRPC call with the error's status code and message (raises, as context.abort does)."""
    await context.abort(error.grpc_code, error.message)
