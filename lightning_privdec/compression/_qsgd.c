/* QSGD(8)'s host chunk loops (lightning_privdec.compression.quantizers.QSGD, bits = 8, float32 work), compiled on
 * first use by lightning_privdec/compression/native_qsgd.py and checked there, bit for bit, against the NumPy/torch
 * path before use. Chunks start on multiples of 8 coordinates, so each chunk's sign bits start on a byte.
 *
 * qsgd8_encode, coordinate i of a chunk of n:
 *   scaled = fl32(fl32(|x_i| * unit) + r_i 2^-24)   (r_i the 24-bit dithering integer: r_i 2^-24 is exact)
 *   level  = min(floor(scaled), s), 0 for NaN        (scaled <= s + 1 by construction)
 *   sign bit i = x_i < 0 (little bit order), and with feedback: feedback_i += (x_i < 0 ? -1 : 1) fl32(scale level)
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

void qsgd8_encode(const float *restrict x, const int32_t *restrict dither, int64_t n, float unit, int32_t s,
                  float scale, uint8_t *restrict levels, uint8_t *restrict signs, float *restrict feedback)
{
    uint8_t negative[BLOCK] __attribute__((aligned(64)));
    for (int64_t start = 0; start < n; start += BLOCK) {
        const int64_t m = n - start < BLOCK ? n - start : BLOCK;
        const float *xs = x + start;
        const int32_t *ds = dither + start;
        uint8_t *ls = levels + start;
        for (int64_t i = 0; i < m; i++) {
            const float scaled = fabsf(xs[i]) * unit + (float)(ds[i] & 0xFFFFFF) * 0x1p-24f;
            int32_t level = scaled >= 0.0f && scaled < 256.0f ? (int32_t)scaled : 0;
            ls[i] = (uint8_t)(level > s ? s : level);
            negative[i] = xs[i] < 0.0f;
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
