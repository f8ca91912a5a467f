"""OpenAI-style errors: every failure answers ``{"error": {"message", "type", "param", "code"}}``.

Bad input is always a 4xx: request bodies that fail validation (malformed JSON included)
are 400, as in vLLM and OpenAI, rather than FastAPI's default 422.
"""
from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.engine.exceptions import EngineDeadError
from engine.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

log = logging.getLogger(__name__)

ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "permission_error",
               404: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
               503: "service_unavailable", 500: "internal_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ERROR_TYPES.get(status, "invalid_request_error")

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code))

    def response(self) -> JSONResponse:
        return ErrorJSONResponse(self.body().model_dump(), status_code=self.status)


class ErrorJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: a message quoting what a client sent can then never fail
    to encode (a lone surrogate has no UTF-8 form, yet ``"\\ud800"`` is valid JSON)."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


def body_too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than this server accepts ({limit:,} bytes; "
                         f"serve --max-request-body-mib raises it)", code="body_too_large")


class RefuseLargeBodies:
    """ASGI middleware: a request body over `max_body_size` bytes gets the OpenAI-style 413,
    at once when its Content-Length says so, else as soon as the bytes read pass the limit.
    (FastAPI's own max_body_size answers in plain text.)"""

    def __init__(self, app, max_body_size: int):
        self.app, self.max_body_size = app, max_body_size

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = next((v for k, v in scope["headers"] if k == b"content-length"), b"")
        if length.isdigit() and int(length) > self.max_body_size:
            return await body_too_large(self.max_body_size).response()(scope, receive, send)
        scope[MAX_BODY_SIZE_KEY] = self.max_body_size
        read = 0

        async def counted() -> dict:
            nonlocal read
            message = await receive()
            read += len(message.get("body", b""))
            if read > self.max_body_size:  # an HTTPException passes FastAPI's body reading unchanged
                raise StarletteHTTPException(413)
            return message

        await self.app(scope, counted, send)


def bad_request(e: ValueError) -> APIError:
    """An engine ValueError (SamplingParamsError carries the offending parameter)."""
    return APIError(400, str(e), param=getattr(e, "param", None))


MAX_BODY_SIZE_KEY = "vllm_trace.max_body_size"  # in the ASGI scope, for the 413's message

# Documented on every route so the OpenAPI schema (and schemathesis) know our error shape.
ERROR_RESPONSES = {code: {"model": ErrorResponse} for code in (400, 401, 404)}


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if loc and loc[0] in ("query", "path"):  # where it came from: the parameter is what follows
        loc = loc[1:]
    if first.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}",
                        code="json_invalid")
    where = ".".join(loc) or "body"
    msg = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
                    for e in errors[:5])
    return APIError(400, msg or f"invalid request body at {where}", param=loc[0] if loc else None)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        limit = request.scope.get(MAX_BODY_SIZE_KEY)
        if exc.status_code == 413 and limit is not None:
            return body_too_large(limit).response()
        resp = APIError(exc.status_code, str(exc.detail)).response()
        resp.headers.update(exc.headers or {})
        return resp

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return APIError(500, str(exc), code="engine_dead").response()  # "engine core died: signal 9"

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}").response()
