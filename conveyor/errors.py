"""The ConveyorError family: each class carries its HTTP status and OpenAI error type."""

from __future__ import annotations


class ConveyorError(Exception):
    """Base class; `status` and `error_type` shape the OpenAI-style error body."""

    status: int = 500
    error_type: str = "internal_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code


class InvalidRequest(ConveyorError, ValueError):
    status = 400
    error_type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class Unauthorized(ConveyorError):
    status = 401
    error_type = "authentication_error"
    code = "invalid_api_key"


class ModelNotFound(ConveyorError):
    status = 404
    error_type = "not_found_error"
    code = "model_not_found"


class NotFound(ConveyorError):
    """An id (a file, a batch) that does not exist."""

    status = 404
    error_type = "not_found_error"


class RequestTooLarge(ConveyorError):
    """An HTTP request body over the server's limit."""

    status = 413
    error_type = "invalid_request_error"
    code = "request_too_large"


class RequestTimeout(ConveyorError):
    """A request body that did not arrive within the server's body timeout."""

    status = 408
    error_type = "invalid_request_error"
    code = "request_timeout"


class PromptTooLong(RequestTooLarge):
    """A prompt whose text is over the server's character limit, refused before it is tokenized."""

    code = "prompt_too_long"


class QueueFull(ConveyorError):
    status = 429
    error_type = "rate_limit_error"
    code = "queue_full"


class ServerBusy(ConveyorError):
    """More requests in progress than the server's concurrency cap."""

    status = 503
    error_type = "service_unavailable"
    code = "server_busy"


class StorageFull(ConveyorError):
    """The server could not store what was sent (a full or failing disk under --state-dir).

    507 says why; OpenAI's clients treat it as their 500s (an InternalServerError, retried)."""

    status = 507
    error_type = "server_error"
    code = "insufficient_storage"


class ModelLoadError(ConveyorError):
    """A checkpoint that is missing, corrupt or of an unsupported architecture."""

    error_type = "model_load_error"
