/* The quantized products of the CPU engine's decode steps: x [M, K] (float32) times a weight [N, K]
   transposed, y [M, N], for a 4-bit weight in GGUF's Q4_1 form (nvchat_q4_1_gemv) and an 8-bit one
   with a scale per row (nvchat_q8_gemv). Both take the activations as integers, in the same parts.

   Q4_1:

   The weight is stored in blocks of four rows, in groups of 32 along K: 16 bytes of nibbles per
   row and group (byte j holds value j in its low nibble and value j + 16 in its high one), the
   four rows' groups side by side ([blocks][groups][4][16]), with a float16 scale and minimum per
   row and group ([blocks][groups][4], as Q4_1 stores them): w = scale * q + minimum, q in 0..15,
   20 bytes a row and group. A block is read front to back, one stream of nibbles and two of
   scales, which the prefetchers follow; the rows one after another made twelve streams and ran at
   half the bandwidth.

   The activations are split into two int8 parts per group of 32, x = xscale * (high + low / 256)
   with xscale = amax / 127, so that a group's dot product is integer arithmetic: AVX2's maddubs
   multiplies the unsigned nibbles by signed int8 values and adds neighbouring pairs, 32 products
   in two instructions, once for each part. The two parts hold x to about 2^-16 of the group's
   largest value: rounding x to one int8 (llama.cpp's Q8_1) turned SmolLM2's "The capital of
   France is Paris" into "L'Étoile, la Marseillaise", as llama.cpp answers on the same file. Per
   group, sum_i w_i x_i = scale * xscale / 256 * sum_i q_i (256 high_i + low_i) + minimum * sum_i x_i.
   The high part alone is one int8 per value, which a caller may choose (two_parts 0).

   Four weight rows go through the group loop together, against two activation rows at a time:
   eight independent accumulators keep the FMA units busy where one row's chain of dependent adds
   would wait on itself, and each group's nibbles are unpacked once for both activation rows. The
   blocks of four weight rows are split between OpenMP threads. Built by
   engine/layers/native_cpu.py with -mavx2 -mfma -mf16c. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* How far ahead of its products a kernel asks for its weights, in groups: 16 groups of an int8
   block of four rows are 2 KiB. The hardware prefetchers alone left one core reading ~9 GB/s of a
   stream it can read at ~16; asking this far ahead gave SmolLM2's int8 products 18% and its int4
   ones 6% on one thread on the AVX2 box (8 groups ahead: 10%; 32: as 16). */
enum { PREFETCH_GROUPS = 16 };

static inline float sum8(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_shuffle_ps(a, a, 1));
    return _mm_cvtss_f32(a);
}

static inline float max8(__m256 v) {
    __m128 a = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_max_ps(a, _mm_movehl_ps(a, a));
    a = _mm_max_ss(a, _mm_shuffle_ps(a, a, 1));
    return _mm_cvtss_f32(a);
}

