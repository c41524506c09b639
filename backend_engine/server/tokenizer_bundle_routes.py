"""`GET /tokenizer/bundle`: this replica's tokenizer as a gateway needs it (protocol/
tokenizer_bundle.py), so a gateway in front of kvgate replicas tokenises locally with no
tokenizer folder of its own. The ETag is the content hash; `If-None-Match` answers 304, so a
gateway that already holds the bundle from another replica only confirms the hash."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from backend_engine.server.state import ServerState
from protocol.errors import not_found
from protocol.tokenizer_bundle import BUNDLE_PATH, SPECIAL_TOKENS, TokenizerBundle, content_hash
from routing.hashing import NAMESPACE_RULE

router = APIRouter()


def build_bundle(tokenizer, model: str, block_size: int) -> TokenizerBundle | None:  # noqa: ANN001 - a HF tokenizer
    """The bundle of a fast (Rust `tokenizers`) HF tokenizer; None for any other kind, or a
    template that is not one string (the gateway then asks /tokenize)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    template = tokenizer.chat_template
    if backend is None or not isinstance(template, (str, type(None))):
        return None
    special = {name: None if getattr(tokenizer, name, None) is None else str(getattr(tokenizer, name))
               for name in SPECIAL_TOKENS}
    return TokenizerBundle(model, backend.to_str(), template, block_size, NAMESPACE_RULE, special)


@router.get(BUNDLE_PATH)
async def tokenizer_bundle(request: Request) -> Response:
    state: ServerState = request.app.state.server
    engine = state.ready_engine()
    cached = getattr(request.app.state, "tokenizer_bundle", None)
    if cached is None:
        bundle = build_bundle(engine.tokenizer, engine.model_id, engine.block_size)
        payload = bundle.encode() if bundle is not None else b""
        cached = request.app.state.tokenizer_bundle = (payload, content_hash(payload))
    payload, digest = cached
    if not payload:
        raise not_found("This replica's tokenizer cannot be exported; use /tokenize.")
    etag = f'"{digest}"'
    if request.headers.get("if-none-match") == etag:
        return Response(status_code=304, headers={"ETag": etag})
    return Response(payload, media_type="application/json", headers={"ETag": etag})
