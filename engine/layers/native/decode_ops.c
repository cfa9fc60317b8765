/* The small operations of a CPU decode step between its int4 products (engine/models/cpu_decode.py):
 * each replaces the several PyTorch calls that did it, whose dispatch cost more than their arithmetic
 * at one token per sequence. All tensors are float32 and contiguous unless said otherwise. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

static inline float horizontal_sum(__m256 v) {
    __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
    sum = _mm_add_ss(sum, _mm_movehdup_ps(sum));
    return _mm_cvtss_f32(sum);
}

/* e^x for 8 floats: x = n ln2 + r, |r| <= ln2 / 2, e^r by Cephes' expf polynomial, 2^n built in the
 * exponent bits; within 2 ulp of expf. x is clamped to [-87.3, 88.4], where 2^n stays normal: below,
 * the result is ~1e-38 instead of 0 (a softmax weight or a SiLU of a very negative value: both
 * negligible). libm's expf, one value a call, was most of attention's time. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3365447505531f)), _mm256_set1_ps(88.3762626647949f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  /* ln2 in two parts, for precision */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
}

static inline float exp1(float x) {
    float out[8];
    _mm256_storeu_ps(out, exp8(_mm256_set1_ps(x)));
    return out[0];
}

static inline float dot(const float *a, const float *b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float sum = horizontal_sum(acc);
    for (; i < n; i++)
        sum += a[i] * b[i];
    return sum;
}

/* out[i] = x[i] * scale * weight[i], scale = 1 / sqrt(mean(x^2) + eps): RMSNorm of one row. */
static void norm_row(const float *x, const float *weight, float eps, float *out, int64_t dim) {
    float scale = 1.0f / sqrtf(dot(x, x, dim) / (float)dim + eps);
    for (int64_t i = 0; i < dim; i++)
        out[i] = x[i] * scale * weight[i];
}

/* residual += x (where x is not NULL), then out = RMSNorm(residual) * weight; rows of dim. */
void nvchat_add_rms_norm(const float *x, float *residual, const float *weight, float eps, float *out,
                         int64_t rows, int64_t dim) {
    for (int64_t r = 0; r < rows; r++) {
        float *row = residual + r * dim;
        if (x != NULL)
            for (int64_t i = 0; i < dim; i++)
                row[i] += x[r * dim + i];
        norm_row(row, weight, eps, out + r * dim, dim);
    }
}

/* Neox RoPE of one head in place, as RotaryEmbedding.apply: the halves (x0, x1) become
 * (x0 * cos0 + x1 * sin0, x1 * cos1 + x0 * sin1), sin's first half already negated. */
static void rotate(float *x, const float *cos, const float *sin, int64_t half) {
    for (int64_t i = 0; i < half; i++) {
        float x0 = x[i], x1 = x[half + i];
        x[i] = x0 * cos[i] + x1 * sin[i];
        x[half + i] = x1 * cos[half + i] + x0 * sin[half + i];
    }
}

/* A decode step's qkv rows [rows, (heads + 2 * kv_heads) * head_dim]: q and k normed per head (where
 * q_norm is not NULL; Qwen3) and rotated, q written to q_out [rows, heads, head_dim], k and v stored
 * at the row's slot of k_cache and v_cache [slots, kv_heads, head_dim]. cos and sin: [rows, head_dim]. */
void nvchat_rope_store(const float *qkv, int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim,
                       const float *cos, const float *sin, const float *q_norm, const float *k_norm, float eps,
                       const int64_t *slots, float *k_cache, float *v_cache, float *q_out) {
    int64_t width = (heads + 2 * kv_heads) * head_dim, half = head_dim / 2;
    for (int64_t r = 0; r < rows; r++) {
        const float *row = qkv + r * width, *c = cos + r * head_dim, *s = sin + r * head_dim;
        float *k_row = k_cache + slots[r] * kv_heads * head_dim, *v_row = v_cache + slots[r] * kv_heads * head_dim;
        for (int64_t h = 0; h < heads + kv_heads; h++) {
            float *target = h < heads ? q_out + (r * heads + h) * head_dim : k_row + (h - heads) * head_dim;
            const float *norm = h < heads ? q_norm : k_norm;
            if (norm != NULL)
                norm_row(row + h * head_dim, norm, eps, target, head_dim);
            else
                for (int64_t i = 0; i < head_dim; i++)
                    target[i] = row[h * head_dim + i];
            rotate(target, c, s, half);
        }
        for (int64_t i = 0; i < kv_heads * head_dim; i++)
            v_row[i] = row[(heads + kv_heads) * head_dim + i];
    }
}

