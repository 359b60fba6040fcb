"""Tests for lightning_privdec.privacy.pairwise: Decor's pairwise secrets (X25519 + HKDF) and correlated noise."""

from __future__ import annotations

import copy
import io
import itertools
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_privdec.privacy import keystream, pairwise
from lightning_privdec.privacy.errors import PrivacyConfigError
from lightning_privdec.privacy.pairwise import (
    CorrelatedNoise,
    PairwiseSecrets,
    exchange_public_keys,
    simulate_key_agreement,
    verify_agreement,
)
from tests.multiprocess import die_with_parent


def ring(n: int) -> dict[int, list[int]]:
    return {i: [(i - 1) % n, (i + 1) % n] for i in range(n)}


def torus(rows: int, cols: int) -> dict[int, list[int]]:
    def node(r: int, c: int) -> int:
        return (r % rows) * cols + c % cols

    return {
        node(r, c): sorted({node(r - 1, c), node(r + 1, c), node(r, c - 1), node(r, c + 1)})
        for r in range(rows)
        for c in range(cols)
    }


def edges(graph: dict[int, list[int]]) -> list[tuple[int, int]]:
    return sorted({(min(i, j), max(i, j)) for i, peers in graph.items() for j in peers})


def noises(graph: dict[int, list[int]], sigma: float) -> dict[int, CorrelatedNoise]:
    return {i: CorrelatedNoise(s, sigma) for i, s in simulate_key_agreement(graph).items()}


def edge_noise(
    node: CorrelatedNoise, j: int, round: int, numel: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """v_ij^(round) of one edge (Decor Alg. 1, step 3): +sigma_cor z_ij if i < j else -sigma_cor z_ij, z_ij the edge's
    keystream normals, one term of the node's ``sum_for_round``."""
    sign = 1.0 if node.rank < j else -1.0
    return node._standard_normal(j, round, numel, torch.device("cpu")).mul_(sign * node.sigma_cor).to(dtype)


def corr(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.corrcoef(torch.stack([a.double(), b.double()]))[0, 1])


# ------------------------------------------------------------------------------------------------ key agreement
def test_both_ends_share_the_secret_and_only_they_do():
    graph = ring(6)
    nodes = simulate_key_agreement(graph)
    secrets = {}
    for i, j in edges(graph):
        assert nodes[i].secret(j) == nodes[j].secret(i)
        assert len(nodes[i].secret(j)) == 32
        assert nodes[i].fingerprint(j) == nodes[j].fingerprint(i)
        secrets[(i, j)] = nodes[i].secret(j)
    assert len(set(secrets.values())) == len(secrets)  # a different secret on every edge
    with pytest.raises(PrivacyConfigError, match="not a neighbour"):
        nodes[0].secret(3)  # 0 and 3 are not adjacent on the 6-ring: no shared secret
    assert len({s.run_id for s in nodes.values()}) == 1

    again = simulate_key_agreement(graph)  # fresh keys: fresh secrets
    assert all(again[i].secret(j) != s for (i, j), s in secrets.items())
    assert again[0].public_key_bytes() != nodes[0].public_key_bytes()


def test_agree_validates_its_input():
    a, b, c = PairwiseSecrets(0, [1, 2]), PairwiseSecrets(1, [0]), PairwiseSecrets(2, [0])
    keys = {0: a.public_key_bytes(), 1: b.public_key_bytes(), 2: c.public_key_bytes()}
    with pytest.raises(PrivacyConfigError, match=r"no public key for node\(s\) \[2\]"):
        a.agree({0: keys[0], 1: keys[1]})
    with pytest.raises(PrivacyConfigError, match="must be 32 bytes, got 31"):
        a.agree({**keys, 2: keys[2][:31]})
    with pytest.raises(PrivacyConfigError, match="must be 32 bytes, got str"):
        a.agree({**keys, 2: "not bytes"})
    with pytest.raises(PrivacyConfigError, match="including this node's own"):
        a.agree({1: keys[1], 2: keys[2]})
    with pytest.raises(PrivacyConfigError, match="not this node's public key"):
        a.agree({0: keys[1], 1: keys[0], 2: keys[2]})
    with pytest.raises(PrivacyConfigError, match="same public key"):
        a.agree({**keys, 3: keys[2]})
    with pytest.raises(PrivacyConfigError, match="invalid public key from node 2"):
        a.agree({**keys, 2: bytes(32)})  # low-order point
    with pytest.raises(PrivacyConfigError, match="context must be bytes"):
        a.agree(keys, context="run")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="call agree"):
        a.secret(1)
    a.agree(keys, context=b"run-1")
    with pytest.raises(RuntimeError, match="already called"):
        a.agree(keys)
    with pytest.raises(PrivacyConfigError, match="lists itself"):
        PairwiseSecrets(0, [0, 1])
    with pytest.raises(PrivacyConfigError, match="duplicate"):
        PairwiseSecrets(0, [1, 1])
    with pytest.raises(PrivacyConfigError, match="non-negative"):
        PairwiseSecrets(-1, [1])


