"""`/tokenize` of a conversation with `add_special_tokens` (found by the schema fuzzer: a 500)."""

from backend_engine.server.tokenize_routes import with_special_tokens
from tests.backend_engine.server.conftest import MODEL

MESSAGES = [{"role": "user", "content": "Say hello."}]


class BosEosTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [100 + ord(c) for c in text]
        return [1, *ids, 2] if add_special_tokens else ids


def test_special_tokens_wrap_the_tokens_as_encode_wraps_text():
    assert with_special_tokens(BosEosTokenizer(), [7, 8]) == [1, 7, 8, 2]


def test_tokenize_messages_with_special_tokens(http):
    plain = http.post("/tokenize", json={"model": MODEL, "messages": MESSAGES}).json()["tokens"]
    r = http.post("/tokenize", json={"model": MODEL, "messages": MESSAGES, "add_special_tokens": True})
    assert r.status_code == 200, r.text
    tokens = r.json()["tokens"]
    start = len(tokens) - len(plain)
    assert any(tokens[i:i + len(plain)] == plain for i in range(start + 1))
