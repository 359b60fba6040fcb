"""Gossip over one TCP connection per edge, every message preceded by its length: no message can crash the receiver.

gloo reads a message into the buffer its receiver posted after checking only that it fits: a shorter message is
accepted silently, with the rest of the buffer left as it was, and a longer one aborts the receiving process from
gloo's own thread (an uncaught C++ exception, SIGABRT) before Python can act. So a neighbour that sends the wrong
number of bytes, by malice or by a bug, either corrupts or kills the node. With a roster the gossip travels instead
over :class:`FramedExchange`, where each message is its 8-byte big-endian length followed by its bytes; the receiver
reads the length first, and one other than the round's fixed size stops the node with :class:`MessageSizeError`
naming the sender and the round: nothing of the message is read, nothing is allocated for it.

Connections, made once when the gossip is built: every node listens on an ephemeral TCP port of the interface that
reaches the rendezvous host (``MASTER_ADDR``; ``PRIVDEC_GOSSIP_ADDR`` overrides it), the nodes exchange their
addresses in the typed encoding, and for every edge the lower rank connects to the higher one and opens with its rank
and an HMAC-SHA256 of both ranks under its sealing key for that edge. A connection whose opening does not verify is
closed and ignored, so no member can take another's place on an edge (it could only fail to connect: denial of
service). The messages themselves are authenticated by :class:`~lightning_privdec.comm.sealed.SealedExchange`.

Rounds are blocking (``start`` runs the round at once: no overlap with computation), sends and receives of a round
progress together on non-blocking sockets, and the node waits at most ``timeout`` for any progress before
:class:`~lightning_privdec.comm.distributed.PeerFailureError`. Tensors on a GPU are copied to the host and back.
"""

from __future__ import annotations

import hmac
import os
import selectors
import socket
import struct
import time
from collections.abc import Iterable, Mapping
from datetime import timedelta

import torch
from torch import Tensor

from lightning_privdec.comm.base import Exchange, Incoming, Outgoing, Received, check_finite
from lightning_privdec.comm.distributed import PeerFailureError
from lightning_privdec.comm.objects import all_gather_objects
from lightning_privdec.comm.distributed import message_nbytes, pack, unpack

__all__ = ["FRAME_HEADER", "FramedExchange", "MessageSizeError", "gossip_address"]

FRAME_HEADER = 8  # bytes of the length that precedes every message
_HELLO = struct.Struct(">Q32s")  # the connecting rank and its HMAC
_TAG = b"lightning_privdec/framed-gossip/v1"


class MessageSizeError(RuntimeError):
    """A neighbour announced a message of another size than the round's: nothing of it was read, and the node stops."""


def gossip_address() -> str:
    """The local address the gossip listens on: ``PRIVDEC_GOSSIP_ADDR``, else the interface that reaches
    ``MASTER_ADDR`` (no packet is sent), else the loopback address."""
    if os.environ.get("PRIVDEC_GOSSIP_ADDR"):
        return os.environ["PRIVDEC_GOSSIP_ADDR"]
    master = os.environ.get("MASTER_ADDR")
    if not master:
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((master, int(os.environ.get("MASTER_PORT", "29500"))))
        return probe.getsockname()[0]


def _hello_mac(key: bytes, sender: int, receiver: int) -> bytes:
    return hmac.new(key, _TAG + b"/hello" + struct.pack(">QQ", sender, receiver), "sha256").digest()


