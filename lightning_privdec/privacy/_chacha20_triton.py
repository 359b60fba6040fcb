"""The Triton kernel of :mod:`.device_keystream`: RFC 8439's ChaCha20 blocks, one per lane (imported only where a
draw's keystream is computed on a device: a host-only run never builds it, nor needs Triton)."""

import triton
import triton.language as tl


@triton.jit
def _rotl(x, n: tl.constexpr):  # noqa: ANN001, ANN202
    return (x << n) | (x >> (32 - n))


@triton.jit
def _quarter_round(a, b, c, d):  # noqa: ANN001, ANN202 - RFC 8439, section 2.1
    a = a + b
    d = _rotl(d ^ a, 16)
    c = c + d
    b = _rotl(b ^ c, 12)
    a = a + b
    d = _rotl(d ^ a, 8)
    c = c + d
    b = _rotl(b ^ c, 7)
    return a, b, c, d


#: the scalar arguments are never specialised (Triton compiles a variant for an integer equal to 1 or divisible by
#: 16, which key words and block numbers are by chance): one compiled kernel serves every draw
WORD_ARGUMENTS = ["c0", "c1", "c2", "c3", "k0", "k1", "k2", "k3", "k4", "k5", "k6", "k7", "counter", "n0", "n1", "n2"]


@triton.jit(do_not_specialize=[*WORD_ARGUMENTS, "first_block", "n_blocks"])
def chacha20_blocks(  # noqa: ANN202, PLR0913
    out_ptr, c0, c1, c2, c3, k0, k1, k2, k3, k4, k5, k6, k7, counter, n0, n1, n2,  # noqa: ANN001
    first_block, n_blocks, LANES: tl.constexpr,  # noqa: ANN001
):
    """Keystream blocks ``first_block + i`` (i < n_blocks) of the state c0..c3 (RFC 8439's constants), k0..k7
    (the key), the block counter and n0..n2 (the nonce), each a signed 32-bit integer holding the word's bits,
    into ``out_ptr`` (int32, 16 words per block, in the keystream's order)."""
    lane = tl.program_id(0) * LANES + tl.arange(0, LANES)
    live = lane < n_blocks
    zero = tl.zeros([LANES], dtype=tl.uint32)
    s0 = c0.to(tl.uint32, bitcast=True)
    s1 = c1.to(tl.uint32, bitcast=True)
    s2 = c2.to(tl.uint32, bitcast=True)
    s3 = c3.to(tl.uint32, bitcast=True)
    s4 = k0.to(tl.uint32, bitcast=True)
    s5 = k1.to(tl.uint32, bitcast=True)
    s6 = k2.to(tl.uint32, bitcast=True)
    s7 = k3.to(tl.uint32, bitcast=True)
    s8 = k4.to(tl.uint32, bitcast=True)
    s9 = k5.to(tl.uint32, bitcast=True)
    s10 = k6.to(tl.uint32, bitcast=True)
    s11 = k7.to(tl.uint32, bitcast=True)
    s13 = n0.to(tl.uint32, bitcast=True)
    s14 = n1.to(tl.uint32, bitcast=True)
    s15 = n2.to(tl.uint32, bitcast=True)
    # the block counter: the nonce's plus the block's index (the caller keeps it below 2^32)
    s12 = counter.to(tl.uint32, bitcast=True) + (lane.to(tl.int64) + first_block).to(tl.uint32)
    x0, x1, x2, x3, x4, x5, x6, x7 = zero + s0, zero + s1, zero + s2, zero + s3, zero + s4, zero + s5, zero + s6, \
        zero + s7
    x8, x9, x10, x11, x12, x13, x14, x15 = zero + s8, zero + s9, zero + s10, zero + s11, s12, zero + s13, \
        zero + s14, zero + s15
    for _ in range(10):  # ten double rounds: a column round, then a diagonal round
        x0, x4, x8, x12 = _quarter_round(x0, x4, x8, x12)
        x1, x5, x9, x13 = _quarter_round(x1, x5, x9, x13)
        x2, x6, x10, x14 = _quarter_round(x2, x6, x10, x14)
        x3, x7, x11, x15 = _quarter_round(x3, x7, x11, x15)
        x0, x5, x10, x15 = _quarter_round(x0, x5, x10, x15)
        x1, x6, x11, x12 = _quarter_round(x1, x6, x11, x12)
        x2, x7, x8, x13 = _quarter_round(x2, x7, x8, x13)
        x3, x4, x9, x14 = _quarter_round(x3, x4, x9, x14)
    base = out_ptr + lane.to(tl.int64) * 16
    tl.store(base + 0, (x0 + s0).to(tl.int32, bitcast=True), mask=live)
    tl.store(base + 1, (x1 + s1).to(tl.int32, bitcast=True), mask=live)
    tl.store(base + 2, (x2 + s2).to(tl.int32, bitcast=True), mask=live)
    tl.store(base + 3, (x3 + s3).to(tl.int32, bitcast=True), mask=live)
    tl.store(base + 4, (x4 + s4).to(tl.int32, bitcast=True), mask=live)
    tl.store(base + 5, (x5 + s5).to(tl.int32, bitcast=True), mask=live)
    tl.store(base + 6, (x6 + s6).to(tl.int32, bitcast=True), mask=live)
    tl.store(base + 7, (x7 + s7).to(tl.int32, bitcast=True), mask=live)
    tl.store(base + 8, (x8 + s8).to(tl.int32, bitcast=True), mask=live)
    tl.store(base + 9, (x9 + s9).to(tl.int32, bitcast=True), mask=live)
    tl.store(base + 10, (x10 + s10).to(tl.int32, bitcast=True), mask=live)
    tl.store(base + 11, (x11 + s11).to(tl.int32, bitcast=True), mask=live)
    tl.store(base + 12, (x12 + s12).to(tl.int32, bitcast=True), mask=live)
    tl.store(base + 13, (x13 + s13).to(tl.int32, bitcast=True), mask=live)
    tl.store(base + 14, (x14 + s14).to(tl.int32, bitcast=True), mask=live)
    tl.store(base + 15, (x15 + s15).to(tl.int32, bitcast=True), mask=live)
