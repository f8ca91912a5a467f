/* Paged attention over a float32 KV cache, one query row at a time: vLLM's CPU attention
 * (csrc/cpu/, cpu_attention_with_kv_cache) for the rows of decodes and short queries.
 *
 * key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size], contiguous.
 * Query row i of request r sits at position seq_lens[r] - q_len + i and sees the keys at
 * positions <= its own (and, with a sliding window, > its own - window). For each row, three
 * passes over its keys: every head's scores (each key row is read once for all heads), each
 * head's softmax weights, then the weighted sum of the values. Softmax in float32.
 *
 * Measured at 32 decodes of 64-128 tokens, 4 heads of 32, caches not in the CPU's caches (as in an
 * engine step: the other layers' and the weights' bytes pass in between): 433 us a call as the loops
 * stand, 196 us with each key row fetched AHEAD positions before it is read (and each value row as its
 * key is), 176 us with the softmax's exp vectorised (glibc's libmvec, where it has it).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#ifdef VECTOR_EXPF
#pragma omp declare simd notinbranch
extern float expf(float);  /* (as -ffast-math would declare it: libmvec's vector variants) */
#endif

#define AHEAD 8

struct shape {
    int num_q_heads, num_kv_heads, head_size, block_size;
    int64_t q_token_stride, q_head_stride, table_stride;
};

/* where position p's row (every KV head's) starts in the cache, in floats: the same for K and V */
static inline int64_t key_offset(const int32_t *table, int p, const struct shape *s) {
    const int64_t slot = (int64_t)s->num_kv_heads * s->head_size;
    return table[p / s->block_size] * slot * s->block_size + (p % s->block_size) * slot;
}

static void scores(float *w, int stride, const float *q, const float *kc, const float *vc, const int32_t *table,
                   int first, int last, const struct shape *s, float scale, float *mx) {
    const int D = s->head_size, group = s->num_q_heads / s->num_kv_heads;
    const int64_t slot = (int64_t)s->num_kv_heads * D;
    for (int p = first; p <= last; p++) {
        const int64_t at = key_offset(table, p, s), ahead = p + AHEAD <= last ? key_offset(table, p + AHEAD, s) : at;
        for (int64_t b = 0; b < slot; b += 16) {  /* 16 floats: a cache line */
            __builtin_prefetch(kc + ahead + b);
            __builtin_prefetch(vc + at + b);
        }
        const float *k = kc + at;
        for (int h = 0; h < s->num_q_heads; h++) {
            const float *qh = q + h * s->q_head_stride, *kh = k + (h / group) * D;
            float dot = 0.f;
            for (int d = 0; d < D; d++) dot += qh[d] * kh[d];
            dot *= scale;
            w[(int64_t)h * stride + p - first] = dot;
            if (dot > mx[h]) mx[h] = dot;
        }
    }
}

static void weights(float *w, int stride, int n, const struct shape *s, const float *sinks,
                    float *mx, float *inv_sum) {
    for (int h = 0; h < s->num_q_heads; h++) {
        float *wh = w + (int64_t)h * stride, m = mx[h], total = 0.f;
        if (sinks && sinks[h] > m) m = sinks[h];  /* the sink: one more logit, with no value */
        #pragma omp simd reduction(+: total)
        for (int j = 0; j < n; j++) {
            wh[j] = expf(wh[j] - m);
            total += wh[j];
        }
        if (sinks) total += expf(sinks[h] - m);
        inv_sum[h] = 1.f / total;
    }
}

static void values(float *out, const float *w, int stride, const float *vc, const int32_t *table,
                   int first, int last, const struct shape *s, const float *inv_sum) {
    const int D = s->head_size, group = s->num_q_heads / s->num_kv_heads;
    for (int j = 0; j < s->num_q_heads * D; j++) out[j] = 0.f;
    for (int p = first; p <= last; p++) {
        const float *v = vc + key_offset(table, p, s);
        for (int h = 0; h < s->num_q_heads; h++) {
            const float wt = w[(int64_t)h * stride + p - first], *vh = v + (h / group) * D;
            float *o = out + h * D;
            for (int d = 0; d < D; d++) o[d] += wt * vh[d];
        }
    }
    for (int h = 0; h < s->num_q_heads; h++)
        for (int d = 0; d < D; d++) out[h * D + d] *= inv_sum[h];
}

/* One request's query rows; w: a scratch of num_q_heads * max_len + 2 * num_q_heads floats. */
static void attend_request(float *out, const float *q, const float *key_cache, const float *value_cache,
                           const int32_t *query_start_loc, const int32_t *seq_lens, const int32_t *block_tables,
                           int r, const struct shape *s, float scale, int sliding_window, const float *sinks,
                           float *w, int max_len) {
    float *mx = w + (size_t)s->num_q_heads * max_len, *inv_sum = mx + s->num_q_heads;
    const int q0 = query_start_loc[r], q_len = query_start_loc[r + 1] - q0, context = seq_lens[r] - q_len;
    const int32_t *table = block_tables + r * s->table_stride;
    for (int row = 0; row < q_len; row++) {
        const int last = context + row;
        int first = 0;
        if (sliding_window > 0 && last - sliding_window + 1 > 0) first = last - sliding_window + 1;
        for (int h = 0; h < s->num_q_heads; h++) mx[h] = -INFINITY;
        scores(w, max_len, q + (q0 + row) * s->q_token_stride, key_cache, value_cache, table, first, last, s, scale,
               mx);
        weights(w, max_len, last - first + 1, s, sinks, mx, inv_sum);
        values(out + (int64_t)(q0 + row) * s->num_q_heads * s->head_size, w, max_len, value_cache, table,
               first, last, s, inv_sum);
    }
}

/* out [num_tokens, num_q_heads, head_size], contiguous; q strided (a view of the fused QKV).
 * reqs: the num_reqs requests to compute (indices into query_start_loc, seq_lens, block_tables).
 * sliding_window <= 0: none; sinks: NULL or [num_q_heads]. The requests are shared among `threads`
 * OpenMP threads, interleaved. Returns 0, or -1 if out of memory. */
int cpu_attention_with_kv_cache(float *out, const float *q, const float *key_cache, const float *value_cache,
                                const int32_t *query_start_loc, const int32_t *seq_lens,
                                const int32_t *block_tables, const int32_t *reqs, int num_reqs,
                                struct shape s, float scale, int sliding_window, const float *sinks, int threads) {
    int max_len = 1, failed = 0;
    for (int i = 0; i < num_reqs; i++)
        if (seq_lens[reqs[i]] > max_len) max_len = seq_lens[reqs[i]];
    #pragma omp parallel num_threads(threads) reduction(|: failed)
    {
        float *w = malloc(sizeof(float) * ((size_t)s.num_q_heads * max_len + 2 * (size_t)s.num_q_heads));
        if (!w) failed = 1;  /* its share of the requests is left undone: the caller raises */
        #pragma omp for schedule(static, 1)
        for (int i = 0; i < num_reqs; i++)
            if (w) attend_request(out, q, key_cache, value_cache, query_start_loc, seq_lens, block_tables,
                                  reqs[i], &s, scale, sliding_window, sinks, w, max_len);
        free(w);
    }
    return failed ? -1 : 0;
}