/* Eight int32 vectors' values (each in int8 range) as 32 bytes in order. */
static inline __m256i pack_bytes(const __m256i *v) {
    /* packs works within 128-bit halves: the 4-byte runs come out as v0 lo, v1 lo, v2 lo, v3 lo,
       v0 hi, ..., and the permutation puts them back in order. */
    __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    return _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* Rows x[m] in two int8 parts per group of 32 (high, then low, 64 bytes a group), the group's
   xscale / 256 (xscale, for the high part alone), and the group's sum of x. Vectorized: value by
   value, the split takes 11 us of a one-block product at K = 576, ~1.7 ms of SmolLM2's ~12 ms
   one-thread step over its 121 products. */
static void split_rows(const float *x, int64_t rows, int64_t groups, int two_parts, int lowest, int8_t *parts,
                       float *xscale, float *xsum) {
    const __m256 sign_bit = _mm256_set1_ps(-0.0f), times_256 = _mm256_set1_ps(256.0f);
    const __m256 low_most = _mm256_set1_ps(127.0f), low_least = _mm256_set1_ps((float)lowest);
    const int nearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;  /* nearbyintf's rounding */
    for (int64_t g = 0; g < rows * groups; g++) {
        const float *v = x + g * 32;
        __m256 values[4], largest = _mm256_setzero_ps(), sums = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            values[j] = _mm256_loadu_ps(v + 8 * j);
            largest = _mm256_max_ps(largest, _mm256_andnot_ps(sign_bit, values[j]));
            sums = _mm256_add_ps(sums, values[j]);
        }
        const float scale = max8(largest) / 127.0f;
        const __m256 inverse = _mm256_set1_ps(scale > 0.0f ? 1.0f / scale : 0.0f);
        __m256i high[4], low[4];
        for (int j = 0; j < 4; j++) {
            __m256 scaled = _mm256_mul_ps(values[j], inverse);
            __m256 h = _mm256_round_ps(scaled, nearest);
            __m256 l = _mm256_round_ps(_mm256_mul_ps(_mm256_sub_ps(scaled, h), times_256), nearest);
            high[j] = _mm256_cvtps_epi32(h);
            low[j] = _mm256_cvtps_epi32(_mm256_max_ps(_mm256_min_ps(l, low_most), low_least));
        }
        _mm256_storeu_si256((__m256i *)(parts + g * 64), pack_bytes(high));
        _mm256_storeu_si256((__m256i *)(parts + g * 64 + 32), pack_bytes(low));
        xscale[g] = two_parts ? scale / 256.0f : scale;
        xsum[g] = sum8(sums);
    }
}

/* The activations as both kernels take them: split_rows' parts, scales and sums, in memory of their own. */
struct activations {
    int8_t *parts;
    float *xscale, *xsum;
};

static void free_activations(struct activations *a) {
    free(a->parts); free(a->xscale); free(a->xsum);
}

/* Returns 0, or -1 where the memory could not be had (nothing is then held). */
static int split_activations(const float *x, int64_t rows, int64_t k, int two_parts, int lowest, struct activations *a) {
    const int64_t groups = k / 32;
    a->parts = malloc((size_t)(rows * k * 2));
    a->xscale = malloc(sizeof(float) * (size_t)(rows * groups));
    a->xsum = malloc(sizeof(float) * (size_t)(rows * groups));
    if (!a->parts || !a->xscale || !a->xsum) {
        free_activations(a);
        return -1;
    }
    split_rows(x, rows, groups, two_parts, lowest, a->parts, a->xscale, a->xsum);
    return 0;
}

/* Group g's two parts of each of the `pair` activation rows. */
static inline __attribute__((always_inline)) void load_parts(const int8_t *const *parts, int pair, int64_t g,
                                                              __m256i *high, __m256i *low) {
    for (int m = 0; m < pair; m++) {
        high[m] = _mm256_loadu_si256((const __m256i *)(parts[m] + g * 64));
        low[m] = _mm256_loadu_si256((const __m256i *)(parts[m] + g * 64 + 32));
    }
}

/* A block of four weight rows against `pair` activation rows (1 or 2): each group's nibbles are
   unpacked once for both activation rows, and its four scales and minimums are taken together. */
