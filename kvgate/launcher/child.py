"""One supervised child process: started in its own process group, logging to a file, stopped
with SIGTERM and then SIGKILL."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from collections import deque
from pathlib import Path

from kvgate.launcher.plan import ChildSpec

_PR_SET_PDEATHSIG = 1


def _die_with_supervisor() -> None:
    """Runs in the child before exec: if the supervisor is SIGKILLed, the kernel sends this
    child SIGTERM, so no replica outlives its `kvgate up`. Linux only; elsewhere a no-op."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


SECRET_FLAGS = ("--admin-key", "--api-key")


def redacted(argv: list[str]) -> list[str]:
    """The command line with key values masked, for logs (`--admin-key=K` and `--admin-key K`)."""
    out: list[str] = []
    for arg in argv:
        flag = arg.split("=", 1)[0]
        if flag in SECRET_FLAGS and "=" in arg:
            out.append(f"{flag}=***")
        elif out and out[-1] in SECRET_FLAGS:
            out.append("***")
        else:
            out.append(arg)
    return out


class Child:
    def __init__(self, spec: ChildSpec, log_path: Path):
        self.spec = spec
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.healthy_since: float | None = None
        self.crashes_in_a_row = 0
        self.restart_at: float | None = None  # when a crashed child is due to start again
        self.status = "not started"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> None:
        env = {**os.environ, **self.spec.env}
        with open(self.log_path, "ab") as log:
            log.write(f"\n==== {time.strftime('%H:%M:%S')} {' '.join(redacted(self.spec.argv))}\n".encode())
            log.flush()
            # Own session and process group: the terminal's Ctrl-C reaches only the supervisor,
            # which stops children in order, and killpg also reaches their own children.
            self.proc = subprocess.Popen(self.spec.argv, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                         preexec_fn=_die_with_supervisor)
        self.healthy_since = None
        self.restart_at = None
        self.status = "starting"

    def exit_code(self) -> int | None:
        """None while running (or never started); reaps the process once it has exited."""
        return self.proc.poll() if self.proc is not None else None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)  # the group outlives its leader while members remain
        except (ProcessLookupError, PermissionError):
            pass

    def log_tail(self, lines: int = 8) -> list[str]:
        try:
            with open(self.log_path, errors="replace") as f:
                return [line.rstrip() for line in deque(f, maxlen=lines)]
        except OSError:
            return []


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"
