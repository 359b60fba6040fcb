"""Authenticated membership: a roster of long-term Ed25519 keys, each node's identity key, and the signed setup.

A **roster** is a text file distributed out of band (as WireGuard's peer list), one member per line::

    # name-or-rank   Ed25519 public key (base64 of the 32 raw bytes)
    hospital-a       3q2+7w...=
    2                Zm9vYmFy...=

A member named by an integer may only take that rank; any other name may take any rank (its process's rank is then
what the launcher gave it). Each node holds its **identity key**, the Ed25519 private key of one roster member, in a
PEM file of mode 0600 outside the run's checkpoint, log and ledger directories (:func:`check_key_outside`;
``privdec-keygen`` creates one and prints its roster line).

At setup (:func:`authenticate_members`) every node

1. contributes a fresh 32-byte nonce; the **run id** is SHA-256 over every node's nonce, so it is new for every run
   and no node (nor the network) can make it repeat an earlier one;
2. signs ``(run id, rank, world size, its identity key, its ephemeral X25519 key, its configuration digest)``;
3. verifies every other node's signature against the roster, and refuses to train, naming the rank, for an unknown
   identity, a wrong signature, a setup signed for another run (a replay), a member at a rank its roster line does not
   allow or present twice, or a different configuration.

The verified X25519 keys then give every pair of neighbours its secrets (ECDH, then HKDF-SHA256 salted with the run
id): the per-direction keys that seal the gossip (:func:`seal_keys`, :mod:`lightning_privdec.comm.sealed`) and
Decor's pairwise secrets (:class:`~lightning_privdec.privacy.pairwise.PairwiseSecrets`). A man in the middle who
replaces a public key cannot sign it under the member's identity, so the substitution is refused.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from lightning_privdec.comm.objects import UnsafeObjectError, all_gather_objects, decode, encode

__all__ = [
    "AuthenticatedSetup",
    "Identity",
    "Member",
    "MembershipError",
    "Roster",
    "authenticate_members",
    "check_key_outside",
    "check_membership",
    "identity_path",
    "seal_keys",
    "write_identity_key",
]

_TAG = b"lightning_privdec/authenticated-setup/v1"
MEMBER_NAME = re.compile(r"^[A-Za-z0-9_.@:-]{1,128}$")


class MembershipError(ValueError):
    """A node could not prove that it is the roster member it claims to be, for this run: raised before training."""


def check_membership(roster: str | os.PathLike[str] | Roster | None, identity_key: str | os.PathLike[str] | None,
                     ) -> tuple[Roster | None, Path | None]:
    """The roster and identity-key path a strategy was given, checked before anything starts: both or neither, a
    readable key of mode 0600 whose public key is in the roster. A path with ``{rank}``, ``{local_rank}`` or
    ``{node_rank}`` (one key per process of a machine) is checked when :func:`identity_path` resolves it."""
    if (roster is None) != (identity_key is None):
        raise MembershipError(
            "roster= and identity_key= go together: the roster lists every member's public key, identity_key is this "
            "node's private key (create one with privdec-keygen). Give both, or neither for a run without "
            "authentication (honest-but-curious members, see docs/threat-model.md)"
        )
    if roster is None or identity_key is None:
        return None, None
    roster = roster if isinstance(roster, Roster) else Roster.from_file(roster)
    if "{" in str(identity_key):  # one key per process: checked once the process knows its rank
        try:
            str(identity_key).format(rank=0, local_rank=0, node_rank=0)
        except (KeyError, IndexError, ValueError) as error:
            raise MembershipError(
                f"identity_key={str(identity_key)!r}: the only placeholders are {{rank}}, {{local_rank}} and "
                f"{{node_rank}} ({error!r})"
            ) from None
        return roster, Path(identity_key)
    identity = Identity(identity_key)
    if roster.member(identity.public_key) is None:
        raise MembershipError(
            f"this node's identity key {identity.path} (public key {_fingerprint(identity.public_key)}) is not in "
            f"{roster.source}: add the line `privdec-keygen --public {identity.path}` prints to every node's roster"
        )
    return roster, identity.path


def identity_path(roster: Roster, identity_key: Path, *, rank: int, local_rank: int, node_rank: int) -> Path:
    """This process's identity key file, its placeholders filled in, checked as :func:`check_membership` does."""
    path = Path(str(identity_key).format(rank=rank, local_rank=local_rank, node_rank=node_rank))
    check_membership(roster, path)
    return path


