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

/* Decode attention: each row's query heads q [rows, heads, head_dim] over the keys and values at
 * its slots (slot_table [rows, table_width], the first lengths[r] of them), grouped-query (query head
 * h reads kv head h / (heads / kv_heads)); out [rows, heads * head_dim]. Returns nonzero where
 * scratch could not be allocated. */
int nvchat_decode_attention(const float *q, int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim,
                            const float *k_cache, const float *v_cache, const int64_t *slot_table,
                            int64_t table_width, const int64_t *lengths, float scale, float *out, int threads) {
    int64_t group = heads / kv_heads, tasks = rows * kv_heads;
    int failed = 0;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (threads > 1 && tasks > 1)
    for (int64_t task = 0; task < tasks; task++) {
        int64_t r = task / kv_heads, g = task % kv_heads, length = lengths[r];
        const int64_t *slots = slot_table + r * table_width;
        float *scores = malloc(sizeof(float) * group * (length > 0 ? length : 1));
        if (scores == NULL) {
            failed = 1;
            continue;
        }
        const float *queries = q + (r * heads + g * group) * head_dim;
        float *outputs = out + (r * heads + g * group) * head_dim;
        float largest[group];
        for (int64_t h = 0; h < group; h++)
            largest[h] = -INFINITY;
        for (int64_t j = 0; j < length; j++) {
            const float *key = k_cache + (slots[j] * kv_heads + g) * head_dim;
            for (int64_t h = 0; h < group; h++) {
                float score = dot(queries + h * head_dim, key, head_dim) * scale;
                scores[h * length + j] = score;
                if (score > largest[h])
                    largest[h] = score;
            }
        }
        for (int64_t h = 0; h < group; h++) {
            float total = 0.0f, *p = scores + h * length;
            for (int64_t j = 0; j < length; j++) {
                p[j] = expf(p[j] - largest[h]);
                total += p[j];
            }
            float inverse = total > 0.0f ? 1.0f / total : 0.0f;
            for (int64_t j = 0; j < length; j++)
                p[j] *= inverse;
            for (int64_t i = 0; i < head_dim; i++)
                outputs[h * head_dim + i] = 0.0f;
        }
        for (int64_t j = 0; j < length; j++) {
            const float *value = v_cache + (slots[j] * kv_heads + g) * head_dim;
            for (int64_t h = 0; h < group; h++) {
                float weight = scores[h * length + j], *o = outputs + h * head_dim;
                __m256 w = _mm256_set1_ps(weight);
                int64_t i = 0;
                for (; i + 8 <= head_dim; i += 8)
                    _mm256_storeu_ps(o + i, _mm256_fmadd_ps(w, _mm256_loadu_ps(value + i), _mm256_loadu_ps(o + i)));
                for (; i < head_dim; i++)
                    o[i] += weight * value[i];
            }
        }
        free(scores);
    }
    return failed;
}

/* out [rows, n] = silu(gate) * up, gate_up [rows, 2n] holding gate then up. */
void nvchat_silu_mul(const float *gate_up, int64_t rows, int64_t n, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * n, *up = gate + n;
        for (int64_t i = 0; i < n; i++)
            out[r * n + i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    }
}
