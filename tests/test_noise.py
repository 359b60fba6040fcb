"""Every random draw privacy rests on comes from ChaCha20 under a 256-bit key (privacy/noise.py).

The attack these tests replay: a neighbour receives one released step ``g + N(0, sigma^2 I)``; for each candidate
seed it regenerates the noise the code would have drawn and subtracts it. With torch's CPU generator (mt19937, 32
effective seed bits) the true seed leaves a residual of the size of the gradient, every wrong one a residual of the
size of the noise, so a search over the seed space recovers the noise exactly.
"""

from __future__ import annotations

import os
import pickle
import time

import numpy as np
import pytest
import torch
from scipy import stats

from lightning_privdec import CorrelatedNoiseStrategy, CPGTStrategy, DPCSGPStrategy, DynD2PStrategy, PrivSGPVRStrategy
from lightning_privdec.algorithms.cpgt import NOISE_STREAM
from lightning_privdec.privacy import PrivacyConfigError, PrivacyParameters
from lightning_privdec.algorithms.dp_csgp import DPCSGPNode
from lightning_privdec.privacy.noise import KEY_BYTES, NoiseGenerator, node_noise_generator
from lightning_privdec.privacy.sampling import PoissonBatchSampler

D, SIGMA, COORDS = 5000, 1.0, 32  # one released step of d = 5,000 at sigma = 1; the attack looks at 32 coordinates
WINDOW = 1 << 12  # candidate seeds per search (the real attack covers 2^32 in core-hours; the test covers a window)


def _released_step(noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the clipped mean gradient, the released update) of one step: small gradient, unit noise."""
    gradient = 0.01 * torch.randn(noise.numel(), generator=torch.Generator().manual_seed(123))
    return gradient, gradient + noise


def _best_residual(released: torch.Tensor, candidates) -> float:
    """The attack: min over candidate noise streams of ||released - candidate|| on the first COORDS coordinates."""
    target = released[:COORDS]
    return min(float((target - candidate[:COORDS]).norm()) for candidate in candidates)


def test_the_seed_search_finds_a_torch_generator_and_is_therefore_a_real_attack() -> None:
    """Positive control: the same search recovers noise drawn the old way (torch.Generator, 63-bit seed whose low
    32 bits fall in the window), so the negative result below is not a search that cannot succeed."""
    secret = int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1)
    secret = (secret & ~0xFFFFFFFF) | 1234  # low 32 bits inside the searched window
    generator = torch.Generator().manual_seed(secret)
    _, released = _released_step(torch.randn(D, generator=generator) * SIGMA)
    candidates = (torch.randn(COORDS, generator=torch.Generator().manual_seed(s)) * SIGMA for s in range(WINDOW))
    assert _best_residual(released, candidates) < 0.5  # only the gradient is left: the noise is recovered


def test_a_seed_search_cannot_reproduce_the_noise_of_an_os_entropy_generator() -> None:
    released = _released_step(node_noise_generator("cpu", None, rank=0).normal(D, SIGMA))[1]
    # every seed the code could have used in a small window, for torch's generators (32/64-bit seeds) and for this
    # library's own seeded derivation (every rank and stream name it uses)
    torch_candidates = (torch.randn(COORDS, generator=torch.Generator().manual_seed(s)) for s in range(WINDOW))
    ours = (
        node_noise_generator("cpu", s, rank, stream).normal(COORDS, SIGMA)
        for s in range(WINDOW // 16)
        for rank in range(4)
        for stream in ("noise", "sampling", NOISE_STREAM, "decor")
    )
    # ||a - b||^2 of two independent N(0, I_32) draws is 2 chi^2_32 (about 64; below 4 with probability ~1e-20 even
    # for the best of 4096 candidates), while the right candidate leaves only the gradient (~0.06)
    assert _best_residual(released, torch_candidates) > 2.0
    assert _best_residual(released, ours) > 2.0


def test_keys_have_256_bits_and_no_two_nodes_or_runs_share_noise() -> None:
    generators = [node_noise_generator("cpu", None, rank) for rank in range(8) for _ in range(4)]
    keys = {g._key for g in generators}
    assert len(keys) == len(generators) and all(len(k) == KEY_BYTES == 32 for k in keys)
    draws = torch.stack([g.normal(256, 1.0, torch.float64) for g in generators])
    correlation = torch.corrcoef(draws) - torch.eye(len(generators), dtype=torch.float64)
    assert correlation.abs().max() < 0.35  # 256 coordinates: independent streams correlate by ~1/16
    assert len({tuple(d[:4].tolist()) for d in draws}) == len(generators)  # none coincide


def test_secure_generators_never_leave_the_process() -> None:
    generator = node_noise_generator("cpu", None, 0)
    with pytest.raises(PrivacyConfigError, match="never saved"):
        generator.get_state()
    with pytest.raises(TypeError, match="secret key"):
        pickle.dumps(generator)
    assert "NOT private" in repr(node_noise_generator("cpu", 1, 0)) and "OS entropy" in repr(generator)


@pytest.mark.parametrize(("secure_mode", "dtype"), [(False, torch.float64), (True, torch.float64), (False, torch.float32)])
def test_gaussian_noise_has_the_right_mean_std_and_tails(
    secure_mode: bool, dtype: torch.dtype, device: torch.device
) -> None:
    n, std = 400_000, 2.5
    generator = node_noise_generator(device, None, 0, secure_mode=secure_mode)
    draws = generator.normal(n, std, dtype)
    assert draws.device.type == device.type
    draws = draws.double().cpu().numpy()
    assert abs(draws.mean()) < 5 * std / np.sqrt(n)
    assert draws.std() == pytest.approx(std, rel=0.01)
    assert stats.kstest(draws / std, "norm").pvalue > 1e-4
    for k, expected in ((2, 0.0455), (3, 0.0027), (4, 6.3e-5)):  # two-sided tail mass of N(0, 1)
        observed = float(np.mean(np.abs(draws) > k * std))
        assert observed == pytest.approx(expected, rel=5 / np.sqrt(expected * n))


def _narrow_reference(key: bytes, numel: int, std: float) -> tuple[np.ndarray, np.ndarray]:
    """(the float64 values, the radius r of each entry's pair) of the first draw of a generator under ``key`` in the
    narrow format, recomputed from the raw keystreams as the module documents it: u1 from the 64-bit words under the
    draw's nonce, the angle a 2 pi 2^-32 from the signed 32-bit words a under the nonce whose last word is 1; the
    cosines of all pairs first, then the sines."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

    pairs = (numel + 1) // 2
    raw = Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None).encryptor().update(bytes(8 * pairs))
    u1 = (np.frombuffer(raw, dtype="<u8") >> np.uint64(11)).astype(np.float64) * 2.0**-53
    angle_nonce = bytes(12) + (1).to_bytes(4, "little")
    raw = Cipher(algorithms.ChaCha20(key, angle_nonce), mode=None).encryptor().update(bytes(4 * pairs))
    theta = np.frombuffer(raw, dtype="<i4").astype(np.float64) * (2 * np.pi * 2.0**-32)
    r = std * np.sqrt(-2.0 * np.log1p(-u1))
    sines = numel - pairs
    return (np.concatenate([r * np.cos(theta), (r * np.sin(theta))[:sines]]), np.concatenate([r, r[:sines]]))


