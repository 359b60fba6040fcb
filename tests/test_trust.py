"""Zero trust between nodes, in one process: the roster and identity keys, the signed setup (nodes simulated by
threads, the network between them played by the test) and sealed gossip."""

from __future__ import annotations

import base64
import os
import re
import threading
from collections import defaultdict
from collections.abc import Callable

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from lightning_privdec.cli.keygen import main as keygen
from lightning_privdec.comm import LoopbackNetwork, TensorSpec
from lightning_privdec.comm.identity import (
    AuthenticatedSetup,
    Identity,
    MembershipError,
    Roster,
    authenticate_members,
    check_membership,
    seal_keys,
)
from lightning_privdec.comm.objects import decode, encode
from lightning_privdec.comm.sealed import SEAL_OVERHEAD, SealedExchange, TamperedMessageError


# ---- roster and identity keys --------------------------------------------------------------------------------------------
def make_members(tmp_path, names) -> tuple[Roster, list]:
    """One identity key per name (privdec-keygen) and the roster of their printed lines."""
    lines = []
    for name in names:
        path = tmp_path / f"{name}.key"
        assert keygen([str(path), "--name", name]) == 0
        lines.append(_line(path, name))
    (tmp_path / "roster").write_text("# the members\n" + "\n".join(lines) + "\n")
    return Roster.from_file(tmp_path / "roster"), [tmp_path / f"{name}.key" for name in names]


def _line(path, name) -> str:
    return f"{name} {base64.b64encode(Identity(path).public_key).decode()}"


def test_keygen_writes_a_private_key_file_of_mode_0600_and_prints_its_roster_line(tmp_path, capsys):
    assert keygen([str(tmp_path / "site-a.key")]) == 0
    line = capsys.readouterr().out.strip()
    assert oct(os.stat(tmp_path / "site-a.key").st_mode & 0o777) == "0o600"
    assert line == _line(tmp_path / "site-a.key", "site-a")
    assert keygen([str(tmp_path / "site-a.key")]) == 2  # never overwritten
    assert "never overwritten" in capsys.readouterr().err
    assert keygen([str(tmp_path / "site-a.key"), "--public", "--name", "3"]) == 0
    assert capsys.readouterr().out.strip() == "3 " + line.split()[1]


def test_bad_rosters_and_identity_keys_are_refused_before_anything_starts(tmp_path):
    roster, (a, b) = make_members(tmp_path, ["a", "b"])
    for text, problem in [
        ("a\n", "expected '<name or rank>"),
        ("a c2hvcnQ=\n", "not a base64 32-byte"),
        (f"a {base64.b64encode(bytes(32)).decode()}\na {base64.b64encode(bytes(range(32))).decode()}\n", "same name"),
        ("# nobody\n", "no member"),
    ]:
        with pytest.raises(MembershipError, match=problem):
            Roster.parse(text)
    with pytest.raises(MembershipError, match="go together"):
        check_membership(roster, None)
    os.chmod(a, 0o644)
    with pytest.raises(MembershipError, match="chmod 600"):
        check_membership(roster, a)
    os.chmod(a, 0o600)
    outsider = tmp_path / "outsider.key"
    keygen([str(outsider)])
    with pytest.raises(MembershipError, match="is not in roster .*privdec-keygen --public"):
        check_membership(roster, outsider)
    with pytest.raises(MembershipError, match="privdec-keygen"):
        check_membership(roster, tmp_path / "missing.key")
    assert check_membership(str(tmp_path / "roster"), b)[1] == b


# ---- the signed setup, with the network played by the test ---------------------------------------------------------------
Tamper = Callable[[int, int, list], list]  # (collective number, receiving rank, what it would receive) -> what it gets


class Network:
    """``n`` nodes in threads; ``gather(rank)`` is an all-gather between them, passed through ``tamper``."""

    def __init__(self, n: int, tamper: Tamper | None = None) -> None:
        self.n, self.tamper = n, tamper
        self.barrier = threading.Barrier(n)
        self.slots: dict[tuple[int, int], object] = {}
        self.calls: dict[int, int] = defaultdict(int)
        self.sent: list[list] = []  # every collective's honest values, by rank

    def gather(self, rank: int):
        def all_gather(value, what):
            k = self.calls[rank]
            self.calls[rank] += 1
            self.slots[(k, rank)] = decode(encode(value))
            self.barrier.wait()
            values = [self.slots[(k, r)] for r in range(self.n)]
            if rank == 0:
                self.sent.append(values)
            self.barrier.wait()
            return self.tamper(k, rank, values) if self.tamper else values
        return all_gather