def test_inconsistent_agreements_are_detected():
    with pytest.raises(PrivacyConfigError, match="not symmetric"):
        simulate_key_agreement({0: [1, 2], 1: [0], 2: []})
    # different contexts at the two ends: different secrets, caught by the fingerprints
    a, b = PairwiseSecrets(0, [1]), PairwiseSecrets(1, [0])
    keys = {0: a.public_key_bytes(), 1: b.public_key_bytes()}
    a.agree(keys, b"x")
    b.agree(keys, b"y")
    assert a.secret(1) != b.secret(0)
    records = [(s.rank, s.neighbours, {j: s.fingerprint(j) for j in s.neighbours}) for s in (a, b)]
    with pytest.raises(PrivacyConfigError, match=r"edge \(0, 1\).*different secrets"):
        pairwise._check_agreement_records(records)
    with pytest.raises(PrivacyConfigError, match="did not take part"):
        pairwise._check_agreement_records(records[:1])


def test_repr_state_dict_and_pickle_reveal_no_secret():
    nodes = simulate_key_agreement(ring(4))
    node = nodes[0]
    state = node.state_dict()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    saved = buffer.getvalue()
    texts = [repr(node), str(node), str(state), repr(CorrelatedNoise(node, 1.0))]
    for j in node.neighbours:
        secret = node.secret(j)
        for text in texts:
            assert secret.hex() not in text.lower()
            assert secret.hex().upper() not in text
            assert repr(secret) not in text
        assert secret not in saved
        assert secret.hex().encode() not in saved
    assert "neighbours=[1, 3]" in repr(node)
    assert set(state) == {"version", "rank", "neighbours", "run_id", "fingerprints"}
    for obj in (node, CorrelatedNoise(node, 1.0)):
        with pytest.raises(TypeError, match="cannot be pickled"):
            pickle.dumps(obj)
        with pytest.raises(TypeError, match="cannot be pickled"):
            copy.deepcopy(obj)


# --------------------------------------------------------------------------------------------- key file resume
def _run_with_key_files(graph, directory: Path, context: bytes = b"run-A") -> dict[int, PairwiseSecrets]:
    nodes = {i: PairwiseSecrets(i, peers, key_file=directory / f"node{i}.key") for i, peers in graph.items()}
    keys = {i: s.public_key_bytes() for i, s in nodes.items()}
    for s in nodes.values():
        s.agree(keys, context)
    return nodes


