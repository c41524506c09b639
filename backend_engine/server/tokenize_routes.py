"""`POST /tokenize` and `POST /detokenize` (vLLM's bodies). The gateway checks at start-up that
its own tokenisation matches these, so chat rendering here is exactly what generation uses."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.requests import Request

from backend_engine.errors import InvalidRequestError
from backend_engine.server.sampling import engine_error_to_api
from backend_engine.server.state import ServerState
from protocol.errors import bad_request
from protocol.parsing import parse_request
from protocol.tokenize import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse

router = APIRouter()


@router.post("/tokenize")
async def tokenize(request: Request) -> TokenizeResponse:
    state: ServerState = request.app.state.server
    req = parse_request(TokenizeRequest, await request.body())
    engine = state.ready_engine()
    state.check_model(req.model)
    if req.messages is not None:
        try:
            tokens = engine.render_chat(
                req.template_messages(),
                add_generation_prompt=req.add_generation_prompt is not False,
                chat_template_kwargs=req.chat_template_kwargs,
                tools=req.tools,
                continue_final_message=bool(req.continue_final_message),
            )
        except InvalidRequestError as exc:
            raise engine_error_to_api(exc) from None
        if req.add_special_tokens:
            tokens = with_special_tokens(engine.tokenizer, tokens)
    else:
        tokens = engine.tokenizer.encode(req.prompt or "", add_special_tokens=req.add_special_tokens is not False)
    token_strs = engine.tokenizer.convert_ids_to_tokens(tokens) if req.return_token_strs else None
    return TokenizeResponse(count=len(tokens), max_model_len=engine.max_model_len, tokens=tokens, token_strs=token_strs)


@router.post("/detokenize")
async def detokenize(request: Request) -> DetokenizeResponse:
    state: ServerState = request.app.state.server
    req = parse_request(DetokenizeRequest, await request.body())
    engine = state.ready_engine()
    state.check_model(req.model)
    if req.tokens and max(req.tokens) >= len(engine.tokenizer):
        raise bad_request(f"Token id {max(req.tokens)} is out of the vocabulary.", "tokens", "invalid_value")
    return DetokenizeResponse(prompt=engine.tokenizer.decode(req.tokens))


def with_special_tokens(tokenizer, tokens: list[int]) -> list[int]:  # noqa: ANN001 - a HF tokenizer
    """`tokens` inside the special tokens the tokenizer adds around any text (BOS, EOS, …).
    transformers' fast-tokenizer backend has no `build_inputs_with_special_tokens`."""
    plain = tokenizer.encode("a", add_special_tokens=False)
    full = tokenizer.encode("a", add_special_tokens=True)
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return full[:start] + tokens + full[start + len(plain):]
    return tokens
