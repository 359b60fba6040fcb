"""Tests for lightning_privdec.compression: contraction, wire sizes, round trips, bit packing."""

from __future__ import annotations

import math
import random

import pytest
import torch

from lightning_privdec.compression import (
    QSGD,
    Compressor,
    Identity,
    RandK,
    Sign,
    TopK,
    Workspace,
    build_compressor,
    pack_bits,
    packed_nbytes,
    unpack_bits,
)

COMPRESSORS: list[Compressor] = [
    Identity(),
    TopK(0.1),
    TopK(0.01),
    RandK(0.1),
    RandK(0.5),
    QSGD(8),
    QSGD(4),
    QSGD(2),
    Sign(),
]
DIMS = [1, 7, 1000, 100_003]
X_KINDS = ["gaussian", "sparse_heavy", "constant"]

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")


def _ids(c: Compressor) -> str:
    return repr(c)


def is_random(c: Compressor) -> bool:
    return isinstance(c, (RandK, QSGD))


def make_x(kind: str, d: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "gaussian":
        x = torch.randn(d, generator=g, dtype=torch.float64)
    elif kind == "sparse_heavy":
        # ~10% non-zeros with log-normal (heavy-tailed) magnitudes; coordinate 0 always non-zero.
        x = torch.randn(d, generator=g, dtype=torch.float64) * torch.exp(2 * torch.randn(d, generator=g, dtype=torch.float64))
        mask = torch.rand(d, generator=g) < 0.1
        mask[0] = True
        x = x * mask
    elif kind == "constant":
        x = torch.full((d,), -0.75, dtype=torch.float64)
    else:
        raise AssertionError(kind)
    return x.to(dtype)


def sq_err(q: torch.Tensor, x: torch.Tensor) -> float:
    return float(((q.double() - x.double()) ** 2).sum())


# --------------------------------------------------------------------------- contraction
@pytest.mark.parametrize("kind", X_KINDS)
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("comp", COMPRESSORS, ids=_ids)
def test_contraction(comp: Compressor, d: int, kind: str) -> None:
    """E||Q(x) - x||^2 <= omega^2 ||x||^2 (CHOCO-SGD Assumption 1 / DP-CSGP Assumption 4)."""
    x = make_x(kind, d, seed=d)
    norm2 = float((x.double() ** 2).sum())
    omega2 = comp.omega2(d)
    assert 0.0 <= omega2 < 1.0
    bound = omega2 * norm2
    if is_random(comp):
        # RandK on sparse_heavy at large d: one coordinate holds ~87% of ||x||^2 and RandK(0.1) keeps it with
        # probability 0.1, so the error is bimodal; with 8 keys a uniform sampler fails this 4-stderr check ~40%
        # of the time
        heavy = kind == "sparse_heavy" and isinstance(comp, RandK)
        n_keys = 100 if d <= 1000 else (400 if heavy else 8)
        rng = random.Random(1234 + d)
        errs = torch.tensor([sq_err(comp.compress(x, rng.getrandbits(63)), x) for _ in range(n_keys)])
        mean = float(errs.mean())
        stderr = float(errs.std()) / math.sqrt(n_keys)
        assert mean <= bound + 4 * stderr + 1e-5 * norm2, (mean, bound, stderr)
    else:
        err = sq_err(comp.compress(x, key=0), x)
        assert err <= bound + 1e-5 * norm2, (err, bound)


@pytest.mark.parametrize("comp", COMPRESSORS, ids=_ids)
def test_zero_vector_decodes_to_zero(comp: Compressor) -> None:
    x = torch.zeros(37)
    q = comp.compress(x, key=5)
    assert torch.isfinite(q).all()
    assert torch.equal(q, torch.zeros(37))


def test_randk_error_is_exact_in_expectation() -> None:
    """For rand_k, E||Q(x) - x||^2 = (1 - k/d)||x||^2 exactly, so omega2 is tight."""
    comp, d = RandK(0.25), 64
    x = make_x("gaussian", d, seed=3)
    errs = torch.tensor([sq_err(comp.compress(x, key), x) for key in range(2000)])
    expected = comp.omega2(d) * float((x.double() ** 2).sum())
    assert abs(float(errs.mean()) - expected) <= 4 * float(errs.std()) / math.sqrt(2000)


def test_qsgd_scaled_is_unbiased() -> None:
    """tau * Q(x) is the unbiased QSGD estimator (Alistarh et al. 2017), so its mean tends to x."""
    comp, d = QSGD(2), 50
    x = make_x("gaussian", d, seed=4)
    mean = torch.stack([comp.compress(x, key) for key in range(2000)]).double().mean(0) * comp.tau(d)
    assert torch.allclose(mean, x.double(), atol=0.1 * float(x.norm()) / math.sqrt(d) + 0.05)


# --------------------------------------------------------------------------- wire format
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("comp", COMPRESSORS, ids=_ids)
def test_payload_matches_spec_and_size(comp: Compressor, d: int, dtype: torch.dtype) -> None:
    x = make_x("gaussian", d, seed=1, dtype=dtype)
    payload = comp.encode(x, key=42)
    spec = comp.payload_spec(d, dtype)
    assert [(tuple(t.shape), t.dtype) for t in payload] == spec
    nbytes = sum(t.numel() * t.element_size() for t in payload)
    assert nbytes == comp.encoded_nbytes(d, dtype)
    assert nbytes == sum(math.prod(s) * torch.empty((), dtype=dt).element_size() for s, dt in spec)
    assert all(t.device == x.device for t in payload)
    if not isinstance(comp, Identity) and d >= 1000:
        # No dense float vectors on the wire, and strictly fewer bytes than sending x itself.
        assert not any(t.numel() == d and t.is_floating_point() for t in payload)
        assert nbytes < d * x.element_size()
    q = comp.decode(payload, d, key=42, dtype=dtype)
    assert q.shape == (d,) and q.dtype == dtype


def test_resnet18_sized_byte_counts() -> None:
    """Exact wire sizes for d = 11,173,962 (ResNet-18), float32."""
    d = 11_173_962
    assert TopK(0.01).encoded_nbytes(d) == 111_739 * (4 + 4)
    assert RandK(0.1).encoded_nbytes(d) == 1_117_396 * 4
    assert QSGD(8).encoded_nbytes(d) == d + math.ceil(d / 8) + 4 == 12_570_712
    assert Sign().encoded_nbytes(d) == math.ceil(d / 8) + 4 == 1_396_750
    assert Identity().encoded_nbytes(d) == 4 * d == 44_695_848


def test_qsgd_bits_per_coordinate() -> None:
    for bits in range(1, 17):
        d = 8 * 1001
        assert QSGD(bits).encoded_nbytes(d) == d * (bits + 1) // 8 + 4


def test_num_kept_formula() -> None:
    assert TopK(0.1).num_kept(7) == 1  # max(1, floor(0.7))
    assert TopK(0.29).num_kept(100) == 29  # despite 0.29 * 100 == 28.999999999999996
    assert RandK(1.0).num_kept(13) == 13
    assert RandK(0.5).num_kept(1) == 1
    assert RandK(0.1).omega2(1000) == pytest.approx(0.9)


# --------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("comp", COMPRESSORS, ids=_ids)
def test_same_key_same_result(comp: Compressor) -> None:
    x = make_x("gaussian", 1000, seed=2)
    a, b = comp.encode(x, key=7), comp.encode(x, key=7)
    assert all(torch.equal(s, t) for s, t in zip(a, b))
    assert torch.equal(comp.decode(a, 1000, 7), comp.compress(x, 7))
    if is_random(comp):
        assert not torch.equal(comp.compress(x, 7), comp.compress(x, 8))


def test_randk_receiver_reconstructs_kept_coordinates() -> None:
    comp, d, key = RandK(0.1), 1000, 2**62 + 12345
    x = make_x("gaussian", d, seed=5)
    (values,) = comp.encode(x, key)
    # The receiver only has the values, d and the key.
    received = values.clone()
    q = comp.decode([received], d, key)
    idx = comp.indices(d, key)
    assert idx.numel() == comp.num_kept(d) == 100
    assert idx.unique().numel() == 100
    mask = torch.zeros(d, dtype=torch.bool)
    mask[idx] = True
    assert torch.equal(q[mask], x[mask])
    assert torch.equal(q[~mask], torch.zeros(d - 100))
    assert torch.equal(q, torch.where(mask, x, torch.zeros(())))


def test_randk_coordinates_are_uniform() -> None:
    comp, d = RandK(0.25), 20  # k = 5
    counts = torch.zeros(d)
    n = 4000
    for key in range(n):
        counts[comp.indices(d, key)] += 1
    expected = n * 5 / d
    assert ((counts - expected).abs() < 0.15 * expected).all(), counts


def test_randk_keeps_every_coordinate_with_probability_k_over_d_when_k_does_not_divide_d() -> None:
    """Blocks of 3 and 4 coordinates (d = 13, k = 4): the random shift evens out their sizes, so each coordinate
    is kept with probability exactly 4/13 (a block-of-4 coordinate without the shift: 1/4)."""
    comp, d, n = RandK(0.31), 13, 20000
    assert comp.num_kept(d) == 4
    counts = torch.zeros(d)
    for key in range(n):
        idx = comp.indices(d, key)
        assert idx.unique().numel() == 4 and 0 <= int(idx.min()) and int(idx.max()) < d
        counts[idx] += 1
    expected = n * 4 / d
    assert ((counts - expected).abs() < 4 * math.sqrt(expected)).all(), counts  # 4 sigma per coordinate


@pytest.mark.parametrize("ratio", [0.1, 0.31, 1.0])
@pytest.mark.parametrize("d", [1, 2, 9, 10, 11, 13, 1000, 100_003])
def test_randk_keeps_the_rotated_comb_in_payload_order(d: int, ratio: float) -> None:
    """The kept coordinates are the comb's runs (run j: L consecutive coordinates from j B, the last run the rest)
    shifted by c modulo d, k distinct ones, and the payload carries x at them in that order, including the run that
    the wrap at d cuts."""
    comp = RandK(ratio)
    k = comp.num_kept(d)
    runs, length, spacing = comp.comb(d)
    assert runs * spacing <= d and (runs == 1 or spacing >= length) and (runs - 1) * length < k <= runs * length
    x = torch.randn(d)
    for key in (0, 1, 5, 2**62 + 7):
        c = comp.shift(d, key)
        expected = torch.tensor([(j * spacing + t + c) % d for j in range(runs) for t in range(length)][:k])
        idx = comp.indices(d, key)
        assert torch.equal(idx, expected) and idx.unique().numel() == k
        (values,) = comp.encode(x, key)
        assert torch.equal(values, x[expected])
        assert torch.equal(comp.decode([values], d, key), torch.zeros(d).index_put_((expected,), x[expected]))


@pytest.mark.parametrize(("ratio", "comb"), [(0.5, (3, 64, 100)), (0.9, (9, 32, 33)), (0.1, (1, 30, 301))])
def test_randk_comb_wraps_at_every_shift(monkeypatch: pytest.MonkeyPatch, ratio: float, comb: tuple) -> None:
    """Every shift c, so that every way the wrap at d cuts the comb is met (between runs, inside a full run, inside
    the last run): k distinct coordinates each time, each coordinate kept by exactly k of the d shifts (P = k/d),
    and the in-place error feedback reads and writes exactly those."""
    comp, d = RandK(ratio), 301  # k = 150: runs of 64, 64, 22; k = 270: runs of 64 do not fit, 8 of 32 and 14
    k = comp.num_kept(d)
    assert comp.comb(d) == comb
    monkeypatch.setattr(RandK, "shift", staticmethod(lambda d, key: key))  # the key is the shift
    counts = torch.zeros(d, dtype=torch.int64)
    x, copy = torch.randn(d), torch.randn(d)
    for c in range(d):
        kept = comp.indices(d, c)
        assert kept.unique().numel() == k and 0 <= int(kept.min()) and int(kept.max()) < d
        counts[kept] += 1
        before = copy.clone()
        (values,) = comp.encode_feedback_(x, copy, c)
        assert torch.equal(values, x[kept] - before[kept])
        assert torch.equal(copy, before.index_put_((kept,), before[kept] + values))
    assert torch.equal(counts, torch.full((d,), k))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("comp", COMPRESSORS, ids=_ids)
def test_error_feedback_in_place_matches_encode_and_decode(comp: Compressor, dtype: torch.dtype) -> None:
    """What the gossip calls (a reused workspace, decoded messages added in place) gives bit for bit what
    ``encode(x - copy)`` and ``copy + decode(...)`` give, round after round."""
    d, workspace = 100_003, Workspace()
    copy = make_x("gaussian", d, seed=11, dtype=dtype)
    expected_copy, received, expected_received = copy.clone(), torch.zeros(d, dtype=dtype), torch.zeros(d, dtype=dtype)
    for key in range(3):
        x = make_x("sparse_heavy", d, seed=key, dtype=dtype)
        expected = comp.encode(x - expected_copy, key)
        payload = comp.encode_feedback_(x, copy, key, workspace)
        assert all(torch.equal(a, b) for a, b in zip(payload, expected))
        expected_copy += comp.decode(expected, d, key, dtype=dtype)
        assert torch.equal(copy, expected_copy)
        assert all(torch.equal(a, b) for a, b in zip(comp.encode_difference(x, copy, key + 7, workspace),
                                                     comp.encode(x - copy, key + 7)))
        comp.decode_add_(payload, received, key, workspace)
        expected_received += comp.decode(expected, d, key, dtype=dtype)
        assert torch.equal(received, expected_received)


def test_topk_keeps_largest_magnitudes() -> None:
    comp, d = TopK(0.1), 1000
    x = make_x("sparse_heavy", d, seed=6) + 1e-3 * make_x("gaussian", d, seed=7)  # no exact ties
    q = comp.compress(x, key=0)
    kept = q != 0
    assert int(kept.sum()) == 100
    assert torch.equal(q[kept], x[kept])
    assert x[kept].abs().min() >= x[~kept].abs().max()
    assert set(torch.topk(x.abs(), 100).indices.tolist()) == set(kept.nonzero().flatten().tolist())


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8, 11, 16])
def test_qsgd_values_on_grid(bits: int) -> None:
    comp, d = QSGD(bits), 1001
    x = make_x("sparse_heavy", d, seed=bits)
    payload = comp.encode(x, key=bits)
    q = comp.decode(payload, d, key=bits).double()
    norm = float(payload[2])
    assert norm == pytest.approx(float(x.double().norm()), rel=1e-6)
    levels = q * comp.tau(d) * comp.s / norm  # signed level, must be an integer in [-s, s]
    assert torch.allclose(levels, levels.round(), atol=1e-3)
    assert levels.abs().max() <= comp.s + 1e-3
    nz = q != 0
    assert torch.equal(torch.sign(q[nz]), torch.sign(x.double()[nz]))
    # Each level is floor or ceil of s|x|/||x||.
    target = comp.s * x.double().abs() / norm
    assert ((levels.abs() - target).abs() <= 1 + 1e-3).all()


