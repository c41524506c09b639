"""A kvgate replica whose every engine step takes `KVGATE_SLOW_STEP_S` seconds longer: a replica
busy with a heavy batch, whose requests advance slowly but surely. `python -m
benchmarks.reliability.slow_engine engine …` takes `kvgate engine`'s flags. The stall scenarios
use it for a stream that is silent (a long chunked prefill) while its request is alive."""

from __future__ import annotations

import os
import sys
import time

from backend_engine.engine import LLMEngine
from kvgate.cli import main

STEP_DELAY_ENV = "KVGATE_SLOW_STEP_S"


def slow_down(delay_s: float) -> None:
    step = LLMEngine.step

    def slow_step(self: LLMEngine) -> list:
        time.sleep(delay_s)
        return step(self)

    LLMEngine.step = slow_step


if __name__ == "__main__":
    slow_down(float(os.environ.get(STEP_DELAY_ENV, "0.2")))
    sys.exit(main())
