/* Paged attention for short query chunks on the CPU, reading K/V in place from the pages.
 *
 * Built at first use by dspark/llm/paged_attention.py (gcc -O3 -march=native -fopenmp) and
 * called through ctypes. The torch path gathers every sequence's K/V out of the pages
 * before each SDPA call; at batch 32 that copy and the padded SDPA calls were half a decode
 * step here. This kernel reads each page once, straight from the cache.
 *
 * Layout (as dspark.llm.kv_cache.PagedKVCache holds it): kc, vc [num_pages, P, KVH, D];
 * q row t, head h at q[t * q_stride + h * D]; out [T, H, D] contiguous.
 * Query head h uses KV head h / (H / KVH), as Hugging Face's repeat_kv does.
 * Row t attends to the first row_len[t] positions of sequence row_seq[t] (block table
 * tables[row_seq[t] * W ...]); row_len[t] == 0 leaves the row alone (another path runs it).
 * Softmax is the online (flash) form: one pass over the keys, page by page.
 */
#include <math.h>
#include <stdint.h>

#define MAX_G 16
#define MAX_D 256
#define MAX_P 128

int dspark_paged_attention_limits(int32_t *g, int32_t *d, int32_t *p) {
    *g = MAX_G;
    *d = MAX_D;
    *p = MAX_P;
    return 0;
}

void dspark_paged_attention(const float *q, int64_t q_stride, float *out, const float *kc, const float *vc,
                            const int32_t *tables, int32_t W, const int32_t *row_seq, const int32_t *row_len,
                            int32_t T, int32_t H, int32_t KVH, int32_t D, int32_t P, float scale,
                            int32_t nthreads) {
    const int32_t G = H / KVH;
    const int64_t items = (int64_t)T * KVH;
    const int64_t kstride = (int64_t)KVH * D; /* between consecutive positions of a page */
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
    for (int64_t item = 0; item < items; item++) {
        const int32_t t = (int32_t)(item / KVH), kh = (int32_t)(item % KVH);
        const int32_t n = row_len[t];
        if (n <= 0) continue;
        const int32_t *table = tables + (int64_t)row_seq[t] * W;
        float qs[MAX_G][MAX_D], acc[MAX_G][MAX_D], s[MAX_G][MAX_P], m[MAX_G], l[MAX_G];
        for (int32_t g = 0; g < G; g++) {
            const float *qg = q + (int64_t)t * q_stride + (int64_t)(kh * G + g) * D;
            for (int32_t d = 0; d < D; d++) {
                qs[g][d] = qg[d] * scale;
                acc[g][d] = 0.0f;
            }
            m[g] = -INFINITY;
            l[g] = 0.0f;
        }
        for (int32_t start = 0; start < n; start += P) {
            const int64_t page = table[start / P];
            const int32_t cnt = n - start < P ? n - start : P;
            const float *kp = kc + page * P * kstride + (int64_t)kh * D;
            const float *vp = vc + page * P * kstride + (int64_t)kh * D;
            for (int32_t g = 0; g < G; g++) {
                float mx = m[g];
                for (int32_t j = 0; j < cnt; j++) {
                    const float *kj = kp + j * kstride;
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (int32_t d = 0; d < D; d++) dot += qs[g][d] * kj[d];
                    s[g][j] = dot;
                    if (dot > mx) mx = dot;
                }
                const float corr = expf(m[g] - mx); /* 0 on the first page (m = -inf) */
                float sum = l[g] * corr;
                for (int32_t d = 0; d < D; d++) acc[g][d] *= corr;
                for (int32_t j = 0; j < cnt; j++) {
                    const float p = expf(s[g][j] - mx);
                    s[g][j] = p;
                    sum += p;
                }
                l[g] = sum;
                m[g] = mx;
            }
            for (int32_t j = 0; j < cnt; j++) {
                const float *vj = vp + j * kstride;
                for (int32_t g = 0; g < G; g++) {
                    const float p = s[g][j];
#pragma omp simd
                    for (int32_t d = 0; d < D; d++) acc[g][d] += p * vj[d];
                }
            }
        }
        for (int32_t g = 0; g < G; g++) {
            float *o = out + ((int64_t)t * H + kh * G + g) * D;
            const float inv = 1.0f / l[g];
            for (int32_t d = 0; d < D; d++) o[d] = acc[g][d] * inv;
        }
    }
}