def check_key_outside(identity_key: Path, directories: Iterable[tuple[str, str | os.PathLike[str]]]) -> None:
    """Refuse an identity key file that lies inside one of ``directories`` (``(what, path)`` pairs: the run's
    checkpoint, log and ledger directories), which are copied, archived and shared with the model; a private key must
    never travel with them."""
    key = Path(identity_key).resolve()
    holding = [(what, Path(d).resolve()) for what, d in directories
               if "://" not in str(d) and key.is_relative_to(Path(d).resolve())]  # a remote file system holds no key
    if holding:
        what, folder = max(holding, key=lambda item: len(item[1].parts))  # the innermost names the problem best
        raise MembershipError(
            f"the identity key {identity_key} lies inside {what} ({folder}), so it would travel with every copy of "
            "the checkpoints and logs written there. Keep private keys outside the run's output: move the file "
            "(e.g. to ~/.privdec/) and pass its new path as identity_key"
        )


def _fingerprint(public_key: bytes) -> str:
    return base64.b64encode(public_key).decode()


# ---- roster and identity keys ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Member:
    """One roster line: a name (a pinned rank if it is an integer) and its Ed25519 public key."""

    name: str
    public_key: bytes

    @property
    def rank(self) -> int | None:
        return int(self.name) if self.name.isdigit() else None


class Roster:
    """The members allowed in a run, by Ed25519 public key (see the module docstring for the file format)."""

    def __init__(self, members: Iterable[Member], source: str = "the roster") -> None:
        self.members = tuple(members)
        self.source = source
        names = [m.name for m in self.members]
        keys = [m.public_key for m in self.members]
        for what, values in (("name", names), ("public key", keys)):
            repeated = {v for v in values if values.count(v) > 1}
            if repeated:
                shown = ", ".join(sorted(map(str, repeated))) if what == "name" else f"{len(repeated)} key(s)"
                raise MembershipError(f"{source} lists the same {what} twice ({shown}): one line per member")
        if not self.members:
            raise MembershipError(f"{source} lists no member")
        self._by_key = {m.public_key: m for m in self.members}

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Roster:
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as error:
            raise MembershipError(f"cannot read the roster {path}: {error.strerror or error}") from None
        return cls.parse(text, source=f"roster {path}")

    @classmethod
    def parse(cls, text: str, source: str = "the roster") -> Roster:
        members = []
        for number, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            fields = line.split()
            if len(fields) != 2 or not MEMBER_NAME.match(fields[0]):
                raise MembershipError(
                    f"{source}, line {number}: expected '<name or rank> <base64 Ed25519 public key>' (the line "
                    f"privdec-keygen prints), got {line!r}"
                )
            try:
                key = base64.b64decode(fields[1], validate=True)
            except binascii.Error:
                key = b""
            if len(key) != 32:
                raise MembershipError(f"{source}, line {number}: {fields[1]!r} is not a base64 32-byte Ed25519 key")
            members.append(Member(fields[0], key))
        return cls(members, source)

    def member(self, public_key: bytes) -> Member | None:
        return self._by_key.get(public_key)

    @property
    def digest(self) -> str:
        """SHA-256 of the members, in order: every node of a run must hold the same roster."""
        h = hashlib.sha256(_TAG + b"/roster")
        for m in self.members:
            h.update(encode([m.name, m.public_key]))
        return h.hexdigest()

    def __repr__(self) -> str:
        return f"Roster({len(self.members)} members, sha256:{self.digest[:16]})"


