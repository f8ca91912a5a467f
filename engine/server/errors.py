"""OpenAI-style errors: every failure answers ``{"error": {"message", "type", "param", "code"}}``.

Bad input is always a 4xx: request bodies that fail validation (malformed JSON included)
are 400, as in vLLM and OpenAI, rather than FastAPI's default 422.
"""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.core import EngineDeadError
from engine.server.protocol import ErrorInfo, ErrorResponse

log = logging.getLogger(__name__)

ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "permission_error",
               404: "invalid_request_error", 503: "service_unavailable", 500: "internal_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ERROR_TYPES.get(status, "invalid_request_error")

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code))

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status)


def bad_request(e: ValueError) -> APIError:
    """An engine ValueError (SamplingParamsError carries the offending parameter)."""
    return APIError(400, str(e), param=getattr(e, "param", None))


# Documented on every route so the OpenAPI schema (and schemathesis) know our error shape.
ERROR_RESPONSES = {code: {"model": ErrorResponse} for code in (400, 401, 404)}


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
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
