"""The ext_proc gRPC service and the picker process: one Exchange per ext_proc stream (one per
HTTP request), beside the gateway's HTTP app (health, metrics, admin API and dashboard, and the
OpenAI proxy too) on the same state."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator

import grpc
import uvicorn
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc

from gateway.config import GatewayConfig
from gateway.picker.endpoints import Endpoints
from gateway.picker.exchange import Exchange
from gateway.state import GatewayState

log = logging.getLogger(__name__)


class EndpointPicker(ext_proc_grpc.ExternalProcessorServicer):
    def __init__(self, state: GatewayState) -> None:
        self.state = state
        self.endpoints = Endpoints()
        self.open_streams = 0  # exchanges in progress (a gauge for tests and the dashboard)

    async def Process(self, request_iterator: AsyncIterator[ext_proc.ProcessingRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[ext_proc.ProcessingResponse]:
        exchange = Exchange(self.state, self.endpoints)
        self.open_streams += 1
        try:
            async for request in request_iterator:
                if not request.HasField("request_body"):  # only routing may wait
                    yield await exchange.handle(request)
                    continue
                async for response in _answers(exchange, request):
                    yield response
        finally:
            self.open_streams -= 1
            await exchange.close()


async def _answers(exchange: Exchange, request: ext_proc.ProcessingRequest
                   ) -> AsyncIterator[ext_proc.ProcessingResponse]:
    """The answer to one message, preceded by the interim messages the exchange sends while it
    works on it (a queued request asks the proxy to wait longer). Cancelled (the proxy ended
    the stream: the client went away), the work is cancelled with it."""
    answer = asyncio.ensure_future(exchange.handle(request))
    interim: asyncio.Future | None = None
    try:
        while not answer.done():
            interim = asyncio.ensure_future(exchange.interim.get())
            await asyncio.wait({answer, interim}, return_when=asyncio.FIRST_COMPLETED)
            if interim.done():
                yield interim.result()
        yield answer.result()
    finally:
        if interim is not None and not interim.done():
            interim.cancel()
        if not answer.done():
            answer.cancel()
            await asyncio.gather(answer, return_exceptions=True)  # its queue place is left


async def run_picker(config: GatewayConfig, grpc_address: str) -> None:
    """Serve ext_proc on `grpc_address` and the gateway's HTTP app on config.host:port."""
    from gateway.app import create_app

    state = GatewayState(config)
    await state.start()
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", config.max_body_bytes + (1 << 16))])
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(EndpointPicker(state), server)
    server.add_insecure_port(grpc_address)
    await server.start()
    log.info("endpoint picker: ext_proc on %s, admin and metrics on http://%s:%d",
             grpc_address, config.host, config.port)
    gc.collect()
    gc.freeze()  # as the gateway: long-lived objects out of the collector's scans
    http = uvicorn.Server(uvicorn.Config(create_app(config, state), host=config.host,
                                         port=config.port, log_level=config.log_level,
                                         access_log=False, timeout_graceful_shutdown=5))
    try:
        await http.serve()
    finally:
        await server.stop(grace=2)
        await state.close()


def serve_picker(config: GatewayConfig, grpc_address: str) -> int:
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    asyncio.run(run_picker(config, grpc_address))
    return 0
