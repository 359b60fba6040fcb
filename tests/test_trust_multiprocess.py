"""A malicious node among honest ones: 3 processes over gloo, rank 2 attacks every path between nodes in turn.

Each attack runs the honest code on ranks 0 and 1 and a modified version on rank 2, over the real collectives and
point-to-point exchange; every honest node records what it did. Expected: it refuses the foreign object or stops
naming node 2 (and the round), and nothing rank 2 sent ever executes (its pickles would create a marker file).
In the second half the same processes train (DP²-SGD with a roster, a checkpoint every 2 steps, the write-ahead
privacy ledger) and rank 2 attacks a restart and the gossip round after a checkpoint: the honest nodes' files stay
as they were, and their checkpoints and ledgers read back as recorded and resume. Running
``python -m tests.test_trust_multiprocess`` prints the table of attacks and outcomes.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import os
import pickle
import shutil
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_privdec.cli.keygen import main as keygen
from lightning_privdec.comm.identity import Identity, Roster, authenticate_members, seal_keys, write_identity_key
from lightning_privdec.comm.framed import FRAME_HEADER, FramedExchange
from lightning_privdec.comm.objects import all_gather_bytes, broadcast_bytes, decode, encode, gather_bytes, gather_objects
from lightning_privdec.comm.robust import ClippedExchange
from lightning_privdec.comm.sealed import SEAL_OVERHEAD, SealedExchange
from lightning_privdec.comm import TensorSpec
from lightning_privdec.data.digits import DigitsClassifier, DigitsDataModule
from lightning_privdec.privacy.pairwise import PairwiseSecrets, exchange_public_keys, verify_agreement
from lightning_privdec.privacy.write_ahead import WriteAheadLedger
from lightning_privdec.strategies import DecentralizedPushSumStrategy, DP2SGDStrategy
from lightning_privdec.strategies.checks import describe, gather_from_nodes
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
    "undersized gossip": ("MessageSizeError", "message from node 2 in round 1 is 40 bytes, not the round's 48"),
    "oversized gossip": ("MessageSizeError", "message from node 2 in round 1 is 56 bytes, not the round's 48"),
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


class AttackDone(Exception):
    """Raised by the attacker after its attack round, so that every process leaves the fit together."""


class Attacker(SealedExchange):
    """Rank 2's sealed exchange: honest before round ``at_round``, ``attack`` in it; with ``stop``, it raises
    :class:`AttackDone` once that round's messages have arrived."""

    def __init__(self, inner, keys, attack: str, at_round: int = 1, stop: bool = False) -> None:
        super().__init__(inner, keys)
        self.attack, self.first, self.at_round, self.stop = attack, {}, at_round, stop

    def _seal(self, peer, tensors, reuse=False):  # fresh buffers: it keeps its first messages to replay them
        attacking = self.rounds == self.at_round + 1  # counted from 1 while round r's messages are sealed
        if attacking and self.attack.startswith("non-finite gossip"):
            tensors = [torch.full_like(t, float("nan")) if t.is_floating_point() else t for t in tensors]
        if attacking and self.attack.startswith("huge gossip"):
            tensors = [torch.full_like(t, 1e30) for t in tensors]
        sealed = super()._seal(peer, tensors)
        if attacking:
            if self.attack.startswith("tampered gossip"):
                sealed = sealed.clone()
                sealed[5] ^= 1
            elif self.attack.startswith("replayed gossip"):
                sealed = self.first[peer]
            elif self.attack.startswith("reordered gossip"):  # the next round's message sent in this one
                sealed = super()._seal(peer, tensors)
            elif self.attack.startswith("forged gossip"):
                forger = SealedExchange(self.inner, {peer: (os.urandom(32), os.urandom(32))})
                sealed = forger._seal(peer, tensors)
            elif self.attack.startswith("undersized gossip"):  # 8 bytes short (gloo would accept it)
                sealed = sealed[:-8]
            elif self.attack.startswith("oversized gossip"):  # 8 bytes too many (gloo would abort the receiver)
                sealed = torch.cat([sealed, sealed[:8]])
        self.first.setdefault(peer, sealed)
        return sealed

    def _open_round(self, received, expected, reuse):
        opened = super()._open_round(received, expected, reuse)
        if self.stop and self.rounds > self.at_round:
            raise AttackDone(f"node {self.rank} sent its attack in round {self.at_round}")
        return opened


def gossip(rank: int, keys: Path, attack: str) -> None:
    edge_keys = setup(rank, keys)
    inner = FramedExchange(torch.device("cpu"), edge_keys, timeout=timedelta(seconds=20))
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