class Forger:
    """Claims a roster member's public key but signs with another key (it does not hold the member's)."""

    def __init__(self, claimed: Identity) -> None:
        self.public_key, self.path = claimed.public_key, claimed.path
        self._key = Ed25519PrivateKey.generate()

    def sign(self, message: bytes) -> bytes:
        return self._key.sign(message)


def run_setup(roster, identities, tamper=None, digests=None, ranks=None):
    """Every node's AuthenticatedSetup or the error it raised, by rank."""
    n = len(identities)
    network = Network(n, tamper)
    results: list = [None] * n

    def node(rank: int) -> None:
        try:
            results[rank] = authenticate_members(
                identities[rank], roster, rank=rank, world_size=n,
                agreement_key=X25519PrivateKey.generate().public_key().public_bytes_raw(),
                configuration_digest=(digests or [b"same"] * n)[rank], gather=network.gather(rank),
            )
        except MembershipError as error:
            results[rank] = error

    threads = [threading.Thread(target=node, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results, network


@pytest.fixture
def members(tmp_path):
    roster, paths = make_members(tmp_path, ["0", "site-b", "site-c"])
    return roster, [Identity(p) for p in paths], tmp_path


def test_members_of_the_roster_agree_on_the_run_and_each_others_keys(members):
    roster, identities, _ = members
    results, _ = run_setup(roster, identities)
    assert all(isinstance(r, AuthenticatedSetup) for r in results)
    assert all(r == results[0] for r in results)
    assert results[0].members == {0: "0", 1: "site-b", 2: "site-c"}
    again, _ = run_setup(roster, identities)
    assert again[0].run_id != results[0].run_id  # a new run id every run


def replace_record(sender: int, new: Callable[[list], list], receivers=(0, 1)) -> Tamper:
    def tamper(k, rank, values):
        if k == 1 and rank in receivers:
            values = list(values)
            values[sender] = new(values[sender])
        return values
    return tamper


def substitute_key(item: list) -> list:
    """A man in the middle replaces the X25519 key in a signed record (he cannot re-sign it)."""
    record = decode(item[0])
    record["agreement_key"] = X25519PrivateKey.generate().public_key().public_bytes_raw()
    return [encode(record), item[1]]


@pytest.mark.parametrize("attack, expected", [
    ("unknown member", r"node 2 presents identity key .* not in roster .*an unknown member"),
    ("forged signature", r"node 2 \(roster member 'site-c'\): its setup signature does not verify"),
    ("key substituted in transit", r"node 1 \(roster member 'site-b'\): its setup signature does not verify"),
    ("replayed setup", r"node 2 \(roster member 'site-c'\) sent a setup signed for another run \(a replayed"),
    ("pinned rank taken", r"node 1 is roster member '0', which may only take rank 0"),
    ("copied identity", r"nodes 1 and 2 both present roster member 'site-b'"),
    ("different configuration", r"node 2 \(roster member 'site-c'\) signed a different training configuration"),
])
def test_every_node_refuses_to_train_naming_the_rank(members, attack, expected):
    roster, identities, tmp_path = members
    digests, tamper = None, None
    if attack == "unknown member":
        keygen([str(tmp_path / "outsider.key")])
        identities[2] = Identity(tmp_path / "outsider.key")
    elif attack == "forged signature":
        identities[2] = Forger(identities[2])
    elif attack == "key substituted in transit":
        tamper = replace_record(1, substitute_key, receivers=(0, 2))
    elif attack == "replayed setup":
        _, earlier = run_setup(roster, identities)
        tamper = replace_record(2, lambda item: earlier.sent[1][2])
    elif attack == "pinned rank taken":
        identities[0], identities[1] = identities[1], identities[0]
    elif attack == "copied identity":
        identities[2] = identities[1]
    elif attack == "different configuration":
        digests = [b"same", b"same", b"other"]
    results, _ = run_setup(roster, identities, tamper=tamper, digests=digests)
    for rank in (0, 2) if attack == "key substituted in transit" else (0, 1):  # the nodes that received the attack
        assert isinstance(results[rank], MembershipError), f"node {rank} accepted: {attack}"
        assert re.search(expected, str(results[rank])), str(results[rank])


# ---- sealed gossip ------------------------------------------------------------------------------------------------------
def edge_keys(n: int) -> list[dict[int, tuple[bytes, bytes]]]:
    """Every node's sealing keys on the complete graph, from one honest setup."""
    private = [X25519PrivateKey.generate() for _ in range(n)]
    setup = AuthenticatedSetup(os.urandom(32), {r: str(r) for r in range(n)},
                               {r: k.public_key().public_bytes_raw() for r, k in enumerate(private)})
    return [seal_keys(private[r], setup, r, [j for j in range(n) if j != r]) for r in range(n)]


def ring_round(rank: int, exchange, step: int) -> dict:
    n = exchange.world_size
    message = [torch.full((5,), float(10 * rank + step)), torch.tensor([rank], dtype=torch.int64)]
    peers = [(rank + 1) % n, (rank - 1) % n]
    specs = [TensorSpec((5,), torch.float32), TensorSpec((1,), torch.int64)]
    received = exchange.exchange({p: message for p in peers}, {p: specs for p in peers})
    return {p: [t.clone() for t in tensors] for p, tensors in received.items()}  # views the next round overwrites


def test_sealed_gossip_delivers_the_same_tensors_with_exactly_16_more_bytes_per_message():
    keys = edge_keys(3)
    plain, sealed = LoopbackNetwork(3), LoopbackNetwork(3)

    def run(network, seal):
        def node(rank, exchange):
            exchange = SealedExchange(exchange, keys[rank]) if seal else exchange
            received = [ring_round(rank, exchange, step) for step in range(3)]
            return received, exchange.traffic.bytes_sent, exchange.traffic.rounds
        return network.run(node)

    for (got, sent_sealed, rounds), (want, sent_plain, _) in zip(run(sealed, True), run(plain, False)):
        for a, b in zip(got, want):
            assert a.keys() == b.keys() and all(torch.equal(x, y) for p in a for x, y in zip(a[p], b[p]))
        assert sent_sealed == sent_plain + SEAL_OVERHEAD * 2 * rounds  # two messages per round


def seal_pair():
    keys = edge_keys(3)
    sender = SealedExchange(LoopbackNetwork(3).exchanges[1], keys[1])
    receiver = SealedExchange(LoopbackNetwork(3).exchanges[0], keys[0])
    return sender, receiver, keys


SPECS = [TensorSpec((4,), torch.float32)]


@pytest.mark.parametrize("attack", ["tampered", "replayed", "reordered", "forged", "reflected"])
def test_a_tampered_replayed_reordered_or_forged_message_is_rejected_naming_the_sender_and_round(attack):
    sender, receiver, keys = seal_pair()
    first, second = sender._seal(0, [torch.ones(4)]), sender._seal(0, [torch.full((4,), 2.0)])
    assert torch.equal(receiver._open(1, first, SPECS, 0, 0)[0], torch.ones(4))  # round 0 arrives intact
    if attack == "tampered":
        message = second.clone()
        message[3] ^= 1
    elif attack == "replayed":
        message = first
    elif attack == "reordered":  # message 2 where message 1 is due
        message = sender._seal(0, [torch.full((4,), 3.0)])
    elif attack == "forged":  # node 2 (or anyone) seals as node 1 under its own key
        message = SealedExchange(LoopbackNetwork(3).exchanges[2], keys[2])._seal(0, [torch.full((4,), 2.0)])
    else:  # node 0's own message to node 1, sent back to it
        message = receiver._seal(1, [torch.full((4,), 2.0)])
    with pytest.raises(TamperedMessageError, match=r"node 0: the gossip message from node 1 in round 1 does not "
                                                   r"authenticate.*Nothing of it was used"):
        receiver._open(1, message, SPECS, 1, 1)
    assert torch.equal(receiver._open(1, second, SPECS, 1, 1)[0], torch.full((4,), 2.0))  # the genuine one opens


def test_a_tampered_message_stops_the_receiving_node_inside_the_exchange():
    keys = edge_keys(3)
    network = LoopbackNetwork(3, timeout=1)

    class FlipOneBit:  # the network between node 1 and node 0, at round 1
        def __init__(self, inner):
            self.inner, self.calls = inner, 0

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def start(self, outgoing, incoming, tag=0):
            self.calls += 1
            if self.calls == 2:
                outgoing = {p: [t.clone() for t in m] for p, m in outgoing.items()}
                outgoing[0][0][7] ^= 0x40
            return self.inner.start(outgoing, incoming, tag)

        def exchange(self, outgoing, incoming):
            return self.start(outgoing, incoming).wait()

    def node(rank, exchange):
        inner = FlipOneBit(exchange) if rank == 1 else exchange
        sealed = SealedExchange(inner, keys[rank])
        return [ring_round(rank, sealed, step) for step in range(3)]

    with pytest.raises(TamperedMessageError, match="node 0: the gossip message from node 1 in round 1"):
        network.run(node)


def test_a_non_finite_message_is_refused_naming_its_sender_before_anything_is_mixed():
    from lightning_privdec.comm import NonFiniteMessageError

    def node(rank, exchange):
        for step in range(2):
            value = float("nan") if (rank, step) == (1, 1) else float(rank)
            specs = [TensorSpec((3,), torch.float32)]
            exchange.exchange({(rank + 1) % 2: [torch.full((3,), value)]}, {(rank + 1) % 2: specs})

    with pytest.raises(NonFiniteMessageError, match=r"node 0: the gossip message from node 1 in round 1 holds NaN"):
        LoopbackNetwork(2, timeout=3).run(node)


def test_an_identity_key_path_may_name_one_key_per_process(tmp_path):
    from lightning_privdec.comm.identity import identity_path

    roster, _ = make_members(tmp_path, ["site-a-0", "site-a-1"])
    template = tmp_path / "site-a-{local_rank}.key"
    checked_roster, path = check_membership(roster, template)  # nothing to read until the rank is known
    assert path == template
    assert identity_path(roster, path, rank=5, local_rank=1, node_rank=2) == tmp_path / "site-a-1.key"
    with pytest.raises(MembershipError, match="privdec-keygen"):
        identity_path(roster, path, rank=2, local_rank=2, node_rank=1)
    with pytest.raises(MembershipError, match="placeholders"):
        check_membership(roster, tmp_path / "{machine}.key")


def _directories_of(strategy, monkeypatch, cwd, **trainer):
    """The output directories ``strategy`` names once attached to a Trainer built with ``trainer`` in ``cwd``."""
    import lightning as L

    from lightning_privdec.data.digits import DigitsClassifier

    monkeypatch.chdir(cwd)
    model = DigitsClassifier()
    trainer = L.Trainer(**{"accelerator": "cpu", "devices": 1, "strategy": strategy, "logger": False, **trainer})
    trainer.strategy.connect(model)
    model.trainer = trainer
    return strategy.output_directories()


def test_an_identity_key_inside_the_runs_checkpoint_or_log_directories_is_refused(tmp_path, monkeypatch):
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    from lightning_privdec.comm.identity import check_key_outside
    from lightning_privdec.strategies import DecentralizedSGDStrategy, DP2SGDStrategy

    roster, (key,) = make_members(tmp_path / "keys", ["site-a"])
    inside = {
        "the Trainer's default_root_dir": dict(default_root_dir=tmp_path / "keys"),
        "a ModelCheckpoint's dirpath": dict(default_root_dir=tmp_path / "out",
                                            callbacks=[ModelCheckpoint(dirpath=tmp_path / "keys")]),
        "the CSVLogger's directory": dict(default_root_dir=tmp_path / "out", logger=CSVLogger(tmp_path, name="keys")),
    }
    for what, trainer in inside.items():
        directories = _directories_of(DecentralizedSGDStrategy(roster=roster, identity_key=key), monkeypatch, tmp_path,
                                      **trainer)
        with pytest.raises(MembershipError, match=f"lies inside {re.escape(what)}.*move the file"):
            check_key_outside(key, directories)
    for ledger_dir, refused in ((tmp_path / "keys" / "ledger", False), (tmp_path, True)):
        private = DP2SGDStrategy(roster=roster, identity_key=key, max_grad_norm=1.0, noise_multiplier=1.0,
                                 ledger_dir=ledger_dir)
        directories = _directories_of(private, monkeypatch, tmp_path, default_root_dir=tmp_path / "out")
        if refused:
            with pytest.raises(MembershipError, match=r"lies inside the write-ahead ledger directory \(ledger_dir\)"):
                check_key_outside(key, directories)
        else:
            check_key_outside(key, directories)
    # Lightning's default root, the working directory: only the folders it writes there are the run's
    default = _directories_of(DecentralizedSGDStrategy(roster=roster, identity_key=key), monkeypatch, tmp_path)
    check_key_outside(key, default)  # keys/ next to the script is fine
    with pytest.raises(MembershipError, match="lies inside the Trainer's default checkpoint directory"):
        check_key_outside(tmp_path / "checkpoints" / "site-a.key", default)
    with pytest.raises(MembershipError, match="lies inside the Trainer's default log directory"):
        check_key_outside(tmp_path / "lightning_logs" / "version_0" / "site-a.key", default)


# ---- length-framed gossip --------------------------------------------------------------------------------------------------
def _framed(rank: int, peer: int, conn) -> "FramedExchange":  # noqa: F821
    """A FramedExchange of ``rank`` whose connection to ``peer`` is ``conn`` (no process group needed)."""
    from lightning_privdec.comm.base import Exchange
    from lightning_privdec.comm.framed import FramedExchange

    exchange = FramedExchange.__new__(FramedExchange)
    Exchange.__init__(exchange, rank, 2)
    exchange.device, exchange.timeout, exchange._buffers = torch.device("cpu"), 10.0, {}
    conn.setblocking(False)
    exchange._sockets = {peer: conn}
    return exchange


def _both(first: Callable, second: Callable) -> list:
    """Run two nodes' rounds at once; each one's result or exception."""
    results: list = [None, None]

    def run(i, call):
        try:
            results[i] = call()
        except Exception as error:  # noqa: BLE001
            results[i] = error

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate((first, second))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


def test_framed_gossip_delivers_large_messages_both_ways_and_stops_on_a_wrong_size_naming_the_sender_and_round():
    import socket

    from lightning_privdec.comm.framed import FRAME_HEADER, MessageSizeError

    a, b = socket.socketpair()
    node0, node1 = _framed(0, 1, a), _framed(1, 0, b)
    x0, x1 = torch.randn(1 << 20), torch.randn(1 << 20)  # 4 MB: more than the sockets buffer, both ways at once
    spec = [TensorSpec((1 << 20,), torch.float32)]
    got0, got1 = _both(lambda: node0.exchange({1: [x0]}, {1: spec}), lambda: node1.exchange({0: [x1]}, {0: spec}))
    assert torch.equal(got0[1][0], x1) and torch.equal(got1[0][0], x0)
    assert node0.traffic.bytes_sent == node0.traffic.bytes_received == 4 * (1 << 20) + FRAME_HEADER
    for wrong in (torch.randn((1 << 20) + 1), torch.randn(2)):  # one float too many, then far too few
        sender = threading.Thread(target=_both, args=(lambda: node1.exchange({0: [wrong]}, {}), lambda: None))
        sender.start()
        with pytest.raises(MessageSizeError, match=f"node 0: the gossip message from node 1 in round 1 is "
                           f"{wrong.numel() * 4} bytes, not the round's {4 << 20}: nothing of it was read"):
            node0.exchange({}, {1: spec})
        a.close()  # the stopped node's connection holds the rest of the message: the sender fails, then a new pair
        sender.join(30)
        node1.close()
        a, b = socket.socketpair()
        node0, node1 = _framed(0, 1, a), _framed(1, 0, b)
        node0.traffic.rounds = node1.traffic.rounds = 1
    node0.close()
    node1.close()


def test_sealed_framed_gossip_rounds_posted_ahead_arrive_in_order():
    """overlap=True posts a round with ``start`` and waits for it later: over framed TCP the round runs at once."""
    import socket

    a, b = socket.socketpair()
    keys = (os.urandom(32), os.urandom(32))
    node0 = SealedExchange(_framed(0, 1, a), {1: keys})
    node1 = SealedExchange(_framed(1, 0, b), {0: keys[::-1]})
    spec = [TensorSpec((3,), torch.float32)]
    messages = [torch.full((3,), float(r)) for r in range(3)]

    def rounds(node, peer):
        pending = [node.start({peer: [m * (node.rank + 1)]}, {peer: spec}, tag=r % 2) for r, m in enumerate(messages)]
        return [p.wait()[peer][0] for p in pending]

    got0, got1 = _both(lambda: rounds(node0, 1), lambda: rounds(node1, 0))
    assert [t.tolist() for t in got0] == [(m * 2).tolist() for m in messages]
    assert [t.tolist() for t in got1] == [m.tolist() for m in messages]
    node0.close()
    node1.close()


def test_a_framed_connection_that_does_not_prove_its_sender_is_ignored():
    import socket

    from lightning_privdec.comm.base import Exchange
    from lightning_privdec.comm.framed import _HELLO, FramedExchange, _hello_mac

    keys = {0: (os.urandom(32), os.urandom(32))}  # node 1's (sending, receiving) keys with node 0
    listener = socket.create_server(("127.0.0.1", 0))
    address = listener.getsockname()
    impostor = socket.create_connection(address)  # claims to be node 0 without its key
    impostor.sendall(_HELLO.pack(0, os.urandom(32)))
    honest = socket.create_connection(address)
    honest.sendall(_HELLO.pack(0, _hello_mac(keys[0][1], 0, 1)))  # node 0 signs with its sending key = node 1's receiving
    node1 = FramedExchange.__new__(FramedExchange)
    Exchange.__init__(node1, 1, 2)
    node1.timeout = 10.0
    sockets = node1._connect(listener, [None, None], keys)
    honest.sendall(b"x")
    assert sockets[0].recv(1) == b"x"  # the accepted connection is the honest one
    assert impostor.recv(1) == b""  # the impostor's was closed
    for conn in (listener, impostor, honest, sockets[0]):
        conn.close()


# ---- bounded influence: robust="clip" ------------------------------------------------------------------------------------
def test_a_clipped_exchange_moves_no_received_model_farther_than_the_radius_and_leaves_close_ones_alone():
    from lightning_privdec.comm.robust import ClippedExchange

    def node(rank, exchange):
        exchange = ClippedExchange(exchange, radius=1.0)
        own = torch.zeros(4) if rank == 0 else torch.full((4,), 100.0 if rank == 1 else 0.1)
        peers = [p for p in range(3) if p != rank]
        received = exchange.exchange({p: [own] for p in peers}, {p: [TensorSpec((4,), torch.float32)] for p in peers})
        return {p: t[0].clone() for p, t in received.items()}, exchange.clipped

    (at_0, clipped_0), *_ = LoopbackNetwork(3).run(node)
    assert torch.allclose(at_0[1], torch.full((4,), 0.5)) and clipped_0 == {1: 1}  # 100 -> radius 1 towards it
    assert torch.equal(at_0[2], torch.full((4,), 0.1))  # within the radius: unchanged


def test_robust_clip_is_refused_where_the_message_is_not_the_model():
    from lightning_privdec.strategies import DecentralizedPushSumStrategy, DecentralizedSGDStrategy

    with pytest.raises(ValueError, match="does not support robust='clip'"):
        DecentralizedPushSumStrategy(robust="clip", robust_radius=1.0)
    with pytest.raises(ValueError, match="with a compressor does not support"):
        DecentralizedSGDStrategy(compressor="randk:0.5", robust="clip", robust_radius=1.0)
    with pytest.raises(ValueError, match="needs robust_radius"):
        DecentralizedSGDStrategy(robust="clip")
    with pytest.raises(ValueError, match="only applies with robust='clip'"):
        DecentralizedSGDStrategy(robust_radius=1.0)
    assert DecentralizedSGDStrategy(robust="clip", robust_radius=0.5).robust_radius == 0.5


def test_robust_clip_keeps_honest_nodes_accurate_next_to_a_sign_flipping_neighbour():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from robust_clip import run

    plain = run(4, 60, "sign-flip", None, scale=10.0, sigma=1.0, lr=0.5)
    clipped = run(4, 60, "sign-flip", 0.5, scale=10.0, sigma=1.0, lr=0.5)
    assert plain is None or min(plain) < 0.3, plain  # None: the plain models diverged to infinity
    assert clipped is not None and min(clipped) > 0.7, clipped