/* Softmax of scores[0..length) in place, from their largest value. */
static void softmax(float *scores, int64_t length, float largest) {
    __m256 sums = _mm256_setzero_ps(), top = _mm256_set1_ps(largest);
    int64_t j = 0;
    for (; j + 8 <= length; j += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + j), top));
        _mm256_storeu_ps(scores + j, e);
        sums = _mm256_add_ps(sums, e);
    }
    float total = horizontal_sum(sums);
    for (; j < length; j++) {
        scores[j] = exp1(scores[j] - largest);
        total += scores[j];
    }
    float inverse = total > 0.0f ? 1.0f / total : 0.0f;
    for (j = 0; j < length; j++)
        scores[j] *= inverse;
}

/* Keys a query group takes at a time: a tile's keys and values (8 KiB each at head_dim 64, 16 at
 * 128) stay in L1 while every query head of the group reads them. */
enum { KEY_TILE = 32 };

/* The query heads of one KV head (`group` of them, queries [group][head_dim], out likewise) over its
 * keys and values (each at cache + slots[j] * stride), head_dim = 8 * chunks with chunks even and at
 * most 16: a head's query, then its output, stays in registers across a tile of keys, and the
 * group's heads take each tile in turn, so that the context's keys and values come from L2 or
 * beyond once a KV head, not once a query head (three times for SmolLM2). Each head's arithmetic is
 * the same, in the same order, as on its own. scores: group * length floats. */
static inline __attribute__((always_inline)) void attend_group_in_registers(
        const float *queries, const float *k_cache, const float *v_cache, const int64_t *slots, int64_t length,
        int64_t stride, int64_t group, float scale, float *scores, float *out, const int chunks) {
    const int64_t head_dim = 8 * chunks;
    __m256 held[16];
    float largest[64];  /* group <= 64: checked by the caller */
    for (int64_t g = 0; g < group; g++)
        largest[g] = -INFINITY;
    for (int64_t start = 0; start < length; start += KEY_TILE) {
        const int64_t end = start + KEY_TILE < length ? start + KEY_TILE : length;
        for (int64_t g = 0; g < group; g++) {
            for (int c = 0; c < chunks; c++)
                held[c] = _mm256_loadu_ps(queries + g * head_dim + 8 * c);
            float *row = scores + g * length, top = largest[g];
            for (int64_t j = start; j < end; j++) {
                const float *key = k_cache + slots[j] * stride;
                __m256 even = _mm256_mul_ps(held[0], _mm256_loadu_ps(key));
                __m256 odd = _mm256_mul_ps(held[1], _mm256_loadu_ps(key + 8));
                for (int c = 2; c < chunks; c += 2) {
                    even = _mm256_fmadd_ps(held[c], _mm256_loadu_ps(key + 8 * c), even);
                    odd = _mm256_fmadd_ps(held[c + 1], _mm256_loadu_ps(key + 8 * c + 8), odd);
                }
                float score = horizontal_sum(_mm256_add_ps(even, odd)) * scale;
                row[j] = score;
                top = score > top ? score : top;
            }
            largest[g] = top;
        }
    }
    for (int64_t g = 0; g < group; g++)
        softmax(scores + g * length, length, largest[g]);
    for (int64_t g = 0; g < group; g++)
        for (int c = 0; c < chunks; c++)
            _mm256_storeu_ps(out + g * head_dim + 8 * c, _mm256_setzero_ps());
    for (int64_t start = 0; start < length; start += KEY_TILE) {
        const int64_t end = start + KEY_TILE < length ? start + KEY_TILE : length;
        for (int64_t g = 0; g < group; g++) {
            float *o = out + g * head_dim;
            const float *row = scores + g * length;
            for (int c = 0; c < chunks; c++)
                held[c] = _mm256_loadu_ps(o + 8 * c);
            for (int64_t j = start; j < end; j++) {
                const float *value = v_cache + slots[j] * stride;
                __m256 weight = _mm256_set1_ps(row[j]);
                for (int c = 0; c < chunks; c++)
                    held[c] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(value + 8 * c), held[c]);
            }
            for (int c = 0; c < chunks; c++)
                _mm256_storeu_ps(o + 8 * c, held[c]);
        }
    }
}

