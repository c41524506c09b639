"""What `kvgate up` prints once everything is healthy: where to send requests, and how."""

from __future__ import annotations

from kvgate.launcher.child import Child
from kvgate.launcher.config import UpConfig
from kvgate.launcher.plan import ENVOY, GATEWAY, REDIS, REPLICA


def ready_banner(children: list[Child], model: str, config: UpConfig, redis_url: str | None, log_dir: str) -> str:
    gateways = [c for c in children if c.spec.role == GATEWAY]
    replicas = [c for c in children if c.spec.role == REPLICA]
    envoy = next((c for c in children if c.spec.role == ENVOY), None)
    front = gateways[0] if gateways else replicas[0]
    base_url = f"{(envoy or front).spec.url}/v1"
    tier = "Envoy + endpoint picker" if envoy else f"{len(gateways)} gateway(s)"
    lines = [
        f"\nkvgate is ready: {len(replicas)} replica(s) of {model}, {tier}"
        + (f", policy {config.policy}" if config.policy and gateways else ""),
        "",
        f"  OpenAI base_url:  {base_url}" + ("  (Envoy; kvgate picker chooses the replica)" if envoy else ""),
    ]
    if len(gateways) > 1:
        others = ", ".join(f"{c.spec.url}/v1" for c in gateways[1:])
        lines.append(f"  more gateways:    {others}  (same routing state; put a load balancer in front)")
    if gateways:
        lines.append(f"  dashboard:        {front.spec.url}/admin  (admin key: {config.admin_key})")
    else:
        lines.append("  dashboard:        none (--gateways 0: requests go straight to replica 1)")
    lines.append("  replicas:         " + ", ".join(
        f"{c.spec.url} ({c.spec.name + ', ' if not c.spec.name.startswith('replica') else ''}pid {c.pid})"
        for c in replicas))
    if envoy:
        lines.append(f"  envoy:            {envoy.spec.url} (pid {envoy.pid}), admin {envoy.spec.health_url.removesuffix('/ready')}")
        lines.append(f"  picker:           {front.spec.url} (pid {front.pid})")
    elif gateways:
        lines.append("  gateways:         " + ", ".join(f"{c.spec.url} (pid {c.pid})" for c in gateways))
    redis = [c for c in children if c.spec.role == REDIS]
    if redis_url:
        pid = f" (pid {redis[0].pid})" if redis else ""
        lines.append(f"  redis:            {redis_url}{pid}")
    lines.append(f"  logs:             {log_dir}")
    auth = f" -H 'Authorization: Bearer {config.api_key}'" if config.api_key else ""
    if config.api_key:
        lines.append(f"  api key:          {config.api_key}")
    lines += [
        "",
        f"  curl {base_url}/chat/completions -H 'Content-Type: application/json'{auth} \\",
        f"    -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'",
        "",
        "  from openai import OpenAI",
        f"  client = OpenAI(base_url=\"{base_url}\", api_key=\"{config.api_key or 'unused'}\")",
        f"  reply = client.chat.completions.create(model=\"{model}\", "
        "messages=[{\"role\": \"user\", \"content\": \"Hello!\"}])",
        "  print(reply.choices[0].message.content)",
        "",
        "Ctrl-C stops everything.",
    ]
    return "\n".join(lines)
