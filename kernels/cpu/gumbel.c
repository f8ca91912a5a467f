/* The tokens of each row that can win a Gumbel-max draw (kernels/reference.py, _gumbel_argmax):
 * the hash of every token (murmur3's last mix and finaliser, as kernels/gumbel_sample.py hashes),
 * the best logit among the likely winners (hash below `likely`), and the tokens whose hash is
 * within reach of it. Those few are scored exactly by the caller.
 *
 * Within reach: the reference keeps token t when hash_t <= 2^32 exp(x_t - reach). This keeps every
 * such token and at most as many more, comparing the hash's highest set bit e instead:
 * 2^e <= hash_t, so (e - 32) ln 2 <= x_t - reach whenever the reference keeps t. No exp, no log:
 * integer and compare only, which the compiler vectorises.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline uint32_t rotl32(uint32_t x, int r) { return (x << r) | (x >> (32 - r)); }

static void hash_row(uint32_t *out, uint32_t row_hash, const uint32_t *token_keys, int vocab) {
    for (int t = 0; t < vocab; t++) {
        uint32_t x = rotl32(row_hash ^ token_keys[t], 13) * 5u + 0xE6546B64u;
        x ^= 16u; /* the length, in bytes, of what was hashed */
        x ^= x >> 16;
        x *= 0x85EBCA6Bu;
        x ^= x >> 13;
        x *= 0xC2B2AE35u;
        x ^= x >> 16;
        out[t] = x;
    }
}

/* float -> int32 of the same order, so that a max over floats vectorises as an integer one */
static inline int32_t ordered(float f) {
    int32_t i;
    memcpy(&i, &f, sizeof i);
    return i ^ ((i >> 31) & 0x7FFFFFFF);
}

static float likely_best(const float *x, const uint32_t *hash, int vocab, uint32_t likely) {
    int32_t lane[16], best = ordered(-INFINITY);  /* 16 running maxima (a vector's), then their max */
    for (int j = 0; j < 16; j++) lane[j] = best;
    int t = 0;
    for (; t + 16 <= vocab; t += 16)
        for (int j = 0; j < 16; j++) {
            const int32_t v = hash[t + j] < likely ? ordered(x[t + j]) : INT32_MIN;
            lane[j] = v > lane[j] ? v : lane[j];
        }
    for (; t < vocab; t++) {
        const int32_t v = hash[t] < likely ? ordered(x[t]) : INT32_MIN;
        best = v > best ? v : best;
    }
    for (int j = 0; j < 16; j++) best = lane[j] > best ? lane[j] : best;
    best ^= (best >> 31) & 0x7FFFFFFF;
    float f;
    memcpy(&f, &best, sizeof f);
    return f;
}

/* keep[t] = 1 for the tokens within reach (a superset of the reference's: see above) */
static void within_reach(uint8_t *keep, const float *x, const uint32_t *hash, int vocab, float reach) {
    if (reach == -INFINITY) {  /* no likely winner: every allowed token */
        for (int t = 0; t < vocab; t++) keep[t] = x[t] > -INFINITY;
        return;
    }
    for (int t = 0; t < vocab; t++) {  /* hash 0: e = -1 (any e <= 31 does: it is kept either way) */
        const int e = hash[t] ? 31 - __builtin_clz(hash[t]) : -1;
        keep[t] = (float)(e - 32) * 0.6931472f <= x[t] - reach + 1e-3f;
    }
}

/* scores [rows, vocab] float32; row_hash [rows] (seed and position mixed in); token_keys [vocab];
 * out: the candidates' flat indices (row * vocab + token, ascending) and hashes, at most capacity.
 * Returns how many, or -1 if more than capacity (or out of memory). */
int64_t gumbel_candidates(const float *scores, int rows, int vocab, const uint32_t *row_hash,
                          const uint32_t *token_keys, uint32_t likely, float likely_noise,
                          int64_t *flat, uint32_t *hashes, int64_t capacity) {
    uint32_t *h = malloc(sizeof(uint32_t) * (size_t)vocab + (size_t)vocab + 8);
    if (!h) return -1;
    uint8_t *keep = (uint8_t *)(h + vocab);
    int64_t n = 0;
    for (int r = 0; r < rows; r++) {
        const float *x = scores + (int64_t)r * vocab;
        hash_row(h, row_hash[r], token_keys, vocab);
        const float best = likely_best(x, h, vocab, likely);
        within_reach(keep, x, h, vocab, best + likely_noise - (1e-2f + 1e-6f * fabsf(best)));
        for (int t = 0; t < vocab; t++) {
            uint64_t eight;  /* almost every byte is 0: skip them eight at a time */
            if (t + 8 <= vocab && (memcpy(&eight, keep + t, 8), eight == 0)) {
                t += 7;
                continue;
            }
            if (!keep[t]) continue;
            if (n == capacity) {
                free(h);
                return -1;
            }
            flat[n] = (int64_t)r * vocab + t;
            hashes[n++] = h[t];
        }
    }
    free(h);
    return n;
}