/* The same for any head_dim. */
static void attend(const float *query, const float *k_cache, const float *v_cache, const int64_t *slots,
                   int64_t length, int64_t stride, int64_t head_dim, float scale, float *scores, float *out) {
    float largest = -INFINITY;
    for (int64_t j = 0; j < length; j++) {
        scores[j] = dot(query, k_cache + slots[j] * stride, head_dim) * scale;
        largest = scores[j] > largest ? scores[j] : largest;
    }
    softmax(scores, length, largest);
    for (int64_t i = 0; i < head_dim; i++)
        out[i] = 0.0f;
    for (int64_t j = 0; j < length; j++) {
        const float *value = v_cache + slots[j] * stride;
        for (int64_t i = 0; i < head_dim; i++)
            out[i] += scores[j] * value[i];
    }
}

/* Decode attention: each row's query heads q [rows, heads, head_dim] over the keys and values at
 * its slots (slot_table [rows, table_width], the first lengths[r] of them), grouped-query (query head
 * h reads kv head h / (heads / kv_heads)); out [rows, heads * head_dim]. Returns nonzero where
 * scratch could not be allocated. */
int nvchat_decode_attention(const float *q, int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim,
                            const float *k_cache, const float *v_cache, const int64_t *slot_table,
                            int64_t table_width, const int64_t *lengths, float scale, float *out, int threads) {
    const int64_t group = heads / kv_heads, stride = kv_heads * head_dim;
    const int in_registers = (head_dim == 64 || head_dim == 128) && group <= 64;
    /* One task a KV head's query group where its heads share the tiles, else one a query head. */
    const int64_t per_row = in_registers ? kv_heads : heads, tasks = rows * per_row;
    int failed = 0;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (threads > 1 && tasks > 1)
    for (int64_t task = 0; task < tasks; task++) {
        const int64_t r = task / per_row, length = lengths[r];
        const int64_t *slots = slot_table + r * table_width;
        const int64_t heads_here = in_registers ? group : 1;
        float *scores = malloc(sizeof(float) * (size_t)(heads_here * (length > 0 ? length : 1)));
        if (scores == NULL) {
            failed = 1;
            continue;
        }
        const int64_t first_head = in_registers ? (task % per_row) * group : task % per_row;
        const int64_t kv_head = first_head / group;
        const float *query = q + (r * heads + first_head) * head_dim;
        const float *keys = k_cache + kv_head * head_dim, *values = v_cache + kv_head * head_dim;
        float *o = out + (r * heads + first_head) * head_dim;
        if (in_registers && head_dim == 64)
            attend_group_in_registers(query, keys, values, slots, length, stride, group, scale, scores, o, 8);
        else if (in_registers)
            attend_group_in_registers(query, keys, values, slots, length, stride, group, scale, scores, o, 16);
        else
            attend(query, keys, values, slots, length, stride, head_dim, scale, scores, o);
        free(scores);
    }
    return failed;
}

/* out [rows, n] = silu(gate) * up, gate_up [rows, 2n] holding gate then up. */
void nvchat_silu_mul(const float *gate_up, int64_t rows, int64_t n, float *out) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * n, *up = gate + n;
        float *o = out + r * n;
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) {
            __m256 g = _mm256_loadu_ps(gate + i);
            __m256 sigmoid = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, g))));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(g, sigmoid), _mm256_loadu_ps(up + i)));
        }
        for (; i < n; i++)
            o[i] = gate[i] / (1.0f + exp1(-gate[i])) * up[i];
    }
}
