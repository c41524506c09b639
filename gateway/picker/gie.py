"""The endpoint-picker protocol of the Gateway API Inference Extension, over Envoy's ext_proc
messages (xds-protos): the chosen endpoint as a header and as `envoy.lb` dynamic metadata, the
proxy's subset hint, and errors as immediate responses in OpenAI's format."""

from __future__ import annotations

import json
from collections.abc import Iterable

from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.type.v3.http_status_pb2 import HttpStatus
from google.protobuf.duration_pb2 import Duration
from google.protobuf.struct_pb2 import Struct

from protocol.anthropic_errors import error_body
from protocol.errors import APIError

DESTINATION_HEADER = "x-gateway-destination-endpoint"
SERVED_HEADER = "x-kvgate-upstream"  # the bootstrap's route adds it: the replica that answered
DESTINATION_NAMESPACE = "envoy.lb"  # dynamic metadata the proxy's load balancer reads
SUBSET_NAMESPACE = "envoy.lb.subset_hint"  # filter metadata the proxy may send
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
OVERWRITE = HeaderValueOption.HeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD


class BadSubsetHint(ValueError):
    """The proxy's subset hint is not a list of addresses."""


def header_map(headers: ext_proc.HttpHeaders) -> dict[str, str]:
    """Lower-case name -> value (Envoy sends `raw_value`; older versions `value`)."""
    return {h.key.lower(): h.raw_value.decode("latin-1") if h.raw_value else h.value
            for h in headers.headers.headers}


def subset_hint(request: ext_proc.ProcessingRequest) -> set[str] | None:
    """The endpoints ("ip:port") the proxy allows for this request; None: no hint, any."""
    namespaces = request.metadata_context.filter_metadata
    if SUBSET_NAMESPACE not in namespaces:
        return None
    fields = namespaces[SUBSET_NAMESPACE].fields
    if SUBSET_KEY not in fields:
        return None
    value = fields[SUBSET_KEY]
    kind = value.WhichOneof("kind")
    if kind == "string_value":  # some proxies send "a:1,b:2"
        return {part.strip() for part in value.string_value.split(",") if part.strip()}
    if kind != "list_value":
        raise BadSubsetHint(f"{SUBSET_KEY} must be a list of addresses")
    if any(v.WhichOneof("kind") != "string_value" for v in value.list_value.values):
        raise BadSubsetHint(f"{SUBSET_KEY} entries must be addresses")
    return {v.string_value for v in value.list_value.values}


def _mutation(set_headers: dict[str, str], remove: Iterable[str] = ()) -> ext_proc.HeaderMutation:
    return ext_proc.HeaderMutation(
        set_headers=[HeaderValueOption(header=HeaderValue(key=k, raw_value=v.encode()),
                                       append_action=OVERWRITE)
                     for k, v in set_headers.items()],
        remove_headers=list(remove))


def destination_metadata(endpoints: str) -> Struct:
    metadata = Struct()
    metadata.update({DESTINATION_NAMESPACE: {DESTINATION_HEADER: endpoints}})
    return metadata


def route_to(endpoints: list[str], headers: dict[str, str], body: bytes | None) -> ext_proc.ProcessingResponse:
    """The answer to the buffered request body: the endpoints, the chosen one first and the
    proxy's retries after it in order ("ip:port,ip:port"), in both places GIE asks for; the
    headers the request gains, and the body when admission changed it."""
    value = ",".join(endpoints)
    common = ext_proc.CommonResponse(
        header_mutation=_mutation({DESTINATION_HEADER: value, **headers}),
        clear_route_cache=True)  # the route that needs the header is chosen after this answer
    if body is not None:
        common.body_mutation.body = body
    return ext_proc.ProcessingResponse(request_body=ext_proc.BodyResponse(response=common),
                                       dynamic_metadata=destination_metadata(value))


def continue_headers(phase: str, set_headers: dict[str, str] | None = None,
                     remove: Iterable[str] = ()) -> ext_proc.ProcessingResponse:
    """Go on with the request ("request_headers") or response ("response_headers")."""
    common = ext_proc.CommonResponse(header_mutation=_mutation(set_headers or {}, remove))
    return ext_proc.ProcessingResponse(**{phase: ext_proc.HeadersResponse(response=common)})


def without_response_body(answer: ext_proc.ProcessingResponse) -> ext_proc.ProcessingResponse:
    """The answer to the response headers, asking the proxy to send none of the response body
    from here on (`mode_override`; a proxy whose filter does not set `allow_mode_override`
    sends it still, and the picker lets it through)."""
    answer.mode_override.CopyFrom(ProcessingMode(
        request_header_mode=ProcessingMode.SEND, response_header_mode=ProcessingMode.SEND,
        request_body_mode=ProcessingMode.BUFFERED, response_body_mode=ProcessingMode.NONE,
        request_trailer_mode=ProcessingMode.SKIP, response_trailer_mode=ProcessingMode.SKIP))
    return answer


def continue_body(phase: str) -> ext_proc.ProcessingResponse:
    """Let the body chunk pass unchanged ("request_body" or "response_body")."""
    return ext_proc.ProcessingResponse(**{phase: ext_proc.BodyResponse()})


def extend_timeout(seconds: float) -> ext_proc.ProcessingResponse:
    """Ask the proxy to wait up to `seconds` for the answer to the message it sent last (within
    its `max_message_timeout`): the request waits in the picker's queue."""
    timeout = Duration()
    timeout.FromMilliseconds(int(seconds * 1000))
    return ext_proc.ProcessingResponse(override_message_timeout=timeout)


def immediate(status: int, body: bytes, headers: dict[str, str] | None = None,
              details: str = "") -> ext_proc.ProcessingResponse:
    """Answer the client from here; the request reaches no replica."""
    return ext_proc.ProcessingResponse(immediate_response=ext_proc.ImmediateResponse(
        status=HttpStatus(code=status), body=body, details=details,
        headers=_mutation({"content-type": "application/json", **(headers or {})})))


def error_response(error: APIError, path: str = "") -> ext_proc.ProcessingResponse:
    """An APIError as the client would get it from the gateway on `path`: OpenAI's error
    object, or Anthropic's on the Messages API."""
    status, body = error_body(error, path)
    return immediate(status, json.dumps(body).encode(), dict(error.headers or {}),
                     details=error.code or error.type)