class FramedExchange(Exchange):
    """Length-framed gossip over TCP between this node and ``keys``' peers (its neighbours in every round).

    Args:
        device: where the received tensors are returned (the node's device).
        keys: per neighbour, ``(this node's sending key, its receiving key)`` of the signed setup; they authenticate
            each connection's opening.
        timeout: the longest wait for any progress of a round or of the connections (``None``: no limit).

    Builds its connections at once: every node of the process group must construct it at the same point.
    """

    def __init__(self, device: torch.device, keys: Mapping[int, tuple[bytes, bytes]],
                 timeout: timedelta | None = None) -> None:
        import torch.distributed as dist

        super().__init__(dist.get_rank(), dist.get_world_size())
        self.device = device
        self.timeout = None if timeout is None else timeout.total_seconds()
        listener = socket.create_server((gossip_address(), 0), backlog=max(8, len(keys)))
        try:
            addresses = all_gather_objects(list(listener.getsockname()[:2]), "a gossip address")
            self._sockets = self._connect(listener, addresses, keys)
        finally:
            listener.close()
        for conn in self._sockets.values():
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buffers: dict[int, Tensor] = {}

    # ---- connections ----------------------------------------------------------------------------------------------
    def _connect(self, listener: socket.socket, addresses: list, keys: Mapping[int, tuple[bytes, bytes]],
                 ) -> dict[int, socket.socket]:
        sockets: dict[int, socket.socket] = {}
        for peer in sorted(p for p in keys if p > self.rank):  # the lower rank connects
            host, port = addresses[peer]
            if not (isinstance(host, str) and isinstance(port, int)):
                raise PeerFailureError(f"node {self.rank}: node {peer} sent a malformed gossip address {addresses[peer]!r}")
            try:
                conn = socket.create_connection((host, port), timeout=self.timeout)
                conn.sendall(_HELLO.pack(self.rank, _hello_mac(keys[peer][0], self.rank, peer)))
            except OSError as error:
                for opened in sockets.values():
                    opened.close()
                raise self._lost([peer], error) from error
            sockets[peer] = conn
        waiting = {p for p in keys if p < self.rank}
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while waiting:
            listener.settimeout(None if deadline is None else max(0.0, deadline - time.monotonic()))
            try:
                conn, _ = listener.accept()
            except OSError as error:
                for opened in sockets.values():
                    opened.close()
                raise self._lost(sorted(waiting), error) from error
            try:
                conn.settimeout(None if deadline is None else max(0.001, deadline - time.monotonic()))
                hello = self._read_exactly(conn, _HELLO.size)
            except OSError:  # too slow to open, or closed: ignored like a wrong opening
                hello = None
            peer, mac = _HELLO.unpack(hello) if hello is not None else (-1, b"")
            if peer in waiting and hmac.compare_digest(mac, _hello_mac(keys[peer][1], peer, self.rank)):
                sockets[peer] = conn
                waiting.discard(peer)
            else:  # not the neighbour it claims to be (or not one at all): ignored
                conn.close()
        return sockets

    @staticmethod
    def _read_exactly(conn: socket.socket, size: int) -> bytes | None:
        data = b""
        while len(data) < size:
            chunk = conn.recv(size - len(data))
            if not chunk:
                return None
            data += chunk
        return data

    def _lost(self, peers: Iterable[int], cause: BaseException) -> PeerFailureError:
        return PeerFailureError.during_round(self.rank, sorted(peers), cause)

    # ---- one round --------------------------------------------------------------------------------------------------
    def exchange(self, outgoing: Outgoing, incoming: Incoming) -> Received:
        self._check_peers(outgoing, incoming)
        round = self.traffic.rounds
        missing = [p for p in [*outgoing, *incoming] if p not in self._sockets]
        if missing:
            raise RuntimeError(f"node {self.rank}: no gossip connection to node {missing[0]}, not a neighbour in the graph")
        payloads = {peer: pack([t.detach().cpu() for t in tensors]).contiguous() for peer, tensors in outgoing.items()}
        receives = {peer: self._receive_buffer(peer, message_nbytes(specs)) for peer, specs in incoming.items()}
        self._run(round, {peer: [memoryview(struct.pack(">Q", payload.numel())), memoryview(payload.numpy())]
                          for peer, payload in payloads.items()}, dict(receives))
        self.traffic.record({p: FRAME_HEADER + b.numel() for p, b in payloads.items()},
                            {p: FRAME_HEADER + b.numel() for p, b in receives.items()})
        received = {peer: [t.to(self.device) for t in unpack(receives[peer], specs)] for peer, specs in incoming.items()}
        return check_finite(self.rank, received, round)

    def _receive_buffer(self, peer: int, nbytes: int) -> Tensor:
        """The receive buffer kept for ``peer``: the tensors returned are views of it until the next round."""
        buffer = self._buffers.get(peer)
        if buffer is None or buffer.numel() != nbytes:
            buffer = self._buffers[peer] = torch.empty(nbytes, dtype=torch.uint8)
        return buffer

    def _run(self, round: int, sends: dict[int, list[memoryview]], receives: dict[int, Tensor]) -> None:
        """Move the round's bytes: every send and receive progresses as its socket allows. A connection that fails
        ends only its own transfers: the others go on, so that a neighbour's wrong message size is reported rather
        than another neighbour that stopped because of it; the failure is raised once nothing else can move."""
        lost: dict[int, BaseException] = {}
        headers = {peer: bytearray(FRAME_HEADER) for peer in receives}
        got = dict.fromkeys(receives, 0)  # bytes read so far of each frame (its header, then its message)
        targets = {peer: memoryview(buffer.numpy()).cast("B") for peer, buffer in receives.items()}
        with selectors.DefaultSelector() as selector:
            for peer in {*sends, *receives}:
                events = (selectors.EVENT_WRITE if peer in sends else 0) | (selectors.EVENT_READ if peer in receives else 0)
                selector.register(self._sockets[peer], events, peer)
            while selector.get_map():
                ready = selector.select(self.timeout)
                if not ready:
                    raise self._lost([k.data for k in selector.get_map().values()],
                                     TimeoutError(f"no progress in {self.timeout:g} s"))
                for key, events in ready:
                    peer, conn = key.data, key.fileobj
                    try:
                        if events & selectors.EVENT_WRITE and peer in sends:
                            self._send_some(conn, sends[peer])
                            if not sends[peer]:
                                del sends[peer]
                        if events & selectors.EVENT_READ and peer in receives:
                            if self._receive_some(conn, peer, round, headers, got, targets[peer]):
                                del receives[peer]
                    except (ConnectionError, OSError) as error:
                        lost[peer] = error
                        sends.pop(peer, None)
                        receives.pop(peer, None)
                    remaining = (selectors.EVENT_WRITE if peer in sends else 0) | (
                        selectors.EVENT_READ if peer in receives else 0)
                    if not remaining:
                        selector.unregister(conn)
                    elif remaining != key.events:
                        selector.modify(conn, remaining, peer)
        if lost:
            raise self._lost(lost, next(iter(lost.values())))

    @staticmethod
    def _send_some(conn: socket.socket, pieces: list[memoryview]) -> None:
        while pieces:
            try:
                sent = conn.send(pieces[0])
            except BlockingIOError:
                return
            if sent < len(pieces[0]):
                pieces[0] = pieces[0][sent:]
                return
            pieces.pop(0)

    def _receive_some(self, conn: socket.socket, peer: int, round: int, headers: dict[int, bytearray],
                      got: dict[int, int], target: memoryview) -> bool:
        """Read what ``conn`` has of ``peer``'s frame; True once the whole message is in ``target``."""
        while True:
            header = got[peer] < FRAME_HEADER
            view = memoryview(headers[peer])[got[peer]:] if header else target[got[peer] - FRAME_HEADER:]
            if not len(view):
                return True
            try:
                n = conn.recv_into(view)
            except BlockingIOError:
                return False
            if n == 0:
                raise ConnectionError(f"node {peer} closed its gossip connection")
            got[peer] += n
            if header and got[peer] == FRAME_HEADER:
                (announced,) = struct.unpack(">Q", headers[peer])
                if announced != len(target):
                    raise MessageSizeError(
                        f"node {self.rank}: the gossip message from node {peer} in round {round} is {announced} bytes, "
                        f"not the round's {len(target)}: nothing of it was read and training stops here. Every node "
                        f"knows each round's message size, so node {peer} runs a different configuration or is "
                        "faulty or misbehaving: look at its log, then restart every node from the last checkpoint."
                    )

    def close(self) -> None:
        for conn in self._sockets.values():
            conn.close()
        self._sockets = {}

    def __getstate__(self) -> object:
        raise TypeError("FramedExchange holds open connections and cannot be pickled")