def write_identity_key(path: str | os.PathLike[str]) -> bytes:
    """Create a new Ed25519 identity key file at ``path`` (PEM, mode 0600; never overwrites). Returns the raw public
    key, for the roster."""
    path = Path(path)
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # FileExistsError: never replace a key
    try:
        if hasattr(os, "fchmod"):
            os.fchmod(fd, 0o600)  # whatever the umask
        os.write(fd, pem)
    finally:
        os.close(fd)
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


class Identity:
    """This node's long-term Ed25519 key, read from a PEM file of mode 0600. Refuses to be pickled."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        path = Path(path)
        try:
            mode = path.stat().st_mode
            data = path.read_bytes()
        except OSError as error:
            raise MembershipError(
                f"cannot read the identity key {path}: {error.strerror or error}. Create one with `privdec-keygen "
                f"{path}` and add the line it prints to every node's roster"
            ) from None
        if os.name == "posix" and mode & 0o077:
            raise MembershipError(
                f"identity key {path} is readable by group or others (mode {mode & 0o777:o}); it is a private key: "
                f"run `chmod 600 {path}`"
            )
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError) as error:
            raise MembershipError(f"{path} is not an unencrypted PEM private key ({error})") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise MembershipError(f"{path} holds a {type(key).__name__}, not an Ed25519 key: use privdec-keygen")
        self.path = path
        self._key = key
        self.public_key = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    def sign(self, message: bytes) -> bytes:
        return self._key.sign(message)

    def __repr__(self) -> str:
        return f"Identity({self.path}, public key {_fingerprint(self.public_key)})"

    def __getstate__(self) -> Any:
        raise TypeError("Identity holds a private key and cannot be pickled; load it in each process")


# ---- the signed setup --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AuthenticatedSetup:
    """What the signed setup established, the same on every node: the run id, each rank's roster member and its
    verified X25519 public key."""

    run_id: bytes
    members: dict[int, str]
    agreement_keys: dict[int, bytes]


def _signed_part(record: Mapping[str, Any]) -> bytes:
    return _TAG + b"/record" + encode(record)


def authenticate_members(
    identity: Identity,
    roster: Roster,
    *,
    rank: int,
    world_size: int,
    agreement_key: bytes,
    configuration_digest: bytes,
    gather: Callable[[Any, str], list[Any]] = all_gather_objects,
) -> AuthenticatedSetup:
    """The signed setup of the module docstring (two small all-gathers); raises :class:`MembershipError` on every
    node that finds a problem, naming the rank."""
    nonces = gather(os.urandom(32), "a setup nonce")
    if len(nonces) != world_size:
        raise MembershipError(f"node {rank}: {len(nonces)} nodes answered the setup, expected {world_size}")
    for r, nonce in enumerate(nonces):
        if not isinstance(nonce, bytes) or len(nonce) != 32:
            raise MembershipError(f"node {rank}: node {r} sent a malformed setup nonce; it is not a legitimate member")
    run_id = hashlib.sha256(_TAG + b"/run" + world_size.to_bytes(8, "big") + b"".join(nonces)).digest()
    record = {
        "run": run_id, "rank": rank, "world_size": world_size, "identity": identity.public_key,
        "agreement_key": agreement_key, "configuration": configuration_digest,
    }
    records = gather([encode(record), identity.sign(_signed_part(record))], "a signed setup record")
    problems, members, keys = [], {}, {}
    for r, item in enumerate(records):
        problem, member, key = _verify(r, item, roster, run_id, world_size, configuration_digest)
        if problem:
            problems.append(f"node {r} {problem}")
        else:
            members[r], keys[r] = member, key
    seen: dict[str, int] = {}
    for r, name in sorted(members.items()):
        if name in seen:
            problems.append(f"nodes {seen[name]} and {r} both present roster member {name!r} (a copied identity key)")
        seen[name] = r
    if problems:
        raise MembershipError(
            f"node {rank} refuses to train: " + "; ".join(problems) + f". Every node must hold its own identity key "
            f"from {roster.source} (the same roster everywhere) and be started for this run; a node that fails these "
            "checks is not a legitimate member, or the setup messages were altered on the network."
        )
    if len(set(keys.values())) != len(keys):
        raise MembershipError(f"node {rank} refuses to train: two nodes signed the same X25519 key")
    return AuthenticatedSetup(run_id, members, keys)


def _verify(
    sender: int, item: Any, roster: Roster, run_id: bytes, world_size: int, configuration_digest: bytes
) -> tuple[str | None, str, bytes]:
    """(problem, member name, X25519 key) of one node's setup record: the problem is ``None`` if it verifies."""
    if not (isinstance(item, list) and len(item) == 2 and all(isinstance(v, bytes) for v in item)):
        return "sent a malformed setup record", "", b""
    try:
        record = decode(item[0], f"the setup record of node {sender}")
    except UnsafeObjectError as error:
        return f"sent a setup record that is not a typed message ({error})", "", b""
    fields = {"run": bytes, "rank": int, "world_size": int, "identity": bytes, "agreement_key": bytes,
              "configuration": bytes}
    if not isinstance(record, dict) or set(record) != set(fields) or any(
        type(record[k]) is not t for k, t in fields.items()
    ):
        return "sent a setup record without the expected fields", "", b""
    member = roster.member(record["identity"])
    if member is None:
        return (f"presents identity key {_fingerprint(record['identity'])}, which is not in {roster.source} (an "
                "unknown member)"), "", b""
    try:
        Ed25519PublicKey.from_public_bytes(member.public_key).verify(item[1], _signed_part(record))
    except InvalidSignature:
        return (f"(roster member {member.name!r}): its setup signature does not verify (a forged or altered record, "
                "e.g. a public key substituted in transit)"), "", b""
    if record["run"] != run_id or record["world_size"] != world_size:
        return (f"(roster member {member.name!r}) sent a setup signed for another run (a replayed setup message, or "
                "this run's setup nonces were altered in transit)"), "", b""
    if record["rank"] != sender:
        return (f"(roster member {member.name!r}) sent the signed setup of rank {record['rank']} (a replayed or "
                "relayed message)"), "", b""
    if member.rank is not None and member.rank != sender:
        return f"is roster member {member.name!r}, which may only take rank {member.rank}", "", b""
    if record["configuration"] != configuration_digest:
        return (f"(roster member {member.name!r}) signed a different training configuration (different strategy "
                "arguments, Trainer limits or model: start every node from the same script and command line)"), "", b""
    try:
        X25519PublicKey.from_public_bytes(record["agreement_key"])
    except ValueError:
        return f"(roster member {member.name!r}) signed an invalid X25519 key", "", b""
    return None, member.name, record["agreement_key"]


def seal_keys(
    private_key: X25519PrivateKey, setup: AuthenticatedSetup, rank: int, peers: Iterable[int]
) -> dict[int, tuple[bytes, bytes]]:
    """Per neighbour, the 32-byte ChaCha20-Poly1305 keys of the two directions (this node's sending key, its
    receiving key): X25519 with the neighbour's verified key, HKDF-SHA256 salted with the run id, the direction and
    both public keys in the info. Nobody but the two ends can compute them."""
    keys = {}
    for peer in sorted(set(peers)):
        if peer not in setup.agreement_keys:
            raise MembershipError(f"node {rank}: no authenticated key for neighbour {peer}")
        shared = private_key.exchange(X25519PublicKey.from_public_bytes(setup.agreement_keys[peer]))

        def direction(sender: int, receiver: int) -> bytes:
            info = b"/".join([_TAG, b"seal", sender.to_bytes(8, "big"), receiver.to_bytes(8, "big"),
                              setup.agreement_keys[sender], setup.agreement_keys[receiver]])
            return HKDF(algorithm=hashes.SHA256(), length=32, salt=setup.run_id, info=info).derive(shared)

        keys[peer] = (direction(rank, peer), direction(peer, rank))
    return keys
