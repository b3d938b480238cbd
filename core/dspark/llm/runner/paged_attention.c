/* Paged attention for short query chunks on the CPU, reading K/V in place from the pages.
 *
 * Built at first use by dspark/llm/runner/paged_attention.py (gcc -O3 -march=native -fopenmp)
 * and called through ctypes. The torch path gathers every sequence's K/V out of the pages
 * before each SDPA call, a copy that grows with the batch; this kernel reads each page once,
 * straight from the cache (docs/benchmarks.md has the measurements).
 *
 * Layout (as dspark.llm.runner.kv_cache.PagedKVCache holds it): kc, vc [num_pages, P, KVH, D];
 * q row t, head h at q[t * q_stride + h * D]; out [T, H, D] contiguous.
 * Query head h uses KV head h / (H / KVH), as Hugging Face's repeat_kv does.
 * Row t attends to the first row_len[t] positions of sequence row_seq[t] (block table
 * tables[row_seq[t] * W ...]); row_len[t] == 0 leaves the row alone (another path runs it).
 * With window > 0 (a sliding-window layer) only the last `window` of those: positions
 * row_len[t] - window .. row_len[t] - 1, as transformers' sliding-window mask has it; key blocks
 * wholly before a tile's window are never read. With softcap > 0 (Gemma 2) each scaled score s
 * becomes softcap * tanh(s / softcap) before the softmax.
 *
 * Work is tiled: consecutive rows of one sequence whose lengths grow by one (a chunk: a
 * verification draft, a short prompt) form a tile, and one work item is a tile times a KV
 * head. An item walks the keys in blocks of JB positions, transposes each K block once and
 * scores all its query vectors (tile rows x the KV head's G query heads) against it, four
 * at a time in registers, so a 16-token draft reads its K/V once instead of 16 times. exp is
 * a vectorized polynomial (Cephes' expf, ~1 ulp) instead of libm's scalar call. Softmax is
 * the online (flash) form: one pass over the keys.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define MAX_G 16
#define MAX_D 256
#define MAX_P 128
#define JB 16   /* key positions per block */
#define RMAX 64 /* query vectors per tile (rows x G) */

int dspark_paged_attention_limits(int32_t *g, int32_t *d, int32_t *p) {
    *g = MAX_G;
    *d = MAX_D;
    *p = MAX_P;
    return 0;
}

typedef struct {
    int32_t t0, m; /* rows t0 .. t0 + m - 1 */
} Tile;

/* GCC/Clang vector extensions: 8 floats, unaligned loads and stores (split into what the target has). */
typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef int32_t v8i __attribute__((vector_size(32), aligned(4)));
#define RB 4 /* query vectors scored together: 8 accumulators of 8 */

static inline v8 vsel(v8i mask, v8 a, v8 b) { return (v8)(((v8i)a & mask) | ((v8i)b & ~mask)); }

/* exp(x) for x <= 0 (scores minus their running max): Cephes' expf, ~1 ulp, vectorized. Below
 * -87 it gives exp(-87) ~ 1.6e-38 instead of less: nothing next to the max's 1. */
static inline v8 exp_v8(v8 x) {
    const v8 lo = (v8){0} - 87.0f;
    x = vsel(x < lo, lo, x);
    const v8i ni = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, v8i); /* round(x / ln 2) */
    const v8 n = __builtin_convertvector(ni, v8);
    v8 r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f; /* ln 2 in two parts (Cephes' C1, C2) */
    v8 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return p * (v8)((ni + 127) << 23); /* times 2^n */
}

/* tanh(x) = sign(x) (1 - e) / (1 + e) with e = exp(-2|x|) <= 1, in exp_v8's range. */
static inline v8 tanh_v8(v8 x) {
    const v8 ax = vsel(x < 0.0f, -x, x);
    const v8 e = exp_v8(-2.0f * ax);
    const v8 t = (1.0f - e) / (1.0f + e);
    return vsel(x < 0.0f, -t, t);
}

static inline float hmax(v8 v) {
    float m = v[0];
    for (int i = 1; i < 8; i++) m = v[i] > m ? v[i] : m;
    return m;
}