def test_sign_matches_formula() -> None:
    d = 1003
    x = make_x("sparse_heavy", d, seed=8)  # ~90% exact zeros: sign(0) must be +1
    q = Sign().compress(x, key=0)
    expected = (x.abs().sum() / d) * torch.where(x >= 0, 1.0, -1.0)
    assert torch.allclose(q, expected, rtol=1e-6, atol=0)
    assert (q > 0).sum() == (x >= 0).sum()


@pytest.mark.parametrize("comp", COMPRESSORS, ids=_ids)
def test_compress_keeps_dtype_and_handles_noncontiguous(comp: Compressor) -> None:
    base = make_x("gaussian", 2000, seed=9, dtype=torch.float64)
    x = base[::2]  # non-contiguous view
    q = comp.compress(x, key=3)
    assert q.dtype == torch.float64 and q.shape == (1000,)
    assert torch.equal(q, comp.compress(x.contiguous(), key=3))


@CUDA
@pytest.mark.parametrize("comp", COMPRESSORS, ids=_ids)
def test_cuda_round_trip(comp: Compressor) -> None:
    d = 100_003
    x = make_x("gaussian", d, seed=10).cuda()
    payload = comp.encode(x, key=11)
    assert all(t.is_cuda for t in payload)
    assert [(tuple(t.shape), t.dtype) for t in payload] == comp.payload_spec(d)
    q = comp.decode(payload, d, key=11)
    assert q.is_cuda and torch.equal(q, comp.compress(x, key=11))
    if not is_random(comp):  # deterministic compressors agree across devices
        assert torch.allclose(q.cpu(), comp.compress(x.cpu(), key=11), rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- bit packing
def _reference_pack(values: list[int], width: int) -> list[int]:
    """Pure-Python wire layout: little-endian bit stream, bit j of value i at i*width + j."""
    stream = 0
    for i, v in enumerate(values):
        stream |= v << (i * width)
    nbytes = (len(values) * width + 7) // 8
    return [(stream >> (8 * b)) & 0xFF for b in range(nbytes)]


@pytest.mark.parametrize("width", list(range(1, 17)) + [24, 32])
@pytest.mark.parametrize("n", [0, 1, 3, 7, 13, 100, 1001])
def test_bits_round_trip(width: int, n: int) -> None:
    g = torch.Generator().manual_seed(width * 1000 + n)
    values = torch.randint(0, 2**width, (n,), generator=g, dtype=torch.int64)
    if n:
        values[0] = 2**width - 1  # all ones
    packed = pack_bits(values, width)
    assert packed.dtype == torch.uint8 and packed.shape == (packed_nbytes(n, width),)
    assert packed.numel() == math.ceil(n * width / 8)
    assert torch.equal(unpack_bits(packed, width, n), values)


@pytest.mark.parametrize("width", list(range(1, 17)))
def test_bits_layout_is_the_same_for_all_code_paths(width: int) -> None:
    values = [random.Random(width).randrange(2**width) for _ in range(29)]
    packed = pack_bits(torch.tensor(values), width)
    assert packed.tolist() == _reference_pack(values, width)


def test_bits_accepts_bool_and_small_int_dtypes() -> None:
    b = torch.tensor([True, False, True, True, False, False, False, False, True])
    assert pack_bits(b, 1).tolist() == [0b00001101, 0b1]
    assert torch.equal(unpack_bits(pack_bits(b, 1), 1, 9), b.long())
    u = torch.tensor([3, 0, 2], dtype=torch.uint8)
    assert torch.equal(unpack_bits(pack_bits(u, 2), 2, 3), u.long())


def test_bits_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"bit width must be an int in \[1, 32\]"):
        pack_bits(torch.tensor([1]), 0)
    with pytest.raises(ValueError, match="bit width"):
        pack_bits(torch.tensor([1]), 33)
    with pytest.raises(ValueError, match="integer or bool"):
        pack_bits(torch.tensor([1.0]), 4)
    with pytest.raises(ValueError, match="bytes for 10 values"):
        unpack_bits(torch.zeros(3, dtype=torch.uint8), 4, 10)
    with pytest.raises(ValueError, match="uint8"):
        unpack_bits(torch.zeros(5, dtype=torch.int32), 4, 10)