@pytest.fixture(params=["compiled", "numpy"])
def host_transform(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test with the host's compiled narrow transform (privacy/native_noise.py; skipped where it cannot be
    built) and again with NumPy's (``PRIVDEC_NATIVE_NOISE=0``)."""
    from lightning_privdec.privacy import native_noise

    if request.param == "numpy":
        monkeypatch.setenv("PRIVDEC_NATIVE_NOISE", "0")
    elif native_noise.native_transform() is None:
        pytest.skip("the compiled transform cannot be built here (no C compiler or libmvec)")
    return request.param


def test_narrow_noise_is_box_muller_of_the_documented_keystream_words(device: torch.device, host_transform: str) -> None:
    """float32/bfloat16 draws against a float64 re-computation of the documented format from the raw keystreams:
    every entry within r * 2^-21 (the angle's float32 rounding) plus two ulps of the float64 value, plus, where the
    host takes the radius's logarithm in float32, std^2 2^-24 / r (a relative 2^-24 of 1 - u1); entries with r below
    0.02 std (their logarithm is float64) within the first two terms, so the tails and the density near 0 are those of
    the float64 radius; whatever the chunk size."""
    key, std, numel = bytes(range(32)), 0.7, 100_001  # odd: the last pair's sine is dropped
    expected, radius = (torch.from_numpy(a) for a in _narrow_reference(key, numel, std))
    for dtype in (torch.float32, torch.bfloat16):
        narrow = NoiseGenerator(key, device=device, seeded=True).normal(numel, std, dtype).double().cpu()
        ulp = torch.finfo(dtype).eps * expected.abs()
        error = (narrow - expected).abs()
        float64_radius = 2 * ulp + radius * 2.0**-21
        assert bool((error <= float64_radius + std**2 * 2.0**-24 / radius).all()), dtype
        small = radius < 0.02 * std
        assert int(small.sum()) > 10 and bool((error[small] <= float64_radius[small]).all()), dtype
        assert float((error <= ulp).float().mean()) > 0.5


