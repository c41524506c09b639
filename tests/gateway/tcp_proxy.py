"""A loopback TCP proxy that plays a bad network between a prefill replica and a decode
replica's KV receiver: it can slow the stream down (so a test can act mid-transfer) and flip one
bit at a given offset of the sender → receiver bytes (corruption in transit)."""

from __future__ import annotations

import socket
import threading
import time


class FaultProxy:
    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.port = self.listener.getsockname()[1]
        self.bytes_per_s: float | None = None  # None: full speed
        self.corrupt_at: int | None = None  # flip a bit of the byte at this offset, once
        self.forwarded = 0  # sender → receiver bytes, over all connections
        self._lock = threading.Lock()
        self._closing = False
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def address(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._closing = True
        for s in [self.listener, *self._sockets]:
            try:
                s.close()
            except OSError:
                pass

    def _accept(self) -> None:
        while not self._closing:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=2)
            except OSError:
                client.close()
                continue
            self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, forward: bool) -> None:
        try:
            while True:
                data = src.recv(16384 if self.bytes_per_s is None else 4096)
                if not data:
                    break
                if forward:
                    data = self._maybe_corrupt(bytearray(data))
                    if self.bytes_per_s:
                        time.sleep(len(data) / self.bytes_per_s)
                dst.sendall(data)
        except OSError:
            pass
        finally:  # one side gone: so is the other (as when a process dies)
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def _maybe_corrupt(self, data: bytearray) -> bytearray:
        with self._lock:
            start = self.forwarded
            self.forwarded += len(data)
            at = self.corrupt_at
            if at is not None and start <= at < self.forwarded:
                data[at - start] ^= 0x10
                self.corrupt_at = None
        return data