# --------------------------------------------------------------------------- arguments, factory
@pytest.mark.parametrize("cls", [TopK, RandK])
@pytest.mark.parametrize("ratio", [0, 0.0, -0.1, 1.5, float("nan"), "0.1", None, True])
def test_bad_ratio(cls: type, ratio: object) -> None:
    with pytest.raises(ValueError, match=r"ratio.*\(0, 1\]"):
        cls(ratio)


@pytest.mark.parametrize("bits", [0, 17, -3, 2.5, "8", True])
def test_bad_qsgd_bits(bits: object) -> None:
    with pytest.raises(ValueError, match=r"bits.*\[1, 16\]"):
        QSGD(bits)


@pytest.mark.parametrize("comp", COMPRESSORS, ids=_ids)
def test_bad_inputs(comp: Compressor) -> None:
    with pytest.raises(ValueError, match="1-D floating-point"):
        comp.encode(torch.zeros(3, 4), key=0)
    with pytest.raises(ValueError, match="1-D floating-point"):
        comp.encode(torch.arange(5), key=0)
    with pytest.raises(ValueError, match="non-empty"):
        comp.encode(torch.zeros(0), key=0)
    with pytest.raises(ValueError, match="positive int"):
        comp.omega2(0)
    payload = comp.encode(torch.ones(100), key=0)
    with pytest.raises(ValueError, match="payload does not match payload_spec"):
        comp.decode(payload, 200, key=0)  # wrong d
    with pytest.raises(ValueError, match="payload does not match payload_spec"):
        comp.decode(payload[:-1], 100, key=0)