# ---- attacks on nodes that train: their checkpoints and write-ahead ledger stay intact ----------------------------------
#: steps of an attacked fit before its attack: the fit checkpoints after them (every 2 steps), then node 2 attacks
STEPS_BEFORE_ATTACK = 2
#: attack on a training run -> (the exception of every honest node, what its message must say)
TRAINING_EXPECTED = {
    "unknown identity at a restart": ("MembershipError", "node 2 presents identity key"),
    **{f"{name} while training": ("TamperedMessageError", "message from node 2 in round {round} does not authenticate")
       for name in ("tampered gossip", "replayed gossip", "reordered gossip", "forged gossip")},
    "non-finite gossip while training": ("NonFiniteMessageError", "message from node 2 in round {round} holds NaN"),
    "oversized gossip while training": ("MessageSizeError", "message from node 2 in round {round} is 19264 bytes, "
                                                            "not the round's 19256"),
}
SETUP_ATTACKS = ("unknown identity at a restart",)
#: a honest node's misconfiguration, refused by every node before anything is written
KEY_IN_CHECKPOINTS = "identity key inside the checkpoint directory"


class AttackingStrategy(DP2SGDStrategy):
    """Rank 2's strategy in the training attacks: the honest one (its class name, hence its configuration, reads the
    same) with ``attack``: at setup, or in the gossip round after its first checkpoint."""

    def __init__(self, attack: str, outsider: Path, **kwargs) -> None:
        super().__init__(**kwargs)
        self.attack, self.outsider = attack, outsider

    def authenticate_members(self) -> None:
        if not self.attack.startswith("unknown identity"):
            return super().authenticate_members()
        gather_from_nodes(None)  # the honest nodes' key-location round: nothing to report
        mine = {name: describe(value) for name, value in self.configuration().items()}
        authenticate_members(
            Identity(self.outsider), self.roster, rank=self.global_rank, world_size=self.world_size,
            agreement_key=X25519PrivateKey.generate().public_key().public_bytes_raw(),
            configuration_digest=hashlib.sha256(encode(mine)).digest(),
        )

    def make_exchange(self):
        inner = FramedExchange(self.root_device, self._seal_keys, timeout=self.peer_timeout)
        return Attacker(inner, self._seal_keys, self.attack, at_round=STEPS_BEFORE_ATTACK, stop=True)


AttackingStrategy.__name__ = AttackingStrategy.__qualname__ = "DP2SGDStrategy"


class LedgerAtCheckpoints(Callback):
    """What this node's privacy ledger held at every checkpoint it took part in, by global step."""

    def __init__(self) -> None:
        self.saved: dict[int, dict] = {}

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:  # noqa: ANN001
        dp = trainer.strategy.privacy
        self.saved[trainer.global_step] = {"steps": dp.steps, "ledger": copy.deepcopy(dp.ledger.state_dict()),
                                           "epsilon": dp.epsilon()}


def fit_node(rank: int, run: Path, keys: Path, max_steps: int, resume: Path | None = None, attack: str | None = None,
             identity: Path | None = None) -> dict:
    """One private fit (DP²-SGD on digits, a roster, 3 nodes) checkpointing every 2 steps into ``run/ckpt``, its
    write-ahead ledger in ``run/ckpt/privacy_ledger``; what this node recorded: its ledger at each checkpoint and at
    the end, and the error that stopped it."""
    L.seed_everything(0, verbose=False)
    options = dict(topology="complete", max_grad_norm=1.0, noise_multiplier=1.0, roster=str(keys / "roster"),
                   identity_key=str(identity or keys / f"node{rank}.key"), peer_timeout=30, divergence_guard=False)
    attacking = attack is not None and rank == ATTACKER
    strategy = AttackingStrategy(attack, keys / "outsider.key", **options) if attacking else DP2SGDStrategy(**options)
    recorder = LedgerAtCheckpoints()
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=max_steps, logger=False, default_root_dir=run,
        callbacks=[ModelCheckpoint(dirpath=run / "ckpt", every_n_train_steps=2, save_top_k=-1), recorder],
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )
    error = None
    try:
        trainer.fit(DigitsClassifier(lr=0.3), datamodule=DigitsDataModule(batch_size=32), ckpt_path=resume)
    except Exception as exc:  # noqa: BLE001 - the outcome is what is recorded
        error = f"{type(exc).__name__}: {exc}"
    dp = strategy.privacy
    return {"error": error, "saved": recorder.saved, "steps": dp.steps if dp else 0,
            "epsilon": dp.epsilon() if dp is not None and dp.steps else 0.0}


def checkpoint_at(run: Path, step: int) -> Path:
    (path,) = (run / "ckpt").glob(f"epoch=*-step={step}.ckpt")
    return path


def digests(folder: Path, without: str = "privacy_ledger") -> dict[str, str]:
    """SHA-256 of every file under ``folder`` (but the ``without`` subfolder), by relative path."""
    return {str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.rglob("*"))
            if f.is_file() and without not in f.relative_to(folder).parts}


