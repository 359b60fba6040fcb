"""A malicious node among honest ones: 3 processes over gloo, rank 2 attacks every path between nodes in turn.

Each attack runs the honest code on ranks 0 and 1 and a modified version on rank 2, over the real collectives and
point-to-point exchange; every honest node records what it did. Expected: it refuses the foreign object or stops
naming node 2 (and the round), and nothing rank 2 sent ever executes (its pickles would create a marker file).
Running ``python -m tests.test_trust_multiprocess`` prints the table of attacks and outcomes.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from lightning_privdec.cli.keygen import main as keygen
from lightning_privdec.comm import TorchDistributedExchange
from lightning_privdec.comm.identity import Identity, Roster, authenticate_members, seal_keys, write_identity_key
from lightning_privdec.comm.objects import all_gather_bytes, broadcast_bytes, decode, encode, gather_bytes, gather_objects
from lightning_privdec.comm.robust import ClippedExchange
from lightning_privdec.comm.sealed import SealedExchange
from lightning_privdec.comm.wire import TensorSpec
from lightning_privdec.privacy.pairwise import PairwiseSecrets, exchange_public_keys, verify_agreement
from lightning_privdec.strategies import DecentralizedPushSumStrategy
from lightning_privdec.strategies.checks import gather_from_nodes
from tests.multiprocess import die_with_parent, fit_digits_in_one_launch

WORLD, ATTACKER = 3, 2
SPECS = [TensorSpec((8,), torch.float32)]

#: attack -> (the exception every honest receiver raises, what its message must say)
EXPECTED = {
    "pickle in the configuration check": ("UnsafeObjectError", "a setup check from node 2 is not a typed"),
    "pickle in Decor's public-key exchange": ("UnsafeObjectError", "public key from node 2 is not a typed"),
    "pickle in Decor's agreement check": ("UnsafeObjectError", "fingerprints from node 2 is not a typed"),
    "pickle in strategy.broadcast": ("UnsafeObjectError", "broadcast from node 2 is not a typed"),
    "pickle in checkpoint gathering": ("UnsafeObjectError", "checkpoint state from node 2 is not a typed"),
    "unknown identity": ("MembershipError", "node 2 presents identity key"),
    "forged signature": ("MembershipError", "node 2 (roster member '2'): its setup signature does not verify"),
    "public key substituted": ("MembershipError", "node 2 (roster member '2'): its setup signature does not verify"),
    "replayed setup": ("MembershipError", "node 2 (roster member '2') sent a setup signed for another run"),
    "tampered gossip": ("TamperedMessageError", "message from node 2 in round 1 does not authenticate"),
    "replayed gossip": ("TamperedMessageError", "message from node 2 in round 1 does not authenticate"),
    "reordered gossip": ("TamperedMessageError", "message from node 2 in round 1 does not authenticate"),
    "forged gossip": ("TamperedMessageError", "message from node 2 in round 1 does not authenticate"),
    "non-finite gossip": ("NonFiniteMessageError", "message from node 2 in round 1 holds NaN"),
    "huge gossip (robust='clip')": ("clipped", "moved this node by at most the radius"),
}
#: the receivers of each attack (a gather reaches rank 0 only)
VICTIMS = {"pickle in checkpoint gathering": (0,)}


class Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class Forger:
    def __init__(self, claimed: Identity) -> None:
        self.public_key, self._key = claimed.public_key, Ed25519PrivateKey.generate()

    def sign(self, message: bytes) -> bytes:
        return self._key.sign(message)


def setup(rank: int, keys: Path, identity=None, gather=None, kept: dict | None = None):
    """The signed setup on every rank and this rank's sealing keys; ``kept`` receives what this rank signed."""
    agreement = X25519PrivateKey.generate()

    def recording(value, what):
        if kept is not None and what == "a signed setup record":
            kept["record"] = value
        return (gather or _gather)(value, what)

    result = authenticate_members(
        identity or Identity(keys / f"node{rank}.key"), Roster.from_file(keys / "roster"), rank=rank, world_size=WORLD,
        agreement_key=agreement.public_key().public_bytes_raw(), configuration_digest=b"config", gather=recording,
    )
    return seal_keys(agreement, result, rank, [r for r in range(WORLD) if r != rank])


def _gather(value, what):
    return [decode(raw) for raw in all_gather_bytes(encode(value))]


