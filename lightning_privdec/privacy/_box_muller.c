/* The narrow Box-Muller transform of lightning_privdec.privacy.keystream (KeyStream's narrow format), one fused
 * loop per block of pairs. lightning_privdec/privacy/native_noise.py compiles it on first use for this machine
 * (-O3 -march=native -fno-math-errno, glibc's libmvec: the vector logf, cosf and sinf) and checks it against the
 * NumPy transform before using it.
 *
 * Pair i: m = 2^53 - (w_i >> 11) (the exact integer of 1 - u1 = m 2^-53, in [1, 2^53]), v = fl32(m) 2^-53,
 * r = sqrt(log(v) * radius_factor) (radius_factor = fl32(-2 scale^2)), the logarithm taken in float64 from the
 * exact m where v >= near_one (r near 0); t = fl32(a_i) * angle_scale; cosines[i] = r cos t for i < p,
 * sines[i] = r sin t for i < q (q <= p). Every step is float32 but the float64 logarithm near r = 0, as in NumPy.
 * narrow_box_muller_add adds the noise into a parameter's gradient as it is made (noise.py's add_normal_): the
 * rounding of torch.add, without writing the noise and reading it back; narrow_box_muller_add64 adds it to float64
 * sums in float64 and rounds the noisy value to float32 once.
 */
#include <math.h>
#include <stdint.h>

__attribute__((simd("notinbranch"))) extern float logf(float);
__attribute__((simd("notinbranch"))) extern float cosf(float);
__attribute__((simd("notinbranch"))) extern float sinf(float);

/* Pairs per block: its work arrays stay in the core's L1 cache. Every loop that calls logf, cosf or sinf runs over
 * the whole block (a partial block's tail padded with r = 0, t = 0), so every entry goes through the same vector
 * function: a scalar remainder loop (glibc's scalar logf, cosf, sinf) would give other last bits, and a draw's
 * values would then depend on where its chunks and blocks start. */
#define BLOCK 512

/* AVX-512 machines: 16-lane loops and libmvec's 16-lane functions (GCC otherwise prefers 8 lanes even there): the
 * transform takes ~0.85 ns per coordinate instead of ~1.0 on one core of an Intel Xeon. */
#if defined(__x86_64__) && defined(__AVX512F__)
#pragma GCC target("prefer-vector-width=512")
#endif

static inline int64_t exact_m(int64_t word) { return (int64_t)(((uint64_t)1 << 53) - ((uint64_t)word >> 11)); }

/* out[i] = r_i f(t_i) (radius, work), or added: fma(alpha, sums[i], r_i f(t_i)) for float32 sums (add == 1), the
 * float64 fma(alpha64, sums[i], r_i f(t_i)) rounded to float32 once for float64 sums (add == 2: the clipped sums,
 * never rounded to float32 before the noise); out may be sums, entry for entry (float32 sums only). */
static inline void emit(float *out, const void *sums, const float *radius, const float *work, int64_t n,
                        float alpha, double alpha64, int add)
{
    if (add == 2) {
        const double *wide = sums;
        for (int64_t i = 0; i < n; i++)
            out[i] = (float)fma(alpha64, wide[i], (double)(radius[i] * work[i]));
    } else if (add) {
        const float *narrow = sums;
#pragma GCC ivdep
        for (int64_t i = 0; i < n; i++)
            out[i] = fmaf(alpha, narrow[i], radius[i] * work[i]);
    } else {
        for (int64_t i = 0; i < n; i++)
            out[i] = radius[i] * work[i];
    }
}

/* Entry i of a vector of sums (float64 when add == 2, else float32). */
static inline const void *sums_at(const void *sums, int64_t i, int add)
{
    return add == 2 ? (const void *)((const double *)sums + i) : (const void *)((const float *)sums + i);
}