def after_the_stop(rank: int, run: Path, step: int, outcome: dict) -> dict:
    """This node's checkpoint of ``step`` (saved before the attack) and its write-ahead ledger, as read back."""
    node = torch.load(checkpoint_at(run, step), weights_only=False)["lightning_privdec"]["nodes"][rank]
    wal = WriteAheadLedger(run / "ckpt" / "privacy_ledger", node["write_ahead"]["run"], rank).read()
    saved = outcome["saved"][step]
    return {
        "checkpoint ledger": node["privacy"]["ledger"], "checkpoint steps": node["privacy"]["steps"],
        "recorded ledger": saved["ledger"], "recorded steps": saved["steps"], "recorded epsilon": saved["epsilon"],
        "write-ahead steps": wal["steps"], "write-ahead ledger": wal["accounting"]["ledger"],
        "steps at the stop": outcome["steps"], "epsilon at the stop": outcome["epsilon"],
    }


def training_attacks(rank: int, tmp: Path, keys: Path) -> dict:
    """Honest nodes train with checkpoints and the write-ahead ledger; node 2 attacks their restarts and their gossip.
    Every fit resumes the previous one's last checkpoint (one launch, as few steps as the checks need)."""
    run, records = tmp / "training", {}
    first = fit_node(rank, run, keys, max_steps=STEPS_BEFORE_ATTACK)  # an honest first run: checkpoint at step 2
    records["first run"] = {"error": first["error"], "steps": first["steps"], "epsilon": first["epsilon"]}
    dist.barrier()
    step = STEPS_BEFORE_ATTACK

    inside = run / "ckpt" / "node1.key"  # node 1's key copied into the checkpoint directory (mode 0600 kept)
    if rank == 1:
        shutil.copy2(keys / "node1.key", inside)
    dist.barrier()
    before = digests(run, without="")
    outcome = fit_node(rank, run, keys, step + 2, checkpoint_at(run, step), identity=inside if rank == 1 else None)
    dist.barrier()
    records[KEY_IN_CHECKPOINTS] = {"error": outcome["error"], "unchanged": digests(run, without="") == before}
    dist.barrier()
    if rank == 1:
        inside.unlink()
    dist.barrier()

    for name in SETUP_ATTACKS:  # a restart from the checkpoint, into the same directories, meets the attacker
        before = digests(run, without="")
        outcome = fit_node(rank, run, keys, step + 2, checkpoint_at(run, step), attack=name)
        dist.barrier()
        records[name] = {"error": outcome["error"], "unchanged": digests(run, without="") == before}
        dist.barrier()

    previous = {"steps": first["steps"], "epsilon": first["epsilon"]}
    for name in (n for n in TRAINING_EXPECTED if n not in SETUP_ATTACKS):  # each resumes the last checkpoint
        before = digests(run)
        outcome = fit_node(rank, run, keys, step + STEPS_BEFORE_ATTACK + 1, checkpoint_at(run, step), attack=name)
        dist.barrier()
        step += STEPS_BEFORE_ATTACK
        kept = digests(run)
        records[name] = {"error": outcome["error"], "previous": previous, "attacked round": step,
                         "earlier checkpoints unchanged": all(kept.get(f) == d for f, d in before.items())}
        if rank != ATTACKER:
            records[name].update(after_the_stop(rank, run, step, outcome))
            previous = {"steps": outcome["steps"], "epsilon": outcome["epsilon"]}
        dist.barrier()

    resumed = fit_node(rank, run, keys, step + 2, checkpoint_at(run, step))  # without the attacker
    records["resumed without the attacker"] = {"error": resumed["error"], "steps": resumed["steps"],
                                               "epsilon": resumed["epsilon"], "previous": previous}
    dist.barrier()
    if rank == 0:  # no file a roster run wrote holds a private key
        secrets = {}
        for name in ("node0", "node1", "node2"):
            identity = Path(keys / f"{name}.key")
            key = serialization.load_pem_private_key(identity.read_bytes(), password=None)
            secrets[name] = [identity.read_bytes(), key.private_bytes_raw()]
        records["files holding a key"] = [
            f"{f.relative_to(tmp)}: {name}" for f in sorted(run.rglob("*")) if f.is_file()
            for name, forms in secrets.items() if any(form in f.read_bytes() for form in forms)
        ]
        records["files searched"] = sum(1 for f in run.rglob("*") if f.is_file())
    return records