def test_repr_and_names() -> None:
    assert repr(RandK(0.1)) == "RandK(ratio=0.1)"
    assert repr(TopK(0.01)) == "TopK(ratio=0.01)"
    assert repr(QSGD(8)) == "QSGD(bits=8)"
    assert repr(Sign()) == "Sign()"
    assert repr(Identity()) == "Identity()"
    assert [c.name for c in (Identity(), TopK(1), RandK(1), QSGD(8), Sign())] == [
        "identity",
        "topk",
        "randk",
        "qsgd",
        "sign",
    ]


def test_build_compressor_valid() -> None:
    assert build_compressor(None) is None
    assert build_compressor("none") is None
    c = RandK(0.3)
    assert build_compressor(c) is c
    assert isinstance(build_compressor("identity"), Identity)
    assert isinstance(build_compressor("sign"), Sign)
    topk = build_compressor(" TopK:0.01 ")
    assert isinstance(topk, TopK) and topk.ratio == 0.01
    randk = build_compressor("randk:0.1")
    assert isinstance(randk, RandK) and randk.ratio == 0.1
    qsgd = build_compressor("qsgd:8")
    assert isinstance(qsgd, QSGD) and qsgd.bits == 8


@pytest.mark.parametrize(
    "spec", ["foo", "topk", "topk:", "topk:abc", "topk:2", "randk:0", "qsgd:0", "qsgd:4.5", "sign:1", "none:0", 42]
)
def test_build_compressor_invalid(spec: object) -> None:
    with pytest.raises(ValueError, match=r"topk:<ratio in \(0, 1\]>.*qsgd:<bits in 1\.\.16>"):
        build_compressor(spec)