def test_narrow_noise_on_the_host_takes_the_logarithm_in_float64_only_near_r_0(host_transform: str) -> None:
    """The float32 logarithm of 1 - u1 = m 2^-53 (m the exact integer, rounded to float32: a relative 2^-24) keeps
    the tail's reach, and r within a relative 2^-25 / |log(1 - u1)| + 2^-22 of the float64 radius; below u1 = 2^-12
    (r^2 < ~2^-11) the float64 logarithm of the exact m takes over: r within 2^-22 there. Crafted uniforms at both
    ends, on both sides of that boundary, and with m halfway between two float32 values (the largest rounding)."""
    from lightning_privdec.privacy.keystream import KeyStream, KeystreamBuffers

    stream = KeyStream(bytes(32), bytes(16), KeystreamBuffers("cpu"))
    stream._buffers.reserve(16)
    k = np.array([0, 1, 2, 3, 2**41 - 2**28, 2**41 - 1, 2**41, 2**41 + 2**28 + 1, 2**45 + 2**27, 2**52 + 2**28,
                  2**53 - 2**30, 2**53 - 2, 2**53 - 1])
    u1 = k.astype(np.float64) * 2.0**-53
    radius_words = torch.from_numpy((k << 11).astype(np.uint64).view(np.int64).copy())
    cosines = torch.empty(len(k))
    stream._box_muller_host(radius_words, torch.zeros(len(k), dtype=torch.int32), cosines, torch.empty(0), 1.0)
    log_v = np.log1p(-u1)
    expected = np.sqrt(-2.0 * log_v)
    assert cosines[0] == 0 and float(cosines[1]) == 2.0**-26  # the density near 0 is resolved as in float64
    got = cosines[1:].double().numpy()
    relative = np.abs(got - expected[1:]) / expected[1:]
    near = u1[1:] < 2.0**-12
    assert bool((relative[near] <= 2.0**-22).all())
    assert bool((relative <= 2.0**-25 / np.abs(log_v[1:]) + 2.0**-22).all())
    assert relative[~near].max() > 2.0**-20  # the crafted roundings do reach the float32 logarithm's error
    assert float(cosines[-1]) == pytest.approx(np.sqrt(2 * 53 * np.log(2)), rel=2.0**-22)  # the tail's reach


@pytest.mark.parametrize("transform", ["_box_muller_host", "_box_muller_torch"])
@pytest.mark.parametrize("narrow", [True, False])
def test_the_radius_has_the_tails_and_the_small_values_of_53_bit_uniforms(transform: str, narrow: bool) -> None:
    """Crafted keystream words: u1 = 0 gives r = 0, u1 = 2^-53 gives r = 2^-26 (the density near 0 is resolved),
    u1 = 1 - 2^-53 gives the largest draw sqrt(2 ln 2^53) ~ 8.57 (the tail); angle 0 puts all of r in the cosine."""
    from lightning_privdec.privacy.keystream import KeyStream, KeystreamBuffers

    stream = KeyStream(bytes(32), bytes(16), KeystreamBuffers("cpu"))
    stream._buffers.reserve(8)
    top = (1 << 53) - 1
    # the words as int64 (two's complement); their top 53 bits k = 0, 1, 2^53 - 1
    radius_words = torch.tensor([0, 1 << 11, (top << 11) - (1 << 64)], dtype=torch.int64)
    angle_words = torch.zeros(3, dtype=torch.int32 if narrow else torch.int64)
    dtype = torch.float32 if narrow else torch.float64
    cosines, sines = torch.empty(3, dtype=dtype), torch.empty(3, dtype=dtype)
    getattr(stream, transform)(radius_words, angle_words, cosines, sines, 1.0)
    largest = float(np.sqrt(2 * 53 * np.log(2)))
    tolerance = 4 * torch.finfo(dtype).eps
    assert cosines[0] == 0 and sines.abs().max() == 0
    assert float(cosines[1]) == pytest.approx(2.0**-26, rel=tolerance)
    assert float(cosines[2]) == pytest.approx(largest, rel=tolerance)


def test_reused_output_draws_the_same_noise_without_allocating(device: torch.device) -> None:
    fresh = node_noise_generator(device, 9, 0)
    reused = node_noise_generator(device, 9, 0)
    first = reused.normal(5000, 1.0, reuse_output=True)
    assert torch.equal(first, fresh.normal(5000, 1.0))
    pointer = first.data_ptr()
    second = reused.normal(4000, 1.0, reuse_output=True)
    assert second.data_ptr() == pointer and torch.equal(second, fresh.normal(4000, 1.0))
    assert reused.normal(6000, 1.0, torch.float64, reuse_output=True).dtype == torch.float64


def test_bernoulli_sampling_has_its_rate(device: torch.device) -> None:
    generator = node_noise_generator(device, None, 0)
    mask = generator.bernoulli(200_000, 0.05)
    assert mask.dtype == torch.bool and float(mask.float().mean()) == pytest.approx(0.05, rel=0.03)


