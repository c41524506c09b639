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
                      context: grpc.aio.ServicerContext) -> None:
        """One answer per message, written as the message is handled (gRPC's read/write API:
        no generator, and no task per message). A queued request's interim message (wait
        longer) is written by the exchange itself before its answer. The proxy ending the
        stream (the client went away) cancels this coroutine, and the work in progress with it."""
        exchange = Exchange(self.state, self.endpoints, context.write)
        self.open_streams += 1
        try:
            while (request := await context.read()) is not grpc.aio.EOF:
                await context.write(await exchange.handle(request))
        finally:
            self.open_streams -= 1
            await exchange.close()


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
