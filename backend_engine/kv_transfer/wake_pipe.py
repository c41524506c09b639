"""A self-pipe that wakes a KV-transfer thread's zmq poll from other threads."""

from __future__ import annotations

import os


class WakePipe:
    def __init__(self) -> None:
        self.fd, self._write_fd = os.pipe()  # poll `fd` (zmq.POLLIN) beside the sockets
        os.set_blocking(self.fd, False)

    def wake(self) -> None:
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
        os.close(self.fd)
        os.close(self._write_fd)