static inline __attribute__((always_inline)) void block_of_four(
        const uint8_t *w, const uint16_t *s, const uint16_t *mins, int64_t groups, const int8_t *const *parts,
        const float *const *xscale, const float *const *xsum, int pair, int count, int two_parts, float *const *out) {
    __m256 acc[4][2];
    __m128 base[2] = {_mm_setzero_ps(), _mm_setzero_ps()};  /* the four rows' sums of minimum * xsum */
    for (int r = 0; r < 4; r++)
        for (int m = 0; m < 2; m++) acc[r][m] = _mm256_setzero_ps();
    const __m256i low_bits = _mm256_set1_epi8(15);
    const __m256i ones = _mm256_set1_epi16(1), times_256 = _mm256_set1_epi16(256);
    for (int64_t g = 0; g < groups; g++) {
        __m256i high[2], low[2];
        load_parts(parts, pair, g, high, low);
        _mm_prefetch((const char *)(w + (g + PREFETCH_GROUPS) * 64), _MM_HINT_T0);
        _mm_prefetch((const char *)(s + (g + PREFETCH_GROUPS) * 4), _MM_HINT_T0);
        _mm_prefetch((const char *)(mins + (g + PREFETCH_GROUPS) * 4), _MM_HINT_T0);
        const __m128 scales = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(s + g * 4)));
        const __m128 minimums = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(mins + g * 4)));
        float product_scale[2][4];  /* row r's scale * xscale, broadcast from memory below */
        for (int m = 0; m < pair; m++) {
            _mm_storeu_ps(product_scale[m], _mm_mul_ps(scales, _mm_set1_ps(xscale[m][g])));
            base[m] = _mm_fmadd_ps(minimums, _mm_set1_ps(xsum[m][g]), base[m]);
        }
        for (int r = 0; r < 4; r++) {
            /* The row's 16 bytes in both halves, the high nibbles shifted down in the upper one. */
            __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(w + (g * 4 + r) * 16)));
            __m256i q = _mm256_and_si256(_mm256_blend_epi32(both, _mm256_srli_epi16(both, 4), 0xF0), low_bits);
            for (int m = 0; m < pair; m++) {
                __m256i dot;
                if (two_parts)  /* 256 * high + low, summed in pairs by the two madds */
                    dot = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(q, high[m]), times_256),
                                           _mm256_madd_epi16(_mm256_maddubs_epi16(q, low[m]), ones));
                else
                    dot = _mm256_madd_epi16(_mm256_maddubs_epi16(q, high[m]), ones);
                acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_broadcast_ss(&product_scale[m][r]),
                                            acc[r][m]);
            }
        }
    }
    for (int m = 0; m < pair; m++) {
        float row_base[4];
        _mm_storeu_ps(row_base, base[m]);
        for (int r = 0; r < count; r++) out[m][r] = sum8(acc[r][m]) + row_base[r];
    }
}

/* two_parts 0 rounds each activation to one int8 (Q8_1's precision), for a product whose largest
   results are computed again in float (the LM head's leaders). Returns 0, or -1 where the scratch
   memory could not be had (y is then not written). */
int nvchat_q4_1_gemv(const float *x, int64_t rows, int64_t k, const uint8_t *nibbles, const uint16_t *scales,
                     const uint16_t *minimums, int64_t n, float *y, int threads, int two_parts) {
    const int64_t groups = k / 32;
    struct activations a;
    if (split_activations(x, rows, k, two_parts, -128, &a) != 0)
        return -1;
    const int8_t *parts = a.parts;
    const float *xscale = a.xscale, *xsum = a.xsum;
    const int64_t blocks = (n + 3) / 4;
    #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t block = 0; block < blocks; block++) {
        const int64_t first = block * 4;
        const int count = n - first < 4 ? (int)(n - first) : 4;  /* a last block's padding rows are not written */
        const uint8_t *w = nibbles + first * groups * 16;
        const uint16_t *s = scales + first * groups, *mins = minimums + first * groups;
        for (int64_t m = 0; m < rows; m += 2) {
            const int pair = rows - m < 2 ? 1 : 2;
            const int8_t *p[2] = {parts + m * k * 2, parts + (m + pair - 1) * k * 2};
            const float *xs[2] = {xscale + m * groups, xscale + (m + pair - 1) * groups};
            const float *xt[2] = {xsum + m * groups, xsum + (m + pair - 1) * groups};
            float *out[2] = {y + m * n + first, y + (m + pair - 1) * n + first};
            /* literal 0 and 1: each call inlines a copy with its own inner loop */
            if (two_parts)
                block_of_four(w, s, mins, groups, p, xs, xt, pair, count, 1, out);
            else
                block_of_four(w, s, mins, groups, p, xs, xt, pair, count, 0, out);
        }
    }
    free_activations(&a);
    return 0;
}

