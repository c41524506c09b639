"""`kvgate up`: a local cluster on one machine — K engine replicas, G gateways and, when the
gateways share state, a private redis-server — each a supervised child process.

config.py (what to run) → plan.py (the child processes) → supervisor.py (start, wait healthy,
restart with backoff, stop) → banner.py (what the user pastes next). No torch is imported here.
"""