def test_key_file_is_refused_when_exposed_or_corrupt(tmp_path):
    path = tmp_path / "keys" / "node.key"
    PairwiseSecrets(0, [1], key_file=path)
    assert PairwiseSecrets(0, [1], key_file=path).public_key_bytes() == PairwiseSecrets(
        0, [1], key_file=path
    ).public_key_bytes()
    os.chmod(path, 0o644)
    with pytest.raises(PrivacyConfigError, match="chmod 600"):
        PairwiseSecrets(0, [1], key_file=path)
    os.chmod(path, 0o600)
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(PrivacyConfigError, match="not a lightning_privdec X25519 key file"):
        PairwiseSecrets(0, [1], key_file=path)


# ------------------------------------------------------------------------------------------------ correlated noise
@pytest.mark.parametrize("graph", [ring(8), torus(4, 4)], ids=["ring8", "torus4x4"])
def test_antisymmetric_and_cancelling(graph):
    sigma, numel = 3.0, 2001
    noise = noises(graph, sigma)
    for t in (0, 1, 5):
        for i, j in edges(graph):
            for dtype in (torch.float32, torch.float64, torch.bfloat16):
                v_ij = edge_noise(noise[i], j, t, numel, dtype=dtype)
                v_ji = edge_noise(noise[j], i, t, numel, dtype=dtype)
                assert v_ij.dtype == dtype and v_ij.shape == (numel,)
                assert torch.equal(v_ij, -v_ji)
        sums = torch.stack([noise[i].sum_for_round(t, numel) for i in graph])
        total = sums.double().sum(0)
        assert total.abs().max() <= 1e-5 * sums.abs().max()
        assert sums.abs().max() > sigma  # but each node's noise is large


def test_statistics_fresh_rounds_independent_edges_and_variance():
    from scipy import stats  # imported here: keeps the spawned workers' start-up light

    graph, sigma, numel = torus(3, 3), 1.7, 200_000
    noise = noises(graph, sigma)
    z = edge_noise(noise[0], 1, 3, numel, dtype=torch.float64) / sigma
    assert abs(float(z.mean())) < 0.01
    assert float(z.std()) == pytest.approx(1.0, rel=0.01)
    assert stats.kstest(z.numpy(), "norm").statistic < 0.01
    assert float((z.abs() > 3).double().mean()) == pytest.approx(0.0027, abs=0.0008)

    next_round = edge_noise(noise[0], 1, 4, numel, dtype=torch.float64)
    assert not torch.equal(z * sigma, next_round)
    assert abs(corr(z, next_round)) < 0.01  # fresh every round
    for a, b in [((0, 1), (0, 2)), ((0, 1), (1, 2)), ((0, 1), (4, 5))]:  # independent across edges
        assert abs(corr(edge_noise(noise[a[0]], a[1], 3, numel), edge_noise(noise[b[0]], b[1], 3, numel))) < 0.01

    total = noise[4].sum_for_round(3, numel, dtype=torch.float64)
    assert float(total.var()) == pytest.approx(len(graph[4]) * sigma**2, rel=0.02)  # deg(i) sigma_cor^2


def test_random_access_and_chunking(monkeypatch):
    nodes = simulate_key_agreement(ring(3))
    numel = 1001
    cold = CorrelatedNoise(nodes[0], 1.0).sum_for_round(10, numel)
    warm = CorrelatedNoise(nodes[0], 1.0)
    for t in range(10):
        warm.sum_for_round(t, numel)
    assert torch.equal(warm.sum_for_round(10, numel), cold)  # round 10 does not depend on rounds 0..9
    assert torch.equal(warm.sum_for_round(10, numel), cold)  # and is reproducible
    prefix = edge_noise(warm, 1, 2, 7)
    assert torch.equal(edge_noise(warm, 1, 2, numel)[:7], prefix)  # coordinates do not depend on numel
    monkeypatch.setattr(keystream, "CHUNK_WORDS", 6)
    assert torch.equal(warm.sum_for_round(10, numel), cold)  # nor on the chunk size


