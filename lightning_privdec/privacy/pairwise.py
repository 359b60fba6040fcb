"""Pairwise secrets and the correlated noise of Decor (Allouah et al., ICML 2024, "Privacy Amplification in
Decentralized Learning with Correlated Noise" / SecLDP).

Decor's one-time setup has every edge {i, j} of the communication graph agree on a secret s_ij "in one round of
encrypted communication"; Algorithm 1, step 3 then has node i add, every round t,

    sum_{j in N_i} v_ij^(t),   v_ij^(t) = -v_ji^(t) ~ N(0, sigma_cor^2 I_d),

fresh and independent for every round, edge and coordinate, and independent of the node's own local noise (step 4).
Because v_ij = -v_ji, sum_i sum_{j in N_i} v_ij = 0: the average model only carries the independent noise. The paper
names neither the key agreement nor the PRG; this module fixes both:

* **Key agreement** (:class:`PairwiseSecrets`): every node draws a fresh X25519 key pair at setup and publishes the
  public key (:func:`exchange_public_keys`, one all-gather of public data in the typed encoding of
  :mod:`lightning_privdec.comm.objects`, never pickled; with a roster the keys come signed instead, see
  :mod:`lightning_privdec.comm.identity`). Each pair of neighbours runs
  ECDH and HKDF-SHA256 to a 32-byte edge secret. The HKDF salt is a *run identifier* hashed from the caller's
  ``context`` and the sorted list of every node's public key; the HKDF info binds a library tag, the ordered pair
  (min(i, j), max(i, j)) and both public keys. No secret (nor any private key) is ever sent; no third node can
  compute it (X25519 CDH). :func:`verify_agreement` checks, with one-way fingerprints, that both ends of every edge
  derived the same secret.
* **PRG** (:class:`CorrelatedNoise`): for edge {i, j} and round t, the stream key is
  ``HMAC-SHA256(s_ij, tag || "round" || t)`` and the stream is the ChaCha20 keystream under that key, turned into
  standard normals by Box-Muller in float64 (53-bit uniforms). It is counter-based: round t's noise is a function of
  (s_ij, t) only, so it does not depend on which rounds were drawn before (random access, resume-friendly) and no
  stream is ever reused across rounds or edges. Both ends compute the same z_ij^(t); node i uses
  v_ij = +sigma_cor z_ij if i < j and -sigma_cor z_ij otherwise.

Why not seed a ``torch.Generator``: torch's generators are not cryptographic PRNGs, and the CPU generator (mt19937)
keeps only the low 32 bits of ``manual_seed``'s argument, i.e. at most 2^32 distinct streams. Over (edges x rounds)
streams that gives birthday collisions in ordinary runs (e.g. 32 edges x 5000 rounds), i.e. repeated noise, and a
2^32 search space per stream for an eavesdropper. CPU (mt19937) and CUDA (Philox) generators also produce different
streams from the same seed, which would break cancellation between a CPU node and a CUDA node. ChaCha20 has neither
problem, and its keystream is identical on every device.

Resuming a run (design). Private keys are never written to checkpoints, so by default a resumed run **re-runs key
agreement with fresh keys**: the correlated noise is new, still exactly cancelling, and privacy is unaffected
(the accountant already counts every released round); only bit-exact replay of the noise is lost. Optionally each
node passes ``key_file=``, a path *outside the checkpoint* (created with mode 0600, refused if readable by others),
holding its own X25519 private key; if every node keeps its key file and passes the same ``context``, a resumed run
re-derives the same secrets and hence, from the checkpointed round counter, the same streams. Caveats of key files:
anyone who reads one learns that node's pairwise secrets (SecLDP then degrades to the curious-user level for those
edges); rounds re-run after a resume reuse the noise of rounds released before the crash, so if those rounds
release *different* messages (different batches or local noise) their difference cancels the correlated noise -
use key files only when the replay is deterministic or nothing was released past the checkpoint; and a key file
must be deleted at the end of the run (:meth:`PairwiseSecrets.delete_key_file`) and never reused for another run
(pass a per-run identifier in ``context`` as well).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from torch import Tensor

from lightning_privdec.comm.objects import all_gather_objects
from lightning_privdec.privacy.errors import PrivacyConfigError
from lightning_privdec.privacy.noise import KeystreamBuffers, keyed_standard_normal

__all__ = [
    "CorrelatedNoise",
    "PairwiseSecrets",
    "exchange_public_keys",
    "simulate_key_agreement",
    "verify_agreement",
]

_TAG = b"lightning_privdec/decor-pairwise/v1"
_KEY_FILE_MAGIC = b"lightning_privdec/x25519-private-key/v1\n"
_KEY_BYTES = 32
_STATE_VERSION = 1


def _u64(value: int) -> bytes:
    return value.to_bytes(8, "big")


def _check_rank(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise PrivacyConfigError(f"{name} must be a non-negative integer, got {value!r}")
    return value


def _edge_info(label: bytes, i: int, j: int, *extra: bytes) -> bytes:
    lo, hi = min(i, j), max(i, j)
    return b"/".join([_TAG, label, _u64(lo), _u64(hi), *extra])


def _hkdf(ikm: bytes, salt: bytes | None, info: bytes, length: int = _KEY_BYTES) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=salt, info=info).derive(ikm)


def _run_id(public_keys: Mapping[int, bytes], context: bytes) -> bytes:
    """SHA-256 over the tag, ``context`` and every (rank, public key), sorted: the same on every node, new per run."""
    h = hashlib.sha256(_TAG + b"/run")
    h.update(_u64(len(context)) + context + _u64(len(public_keys)))
    for rank in sorted(public_keys):
        h.update(_u64(rank) + public_keys[rank])
    return h.digest()


def _raw_private(key: X25519PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())


def _raw_public(key: X25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def load_or_create_key_file(path: Path) -> X25519PrivateKey:
    """Read this node's private key from ``path``, or create the file (mode 0600, atomically) with a new key."""
    if path.exists():
        if os.name == "posix" and path.stat().st_mode & 0o077:
            raise PrivacyConfigError(
                f"key file {path} is accessible by group/others (mode {path.stat().st_mode & 0o777:o}); "
                "it holds a private key: run `chmod 600` on it or delete it to start fresh secrets"
            )
        data = path.read_bytes()
        if len(data) != len(_KEY_FILE_MAGIC) + _KEY_BYTES or not data.startswith(_KEY_FILE_MAGIC):
            raise PrivacyConfigError(
                f"{path} is not a lightning_privdec X25519 key file (truncated or foreign); delete it to start "
                "with fresh secrets"
            )
        return X25519PrivateKey.from_private_bytes(data[len(_KEY_FILE_MAGIC) :])
    key = X25519PrivateKey.generate()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        if hasattr(os, "fchmod"):
            os.fchmod(fd, 0o600)  # independent of the umask
        os.write(fd, _KEY_FILE_MAGIC + _raw_private(key))
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return key