class Attacker(SealedExchange):
    """Rank 2's sealed exchange: honest in round 0, ``attack`` in round 1."""

    def __init__(self, inner, keys, attack: str) -> None:
        super().__init__(inner, keys)
        self.attack, self.first = attack, {}

    def _seal(self, peer, tensors, reuse=False):  # fresh buffers: it keeps its first messages to replay them
        attacking = self.rounds == 2  # counted from 1 while round r's messages are sealed: round 1
        if attacking and self.attack == "non-finite gossip":
            tensors = [torch.full((8,), float("nan"))]
        if attacking and self.attack.startswith("huge gossip"):
            tensors = [torch.full((8,), 1e30)]
        sealed = super()._seal(peer, tensors)
        if attacking:
            if self.attack == "tampered gossip":
                sealed = sealed.clone()
                sealed[5] ^= 1
            elif self.attack == "replayed gossip":
                sealed = self.first[peer]
            elif self.attack == "reordered gossip":  # the round-2 message sent in round 1
                sealed = super()._seal(peer, tensors)
            elif self.attack == "forged gossip":
                forger = SealedExchange(self.inner, {peer: (os.urandom(32), os.urandom(32))})
                sealed = forger._seal(peer, tensors)
        self.first.setdefault(peer, sealed)
        return sealed


def gossip(rank: int, keys: Path, attack: str) -> None:
    edge_keys = setup(rank, keys)
    inner = TorchDistributedExchange(torch.device("cpu"), timeout=timedelta(seconds=20))
    exchange = Attacker(inner, edge_keys, attack) if rank == ATTACKER else SealedExchange(inner, edge_keys)
    clip = "robust='clip'" in attack and rank != ATTACKER
    if clip:
        exchange = ClippedExchange(exchange, radius=1.0)
    peers = [r for r in range(WORLD) if r != rank]
    for step in range(2):
        own = torch.full((8,), 0.1 * rank)  # honest models within the radius of each other
        received = exchange.exchange({p: [own] for p in peers}, {p: SPECS for p in peers})
        if not clip:
            assert all(torch.equal(received[p][0], torch.full((8,), 0.1 * p)) for p in peers)
    if clip:  # accepted, but node 2 moved this node by at most the radius
        moved = float((received[ATTACKER][0] - own).norm())
        assert exchange.clipped == {ATTACKER: 1} and moved <= 1.0 + 1e-6, (exchange.clipped, moved)
        raise Clipped(f"clipped: node 2's model moved this node by at most the radius ({moved:.3f} <= 1)")


class Clipped(Exception):
    """The outcome of a well-formed but huge message under robust='clip' (recorded, not an error)."""


def attack(name: str, rank: int, tmp: Path, keys: Path, state: dict) -> None:
    """One attack: the honest path on ranks 0 and 1, the attacker's on rank 2."""
    bad = rank == ATTACKER
    payload = pickle.dumps(Payload(str(tmp / f"executed-on-a-node-{name.replace(' ', '-')}")))
    if name == "pickle in the configuration check":
        all_gather_bytes(payload) if bad else gather_from_nodes({"strategy": "DecentralizedPushSumStrategy"})
    elif name == "pickle in Decor's public-key exchange":
        all_gather_bytes(payload) if bad else exchange_public_keys(PairwiseSecrets(rank, [(rank + 1) % 3, (rank + 2) % 3]))
    elif name == "pickle in Decor's agreement check":
        secrets = PairwiseSecrets(rank, [(rank + 1) % 3, (rank + 2) % 3])
        secrets.agree(exchange_public_keys(secrets))  # an honest agreement first
        all_gather_bytes(payload) if bad else verify_agreement(secrets)
    elif name == "pickle in strategy.broadcast":
        broadcast_bytes(payload, src=2) if bad else DecentralizedPushSumStrategy().broadcast("ckpt.ckpt", src=2)
    elif name == "pickle in checkpoint gathering":
        gather_bytes(payload, 0) if bad else gather_objects({"rank": rank}, 0, "a node's checkpoint state")
    elif name == "unknown identity":
        setup(rank, keys, identity=Identity(keys / "outsider.key") if bad else None)
    elif name == "forged signature":
        setup(rank, keys, identity=Forger(Identity(keys / "node2.key")) if bad else None)
    elif name in ("replayed setup", "public key substituted"):
        def stale(value, what):  # rank 2 sends what it signed in an earlier run (substituted: with a new X25519 key)
            if what == "a signed setup record":
                body, signature = state["record"]
                record = decode(body)
                if name == "public key substituted":
                    record.update(run=decode(value[0])["run"], agreement_key=os.urandom(32))
                value = [encode(record), signature]
            return _gather(value, what)
        setup(rank, keys, gather=stale if bad else None)
    else:
        gossip(rank, keys, name)


