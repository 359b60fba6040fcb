/* QSGD(8)'s host chunk loops (lightning_privdec.compression.quantizers.QSGD, bits = 8, float32 work), compiled on
 * first use by lightning_privdec/compression/native_qsgd.py and checked there, bit for bit, against the NumPy/torch
 * path before use. Chunks start on multiples of 8 coordinates, so each chunk's sign bits start on a byte.
 *
 * qsgd8_difference_norm: fl32 ||x - copy|| with torch.linalg.vector_norm's rounding on the host (its float32 kernel
 * of 8 lanes): v_i = fl32(x_i - copy_i); lane j sums fl32(v_i^2) for i = j mod 8 over the whole groups of 8, in order;
 * the lanes are summed left to right; the last n mod 8 squares are added in fours (each square rounded), then one by
 * one fused (fmaf); the root.
 *
 * qsgd8_encode, coordinate i of a chunk of n, v_i = x_i (or fl32(x_i - feedback_i) read before the feedback is
 * added, with of_difference):
 *   scaled = fl32(fl32(|v_i| * unit) + r_i 2^-24)   (r_i the 24-bit dithering integer: r_i 2^-24 is exact)
 *   level  = min(floor(scaled), s), 0 for NaN        (scaled <= s + 1 by construction)
 *   sign bit i = v_i < 0 (little bit order), and with feedback: feedback_i += (v_i < 0 ? -1 : 1) fl32(scale level)
 * qsgd8_decode_add: out_i += (bit i ? -1 : 1) fl32(scale level_i), the same rounding as the feedback. */
#include <stdint.h>
#include <string.h>
#include <math.h>

#define BLOCK 4096 /* coordinates per block: its sign bytes stay in the L1 cache */

static inline uint8_t pack8(const uint8_t *bytes) /* 8 bytes of 0 / 1 -> one byte, byte j -> bit j */
{
    uint8_t bits = 0;
    for (int j = 0; j < 8; j++)
        bits |= (uint8_t)(bytes[j] << j);
    return bits;
}

float qsgd8_difference_norm(const float *restrict x, const float *restrict copy, int64_t n)
{
    float lanes[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) {
            const float v = x[i + j] - copy[i + j];
            lanes[j] += v * v;
        }
    float sum = lanes[0];
    for (int j = 1; j < 8; j++)
        sum += lanes[j];
    for (const int64_t fours = n - (n - i) % 4; i < fours; i++) {
        const float v = x[i] - copy[i];
        sum += v * v;
    }
    for (; i < n; i++) {
        const float v = x[i] - copy[i];
        sum = fmaf(v, v, sum);
    }
    return sqrtf(sum);
}

void qsgd8_encode(const float *restrict x, const int32_t *restrict dither, int64_t n, float unit, int32_t s,
                  float scale, uint8_t *restrict levels, uint8_t *restrict signs, float *restrict feedback,
                  int32_t of_difference)
{
    uint8_t negative[BLOCK] __attribute__((aligned(64)));
    for (int64_t start = 0; start < n; start += BLOCK) {
        const int64_t m = n - start < BLOCK ? n - start : BLOCK;
        const float *xs = x + start;
        const int32_t *ds = dither + start;
        const float *cs = of_difference ? feedback + start : NULL;
        uint8_t *ls = levels + start;
        for (int64_t i = 0; i < m; i++) {
            const float v = cs ? xs[i] - cs[i] : xs[i];
            const float scaled = fabsf(v) * unit + (float)(ds[i] & 0xFFFFFF) * 0x1p-24f;
            int32_t level = scaled >= 0.0f && scaled < 256.0f ? (int32_t)scaled : 0;
            ls[i] = (uint8_t)(level > s ? s : level);
            negative[i] = v < 0.0f;
        }
        if (feedback) {
            float *fs = feedback + start;
            for (int64_t i = 0; i < m; i++) {
                const float value = scale * (float)ls[i];
                fs[i] += negative[i] ? -value : value;
            }
        }
        const int64_t whole = m / 8;
        for (int64_t k = 0; k < whole; k++)
            signs[start / 8 + k] = pack8(negative + 8 * k);
        if (m % 8) {
            uint8_t tail[8] = {0};
            memcpy(tail, negative + 8 * whole, (size_t)(m % 8));
            signs[start / 8 + whole] = pack8(tail);
        }
    }
}

void qsgd8_decode_add(const uint8_t *restrict levels, const uint8_t *restrict signs, int64_t n, float scale,
                      float *restrict out)
{
    uint8_t negative[BLOCK] __attribute__((aligned(64)));
    for (int64_t start = 0; start < n; start += BLOCK) {
        const int64_t m = n - start < BLOCK ? n - start : BLOCK;
        for (int64_t k = 0; k < (m + 7) / 8; k++) {
            const uint8_t bits = signs[start / 8 + k];
            for (int j = 0; j < 8; j++)
                negative[8 * k + j] = (bits >> j) & 1;
        }
        const uint8_t *ls = levels + start;
        float *os = out + start;
        for (int64_t i = 0; i < m; i++) {
            const float value = scale * (float)ls[i];
            os[i] += negative[i] ? -value : value;
        }
    }
}
