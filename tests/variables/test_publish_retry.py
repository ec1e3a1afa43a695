"""A publish whose stream breaks mid-way (the variable server killed or restarted, the network
cut) is sent again until its timeout, and lands once: through a real TCP proxy that cuts the
first connections after a few kilobytes, to a real VariableServer."""
from __future__ import annotations

import socket
import threading

import pytest

from sao_actor_learner.variables import PublishError, VariablePublisher, VariableServer

TOKEN = "test-token"


class CuttingProxy:
    """Forwards 127.0.0.1:port to `target`; each of the first `cuts` connections is closed
    after `cut_after` bytes from the client (a stream broken mid-publish)."""

    def __init__(self, target_port: int, cuts: int, cut_after: int):
        self._target = target_port
        self._cuts = cuts
        self._cut_after = cut_after
        self.connections = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            limit = self._cut_after if self.connections <= self._cuts else None
            upstream = socket.create_connection(("127.0.0.1", self._target))
            threading.Thread(target=self._pipe, args=(client, upstream, limit),
                             daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, None),
                             daemon=True).start()

    @staticmethod
    def _pipe(src, dst, limit):
        sent = 0
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if limit is not None and sent + len(data) > limit:
                    break                              # cut: close both ends mid-stream
                dst.sendall(data)
                sent += len(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self):
        self._listener.close()


@pytest.fixture
def server():
    srv = VariableServer(publisher_token=TOKEN, chunk_bytes=64 << 10).start()
    yield srv
    srv.stop(grace_s=0.1)


def test_a_publish_whose_stream_breaks_is_sent_again_and_lands_once(server):
    payload = bytes(range(256)) * 4096                       # 1 MiB, 16 chunks of 64 KiB
    proxy = CuttingProxy(server.port, cuts=2, cut_after=200_000)
    try:
        publisher = VariablePublisher(f"127.0.0.1:{proxy.port}", TOKEN, chunk_bytes=64 << 10)
        assert publisher.publish(4, payload, timeout_s=60) == 4
        assert publisher.retries >= 1 and proxy.connections >= 2
        latest = server.latest()
        assert latest.version == 4 and bytes(latest.payload) == payload
        # The same version again (a retry whose first attempt did land): accepted, unchanged.
        assert publisher.publish(4, payload, timeout_s=60) == 4
        publisher.close()
    finally:
        proxy.close()


def test_a_stream_that_keeps_breaking_fails_at_the_timeout_naming_the_attempts(server):
    proxy = CuttingProxy(server.port, cuts=10 ** 6, cut_after=1000)
    try:
        publisher = VariablePublisher(f"127.0.0.1:{proxy.port}", TOKEN, chunk_bytes=64 << 10)
        with pytest.raises(PublishError, match=r"failed after \d+ attempt"):
            publisher.publish(1, b"x" * (1 << 20), timeout_s=2.0)
        assert publisher.retries >= 1 and server.latest() is None
        publisher.close()
    finally:
        proxy.close()
