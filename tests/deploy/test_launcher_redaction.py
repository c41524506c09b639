"""`kvgate up` logs each child's command line, never the keys on it."""

from kvgate.launcher.child import redacted


def test_key_values_are_masked_in_both_spellings():
    argv = ["python", "-m", "kvgate.cli", "gateway", "--admin-key=admin-s3cret", "--api-key", "sk-s3cret",
            "--api-key=sk-two", "--port", "8000"]
    shown = " ".join(redacted(argv))
    assert "s3cret" not in shown and "sk-two" not in shown
    assert shown == ("python -m kvgate.cli gateway --admin-key=*** --api-key *** --api-key=*** --port 8000")
