"""Start the children in order, wait until each is healthy, restart any that dies (with
backoff), and stop them all — gateways first, then replicas, then Redis — on SIGINT/SIGTERM."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from kvgate.launcher.child import Child, describe_exit
from kvgate.launcher.config import ConfigError, UpConfig
from kvgate.launcher.health import probe
from kvgate.launcher.plan import ENVOY, GATEWAY, REDIS, REPLICA, Plan, port_is_free

TICK_S = 0.5
PROGRESS_EVERY_S = 10.0
STABLE_AFTER_S = 30.0  # a child healthy this long before it died starts a fresh backoff


def restart_delay(config: UpConfig, crashes_in_a_row: int) -> float:
    """Exponential backoff: a child that keeps crashing is retried ever more slowly, up to a cap."""
    return min(config.restart_backoff_max_s, config.restart_backoff_s * 2 ** min(crashes_in_a_row, 30))


class Supervisor:
    def __init__(self, plan: Plan, config: UpConfig, log_dir: Path, say: Callable[[str], None]):
        self.plan = plan
        self.config = config
        self.say = say
        self.children = [Child(spec, log_dir / f"{spec.name}.log") for spec in plan.children]
        self._stop_signal: int | None = None
        self._force = False
        self._t0 = time.monotonic()
        self._last_progress = ("", 0.0)

    # ---- signals --------------------------------------------------------------------------

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        if self._stop_signal is not None:
            self._force = True  # a second Ctrl-C: no more grace
        self._stop_signal = sig

    @property
    def stopping(self) -> bool:
        return self._stop_signal is not None

    # ---- start-up -------------------------------------------------------------------------

    def check_ports(self) -> None:
        for child in self.children:
            if child.spec.role != REDIS and not port_is_free(child.spec.host, child.spec.port):
                raise ConfigError(f"port {child.spec.port} ({child.spec.name}) is in use; choose another --port")
            kv = child.spec.kv_port
            if kv is not None and not port_is_free(child.spec.host, kv):
                raise ConfigError(f"port {kv} ({child.spec.name}'s KV receiver) is in use; choose another --port")

    def start(self) -> bool:
        """Shared state and replicas first, then the gateways (and Envoy, which asks the picker);
        False if any failed or we were stopped."""
        first = [c for c in self.children if c.spec.role not in (GATEWAY, ENVOY)]
        gateways = [c for c in self.children if c.spec.role in (GATEWAY, ENVOY)]
        for child in first:
            child.start()
        for child in gateways:
            child.status = "waiting for replicas"
        deadline = time.monotonic() + self.config.health_timeout_s
        if not self._wait_healthy(first, deadline):
            return False
        for child in gateways:
            child.start()
        return self._wait_healthy(gateways, deadline)

    def _wait_healthy(self, children: list[Child], deadline: float) -> bool:
        while not self.stopping:
            for child in children:
                code = child.exit_code()
                if code is not None:
                    self._report_exit(child, code, "while starting")
                    return False
                if child.healthy_since is None:
                    result = probe(child.spec)
                    child.status = result.status
                    if result.healthy:
                        child.healthy_since = time.monotonic()
            self._show_progress()
            if all(c.healthy_since is not None for c in children):
                return True
            if time.monotonic() > deadline:
                late = ", ".join(c.spec.name for c in children if c.healthy_since is None)
                self.say(f"gave up after {self.config.health_timeout_s:.0f}s: {late} not healthy "
                         f"(health_timeout_s); see {self.children[0].log_path.parent}")
                return False
            time.sleep(TICK_S)
        return False

    def _show_progress(self) -> None:
        """A line when any status changes, and every few seconds while something is slow."""
        line = " · ".join(f"{c.spec.name} {c.status}" for c in self.children)
        now = time.monotonic()
        last_line, last_at = self._last_progress
        if line == last_line and now - last_at < PROGRESS_EVERY_S:
            return
        self._last_progress = (line, now)
        self.say(f"[{now - self._t0:4.0f}s] {line}")
        if line == last_line:  # still slow: show what the slow ones last logged
            for child in self.children:
                tail = child.log_tail(1) if child.running() and child.healthy_since is None else []
                if tail and tail[0]:
                    self.say(f"        {child.spec.name}: {tail[0][:160]}")

    # ---- steady state ---------------------------------------------------------------------

    def watch(self) -> None:
        """Until stopped: restart children that die, announce them when healthy again."""
        while not self.stopping:
            now = time.monotonic()
            for child in self.children:
                if child.restart_at is not None:
                    if now >= child.restart_at:
                        child.start()
                        self.say(f"{child.spec.name}: restarted (pid {child.pid}, crash #{child.crashes_in_a_row})")
                    continue
                code = child.exit_code()
                if code is not None:
                    self._schedule_restart(child, code)
                elif child.healthy_since is None and probe(child.spec).healthy:
                    child.healthy_since = time.monotonic()
                    child.status = "ready"
                    self.say(f"{child.spec.name}: healthy again at {child.spec.url} (pid {child.pid})")
            time.sleep(TICK_S)

    def _schedule_restart(self, child: Child, code: int) -> None:
        now = time.monotonic()
        if child.healthy_since is not None and now - child.healthy_since >= STABLE_AFTER_S:
            child.crashes_in_a_row = 0
        delay = restart_delay(self.config, child.crashes_in_a_row)
        child.crashes_in_a_row += 1
        child.signal_group(signal.SIGKILL)  # whatever the dead leader left behind in its group
        child.restart_at = now + delay
        child.status = "restarting"
        self._report_exit(child, code, f"restarting in {delay:.0f}s")

    def _report_exit(self, child: Child, code: int, what_next: str) -> None:
        self.say(f"{child.spec.name} (pid {child.pid}) {describe_exit(code)}; {what_next}. "
                 f"Last lines of {child.log_path}:")
        for line in child.log_tail():
            self.say(f"    | {line}")

    # ---- shutdown -------------------------------------------------------------------------

    def stop(self) -> None:
        """SIGTERM tier by tier (gateways stop taking traffic before replicas drain), SIGKILL
        whatever outlives the grace period."""
        for role in (ENVOY, GATEWAY, REPLICA, REDIS):
            tier = [c for c in self.children if c.spec.role == role and c.running()]
            if not tier:
                continue
            self.say(f"stopping {role}" + (f"s ({len(tier)})…" if len(tier) > 1 else "…"))
            for child in tier:
                child.signal_group(signal.SIGTERM)
            deadline = time.monotonic() + self.config.shutdown_grace_s
            while any(c.running() for c in tier) and time.monotonic() < deadline and not self._force:
                time.sleep(0.1)
            for child in tier:
                if child.running():
                    self.say(f"{child.spec.name} (pid {child.pid}) did not stop in time: SIGKILL")
        for child in self.children:  # leftovers in any group, and reap
            child.signal_group(signal.SIGKILL)
            if child.proc is not None:
                try:
                    child.proc.wait(timeout=5)
                except Exception:  # noqa: BLE001 - unkillable (D state): nothing more to do
                    pass
