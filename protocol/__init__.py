"""The bottom layer: what both edges (replica server and gateway) speak, once, torch-free and
importing nothing else of kvgate's. The OpenAI protocol (request and response models, the error
object, SSE framing) is here; vLLM's KV-event wire structs are in `protocol.kv_events`."""

from protocol.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionRequest
from protocol.common import Usage
from protocol.completions import Completion, CompletionRequest
from protocol.errors import APIError, ErrorResponse
from protocol.model_list import ModelCard, ModelList
from protocol.parsing import parse_request
from protocol.tokenize import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse

__all__ = [
    "APIError",
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "Completion",
    "CompletionRequest",
    "DetokenizeRequest",
    "DetokenizeResponse",
    "ErrorResponse",
    "ModelCard",
    "ModelList",
    "TokenizeRequest",
    "TokenizeResponse",
    "Usage",
    "parse_request",
]
