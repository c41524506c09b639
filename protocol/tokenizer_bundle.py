"""What a gateway needs to tokenise exactly as a replica does, served by the replica
(`GET /tokenizer/bundle`) and named by its content hash: the tokenizer (the `tokenizers`
library's JSON), the chat template, the special tokens the template sees, the block size and
the namespace rule of the block hash. Data only - JSON text, never pickle or code - and bounded
in size; the chat template runs in the gateway's Jinja sandbox, as a folder's template does."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

BUNDLE_PATH = "/tokenizer/bundle"
BUNDLE_FORMAT = 1
MAX_BUNDLE_BYTES = 64 * 1024 * 1024  # the largest tokenizer.json files (Gemma's) are ~35 MB
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


class BundleError(ValueError):
    """A tokenizer bundle that is malformed, too large, or not what its hash says."""


@dataclass(slots=True)
class TokenizerBundle:
    model: str  # the model id the replica serves (and builds block-hash namespaces from)
    tokenizer_json: str  # the `tokenizers` library's serialised tokenizer
    chat_template: str | None
    block_size: int
    namespace_rule: str
    special_tokens: dict[str, str | None] = field(default_factory=dict)
    format: int = BUNDLE_FORMAT

    def encode(self) -> bytes:
        """Canonical bytes: two replicas with the same tokenizer serve the same bytes."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"),
                          ensure_ascii=False).encode()


def content_hash(payload: bytes) -> str:
    return "sha256:" + hashlib.sha256(payload).hexdigest()


def decode_bundle(payload: bytes) -> TokenizerBundle:
    """The bundle in `payload`, every field checked (raises BundleError)."""
    if len(payload) > MAX_BUNDLE_BYTES:
        raise BundleError(f"tokenizer bundle of {len(payload)} bytes exceeds {MAX_BUNDLE_BYTES}")
    try:
        data = json.loads(payload)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BundleError(f"tokenizer bundle is not JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != BUNDLE_FORMAT:
        raise BundleError("tokenizer bundle has an unknown format")
    special = data.get("special_tokens") or {}
    checks = [isinstance(data.get("model"), str), isinstance(data.get("tokenizer_json"), str),
              isinstance(data.get("chat_template"), (str, type(None))),
              type(data.get("block_size")) is int and data["block_size"] > 0,
              isinstance(data.get("namespace_rule"), str), isinstance(special, dict),
              all(k in SPECIAL_TOKENS and isinstance(v, (str, type(None)))
                  for k, v in special.items())]
    if not all(checks):
        raise BundleError("tokenizer bundle has a missing or mistyped field")
    return TokenizerBundle(data["model"], data["tokenizer_json"], data["chat_template"],
                           data["block_size"], data["namespace_rule"], dict(special))
