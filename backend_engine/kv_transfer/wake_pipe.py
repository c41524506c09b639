"""A self-pipe that wakes a KV-transfer thread's zmq poll from other threads."""

from __future__ import annotations

import os
import threading


class WakePipe:
    """`wake` may race `close` (an engine thread notifying while the transfer thread stops): a
    lock makes a wake after close a no-op, never a write to a closed, or reused, descriptor."""

    def __init__(self) -> None:
        self.fd, self._write_fd = os.pipe()  # poll `fd` (zmq.POLLIN) beside the sockets
        os.set_blocking(self.fd, False)
        os.set_blocking(self._write_fd, False)
        self._lock = threading.Lock()
        self._closed = False

    def wake(self) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                os.write(self._write_fd, b"x")
            except BlockingIOError:  # the pipe is full: the thread is awake anyway
                pass

    def drain(self) -> None:
        try:
            while os.read(self.fd, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            os.close(self.fd)
            os.close(self._write_fd)