def test_a_fixed_seed_is_reproducible_and_its_state_continues_the_stream() -> None:
    def draws(generator: NoiseGenerator) -> list[torch.Tensor]:
        return [generator.normal(300, 1.0), generator.laplace(50, 2.0), generator.uniform(20)]

    first, again = node_noise_generator("cpu", 7, 2), node_noise_generator("cpu", 7, 2)
    for a, b in zip(draws(first), draws(again)):
        assert torch.equal(a, b)
    state = first.get_state()
    expected = draws(first)
    resumed = node_noise_generator("cpu", 7, 2)
    resumed.set_state(state)
    for a, b in zip(draws(resumed), expected):
        assert torch.equal(a, b)
    others = [node_noise_generator("cpu", 8, 2), node_noise_generator("cpu", 7, 3), node_noise_generator("cpu", 7, 2, "x")]
    assert all(not torch.equal(o.normal(300, 1.0), draws(node_noise_generator("cpu", 7, 2))[0]) for o in others)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_draws_do_not_depend_on_the_chunk_size(monkeypatch: pytest.MonkeyPatch, device: torch.device,
                                               dtype: torch.dtype, host_transform: str) -> None:
    from lightning_privdec.privacy import keystream

    expected = node_noise_generator(device, 3, 0).normal(1001, 1.0, dtype)
    monkeypatch.setattr(keystream, "CHUNK_WORDS", 6)
    assert torch.equal(node_noise_generator(device, 3, 0).normal(1001, 1.0, dtype), expected)


def test_poisson_sampling_is_secret_per_node_and_reproducible_with_a_seed() -> None:
    def batches(generator: NoiseGenerator) -> list[list[int]]:
        return list(PoissonBatchSampler(500, 0.1, steps_per_epoch=5, generator=generator))

    assert batches(node_noise_generator("cpu", 4, 0, "sampling")) == batches(node_noise_generator("cpu", 4, 0, "sampling"))
    assert batches(node_noise_generator("cpu", None, 0, "sampling")) != batches(node_noise_generator("cpu", None, 0, "sampling"))
    default = PoissonBatchSampler(500, 0.1)
    assert isinstance(default.generator, NoiseGenerator) and not default.generator.seeded


def test_every_private_strategy_draws_its_noise_from_chacha20_keys() -> None:
    dp = DPCSGPNode(PrivacyParameters(max_grad_norm=1.0, noise_multiplier=1.0), rank=0, device=torch.device("cpu"))
    for generator in (dp.gaussian.generator, dp.sampler.generator):
        assert isinstance(generator, NoiseGenerator) and not generator.seeded and len(generator._key) == 32
    secure = DPCSGPNode(PrivacyParameters(max_grad_norm=1.0, noise_multiplier=1.0), rank=0,
                               device=torch.device("cpu"), secure_mode=True)
    assert secure.gaussian.generator.secure_mode and not secure.sampler.generator.secure_mode
    budget = dict(max_grad_norm=1.0, target_epsilon=3.0, target_delta=1e-5, secure_mode=True)
    for strategy in (DPCSGPStrategy(**budget), DynD2PStrategy(**budget), PrivSGPVRStrategy(**budget),
                     CorrelatedNoiseStrategy(**budget)):
        assert strategy.secure_mode and strategy.configuration()["secure_mode"] is True
    with pytest.raises(PrivacyConfigError, match="Laplace"):
        CPGTStrategy(noise_decay=0.9, lipschitz=1.0, **budget)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_draws_equal_the_cpu_draws_of_the_same_key() -> None:
    cpu = node_noise_generator("cpu", 11, 0).normal(100_003, 1.0, torch.float64)
    cuda = node_noise_generator("cuda", 11, 0).normal(100_003, 1.0, torch.float64)
    assert cuda.device.type == "cuda"
    torch.testing.assert_close(cuda.cpu(), cpu, rtol=1e-12, atol=1e-12)


def test_the_key_is_the_whole_os_entropy_and_every_key_byte_matters(monkeypatch: pytest.MonkeyPatch) -> None:
    """The old defect: 63 bits of OS entropy of which torch kept 32. Here the key is all 32 bytes os.urandom gave,
    and changing any one of them (not only the low ones) changes the stream."""
    from lightning_privdec.privacy import noise

    key = bytes(range(100, 132))
    monkeypatch.setattr(noise.os, "urandom", lambda n: key[:n])
    generator = node_noise_generator("cpu", None, 0)
    assert generator._key == key and not generator.seeded
    stream = generator.normal(64, 1.0, torch.float64)
    for byte in (0, 3, 4, 8, 16, 31):  # the bytes a 32- or 64-bit truncation would drop are among them
        flipped = bytearray(key)
        flipped[byte] ^= 1
        assert not torch.equal(NoiseGenerator(bytes(flipped)).normal(64, 1.0, torch.float64), stream), byte


