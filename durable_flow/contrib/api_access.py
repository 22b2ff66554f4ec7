"""Who may call the JSON API, and the JSON answer to every refusal.

Each route of `durable_flow.urls` is an `Endpoint`: a handler per HTTP method behind the same
rules, checked in this order, each refusal a JSON error (never Django's HTML pages, never a 500):

- a method the route does not serve: 405 with `Allow`;
- `Authorization: Bearer <token>`: a personal access token (`AccessToken`) acts as its user;
  unknown, revoked or expired, or its user inactive: 401. A token request carries no cookie, so
  it needs no CSRF token;
- otherwise the session: anonymous 401, and a POST must pass Django's CSRF check (403,
  `CsrfFailed`). The check runs here, the route being `csrf_exempt`, so that its failure is
  JSON without a project-wide `CSRF_FAILURE_VIEW`;
- staff only (403), and the handler checks its model permission (`requires`, 403) the same way
  for a token and a session;
- a body over `MAX_BODY_BYTES` is refused before it is read (413);
- typed errors from the handler: 404 unknown run/workflow/queue, 429 a quota refusal, 400 bad
  input (the `field` named when one is to blame).

Any other path under the API's prefix answers a JSON 404 (`not_found`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from datetime import timedelta
from functools import wraps
from typing import Any

from django.contrib.auth.models import AnonymousUser
from django.core.exceptions import PermissionDenied, RequestDataTooBig
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.middleware.csrf import CsrfViewMiddleware
from django.urls import Resolver404, resolve
from django.utils import timezone

from durable_flow.config.validation import StrictJSONDecoder
from durable_flow.contrib.http import error_response
from durable_flow.exceptions import DurableFlowError
from durable_flow.models.tokens import MAX_TOKEN_LENGTH, AccessToken, token_digest

Handler = Callable[..., HttpResponse]

#: The largest request body the API reads (a run's input is bounded lower, by the models).
MAX_BODY_BYTES = 2_000_000
#: How stale a token's `last_used_at` may be before a request writes it again: one write a
#: minute at most, not one per request.
LAST_USED_PRECISION = timedelta(minutes=1)
#: Methods that change nothing, so a session request needs no CSRF token (RFC 9110's safe methods).
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})


class ApiError(Exception):
    """A refusal with its HTTP status, error name and, for bad input, the field to blame."""

    def __init__(self, status: int, error: str, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.error = error
        self.message = message
        self.field = field


def error_json(status: int, error: str, message: str, **extra: Any) -> JsonResponse:
    """A JSON error: `{"error": <name>, "message": <text>, ...}`."""
    return JsonResponse({"error": error, "message": message, **extra}, status=status)


def api_error_response(exc: ApiError) -> JsonResponse:
    extra = {"field": exc.field} if exc.field is not None else {}
    response = error_json(exc.status, exc.error, exc.message, **extra)
    if exc.status == 401:
        response["WWW-Authenticate"] = 'Bearer realm="durable_flow"'
    return response


def bearer_token(request: HttpRequest) -> str | None:
    """The token of an `Authorization: Bearer <token>` header; None without one (another scheme,
    such as a proxy's Basic authentication, is not the API's and is left alone)."""
    header = request.META.get("HTTP_AUTHORIZATION", "")
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return value.strip()


def token_user(token: str) -> Any:
    """The user a token acts as, noting its use (to the minute); 401 `ApiError` for a token that
    is unknown, revoked, expired or whose user is inactive. One indexed lookup by digest: the
    clear token is never stored or compared."""
    if not token or len(token) > MAX_TOKEN_LENGTH or not token.isascii():
        raise ApiError(401, "InvalidToken", "the bearer token is not a durable_flow access token")
    row = AccessToken.objects.select_related("user").filter(digest=token_digest(token)).first()
    now = timezone.now()
    if row is None or not row.is_usable(now):
        raise ApiError(401, "InvalidToken", "the access token is unknown, revoked or expired")
    if row.last_used_at is None or now - row.last_used_at >= LAST_USED_PRECISION:
        AccessToken.objects.filter(pk=row.pk).update(last_used_at=now)
    return row.user


class JsonCsrfCheck(CsrfViewMiddleware):
    """Django's CSRF check, its failure reason returned (as a string) instead of the project's
    `CSRF_FAILURE_VIEW` page."""

    def _reject(self, request: HttpRequest, reason: str) -> Any:
        return reason


def csrf_failure(request: HttpRequest) -> str | None:
    """Why a session request fails Django's CSRF check, or None when it passes."""
    check = JsonCsrfCheck(lambda request: HttpResponse())
    check.process_request(request)  # reads the CSRF cookie, as the middleware would have
    reason = check.process_view(request, None, (), {})  # type: ignore[arg-type]  # no view to exempt
    return reason if isinstance(reason, str) else None


