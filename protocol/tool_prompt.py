"""Tools for chat templates that know nothing of them. A template that never reads `tools` would
drop them (the model could not call what it was never shown), and one that never reads
`tool_calls` would drop the calls from the history. For those, the tools go into the system
message and past calls into the assistant's text, in the Hermes `<tool_call>` format that the
default parser reads. Both edges render through here, so their tokens stay the same."""

from __future__ import annotations

import json
from typing import Any

TOOLS_INTRO = (
    "# Tools\n\nYou can call functions to help with the user's request. Each function's "
    "signature is a JSON object on its own line inside <tools></tools>:\n<tools>\n")
TOOLS_HOWTO = (
    "\n</tools>\n\nTo call a function, answer with one <tool_call></tool_call> block per call, "
    "each holding a JSON object with the function's name and its arguments:\n<tool_call>\n"
    '{"name": "the function\'s name", "arguments": {"the argument": "its value"}}\n</tool_call>')


def tools_prompt(tools: list[dict[str, Any]]) -> str:
    lines = [json.dumps(t.get("function", t), ensure_ascii=False) for t in tools]
    return TOOLS_INTRO + "\n".join(lines) + TOOLS_HOWTO


def _call_text(call: dict[str, Any]) -> str:
    function = call.get("function") or {}
    body = {"name": function.get("name"), "arguments": function.get("arguments", {})}
    return f"<tool_call>\n{json.dumps(body, ensure_ascii=False)}\n</tool_call>"


def adapt_to_template(template: str | None, messages: list[dict[str, Any]],
                      tools: list[dict[str, Any]] | None
                      ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and tools to render with `template` (its source text)."""
    source = template if isinstance(template, str) else ""
    if tools and "tools" not in source:
        messages = [dict(m) for m in messages]
        if messages and messages[0].get("role") in ("system", "developer"):
            first = messages[0]
            first["content"] = f"{first.get('content') or ''}\n\n{tools_prompt(tools)}".lstrip()
        else:
            messages.insert(0, {"role": "system", "content": tools_prompt(tools)})
        tools = None
    if "tool_calls" not in source and any(m.get("tool_calls") for m in messages):
        adapted = []
        for m in messages:
            if m.get("tool_calls"):
                calls = "\n".join(_call_text(c) for c in m["tool_calls"])
                m = {k: v for k, v in m.items() if k != "tool_calls"}
                m["content"] = f"{m.get('content') or ''}\n{calls}".lstrip()
            adapted.append(m)
        messages = adapted
    return messages, tools