class PairwiseSecrets:
    """One node's X25519 key pair and the 32-byte secrets it shares with each neighbour (Decor's one-time setup).

    Usage on node ``rank`` (all nodes, collectively)::

        secrets = PairwiseSecrets(rank, neighbours)
        secrets.agree(exchange_public_keys(secrets), context=b"my-run")
        verify_agreement(secrets)            # optional, one more collective of public fingerprints

    The private key lives in memory only until :meth:`agree` (and, if ``key_file`` is given, in that file; see the
    module docstring for the resume design). Objects of this class refuse to be pickled, and neither ``repr`` nor
    :meth:`state_dict` reveals a secret.

    Args:
        rank: this node's id in the graph.
        neighbours: N_rank, the ranks this node shares an edge with (undirected graph: ``rank`` must also be in
            each neighbour's list).
        key_file: optional path outside the checkpoint that persists this node's private key, so that a resumed
            run re-derives the same secrets; created with mode 0600 if missing, loaded otherwise.
        private_key: this node's X25519 private key, when it was already chosen (and its public key signed in the
            authenticated setup of :mod:`lightning_privdec.comm.identity`); excludes ``key_file``.
    """

    def __init__(
        self,
        rank: int,
        neighbours: Sequence[int],
        *,
        key_file: str | os.PathLike[str] | None = None,
        private_key: X25519PrivateKey | None = None,
    ) -> None:
        self.rank = _check_rank(rank, "rank")
        peers = [_check_rank(j, "every neighbour") for j in neighbours]
        if len(set(peers)) != len(peers):
            raise PrivacyConfigError(f"node {rank}: duplicate neighbours in {list(neighbours)}")
        if self.rank in peers:
            raise PrivacyConfigError(f"node {rank} lists itself as a neighbour; N_i excludes i")
        self.neighbours: tuple[int, ...] = tuple(sorted(peers))
        self.key_file = None if key_file is None else Path(key_file)
        if private_key is not None and key_file is not None:
            raise PrivacyConfigError("give key_file or private_key, not both")
        self._private_key: X25519PrivateKey | None = private_key or (
            X25519PrivateKey.generate() if self.key_file is None else load_or_create_key_file(self.key_file)
        )
        self._public_key = _raw_public(self._private_key.public_key())
        self._secrets: dict[int, bytes] = {}
        self._run_id: bytes | None = None

    # ---------------------------------------------------------------------------------------------------- setup
    def public_key_bytes(self) -> bytes:
        """This node's raw 32-byte X25519 public key (public: safe to send, log and store)."""
        return self._public_key

    @property
    def agreed(self) -> bool:
        """Whether :meth:`agree` has derived the neighbour secrets."""
        return self._run_id is not None

    @property
    def run_id(self) -> str:
        """Hex run identifier (public): hash of ``context`` and all public keys; equal on every node of a run."""
        if self._run_id is None:
            raise RuntimeError(f"node {self.rank}: call agree() first")
        return self._run_id.hex()

    def agree(self, public_keys: Mapping[int, bytes], context: bytes = b"") -> None:
        """Derive the secret s_ij for every neighbour j by X25519 ECDH + HKDF-SHA256.

        Args:
            public_keys: rank -> raw 32-byte public key of EVERY node, including this one, identical on all nodes
                (what :func:`exchange_public_keys` returns): the run identifier used as HKDF salt is hashed from it.
            context: bytes bound into every secret (e.g. a per-run experiment id); the same on all nodes.

        The private key is discarded afterwards; a second call raises.
        """
        if self._private_key is None:
            raise RuntimeError(
                f"node {self.rank}: agree() was already called and the private key discarded; "
                "create a new PairwiseSecrets for a new agreement"
            )
        if not isinstance(context, (bytes, bytearray)):
            raise PrivacyConfigError(f"context must be bytes, got {type(context).__name__}")
        keys: dict[int, bytes] = {}
        for r, key in public_keys.items():
            _check_rank(r, "every rank of public_keys")
            if not isinstance(key, (bytes, bytearray, memoryview)) or len(bytes(key)) != _KEY_BYTES:
                got = len(bytes(key)) if isinstance(key, (bytes, bytearray, memoryview)) else type(key).__name__
                raise PrivacyConfigError(
                    f"node {self.rank}: public key of node {r} must be {_KEY_BYTES} bytes, got {got}"
                )
            keys[r] = bytes(key)
        missing = [j for j in (self.rank, *self.neighbours) if j not in keys]
        if missing:
            raise PrivacyConfigError(
                f"node {self.rank}: no public key for node(s) {missing}; pass every node's key "
                "(exchange_public_keys) including this node's own"
            )
        if keys[self.rank] != self._public_key:
            raise PrivacyConfigError(
                f"node {self.rank}: public_keys[{self.rank}] is not this node's public key (ranks mixed up?)"
            )
        if len(set(keys.values())) != len(keys):
            raise PrivacyConfigError("two nodes published the same public key (a key file shared between nodes?)")
        run_id = _run_id(keys, bytes(context))
        secrets: dict[int, bytes] = {}
        for j in self.neighbours:
            try:
                shared = self._private_key.exchange(X25519PublicKey.from_public_bytes(keys[j]))
            except ValueError as err:  # low-order point: all-zero shared value
                raise PrivacyConfigError(f"node {self.rank}: invalid public key from node {j}: {err}") from None
            lo, hi = min(self.rank, j), max(self.rank, j)
            secrets[j] = _hkdf(shared, run_id, _edge_info(b"edge-secret", lo, hi, keys[lo], keys[hi]))
        self._secrets, self._run_id = secrets, run_id
        self._private_key = None  # never kept beyond the agreement (the key file, if any, is the only copy)

    def secret(self, j: int) -> bytes:
        """The 32-byte secret s_ij shared with neighbour ``j``. Internal use only: never log, print or store it."""
        if not self.agreed:
            raise RuntimeError(f"node {self.rank}: call agree() before using the secrets")
        if j not in self._secrets:
            raise PrivacyConfigError(f"node {j} is not a neighbour of node {self.rank} (neighbours: {self.neighbours})")
        return self._secrets[j]

    def fingerprint(self, j: int) -> str:
        """Public hex fingerprint of s_ij (HKDF under a separate label): equal at both ends, reveals nothing of s_ij."""
        return _hkdf(self.secret(j), None, _edge_info(b"fingerprint", self.rank, j), 16).hex()

    # ------------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Public consistency data only (no secret, no private key): rank, neighbours, run id and fingerprints."""
        return {
            "version": _STATE_VERSION,
            "rank": self.rank,
            "neighbours": list(self.neighbours),
            "run_id": self.run_id if self.agreed else None,
            "fingerprints": {j: self.fingerprint(j) for j in self.neighbours} if self.agreed else {},
        }

    def load_state_dict(self, state: Mapping[str, Any], *, require_same_secrets: bool = False) -> bool:
        """Check a checkpointed :meth:`state_dict` against this (agreed) node; nothing is loaded.

        Raises if the rank or neighbours differ. Returns True if the same secrets were re-derived (key files: the
        noise streams continue bit-exactly from the checkpointed round), False if the agreement is fresh (new,
        equally valid noise). With ``require_same_secrets=True`` a fresh agreement raises instead.
        """
        if state.get("version") != _STATE_VERSION:
            raise PrivacyConfigError(f"unsupported PairwiseSecrets state version {state.get('version')!r}")
        if state["rank"] != self.rank or list(state["neighbours"]) != list(self.neighbours):
            raise PrivacyConfigError(
                f"checkpoint is for node {state['rank']} with neighbours {list(state['neighbours'])}, "
                f"this is node {self.rank} with neighbours {list(self.neighbours)}"
            )
        same = self.agreed and state.get("run_id") == self.run_id and {
            int(j): f for j, f in state.get("fingerprints", {}).items()
        } == {j: self.fingerprint(j) for j in self.neighbours}
        if require_same_secrets and not same:
            raise PrivacyConfigError(
                f"node {self.rank}: the pairwise secrets differ from the checkpoint's; keep every node's key_file and "
                "the same context to resume the same noise streams"
            )
        return bool(same)

    def delete_key_file(self) -> None:
        """Overwrite and remove this node's key file (call at the end of a run; no-op without one)."""
        if self.key_file is not None and self.key_file.exists():
            size = self.key_file.stat().st_size
            with open(self.key_file, "r+b") as f:
                f.write(os.urandom(size))
                f.flush()
                os.fsync(f.fileno())
            self.key_file.unlink()

    def __repr__(self) -> str:
        return (
            f"PairwiseSecrets(rank={self.rank}, neighbours={list(self.neighbours)}, "
            f"agreed={self.agreed}, n_secrets={len(self._secrets)})"
        )

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            "PairwiseSecrets holds private keys/secrets and cannot be pickled or deep-copied; run the key agreement "
            "in each process and checkpoint state_dict() (public) instead"
        )


