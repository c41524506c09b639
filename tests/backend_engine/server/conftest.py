import httpx
import openai
import pytest

from backend_engine.config import EngineConfig
from backend_engine.server.settings import ServerSettings
from tests.backend_engine.server.harness import start_server

MODEL = "tiny-random"
BLOCK_SIZE = 16
NUM_KV_BLOCKS = 96
MAX_BODY_BYTES = 1024 * 1024


@pytest.fixture(scope="package")
def replica():
    config = EngineConfig(enforce_eager=True, model=MODEL, block_size=BLOCK_SIZE, num_kv_blocks=NUM_KV_BLOCKS, max_model_len=512,
                          max_num_seqs=16, max_num_batched_tokens=256, kv_event_buffer=64)
    settings = ServerSettings(log_level="warning", max_body_bytes=MAX_BODY_BYTES, kv_heartbeat_s=0.3)
    server = start_server(config, settings)
    yield server
    server.stop()


@pytest.fixture()
def client(replica):
    with openai.OpenAI(base_url=replica.base_url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture()
async def aclient(replica):
    async with openai.AsyncOpenAI(base_url=replica.base_url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture()
def http(replica):
    with httpx.Client(base_url=replica.base_url, timeout=60) as c:
        yield c
