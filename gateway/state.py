"""Everything one gateway process holds: its config, the router (index + load + policy, shared
through Redis when configured), the replicas and their background tasks, keys, limits, stats."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import tempfile

import httpx
import redis.asyncio as aioredis

from gateway.auth import KeyStore
from gateway.circuit import CircuitBreaker
from gateway.config import GatewayConfig
from gateway.health import HealthChecker
from gateway.kv_events_spec import parse_kv_events
from gateway.kv_sync import KvSync
from gateway.metrics import GatewayMetrics
from gateway.overload_queue import OverloadQueue
from gateway.pin_sync import PinSync
from gateway.pins import PinStore
from gateway.pd_stats import PDStats
from gateway.pool import LeanTransport
from gateway.prefix_advice import AdviceConfig, PrefixAdvisor
from gateway.priority import PriorityStats
from gateway.prompt_tokens import PromptTokens
from gateway.replicas import Replica, replica_name, serving
from gateway.stats import GatewayStats
from gateway.zmq_feed import follow_zmq
from routing.policies import make_policy
from routing.policies.pd import PDPolicy
from routing.rate_limit import RateLimiter
from routing.redis_store import RedisStore
from routing.router import Router
from routing.shared_router import SharedRouter

log = logging.getLogger(__name__)


class GatewayState:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        if config.admin_key is None:
            config.admin_key = secrets.token_urlsafe(24)
            log.warning("no admin key configured; this run's admin key is in %s (mode 0600)",
                        _key_file(config.admin_key))
        self.router = Router(config.policy, block_size=config.block_size, seed=config.seed)
        self.router.pd_policy = PDPolicy(config.seed, config.pd_bypass_tokens,
                                         config.pd_transfer_weight)
        self.store = RedisStore(config.redis_url, timeout_s=0.25, lease_s=config.lease_s) if config.redis_url else None
        self.shared = SharedRouter(self.router, self.store, config.max_in_flight, config.seed)
        self.replicas: dict[str, Replica] = {}
        # Two clients: request traffic through the O(1) keep-alive pool (see gateway/pool.py),
        # and the control plane (health, /kv feeds, /tokenize) on httpx's default pool.
        self.proxy = httpx.AsyncClient(
            transport=LeanTransport(),
            timeout=httpx.Timeout(config.read_timeout_s, connect=config.connect_timeout_s))
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(30.0, connect=config.connect_timeout_s),
            limits=httpx.Limits(max_connections=200, max_keepalive_connections=32))
        self.keys_redis = (aioredis.Redis.from_url(config.redis_url, decode_responses=True,
                                                   socket_timeout=0.25)
                           if config.redis_url and config.redis_keys else None)
        self.keys = KeyStore(config.api_keys, config.admin_key, self.keys_redis)
        self.pins_redis = (aioredis.Redis.from_url(config.redis_url, decode_responses=True,
                                                   socket_timeout=0.5)
                           if config.redis_url else None)
        self.pin_store = PinStore(self.pins_redis)
        self.limiter = RateLimiter(self.store)
        self.tokens = PromptTokens(config.tokenizers, self.client, config.replica_tokenizer)
        self.metrics = GatewayMetrics()
        # The workers get what they use; none of them sees this object.
        self.pin_sync = PinSync(self.client, self.pin_store, self.replicas, self.metrics.pin_pushes)
        self.health_checker = HealthChecker(self.client, config.health_interval_s,
                                            self.refresh_models, self.pin_sync)
        self.kv_sync = KvSync(self.client, self.router, self.pin_sync, self.use_approximate_index)
        self.stats = GatewayStats(config.decisions_kept)
        self.overload = OverloadQueue(config.max_queued_requests, config.max_queue_wait_s,
                                      config.overload_affinity_s)
        self.advice = (PrefixAdvisor(AdviceConfig(block_size=config.block_size))
                       if config.prefix_advice else None)
        self.priorities = PriorityStats(self.metrics.registry)
        self.pd = PDStats(self.metrics.registry)
        self._tasks: dict[str, list[asyncio.Task]] = {}
        self._modes: dict[str, str] = {}  # model -> how it is tokenised, as last logged

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        await asyncio.gather(*(self.add_replica(url) for url in self.config.replicas))

    async def close(self) -> None:
        for name in list(self._tasks):
            await self._stop_tasks(name)
        await self.pin_sync.close()
        await self.client.aclose()
        await self.proxy.aclose()
        if self.store is not None:
            await self.store.close()
        if self.keys_redis is not None:
            await self.keys_redis.aclose()
        if self.pins_redis is not None:
            await self.pins_redis.aclose()

    # -- membership -----------------------------------------------------------------------
    async def add_replica(self, url: str, name: str | None = None,
                          kv_events: str | None = None) -> Replica:
        """Add a replica; `kv_events` (or the config's entry for its URL) follows its engine's
        ZMQ KV events instead of /kv/events."""
        url = url.rstrip("/")
        spec = kv_events or self.config.kv_events.get(url)
        spec = parse_kv_events(spec) if spec else None
        for existing in self.replicas.values():
            if existing.url == url:
                return existing
        name = name or replica_name(url, set(self.replicas))
        breaker = CircuitBreaker(self.config.failure_threshold, self.config.circuit_cooldown_s)
        replica = Replica(name, url, breaker, engine=self.config.replica_engines.get(url))
        self.replicas[name] = replica
        self.router.add_replica(name)
        await self.health_checker.check_once(replica)  # reads its models: refresh_models
        feed = (follow_zmq(self.router, replica, spec, self.config.approx_capacity_blocks) if spec
                else self.kv_sync.follow(replica))
        self._tasks[name] = [asyncio.create_task(self.health_checker.check_forever(replica)),
                             asyncio.create_task(feed)]
        return replica

    async def remove_replica(self, name: str) -> None:
        await self._stop_tasks(name)
        self.replicas.pop(name, None)
        self.router.remove_replica(name)
        self.metrics.forget_replica(name)
        self.pin_sync.forget_replica(name)

    async def _stop_tasks(self, name: str) -> None:
        tasks = self._tasks.pop(name, [])
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def use_approximate_index(self, replica: Replica) -> None:
        """The backend has no KV events: learn its cache from routing history instead."""
        log.warning("replica %s has no /kv endpoints: approximate prefix index", replica.name)
        replica.exact = False
        self.router.remove_replica(replica.name)
        self.router.add_replica(replica.name, approximate=True,
                                capacity_blocks=self.config.approx_capacity_blocks)

    def set_policy(self, name: str) -> None:
        self.router.policy = make_policy(name, seed=self.config.seed)

    # -- what replicas serve --------------------------------------------------------------
    async def refresh_models(self, replica: Replica) -> None:
        """Read what the replica serves; the first time it says, check its tokenizer too."""
        try:
            response = await self.client.get(f"{replica.url}/v1/models", timeout=5.0)
            response.raise_for_status()
            replica.model_cards = list(response.json().get("data", []))
            replica.models = [m["id"] for m in replica.model_cards]
            replica.advertised = frozenset(
                f for card in replica.model_cards[:1] for f in card.get("features") or [])
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            log.warning("cannot list models of %s: %s", replica.name, exc)
        if replica.models and replica.parity == "unchecked":
            await self.check_parity(replica)

    async def check_parity(self, replica: Replica) -> None:
        """Load (or confirm) the model's tokenizer from the replica, then compare tokenisations."""
        if not replica.models:
            replica.parity = "unchecked"
            return
        model = replica.models[0]
        refused = await self.tokens.sync_from_replica(model, replica.url, self.config.block_size)
        replica.parity = refused or await self.tokens.check_parity(model, replica.url)
        if refused:
            log.error("refused the tokenizer of replica %s for model %s: %s; this gateway keeps "
                      "the one it loaded first, and its routing predictions for %s may be wrong",
                      replica.name, model, refused, replica.name)
        elif replica.parity.startswith("mismatch"):
            log.error("tokenizer parity with %s failed: %s; routing predictions for it will be "
                      "wrong", replica.name, replica.parity)
        self._log_mode(model)

    def _log_mode(self, model: str) -> None:
        mode = self.tokens.mode(model)
        if self._modes.get(model) == mode:
            return
        self._modes[model] = mode
        if mode.startswith("remote"):
            log.warning("model %s: tokenised %s - no replica serves its tokenizer, so each "
                        "request costs a /tokenize round trip and prefix-stability advice is off "
                        "(give --tokenizer %s=FOLDER, or `tokenizers:` in the config file)",
                        model, mode, model)
        else:
            log.info("model %s: tokenised %s", model, mode)

    def tokenizer_modes(self) -> dict[str, str]:
        return dict(self._modes)

    def model_cards(self) -> list[dict]:
        """The union of the replicas' models, each once (the first replica's card)."""
        seen: dict[str, dict] = {}
        for replica in self.replicas.values():
            for card in replica.model_cards:
                seen.setdefault(card["id"], card)
        return list(seen.values())

    def serving(self, model: str) -> list[Replica]:
        return serving(self.replicas.values(), model)

    def in_flight_by_replica(self) -> dict[str, int]:
        return {name: self.router.load.view(name).in_flight for name in self.replicas
                if name in self.router.replicas}


def _key_file(key: str) -> str:
    """A generated key where only its user can read it (logs are read by others)."""
    fd, path = tempfile.mkstemp(prefix="kvgate-admin-key-")  # created with mode 0600
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return path
