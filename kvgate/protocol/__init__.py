"""The OpenAI protocol, once, for both HTTP edges (replica server and gateway). Torch-free."""

from kvgate.protocol.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionRequest
from kvgate.protocol.common import Usage
from kvgate.protocol.completions import Completion, CompletionRequest
from kvgate.protocol.errors import APIError, ErrorResponse
from kvgate.protocol.model_list import ModelCard, ModelList
from kvgate.protocol.parsing import parse_request
from kvgate.protocol.tokenize import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse

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