/* One transform, written (add == 0) or added: cosines[i] = fma(alpha, cos_sums[i], r cos t) and likewise for the
 * sines, the rounding of torch.add(noise, sums, alpha=alpha, out=out) on the noise it writes. An output may be its
 * sums (the same address, entry for entry); nothing else may share memory. */
static inline void transform(const int64_t *restrict words, const int32_t *restrict angles, float *cosines,
                             const void *cos_sums, float *sines, const void *sin_sums, int64_t p, int64_t q,
                             float radius_factor, float angle_scale, float near_one, float alpha, double alpha64,
                             int add)
{
    float radius[BLOCK] __attribute__((aligned(64)));
    float theta[BLOCK] __attribute__((aligned(64)));
    float work[BLOCK] __attribute__((aligned(64)));
    for (int64_t start = 0; start < p; start += BLOCK) {
        const int64_t n = p - start < BLOCK ? p - start : BLOCK;
        const int64_t *w = words + start;
        const int32_t *a = angles + start;
        int near = 0; /* any v >= near_one (r near 0, one pair in 4,096): its logarithm is float64, of the exact m */
        for (int64_t i = 0; i < n; i++) {
            radius[i] = (float)exact_m(w[i]) * 0x1p-53f; /* v = fl32(m) 2^-53, exact scaling */
            theta[i] = (float)a[i] * angle_scale;
            near |= radius[i] >= near_one;
        }
        for (int64_t i = n; i < BLOCK; i++) {
            radius[i] = 1.0f;
            theta[i] = 0.0f;
        }
        for (int i = 0; i < BLOCK; i++)
            work[i] = logf(radius[i]);
        if (near)
            for (int64_t i = 0; i < n; i++)
                if (radius[i] >= near_one)
                    work[i] = (float)log((double)exact_m(w[i]) * 0x1p-53);
        for (int i = 0; i < BLOCK; i++)
            radius[i] = sqrtf(work[i] * radius_factor);
        for (int i = 0; i < BLOCK; i++)
            work[i] = cosf(theta[i]);
        emit(cosines + start, add ? sums_at(cos_sums, start, add) : 0, radius, work, n, alpha, alpha64, add);
        const int64_t with_sine = q - start < n ? q - start : n;
        if (with_sine > 0) {
            for (int i = 0; i < BLOCK; i++)
                work[i] = sinf(theta[i]);
            emit(sines + start, add ? sums_at(sin_sums, start, add) : 0, radius, work, with_sine, alpha, alpha64,
                 add);
        }
    }
}

void narrow_box_muller(const int64_t *restrict words, const int32_t *restrict angles, float *restrict cosines,
                       float *restrict sines, int64_t p, int64_t q, float radius_factor, float angle_scale,
                       float near_one)
{
    transform(words, angles, cosines, 0, sines, 0, p, q, radius_factor, angle_scale, near_one, 0.0f, 0.0, 0);
}

/* The transform added: cosines = cos_sums * alpha + noise (fused), sines likewise; see transform. */
void narrow_box_muller_add(const int64_t *restrict words, const int32_t *restrict angles, float *cosines,
                           const float *cos_sums, float *sines, const float *sin_sums, int64_t p, int64_t q,
                           float radius_factor, float angle_scale, float near_one, float alpha)
{
    transform(words, angles, cosines, cos_sums, sines, sin_sums, p, q, radius_factor, angle_scale, near_one, alpha,
              0.0, 1);
}

/* The transform added to float64 sums: cosines = fl32(cos_sums * alpha + noise) computed in float64 (one fma), sines
 * likewise; no output may share memory with anything. */
void narrow_box_muller_add64(const int64_t *restrict words, const int32_t *restrict angles, float *cosines,
                             const double *cos_sums, float *sines, const double *sin_sums, int64_t p, int64_t q,
                             float radius_factor, float angle_scale, float near_one, double alpha)
{
    transform(words, angles, cosines, cos_sums, sines, sin_sums, p, q, radius_factor, angle_scale, near_one, 0.0f,
              alpha, 2);
}