/* The 8-bit weight: w = scale * q, q in -127..127, one float32 scale per row. Stored as Q4_1's
   nibbles are, in blocks of four rows with their groups of 32 side by side ([blocks][groups][4][32],
   32 bytes a row and group), the scales [blocks * 4], a last block's padding rows zero.

   maddubs multiplies unsigned by signed bytes, so each group's product takes the weights' absolute
   values and moves their signs onto the activations (sign_epi8), as llama.cpp's Q8_0 product does;
   that needs activations above -128, so the low part is kept to -127..127 (the high part is there
   already: |x| / xscale <= 127). A pair of products is at most 2 * 127 * 127, within int16. */
static inline __attribute__((always_inline)) void q8_block_of_four(
        const int8_t *w, const float *row_scales, int64_t groups, const int8_t *const *parts,
        const float *const *xscale, int pair, int count, int two_parts, float *const *out) {
    __m256 acc[4][2];
    for (int r = 0; r < 4; r++)
        for (int m = 0; m < 2; m++) acc[r][m] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1), times_256 = _mm256_set1_epi16(256);
    for (int64_t g = 0; g < groups; g++) {
        __m256i high[2], low[2];
        load_parts(parts, pair, g, high, low);
        _mm_prefetch((const char *)(w + (g + PREFETCH_GROUPS) * 128), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + (g + PREFETCH_GROUPS) * 128 + 64), _MM_HINT_T0);
        for (int r = 0; r < 4; r++) {
            __m256i q = _mm256_loadu_si256((const __m256i *)(w + (g * 4 + r) * 32));
            __m256i magnitude = _mm256_sign_epi8(q, q);
            for (int m = 0; m < pair; m++) {
                __m256i h;
                if (two_parts)
                    h = _mm256_add_epi32(
                        _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(high[m], q)), times_256),
                        _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(low[m], q)), ones));
                else
                    h = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(high[m], q)), ones);
                acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h), _mm256_set1_ps(xscale[m][g]), acc[r][m]);
            }
        }
    }
    for (int m = 0; m < pair; m++)
        for (int r = 0; r < count; r++) out[m][r] = row_scales[r] * sum8(acc[r][m]);
}

/* As nvchat_q4_1_gemv, for the 8-bit weight. Returns 0, or -1 where the scratch memory could not
   be had (y is then not written). */
int nvchat_q8_gemv(const float *x, int64_t rows, int64_t k, const int8_t *weights, const float *row_scales,
                   int64_t n, float *y, int threads, int two_parts) {
    const int64_t groups = k / 32;
    struct activations a;
    if (split_activations(x, rows, k, two_parts, -127, &a) != 0)
        return -1;
    const int8_t *parts = a.parts;
    const float *xscale = a.xscale;
    const int64_t blocks = (n + 3) / 4;
    #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t block = 0; block < blocks; block++) {
        const int64_t first = block * 4;
        const int count = n - first < 4 ? (int)(n - first) : 4;
        const int8_t *w = weights + first * groups * 32;
        for (int64_t m = 0; m < rows; m += 2) {
            const int pair = rows - m < 2 ? 1 : 2;
            const int8_t *p[2] = {parts + m * k * 2, parts + (m + pair - 1) * k * 2};
            const float *xs[2] = {xscale + m * groups, xscale + (m + pair - 1) * groups};
            float *out[2] = {y + m * n + first, y + (m + pair - 1) * n + first};
            if (two_parts)
                q8_block_of_four(w, row_scales + first, groups, p, xs, pair, count, 1, out);
            else
                q8_block_of_four(w, row_scales + first, groups, p, xs, pair, count, 0, out);
        }
    }
    free_activations(&a);
    return 0;
}