def exchange_public_keys(secrets: PairwiseSecrets) -> dict[int, bytes]:
    """Gather every node's public key over torch.distributed: one all-gather at setup (public data, typed encoding).

    Returns ``{node rank: raw public key}`` keyed by each process's ``PairwiseSecrets.rank`` (the graph ids), the
    same mapping on every process; pass it unchanged to :meth:`PairwiseSecrets.agree`. Unauthenticated: a member
    or a man in the middle can substitute keys; with a roster the strategies use the signed keys instead.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("exchange_public_keys needs an initialised torch.distributed process group")
    gathered = all_gather_objects([secrets.rank, secrets.public_key_bytes()], "Decor's public key")
    keys: dict[int, bytes] = {}
    for sender, record in enumerate(gathered):
        if not (isinstance(record, list) and len(record) == 2 and type(record[0]) is int and isinstance(record[1], bytes)):
            raise PrivacyConfigError(f"node {secrets.rank}: node {sender} sent a malformed public-key record")
        rank, key = record
        if rank in keys:
            raise PrivacyConfigError(f"two processes claim node rank {rank}")
        keys[rank] = key
    return keys


def _check_agreement_records(records: Sequence[tuple[int, Sequence[int], Mapping[int, str]]]) -> None:
    """Raise unless the (rank, neighbours, fingerprints) records describe a symmetric graph with matching secrets."""
    by_rank = {rank: (set(peers), dict(prints)) for rank, peers, prints in records}
    problems = []
    for i, (peers, prints) in sorted(by_rank.items()):
        for j in sorted(peers):
            if j not in by_rank:
                problems.append(f"node {i} lists {j}, which did not take part")
            elif i not in by_rank[j][0]:
                problems.append(f"node {i} lists {j} but {j} does not list {i} (graph not symmetric)")
            elif i < j and prints[j] != by_rank[j][1][i]:
                problems.append(f"edge ({i}, {j}): the two ends derived different secrets (different public_keys "
                                "mappings or contexts?)")
    if problems:
        raise PrivacyConfigError("pairwise key agreement is inconsistent: " + "; ".join(problems))


def verify_agreement(secrets: PairwiseSecrets) -> None:
    """Check collectively that the graph is symmetric and both ends of every edge hold the same secret.

    Gathers only public data (rank, neighbours, one-way fingerprints); raises the same error on every process.
    Without this check a mismatch would silently stop the correlated noise from cancelling.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("verify_agreement needs an initialised torch.distributed process group")
    record = [secrets.rank, list(secrets.neighbours), {j: secrets.fingerprint(j) for j in secrets.neighbours}]
    gathered = all_gather_objects(record, "Decor's agreement fingerprints")
    for sender, item in enumerate(gathered):
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[1], list) and isinstance(item[2], dict)):
            raise PrivacyConfigError(f"node {secrets.rank}: node {sender} sent a malformed agreement record")
    _check_agreement_records(gathered)