def _worker(rank: int, tmp: str, keys: str) -> None:
    die_with_parent()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(f"{tmp}/store", WORLD), rank=rank, world_size=WORLD)
    outcomes, state = {}, {}
    try:
        setup(rank, Path(keys), kept=state)  # an honest run first: rank 2 keeps what it signed, for the replay
        for name in EXPECTED:
            try:
                attack(name, rank, Path(tmp), Path(keys), state)
                outcomes[name] = "accepted"
            except Exception as error:  # noqa: BLE001 - the outcome is what is recorded
                outcomes[name] = str(error) if isinstance(error, Clipped) else f"{type(error).__name__}: {error}"
            dist.barrier()
    finally:
        Path(tmp, f"outcomes{rank}.json").write_text(json.dumps(outcomes))
        dist.destroy_process_group()


def run_harness(tmp: Path) -> list[dict]:
    keys = tmp / "keys"
    lines = []
    for name in ("node0", "node1", "node2", "outsider"):
        keygen([str(keys / f"{name}.key"), "--name", name[-1]])
        if name != "outsider":
            lines.append(f"{name[-1]} {base64.b64encode(Identity(keys / f'{name}.key').public_key).decode()}")
    (keys / "roster").write_text("\n".join(lines) + "\n")
    mp.set_forkserver_preload([__name__])
    try:
        mp.start_processes(_worker, args=(str(tmp), str(keys)), nprocs=WORLD, join=True, start_method="forkserver")
    finally:
        mp.set_forkserver_preload([])
    return [json.loads(Path(tmp, f"outcomes{r}.json").read_text()) for r in range(WORLD)]


def table(outcomes: list[dict]) -> str:
    rows = ["| attack by node 2 | node 0 | node 1 |", "|---|---|---|"]
    for name in EXPECTED:
        cells = [outcomes[r][name] if r in VICTIMS.get(name, (0, 1)) else "(not a receiver)" for r in (0, 1)]
        rows.append(f"| {name} | " + " | ".join(c.split(":")[0] if c != "accepted" else "ACCEPTED" for c in cells) + " |")
    return "\n".join(rows)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_every_attack_of_a_malicious_node_is_refused_naming_it_and_none_of_its_code_runs(tmp_path):
    outcomes = run_harness(tmp_path)
    for name, (error, says) in EXPECTED.items():
        for rank in VICTIMS.get(name, (0, 1)):
            outcome = outcomes[rank][name]
            assert outcome.startswith(error) and says in outcome, f"node {rank}, {name}: {outcome}"
    assert not list(tmp_path.glob("executed-on-a-node-*")), "a pickle sent by node 2 was executed"
    print(table(outcomes))


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_fit_with_a_roster_takes_the_same_steps_as_without_and_sends_16_more_bytes_per_message(tmp_path):
    keys = tmp_path / "keys"
    lines = [f"{r} {base64.b64encode(write_identity_key(keys / f'node{r}.key')).decode()}" for r in range(WORLD)]
    (keys / "roster").write_text("\n".join(lines) + "\n")
    sealed = json.dumps({"roster": str(keys / "roster"), "identity_key": str(keys / "node{rank}.key")})
    common = ["--topology", "ring", "--max-epochs", "1"]
    plain_run, sealed_run = fit_digits_in_one_launch(
        (tmp_path / "plain", common), (tmp_path / "sealed", [*common, "--strategy-kwargs", sealed]), devices=WORLD
    )
    for plain, secure in zip(plain_run, sealed_run):
        assert torch.equal(plain["params"], secure["params"]), f"node {plain['rank']}: sealing changed the model"
        messages = 2 * secure["rounds"]  # a ring: two neighbours per round
        assert secure["bytes_sent"] - plain["bytes_sent"] == 16 * messages


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        print(table(run_harness(Path(directory))))
    sys.exit(0)