def _worker(rank: int, tmp: str, keys: str) -> None:
    die_with_parent()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(f"{tmp}/store", WORLD), rank=rank, world_size=WORLD)
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")  # Lightning: launched from outside, the group is set up
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
        outcomes["training"] = training_attacks(rank, Path(tmp), Path(keys))
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
    # fork: the nodes start with this process's imports instead of loading torch and Lightning again (each sets
    # one thread before any work, so no OpenMP pool of this process is needed in a child)
    mp.start_processes(_worker, args=(str(tmp), str(keys)), nprocs=WORLD, join=True, start_method="fork")
    return [json.loads(Path(tmp, f"outcomes{r}.json").read_text()) for r in range(WORLD)]


def damage(name: str, record: dict) -> list[str]:
    """What an honest node lost or got wrong in one training attack (empty: its files and ledger are intact)."""
    error, says = TRAINING_EXPECTED[name]
    says = says.format(round=record.get("attacked round"))  # the gossip round after the checkpoint
    problems = [] if (record["error"] or "").startswith(error) and says in record["error"] else [f"{record['error']}"]
    if name in SETUP_ATTACKS:
        return problems + ([] if record["unchanged"] else ["a file of the earlier run changed"])
    wal, ckpt = record["write-ahead ledger"], record["checkpoint ledger"]
    checks = {
        "the checkpoint's ledger is the one recorded when it was saved":
            ckpt == record["recorded ledger"] and record["checkpoint steps"] == record["recorded steps"],
        "the write-ahead ledger counts every released step, the attacked round's too":
            record["write-ahead steps"] == record["steps at the stop"] == record["recorded steps"] + 1
            and sum(t for _, _, t in wal["history"]) == record["write-ahead steps"]
            and [h[:2] for h in wal["history"]] == [h[:2] for h in ckpt["history"]],
        "the resumed ledger continued the previous run's (not from 0, not from its checkpoint)":
            record["recorded steps"] == record["previous"]["steps"] + STEPS_BEFORE_ATTACK
            and record["recorded epsilon"] > record["previous"]["epsilon"] > 0,
        "earlier checkpoints unchanged": record["earlier checkpoints unchanged"],
    }
    return problems + [check for check, holds in checks.items() if not holds]


def table(outcomes: list[dict]) -> str:
    rows = ["| attack by node 2 | node 0 | node 1 |", "|---|---|---|"]
    for name in EXPECTED:
        cells = [outcomes[r][name] if r in VICTIMS.get(name, (0, 1)) else "(not a receiver)" for r in (0, 1)]
        rows.append(f"| {name} | " + " | ".join(c.split(":")[0] if c != "accepted" else "ACCEPTED" for c in cells) + " |")
    for name in TRAINING_EXPECTED:
        cells = []
        for r in (0, 1):
            record = outcomes[r]["training"][name]
            intact = "earlier files unchanged" if name in SETUP_ATTACKS else "checkpoint and ledger intact"
            cells.append(f"{(record['error'] or 'ACCEPTED').split(':')[0]}; "
                         + (intact if not damage(name, record) else "DAMAGED"))
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_every_attack_of_a_malicious_node_is_refused_naming_it_and_none_of_its_code_runs(tmp_path):
    outcomes = run_harness(tmp_path)
    for name, (error, says) in EXPECTED.items():
        for rank in VICTIMS.get(name, (0, 1)):
            outcome = outcomes[rank][name]
            assert outcome.startswith(error) and says in outcome, f"node {rank}, {name}: {outcome}"
    assert not list(tmp_path.glob("executed-on-a-node-*")), "a pickle sent by node 2 was executed"

    training = [outcomes[r]["training"] for r in range(WORLD)]
    for rank in range(WORLD):
        assert training[rank]["first run"]["error"] is None and training[rank]["first run"]["steps"] == 2
        refused = training[rank][KEY_IN_CHECKPOINTS]
        assert refused["error"].startswith("MembershipError") and "lies inside a ModelCheckpoint's dirpath" in \
            refused["error"] and refused["unchanged"], f"node {rank}: {refused}"
    for name in TRAINING_EXPECTED:
        for rank in (0, 1):
            assert not damage(name, training[rank][name]), f"node {rank}, {name}: {damage(name, training[rank][name])}"
    for rank in range(WORLD):
        resumed = training[rank]["resumed without the attacker"]
        if rank != ATTACKER:
            assert resumed["error"] is None and resumed["steps"] == resumed["previous"]["steps"] + 2
            assert resumed["epsilon"] > resumed["previous"]["epsilon"]
    assert training[0]["files searched"] > 0 and training[0]["files holding a key"] == []
    print(table(outcomes))


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_fit_with_a_roster_takes_the_same_steps_as_without_and_sends_24_more_bytes_per_message(tmp_path):
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
        assert secure["bytes_sent"] - plain["bytes_sent"] == (SEAL_OVERHEAD + FRAME_HEADER) * messages == 24 * messages


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        print(table(run_harness(Path(directory))))
    sys.exit(0)