def test_qsgd_dithering_does_not_depend_on_the_chunk_size(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_privdec.compression import quantizers

    x = make_x("gaussian", 1001, seed=2)
    expected = QSGD(8).encode(x, 99)
    monkeypatch.setattr(quantizers, "_QUANTIZE_CHUNK", 8)
    assert all(torch.equal(a, b) for a, b in zip(QSGD(8).encode(x, 99), expected))


def test_public_randomness_is_the_documented_aes_128_ctr_keystream() -> None:
    """RandK's shift and QSGD's dithering read the AES-128-CTR keystream under (the 63-bit seed, little-endian, then
    the 8-byte domain tag), counter block 0: recomputed here from the cipher alone, so sender and receiver (and every
    library version) agree on it."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    from lightning_privdec.compression.base import public_words

    key = 2**62 + 12345
    cipher = Cipher(algorithms.AES(key.to_bytes(8, "little") + b"lpd/cmp3"), modes.CTR(bytes(16))).encryptor()
    expected = torch.frombuffer(bytearray(cipher.update(bytes(40))), dtype=torch.int64)
    assert torch.equal(public_words(key | 2**63, 5), expected)  # the seed is the key's low 63 bits
    d = 9_670_666
    assert RandK(0.1).shift(d, key) == (int(expected[0]) & (2**53 - 1)) * d >> 53