def simulate_key_agreement(
    graph_neighbours: Mapping[int, Sequence[int]], context: bytes = b""
) -> dict[int, PairwiseSecrets]:
    """Run the whole agreement in one process (tests, single-process simulation): public keys passed in memory."""
    nodes = {i: PairwiseSecrets(i, peers) for i, peers in graph_neighbours.items()}
    records = []
    public = {i: s.public_key_bytes() for i, s in nodes.items()}
    for s in nodes.values():
        s.agree(public, context)
        records.append((s.rank, s.neighbours, {j: s.fingerprint(j) for j in s.neighbours}))
    _check_agreement_records(records)
    return nodes


class CorrelatedNoise:
    """Node i's correlated noise of Decor's Algorithm 1, step 3: sum_{j in N_i} v_ij^(t), v_ij = -v_ji.

    v_ij^(t) = s_ij sigma_cor z_ij^(t) with s_ij = +1 if i < j else -1, and z_ij^(t) ~ N(0, I) drawn from the ChaCha20
    keystream under ``HMAC-SHA256(secret_ij, tag || "round" || t)`` (see the module docstring): identical at both ends
    of the edge, fresh for every (edge, round), random access in t. The caller checkpoints the round counter and must
    never reuse a round index for two different releases. Independent of the node's local noise (its own
    generator seeded from OS entropy).

    Noise is computed in float64 on ``device`` and cast to ``dtype``: v_ij and v_ji are bitwise negatives when both
    ends use the same device type; across device types they agree to float64 rounding.
    """

    def __init__(self, secrets: PairwiseSecrets, sigma_cor: float) -> None:
        if not secrets.agreed:
            raise PrivacyConfigError(f"node {secrets.rank}: run key agreement before building CorrelatedNoise")
        if isinstance(sigma_cor, bool) or not isinstance(sigma_cor, (int, float)):
            raise PrivacyConfigError(f"sigma_cor must be a number, got {sigma_cor!r}")
        if not math.isfinite(sigma_cor) or sigma_cor < 0:
            raise PrivacyConfigError(f"sigma_cor must be finite and >= 0, got {sigma_cor!r}")
        self.secrets = secrets
        self.sigma_cor = float(sigma_cor)
        self._buffers: dict[torch.device, KeystreamBuffers] = {}  # per device, kept across rounds

    @property
    def rank(self) -> int:
        return self.secrets.rank

    @property
    def neighbours(self) -> tuple[int, ...]:
        return self.secrets.neighbours

    def _stream_key(self, j: int, round: int) -> bytes:
        if isinstance(round, bool) or not isinstance(round, int) or not 0 <= round < 1 << 64:
            raise PrivacyConfigError(f"round must be an integer in [0, 2^64), got {round!r}")
        return hmac.new(self.secrets.secret(j), _TAG + b"/round/" + _u64(round), hashlib.sha256).digest()

    def _standard_normal(self, j: int, round: int, numel: int, device: torch.device) -> Tensor:
        """z_ij^(round) ~ N(0, I_numel) in float64 on ``device``, the same at both ends of the edge."""
        device = torch.device(device)
        buffers = self._buffers.get(device)
        if buffers is None:  # made once per device (it checks whether the device computes the keystream)
            buffers = self._buffers[device] = KeystreamBuffers(device)
        return keyed_standard_normal(self._stream_key(j, round), numel, device, buffers)

    def sum_for_round(
        self,
        round: int,
        numel: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> Tensor:
        """sum_{j in N_i} v_ij^(round), a flat tensor of ``numel`` entries to add to this node's clipped gradient.

        Summed in float64 and cast once; each coordinate has variance deg(i) sigma_cor^2, and the sum over all nodes
        of the graph is 0 up to float rounding.
        """
        numel, device = self._check_request(numel, dtype, device)
        total = torch.zeros(numel, dtype=torch.float64, device=device)
        if self.sigma_cor > 0:
            for j in self.neighbours:
                z = self._standard_normal(j, round, numel, device)
                total.add_(z, alpha=1.0 if self.rank < j else -1.0)
            total.mul_(self.sigma_cor)
        return total.to(dtype)

    @staticmethod
    def _check_request(numel: int, dtype: torch.dtype, device: torch.device | str) -> tuple[int, torch.device]:
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
            raise PrivacyConfigError(f"numel must be a non-negative integer, got {numel!r}")
        if not dtype.is_floating_point:
            raise PrivacyConfigError(f"noise dtype must be floating point, got {dtype}")
        return numel, torch.device(device)

    def __repr__(self) -> str:
        return f"CorrelatedNoise(rank={self.rank}, neighbours={list(self.neighbours)}, sigma_cor={self.sigma_cor})"

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("CorrelatedNoise holds pairwise secrets and cannot be pickled; rebuild it in each process")