def authenticate(request: HttpRequest) -> None:
    """Set `request.user` from a bearer token, or check a session request's CSRF token; an
    `ApiError` when neither lets the caller in. Staff only, for a token as for a session."""
    token = bearer_token(request)
    if token is not None:
        request.user = token_user(token)
    else:
        user = getattr(request, "user", None) or AnonymousUser()
        if not user.is_authenticated:
            raise ApiError(401, "NotAuthenticated", "log in, or send Authorization: Bearer <access token>")
        if request.method not in SAFE_METHODS:
            reason = csrf_failure(request)
            if reason is not None:
                raise ApiError(403, "CsrfFailed", f"CSRF check failed: {reason}")
    if not request.user.is_staff:
        raise ApiError(403, "PermissionDenied", "staff only")


def body_too_large(request: HttpRequest) -> bool:
    try:
        length = int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        return False  # Django reads no body then; `json_body` sees what there is
    return length > MAX_BODY_BYTES


class Endpoint:
    """One API route: its handlers by HTTP method, behind the module's rules."""

    #: Read by `CsrfViewMiddleware`: the endpoint checks CSRF itself, answering in JSON.
    csrf_exempt = True

    def __init__(self, handlers: Mapping[str, Handler], *, public: bool = False) -> None:
        self.handlers = {method.upper(): handler for method, handler in handlers.items()}
        #: A public route (the OpenAPI document) lets anyone in; the others need a user.
        self.public = public

    @property
    def methods(self) -> list[str]:
        return sorted(self.handlers)

    def __call__(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        handler = self.handlers.get(request.method or "")
        if handler is None:
            response = error_json(
                405, "MethodNotAllowed", f"{request.method} is not allowed here; use {', '.join(self.methods)}"
            )
            response["Allow"] = ", ".join(self.methods)
            return response
        try:
            if not self.public:
                authenticate(request)
            if body_too_large(request):
                raise ApiError(413, "PayloadTooLarge", f"request body over {MAX_BODY_BYTES} bytes")
            return handler(request, *args, **kwargs)
        except ApiError as exc:
            return api_error_response(exc)
        except DurableFlowError as exc:
            return error_response(exc)
        except RequestDataTooBig:
            return error_json(413, "PayloadTooLarge", "request body over the server's upload limit")
        except PermissionDenied as exc:
            return error_json(403, "PermissionDenied", str(exc) or "permission denied")
        except Http404 as exc:
            return error_json(404, "NotFound", str(exc) or "not found")


def endpoint(*, public: bool = False, **handlers: Handler) -> Endpoint:
    """A route serving `GET=handler`, `POST=handler`, ..."""
    return Endpoint(handlers, public=public)


def not_found(request: HttpRequest, path: str = "") -> HttpResponse:
    """Any other path under the API's prefix: a JSON 404 (not Django's HTML page), naming the
    route with a trailing slash when that is one (an API answers no redirect to it)."""
    message = f"no API route at {request.path!r}"
    try:
        if not request.path_info.endswith("/") and resolve(request.path_info + "/").url_name != "not_found":
            message += f"; did you mean {request.path + '/'!r}?"
    except Resolver404:
        pass
    return error_json(404, "NotFound", message)


def requires(permission: str) -> Callable[[Handler], Handler]:
    """403 (JSON) unless the caller, by session or token, holds `durable_flow.<permission>`."""

    def decorate(view: Handler) -> Handler:
        @wraps(view)
        def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            if not request.user.has_perm(f"durable_flow.{permission}"):
                raise ApiError(403, "PermissionDenied", f"needs the durable_flow.{permission} permission")
            return view(request, *args, **kwargs)

        return wrapper

    return decorate


def json_body(request: HttpRequest) -> dict[str, Any]:
    """The request's JSON object; 413 over `MAX_BODY_BYTES`, 400 (`InvalidInput`) otherwise bad."""
    if len(request.body) > MAX_BODY_BYTES:
        raise ApiError(413, "PayloadTooLarge", f"request body over {MAX_BODY_BYTES} bytes")
    try:
        body = json.loads(request.body or b"{}", cls=StrictJSONDecoder)
    except ValueError as exc:  # not JSON, not UTF-8, an integer too long to convert, or NaN
        raise ApiError(400, "InvalidInput", f"request body is not JSON: {exc}") from None
    except RecursionError:
        raise ApiError(400, "InvalidInput", "request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise ApiError(400, "InvalidInput", "request body must be a JSON object")
    return body
