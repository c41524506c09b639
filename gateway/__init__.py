"""The OpenAI-compatible gateway: caching-aware routing in front of engine replicas."""