def test_known_answer_stream(tmp_path):
    """Fixed private keys -> fixed stream: a format change would silently break resumes with key files."""
    for i, fill in enumerate((0x11, 0x22)):
        path = tmp_path / f"node{i}.key"
        path.write_bytes(pairwise._KEY_FILE_MAGIC + bytes([fill]) * 32)
        path.chmod(0o600)
    nodes = _run_with_key_files({0: [1], 1: [0]}, tmp_path, context=b"kat")
    assert nodes[0].fingerprint(1) == EXPECTED_FINGERPRINT
    got = edge_noise(CorrelatedNoise(nodes[0], 1.0), 1, 42, 4, dtype=torch.float64)
    torch.testing.assert_close(got, torch.tensor(EXPECTED_ROUND42, dtype=torch.float64), rtol=1e-12, atol=1e-12)


# cross-checked against an independent re-implementation (stdlib HMAC/HKDF, math Box-Muller) of the documented format
EXPECTED_FINGERPRINT = "858d6c209918d403a2af51e5ac0c9b0a"
EXPECTED_ROUND42 = [0.8068996214514802, 0.6482955294801964, 0.12242597054162963, -1.293911631412221]


def test_edge_cases():
    nodes = simulate_key_agreement({0: [1], 1: [0], 2: []})
    assert torch.equal(CorrelatedNoise(nodes[0], 0.0).sum_for_round(0, 5), torch.zeros(5))
    assert torch.equal(CorrelatedNoise(nodes[2], 1.0).sum_for_round(0, 5), torch.zeros(5))  # isolated node
    assert CorrelatedNoise(nodes[0], 1.0).sum_for_round(0, 0).shape == (0,)
    noise = CorrelatedNoise(nodes[0], 1.0)
    for bad in (-1, 1.5, True, 1 << 64):
        with pytest.raises(PrivacyConfigError, match="round must be"):
            noise.sum_for_round(bad, 3)  # type: ignore[arg-type]
    with pytest.raises(PrivacyConfigError, match="floating point"):
        noise.sum_for_round(0, 3, dtype=torch.int64)
    with pytest.raises(PrivacyConfigError, match="sigma_cor"):
        CorrelatedNoise(nodes[0], -1.0)
    with pytest.raises(PrivacyConfigError, match="run key agreement"):
        CorrelatedNoise(PairwiseSecrets(0, [1]), 1.0)


# -------------------------------------------------------------------------------------------------- multiprocess
WORLD = 3


def _worker(rank: int, store_path: str, out_dir: str) -> None:
    die_with_parent()
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    try:
        secrets = PairwiseSecrets(rank, [j for j in range(WORLD) if j != rank])  # complete graph K3 (= 3-ring)
        keys = exchange_public_keys(secrets)
        secrets.agree(keys, context=b"mp-test")
        verify_agreement(secrets)
        noise = CorrelatedNoise(secrets, 2.0)
        torch.save(
            {
                "keys": keys,
                "state": secrets.state_dict(),
                "edges": {j: edge_noise(noise, j, 5, 513) for j in secrets.neighbours},
                "sum": noise.sum_for_round(5, 513),
            },
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_exchange_public_keys_over_gloo(tmp_path):
    # fork: the workers start with this process's imports instead of loading torch again (each sets one thread before
    # any work, so no OpenMP pool of this process is needed in a child)
    mp.start_processes(_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD, join=True,
                       start_method="fork")
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    assert all(r["keys"] == results[0]["keys"] for r in results)  # same public mapping everywhere
    assert sorted(results[0]["keys"]) == list(range(WORLD))
    assert len({r["state"]["run_id"] for r in results}) == 1
    for i, j in itertools.permutations(range(WORLD), 2):
        assert results[i]["state"]["fingerprints"][j] == results[j]["state"]["fingerprints"][i]
        assert torch.equal(results[i]["edges"][j], -results[j]["edges"][i])
    total = torch.stack([r["sum"] for r in results]).double().sum(0)
    assert total.abs().max() < 1e-5 * max(r["sum"].abs().max() for r in results)
