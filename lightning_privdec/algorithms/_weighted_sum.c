/* The gossip's weighted sums of model-sized float32 vectors in one pass (lightning_privdec/algorithms/weighted_sum.py
 * compiles it on first use for this machine with lightning_privdec.native's flags and checks it before use):
 *
 *     out = w_0 t_0 + w_1 t_1 + ... + w_{k-1} t_{k-1},
 *
 * entry by entry: acc = w_0 t_0 (exact when w_0 = 1), then acc = fma(w_j, t_j, acc) for j = 1, 2, ... in order, each
 * term one rounding, as torch's vectorised add with alpha rounds. The first three terms are read in one loop (every
 * vector streams at once, as the memory system prefers); further terms, rare, in a pass each over a block of the
 * running sums held in the L1 cache. out may be t_0 itself (the same address): an entry is read before it is written.
 * No other two vectors may share memory.
 */
#include <math.h>
#include <stdint.h>

#if defined(__x86_64__) && defined(__AVX512F__)
#pragma GCC target("prefer-vector-width=512")
#endif

#define BLOCK 2048

static inline float first_term(float w0, float t0) { return w0 == 1.0f ? t0 : w0 * t0; }

static void first_three(float *o, const float *t0, const float *restrict t1, const float *restrict t2, float w0,
                        float w1, float w2, int64_t count, int64_t m)
{
    /* ivdep: o may be t0 itself, entry for entry (no dependence between entries): vectorise without GCC's overlap
     * check, which would run the scalar loop then */
    if (count == 1)
#pragma GCC ivdep
        for (int64_t i = 0; i < m; i++)
            o[i] = first_term(w0, t0[i]);
    else if (count == 2)
#pragma GCC ivdep
        for (int64_t i = 0; i < m; i++)
            o[i] = fmaf(w1, t1[i], first_term(w0, t0[i]));
    else
#pragma GCC ivdep
        for (int64_t i = 0; i < m; i++)
            o[i] = fmaf(w2, t2[i], fmaf(w1, t1[i], first_term(w0, t0[i])));
}

void weighted_sum_f32(float *out, const float *const *terms, const float *weights, int64_t count, int64_t n)
{
    if (count <= 3) {
        first_three(out, terms[0], count > 1 ? terms[1] : 0, count > 2 ? terms[2] : 0, weights[0],
                    count > 1 ? weights[1] : 0.0f, count > 2 ? weights[2] : 0.0f, count, n);
        return;
    }
    for (int64_t start = 0; start < n; start += BLOCK) {
        const int64_t m = n - start < BLOCK ? n - start : BLOCK;
        float *o = out + start;
        first_three(o, terms[0] + start, terms[1] + start, terms[2] + start, weights[0], weights[1], weights[2], 3,
                    m);
        for (int64_t j = 3; j < count; j++) {
            const float *restrict t = terms[j] + start;
            const float w = weights[j];
            for (int64_t i = 0; i < m; i++)
                o[i] = fmaf(w, t[i], o[i]);
        }
    }
}