def test_draw_k_is_the_chacha20_keystream_under_nonce_k_and_draws_never_repeat() -> None:
    """Each draw reads a fresh keystream (nonce = draw index): no two draws, steps or streams share noise."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

    key = bytes(range(32))
    generator = NoiseGenerator(key, seeded=True)
    for k in range(3):
        nonce = bytes(4) + k.to_bytes(8, "little") + bytes(4)
        raw = Cipher(algorithms.ChaCha20(key, nonce), mode=None).encryptor().update(bytes(8 * 10))
        words = np.frombuffer(raw, dtype="<u8") >> np.uint64(11)
        expected = torch.from_numpy(words.astype(np.float64) * 2.0**-53)
        assert torch.equal(generator.uniform(10), expected), k
    first, second = generator.normal(5000, 1.0, torch.float64), generator.normal(5000, 1.0, torch.float64)
    assert abs(float(torch.corrcoef(torch.stack([first, second]))[0, 1])) < 0.05


def test_a_copied_seeded_generator_continues_the_same_stream() -> None:
    import copy

    generator = node_noise_generator("cpu", 2, 0)
    generator.normal(10, 1.0)
    copied, pickled = copy.deepcopy(generator), pickle.loads(pickle.dumps(generator))
    expected = generator.normal(1000, 1.0)
    assert torch.equal(copied.normal(1000, 1.0), expected) and torch.equal(pickled.normal(1000, 1.0), expected)


def test_the_host_transform_and_the_accelerator_transform_give_the_same_draws() -> None:
    """The host's NumPy transform and the torch transform that accelerators run (here on CPU tensors) compute the
    same Box-Muller draws from the same keystream, to float rounding, for even and odd sizes and both widths."""
    from lightning_privdec.privacy.keystream import KeyStream, KeystreamBuffers

    key = bytes(range(32))
    for numel, dtype in ((1000, torch.float64), (1001, torch.float64), (1001, torch.float32)):
        host, device = torch.empty(numel, dtype=dtype), torch.empty(numel, dtype=dtype)
        KeyStream(key, bytes(16), KeystreamBuffers("cpu")).standard_normal_into(host, 0.5)
        buffers = KeystreamBuffers("cpu")
        buffers.host_transform = False  # the accelerators' torch transform, for float32 draws too
        KeyStream(key, bytes(16), buffers).standard_normal_into(device, 0.5)
        tolerance = 1e-12 if dtype == torch.float64 else 2e-6
        torch.testing.assert_close(host, device, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("secure_mode", [False, True])
@pytest.mark.parametrize("chunk", [6, 1 << 17])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("gathered", [True, False])
@pytest.mark.parametrize("sums64", [False, True])
def test_noise_added_into_pieces_is_the_one_draw_split_over_them(
    monkeypatch: pytest.MonkeyPatch, secure_mode: bool, chunk: int, threads: int, fused: bool, gathered: bool,
    sums64: bool,
) -> None:
    """add_normal_ (the DP step's noise, added into each parameter's gradient chunk by chunk) gives bit for bit
    ``normal(total)`` split over the pieces plus the scaled sums, whatever the chunk size, the pieces' sizes and
    the intra-op threads (with several, it adds in pieces small enough for torch to run on this thread), with the
    compiled addition where it runs (``fused``) and with the noise written and added by torch, small pieces
    gathered into one vector or each drawn into as it is (``gathered``). Float64 sums (``sums64``, the clipped sums
    the strategies noise) are added in float64 and the noisy value rounded to the float32 output once: never the
    sum rounded to float32 first, which would not be a post-processing of the noisy value."""
    from lightning_privdec.privacy import keystream, noise

    if not fused:
        monkeypatch.setattr(noise, "_added_as_made", lambda *args: None)
    if not gathered:
        monkeypatch.setattr(noise, "_GATHER_PIECE", 0)
    monkeypatch.setattr(keystream, "CHUNK_WORDS", chunk)
    torch.set_num_threads(threads)  # (tests/conftest.py restores the count)
    monkeypatch.setattr(noise, "_SERIAL", 4)  # the several-thread path's pieces, small enough to split these sums
    sizes, std, scale = (5, 1, 12, 3, 40), 0.3, 0.25
    # float64 sums 1 + 2^-30 k: every one rounds to another float32 value than itself
    sums = [(1 + torch.randint(1, 1000, (n,), dtype=torch.float64) * 2.0**-30) if sums64 else torch.randn(n)
            for n in sizes]
    expected = node_noise_generator("cpu", 4, 1, secure_mode=secure_mode).normal(sum(sizes), std).split(sizes)
    inputs = [s.clone() for s in sums]
    outs = [torch.empty(n) for n in sizes]
    if not sums64:
        outs[2] = inputs[2]  # an out may be its own sum (p.grad holding the clipped sum)
    node_noise_generator("cpu", 4, 1, secure_mode=secure_mode).add_normal_(outs, std, inputs, scale)
    for out, noise_piece, summed in zip(outs, expected, sums):
        assert torch.equal(out, torch.add(noise_piece, summed, alpha=scale).float())
        if sums64:  # not the sum rounded first (these differ in about 1 entry in 8)
            assert out.dtype == torch.float32 and not all(
                torch.equal(o, torch.add(noise_piece, summed.float(), alpha=scale)) for o, noise_piece, summed in
                zip(outs, expected, sums))


@pytest.mark.parametrize("threads", [1, 3])
def test_noise_on_the_host_is_added_as_it_is_made(monkeypatch: pytest.MonkeyPatch, threads: int) -> None:
    """Float32 host gradients get the compiled transform with the addition fused, on runs of pairs that stop where
    an output ends within the cosines or within the sines (an empty output among them, chunks of 7 pairs, an odd
    draw): ``normal`` plus ``torch.add``, bit for bit, every pair made once. Sums that share memory with another
    output, or a strided output, take the written noise."""
    from lightning_privdec.privacy import keystream, native_noise, noise

    transform = native_noise.native_transform()
    if not isinstance(transform, native_noise.NativeTransform):
        pytest.skip("the compiled transform cannot be built here (no C compiler or libmvec)")
    monkeypatch.setattr(noise, "_GATHER_PIECE", 0)  # each output drawn into as it is (not gathered)
    made = []
    add_at = native_noise.NativeTransform.add_at
    monkeypatch.setattr(native_noise.NativeTransform, "add_at",
                        lambda self, words, angles, p, *rest: made.append(p) or add_at(self, words, angles, p, *rest))
    monkeypatch.setattr(keystream, "CHUNK_WORDS", 7)
    torch.set_num_threads(threads)  # (tests/conftest.py restores the count)
    sizes, std, scale = (5, 0, 1, 12, 3, 40, 8), 0.3, -0.75
    total = sum(sizes)  # 69: 35 pairs, 34 with a sine
    sums = [torch.randn(n) for n in sizes]
    expected = node_noise_generator("cpu", 4, 1).normal(total, std).split(sizes)
    outs = [torch.empty(n) for n in sizes]
    outs[3] = sums[3].clone()
    inputs = [*sums[:3], outs[3], *sums[4:]]  # the fourth output is its own sum
    versions = [o._version for o in outs]
    node_noise_generator("cpu", 4, 1).add_normal_(outs, std, inputs, scale)
    assert all(o._version > v for o, v in zip(outs, versions))  # the writes through addresses are seen
    for out, noise_piece, summed in zip(outs, expected, sums):
        assert torch.equal(out.view(torch.int32), torch.add(noise_piece, summed, alpha=scale).view(torch.int32))
    assert sum(made) == (total + 1) // 2
    assert noise._added_as_made([torch.zeros(4)], [torch.ones(1)], [0, 4], 1.0, 1.0) is None  # sizes differ
    with pytest.raises(RuntimeError, match="must match"):  # as before: torch.add refuses the sizes
        node_noise_generator("cpu", 4, 1).add_normal_([torch.zeros(1000)], 1.0, [torch.arange(2000.0)[:1]], 1.0)
    monkeypatch.setattr(transform, "adds", False)  # the fused addition failed its check here: written, then added
    assert noise._added_as_made([torch.zeros(4)], [torch.ones(4)], [0, 4], 1.0, 1.0) is None
    monkeypatch.setattr(transform, "adds", True)
    shared = [torch.zeros(4), torch.zeros(4)]
    assert noise._added_as_made(shared, [shared[1], torch.ones(4)], [0, 4, 8], 1.0, 1.0) is None
    strided = torch.zeros(8)[::2]
    assert noise._added_as_made([strided], [torch.ones(4)], [0, 4], 1.0, 1.0) is None
    assert noise._added_as_made([torch.zeros(4)], [torch.ones(4)], [0, 4], 1.0, 1.0) is not None


def test_many_small_pieces_are_drawn_through_one_gathered_vector(monkeypatch: pytest.MonkeyPatch) -> None:
    """A DP step's noise into many small float32 gradients (a small transformer's LayerNorm and bias vectors) is drawn
    into one vector holding their sums side by side, in one compiled call per chunk rather than one per piece, and
    copied back: the same bits as drawing into each piece. Few or large pieces, or sums of another dtype, are drawn
    into as they are."""
    from lightning_privdec.privacy import native_noise, noise

    transform = native_noise.native_transform()
    if not isinstance(transform, native_noise.NativeTransform) or not transform.adds:
        pytest.skip("the compiled transform with its fused addition cannot be built here")
    calls = []
    add_at = native_noise.NativeTransform.add_at
    monkeypatch.setattr(native_noise.NativeTransform, "add_at",
                        lambda self, *args: calls.append(args[2]) or add_at(self, *args))
    sizes, std, scale = (64, 1, 700, 7, 7, 300, 2, 33), 0.7, 0.125
    sums = [torch.randn(n) for n in sizes]

    def drawn(gather: int) -> list[torch.Tensor]:
        monkeypatch.setattr(noise, "_GATHER_PIECE", gather)
        outs = [torch.empty(n) for n in sizes]
        outs[1] = sums[1].clone()  # an output that is its own sum
        inputs = [*sums[:1], outs[1], *sums[2:]]
        versions = [o._version for o in outs]
        calls.clear()
        node_noise_generator("cpu", 9, 2).add_normal_(outs, std, inputs, scale)
        assert all(o._version > v for o, v in zip(outs, versions))
        return outs

    piecewise = drawn(0)
    assert len(calls) >= len(sizes)  # one call per output (and per cosine/sine side it spans)
    gathered = drawn(1 << 10)
    assert len(calls) == 1
    expected = node_noise_generator("cpu", 9, 2).normal(sum(sizes), std).split(sizes)
    for a, b, noise_piece, summed in zip(piecewise, gathered, expected, sums):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
        assert torch.equal(b.view(torch.int32), torch.add(noise_piece, summed, alpha=scale).view(torch.int32))
    generator = node_noise_generator("cpu", 9, 2)
    small = [torch.zeros(n) for n in sizes]
    assert generator._gathers(small, small, sum(sizes))
    assert not generator._gathers(small[:3], small[:3], sum(sizes[:3]))  # three pieces: their own calls cost less
    large = [torch.zeros(1 << 11) for _ in range(4)]
    assert not generator._gathers(large, large, 4 << 11)  # large pieces: copying them would cost more
    mixed = [torch.zeros(1 << 20), *small]
    assert not generator._gathers(mixed, mixed, (1 << 20) + sum(sizes))  # nor a large one for a tail of small ones
    with pytest.raises(ValueError, match="one sum per output"):
        generator.add_normal_(small, 1.0, small[:-1], 1.0)
    wide = [t.double() for t in small]
    assert not generator._gathers(small, wide, sum(sizes))  # float64 sums: torch.add's own promotion
    assert not generator._gathers(small, small[::-1], sum(sizes))  # sizes that differ: torch.add refuses them


def test_noise_added_on_an_accelerator_is_one_add_per_chunk_and_parameter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces small enough for the calling thread are for the host's intra-op threads: added into tensors elsewhere
    (here the meta device, as a GPU's gradients), each parameter's part of each chunk is one addition (one kernel
    launch), however many threads torch has."""
    from lightning_privdec.privacy import keystream, noise

    monkeypatch.setattr(keystream, "CHUNK_WORDS", 1 << 12)
    monkeypatch.setattr(noise, "_SERIAL", 64)  # the host's pieces: far smaller than a chunk
    torch.set_num_threads(2)  # (tests/conftest.py restores the count)
    sizes = (5000, 3, 70000)  # 75003 entries: 19 chunks of 4096 words, the first and last parameter over several
    additions, add = [], torch.add

    def counted_add(noise, summed, **kwargs):  # noqa: ANN001, ANN003, ANN202 - called by the drawing threads too
        additions.append(summed.numel())
        return add(noise, summed, **kwargs)

    monkeypatch.setattr(torch, "add", counted_add)
    outs = [torch.empty(n, device="meta") for n in sizes]
    node_noise_generator("cpu", 4, 1).add_normal_(outs, 0.5, [torch.zeros(n, device="meta") for n in sizes], 1.0)
    chunks = -(-sum(sizes) // (1 << 12))
    assert sum(additions) == sum(sizes)
    assert len(additions) <= chunks + len(sizes)  # the host's pieces of 64 entries would be over a thousand
    assert max(additions) > 1 << 11


@pytest.mark.parametrize("chunk", [6, 64])
def test_float32_draws_shared_by_several_threads_are_the_one_thread_draws(monkeypatch: pytest.MonkeyPatch,
                                                                          chunk: int, host_transform: str) -> None:
    """Each chunk of a float32 draw reads its own keystream offsets (unaligned ones too: 6 pairs are 48 bytes of
    radius words), so neither the threads that share the chunks nor the chunk size change a value: ``normal`` and
    ``add_normal_`` on 3 threads with small chunks equal one thread's draws in the default chunks, bit for bit; each
    thread drew chunks with its own buffers."""
    import threading

    from lightning_privdec.privacy import keystream

    drawn_by: set[tuple[int, int]] = set()
    read_pairs, lock = keystream.KeyStream._read_pairs, threading.Lock()  # every chunk's read, written or added
    first_thread: list[int] = []
    second_thread = threading.Event()

    def spied(self, first, p, buffers):  # noqa: ANN001, ANN202
        me = threading.get_ident()
        with lock:
            drawn_by.add((me, id(buffers)))
            first_thread[:] = first_thread or [me]
        if me != first_thread[0]:
            second_thread.set()
        elif not second_thread.wait(timeout=30):  # the first thread's chunks wait until another thread draws one
            raise AssertionError("no second thread drew a chunk")
        return read_pairs(self, first, p, buffers)

    def shared_by_threads() -> bool:  # the last draw's chunks: several threads, each with its own buffers
        threads, buffers = {t for t, _ in drawn_by}, {b for _, b in drawn_by}
        drawn_by.clear()
        first_thread.clear()
        second_thread.clear()
        return len(threads) > 1 and len(buffers) == len(threads)

    def draws(threads: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
        torch.set_num_threads(threads)  # (tests/conftest.py restores the count)
        generator = node_noise_generator("cpu", 5, 0)
        first = generator.normal(1001, 0.5).clone()
        shared = shared_by_threads()
        outs, sums = [torch.zeros(700), torch.zeros(301)], [torch.ones(700), torch.ones(301)]
        generator.add_normal_(outs, 0.5, sums, 0.25)
        return first, torch.cat(outs), shared and shared_by_threads()

    expected = draws(1)
    monkeypatch.setattr(keystream, "CHUNK_WORDS", chunk)
    monkeypatch.setattr(keystream.KeyStream, "_read_pairs", spied)
    shared = draws(3)
    assert shared[2]
    assert torch.equal(shared[0], expected[0]) and torch.equal(shared[1], expected[1])


def test_a_failing_chunk_stops_the_draw_and_is_raised_after_every_thread_ended(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from lightning_privdec.privacy import keystream

    read_pairs, calls = keystream.KeyStream._read_pairs, []

    def failing(self, first, p, buffers):  # noqa: ANN001, ANN202
        calls.append(first)
        if first == 3 * 8:
            raise MemoryError("chunk 3")
        return read_pairs(self, first, p, buffers)

    monkeypatch.setattr(keystream, "CHUNK_WORDS", 8)
    monkeypatch.setattr(keystream.KeyStream, "_read_pairs", failing)
    torch.set_num_threads(3)
    before = threading.active_count()
    with pytest.raises(MemoryError, match="chunk 3"):
        node_noise_generator("cpu", 5, 0).add_normal_([torch.zeros(1600)], 1.0, [torch.zeros(1600)], 1.0)
    assert threading.active_count() == before  # every helper ended
    assert len(calls) < 100  # 100 chunks: the others stopped taking new ones


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and at least 2 usable CPUs")
def test_a_draws_helper_threads_keep_off_the_calling_threads_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """With another process on the second core the scheduler put a draw's two threads on one core, where they drew
    no faster than one: each helper keeps off the calling thread's CPU for its life (the values are unchanged), the
    caller's own CPU set is untouched, and a helper whose set is that one CPU runs where it may."""
    import threading

    from lightning_privdec import native
    from lightning_privdec.privacy import keystream

    allowed = os.sched_getaffinity(0)
    callers = min(allowed)
    probed: list[set[int] | None] = []

    def probe() -> None:  # may a thread change its own CPU set here (not in every sandbox)?
        try:
            os.sched_setaffinity(threading.get_native_id(), allowed - {callers})
            probed.append(os.sched_getaffinity(0))
        except OSError:
            probed.append(None)

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
    if probed != [allowed - {callers}]:
        pytest.skip("a thread may not change its CPU set here")
    monkeypatch.setattr(native, "cpu_now", lambda: callers)
    monkeypatch.setattr(keystream, "CHUNK_WORDS", 64)
    seen: dict[int, set[int]] = {}
    write = keystream.KeyStream.narrow_host_chunk

    def spy(self, *args, **kwargs):  # noqa: ANN001, ANN202
        seen.setdefault(threading.get_ident(), os.sched_getaffinity(0))
        time.sleep(0.002)  # every thread gets chunks
        return write(self, *args, **kwargs)

    expected = node_noise_generator("cpu", 5, 0).normal(20_001, 1.0)
    monkeypatch.setattr(keystream.KeyStream, "narrow_host_chunk", spy)
    torch.set_num_threads(2)  # (tests/conftest.py restores the count)
    assert torch.equal(node_noise_generator("cpu", 5, 0).normal(20_001, 1.0), expected)
    assert seen.pop(threading.get_ident()) == allowed == os.sched_getaffinity(0)  # the caller: as it was
    assert list(seen.values()) == [allowed - {callers}]  # the helper: anywhere but the caller's CPU
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {callers})  # nowhere else to go: left alone
    monkeypatch.setattr(os, "sched_setaffinity", lambda *args: pytest.fail("a one-CPU set was changed"))
    native.keep_off(callers)
