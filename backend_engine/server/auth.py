"""Optional bearer key on /v1/*, compared in constant time."""

from __future__ import annotations

import hmac

from starlette.requests import Request

from protocol.errors import unauthorized


def require_api_key(request: Request) -> None:
    expected = request.app.state.server.settings.api_key
    if not expected:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise unauthorized("Missing bearer API key: send 'Authorization: Bearer <key>'.")
    if not hmac.compare_digest(token.strip().encode(), expected.encode()):
        raise unauthorized()
