"""Optional API key on /v1/*, as `Authorization: Bearer KEY` or `x-api-key: KEY` (Anthropic's
SDK), compared in constant time."""

from __future__ import annotations

import hmac

from starlette.requests import Request

from protocol.errors import unauthorized
from protocol.http import api_key_of


def require_api_key(request: Request) -> None:
    expected = request.app.state.server.settings.api_key
    if not expected:
        return
    token = api_key_of(request.headers)
    if token is None:
        raise unauthorized("Missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'.")
    if not hmac.compare_digest(token.encode(), expected.encode()):
        raise unauthorized()