static inline float hsum(v8 v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

static void run_item(const Tile tile, int32_t kh, const float *q, int64_t q_stride, float *out, const float *kc,
                     const float *vc, const int32_t *tables, int32_t W, const int32_t *row_seq,
                     const int32_t *row_len, int32_t H, int32_t KVH, int32_t D, int32_t P, float scale,
                     int32_t window, float softcap) {
    const int32_t G = H / KVH, R = tile.m * G, NV = D / 8;
    const int64_t kstride = (int64_t)KVH * D; /* between consecutive positions of a page */
    const int32_t *table = tables + (int64_t)row_seq[tile.t0] * W;
    const int32_t first_len = row_len[tile.t0], nmax = row_len[tile.t0 + tile.m - 1];
    float qs[RMAX * MAX_D], acc[RMAX * MAX_D], kt[MAX_D * JB], m[RMAX], l[RMAX], s[RB][JB];
    const float *vrow[JB];
    for (int32_t r = 0; r < R; r++) {
        const int32_t i = r / G, g = r % G;
        const float *src = q + (int64_t)(tile.t0 + i) * q_stride + (int64_t)(kh * G + g) * D;
        for (int32_t d = 0; d < D; d++) {
            qs[r * D + d] = src[d] * scale;
            acc[r * D + d] = 0.0f;
        }
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    /* The tile's first row sees the earliest positions; with a window, nothing before it is read. */
    const int32_t lo0 = window > 0 && first_len > window ? first_len - window : 0;
    for (int32_t start = lo0; start < nmax; start += JB) {
        const int32_t cnt = nmax - start < JB ? nmax - start : JB;
        /* K block transposed into kt[d][j] (zero past cnt), V rows by pointer. */
        for (int32_t j = 0; j < JB; j++) {
            if (j < cnt) {
                const int32_t pos = start + j;
                const int64_t slot = (int64_t)table[pos / P] * P + pos % P;
                const float *kj = kc + slot * kstride + (int64_t)kh * D;
                vrow[j] = vc + slot * kstride + (int64_t)kh * D;
                for (int32_t d = 0; d < D; d++) kt[d * JB + j] = kj[d];
            } else {
                vrow[j] = NULL;
                for (int32_t d = 0; d < D; d++) kt[d * JB + j] = 0.0f;
            }
        }
        for (int32_t r0 = 0; r0 < R; r0 += RB) {
            /* Scores of RB query vectors (the last group repeats its last vector) in registers. */
            const float *qr[RB];
            for (int32_t b = 0; b < RB; b++) qr[b] = qs + (r0 + b < R ? r0 + b : R - 1) * D;
            v8 a[RB][2];
            for (int32_t b = 0; b < RB; b++) a[b][0] = a[b][1] = (v8){0};
            for (int32_t d = 0; d < D; d++) {
                const v8 k0 = *(const v8 *)(kt + d * JB), k1 = *(const v8 *)(kt + d * JB + 8);
                for (int32_t b = 0; b < RB; b++) {
                    const float x = qr[b][d];
                    a[b][0] += x * k0;
                    a[b][1] += x * k1;
                }
            }
            const v8i idx0 = {0, 1, 2, 3, 4, 5, 6, 7}, idx1 = idx0 + 8;
            const v8 ninf = (v8){0} - INFINITY;
            for (int32_t b = 0; b < RB && r0 + b < R; b++) {
                const int32_t r = r0 + b;
                /* Row i of the tile sees positions < first_len + i (causal within the chunk), and with a
                 * window only those >= first_len + i - window. */
                const int32_t vis_all = first_len + r / G - start;
                if (vis_all <= 0) continue;
                const int32_t vis = vis_all < cnt ? vis_all : cnt;
                const int32_t lo_all = window > 0 ? vis_all - window : 0;
                const int32_t lo = lo_all > 0 ? lo_all : 0;
                if (lo >= vis) continue;
                const v8i in0 = (idx0 < vis) & (idx0 >= lo), in1 = (idx1 < vis) & (idx1 >= lo);
                v8 s0 = a[b][0], s1 = a[b][1];
                if (softcap > 0.0f) {
                    s0 = softcap * tanh_v8(s0 / softcap);
                    s1 = softcap * tanh_v8(s1 / softcap);
                }
                const v8 t0 = vsel(in0, s0, ninf), t1 = vsel(in1, s1, ninf);
                const float bm = hmax(vsel(t0 > t1, t0, t1));
                const float mx = bm > m[r] ? bm : m[r];
                const v8 e0 = vsel(in0, exp_v8(t0 - mx), (v8){0}), e1 = vsel(in1, exp_v8(t1 - mx), (v8){0});
                float *sr = s[b];
                *(v8 *)sr = e0;
                *(v8 *)(sr + 8) = e1;
                float *ar = acc + r * D;
                if (mx != m[r]) { /* the running max moved: rescale what was summed (0 on the first block) */
                    const float c = expf(m[r] - mx);
                    for (int32_t d = 0; d < D; d++) ar[d] *= c;
                    l[r] *= c;
                }
                l[r] += hsum(e0 + e1);
                m[r] = mx;
                /* acc += p V, eight vectors of the row at a time in registers. */
                for (int32_t v0 = 0; v0 < NV; v0 += 8) {
                    const int32_t nv = NV - v0 < 8 ? NV - v0 : 8;
                    v8 o[8];
                    for (int32_t u = 0; u < 8; u++) o[u] = u < nv ? *(const v8 *)(ar + (v0 + u) * 8) : (v8){0};
                    for (int32_t j = lo; j < vis; j++) {
                        const float p = sr[j];
                        const float *vj = vrow[j] + v0 * 8;
                        if (nv == 8) {
                            for (int32_t u = 0; u < 8; u++) o[u] += p * *(const v8 *)(vj + u * 8);
                        } else {
                            for (int32_t u = 0; u < nv; u++) o[u] += p * *(const v8 *)(vj + u * 8);
                        }
                    }
                    for (int32_t u = 0; u < nv; u++) *(v8 *)(ar + (v0 + u) * 8) = o[u];
                }
            }
        }
    }
    for (int32_t r = 0; r < R; r++) {
        const int32_t i = r / G, g = r % G;
        float *o = out + ((int64_t)(tile.t0 + i) * H + kh * G + g) * D;
        const float inv = 1.0f / l[r];
        for (int32_t d = 0; d < D; d++) o[d] = acc[r * D + d] * inv;
    }
}

/* Row t (t > 0) is the next row of the chunk row t - 1 belongs to. */
static inline int continues_run(const int32_t *row_seq, const int32_t *row_len, int32_t t) {
    return t > 0 && row_len[t] > 0 && row_len[t - 1] > 0 && row_seq[t] == row_seq[t - 1] &&
           row_len[t] == row_len[t - 1] + 1;
}

void dspark_paged_attention(const float *q, int64_t q_stride, float *out, const float *kc, const float *vc,
                            const int32_t *tables, int32_t W, const int32_t *row_seq, const int32_t *row_len,
                            int32_t T, int32_t H, int32_t KVH, int32_t D, int32_t P, float scale,
                            int32_t window, float softcap, int32_t nthreads) {
    const int32_t G = H / KVH;
    const int32_t max_rows = RMAX / G > 0 ? RMAX / G : 1;
    /* Runs: maximal stretches of consecutive rows of one sequence, lengths growing by one. */
    int32_t runs = 0;
    for (int32_t t = 0; t < T; t++)
        if (row_len[t] > 0 && !continues_run(row_seq, row_len, t)) runs++;
    if (runs == 0) return;
    /* Split runs into tiles of at most max_rows, and further (down to single rows) while there
     * are fewer items than threads: a lone 8-token draft still keeps every thread busy. */
    const int32_t want = (nthreads + KVH - 1) / KVH;
    const int32_t split = want > runs ? (want + runs - 1) / runs : 1;
    Tile *tiles = malloc(sizeof(Tile) * (size_t)T);
    if (tiles == NULL) abort();
    int32_t ntiles = 0;
    for (int32_t t = 0; t < T;) {
        if (row_len[t] <= 0) {
            t++;
            continue;
        }
        int32_t e = t + 1;
        while (e < T && continues_run(row_seq, row_len, e)) e++;
        const int32_t n = e - t;
        int32_t parts = (n + max_rows - 1) / max_rows;
        if (parts < split) parts = split < n ? split : n;
        for (int32_t p = 0; p < parts; p++) {
            const int32_t a = t + (int32_t)((int64_t)n * p / parts), b = t + (int32_t)((int64_t)n * (p + 1) / parts);
            tiles[ntiles].t0 = a;
            tiles[ntiles].m = b - a;
            ntiles++;
        }
        t = e;
    }
    const int64_t items = (int64_t)ntiles * KVH;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
    for (int64_t item = 0; item < items; item++) {
        run_item(tiles[item / KVH], (int32_t)(item % KVH), q, q_stride, out, kc, vc, tables, W, row_seq, row_len,
                 H, KVH, D, P, scale, window, softcap);
    }
    free(tiles);
}
