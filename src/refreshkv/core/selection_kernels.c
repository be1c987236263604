/* The selection's loops in one pass each, for the CPU (loaded by core/native_selection.py).

The top K and the spread work on `rows` independent rows of `n` float32 values, row-major and contiguous; the gather
copies rows of any type. Each computes exactly what the PyTorch reference computes (core/attention_math.py,
core/kvstore.py; tests/test_native_selection.py compares them).
Plain C11, no vector intrinsics: it is compiled on the user's machine with the baseline flags of its C compiler. On
x86-64, GCC and Clang also make an AVX2 version of the two loops over positions, which the loader picks where the
CPU has AVX2 (nothing newer: no AVX-512 code, so that an AVX2 machine and one restricted to AVX2 run the same).
*/
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define AVX2_CLONE __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef AVX2_CLONE
#define AVX2_CLONE
#endif

/* An unsigned key that orders like the float (any real value, +-inf included; -0.0 = 0.0): the bits of a
   non-negative float with the sign bit set, all bits of a negative one flipped. Every real value maps above 0, which
   is left for excluded positions: they rank after -inf. No branch, so that the loop over a row vectorizes. */
static inline uint32_t order_key(float value) {
    uint32_t bits;
    value += 0.0f; /* -0.0 + 0.0 = 0.0 */
    memcpy(&bits, &value, sizeof bits);
    return bits ^ ((uint32_t)((int32_t)bits >> 31) | 0x80000000u);
}

enum { DIGIT_BITS = 8, BINS = 1 << DIGIT_BITS, SPLIT = 4 }; /* four digits make a key */

static inline uint32_t digit_of(uint32_t key, int shift) { return (key >> shift) & (BINS - 1); }

/* Per row, the k positions of the highest values in position order; ties go to the earlier position. `valid`
   (rows x n bytes, or NULL) excludes the positions where it is 0: they are taken only when fewer than k are valid.

   The k-th highest key is found by radix selection on 8-bit digits, highest first: one histogram over the whole row
   (the sign and the top of the exponent), then over only the keys that share the prefix found so far
   (`candidates`). One scan in position order then takes every key
   above it and, of the keys equal to it, the earliest up to k: the order the stores keep, with no sort. `keys` and
   `candidates` are scratch space of n entries each; k is in 1 .. n. */
AVX2_CLONE void top_k_in_order(const float *scores, const uint8_t *valid, int64_t rows, int64_t n, int64_t k, int64_t *out,
                    uint32_t *keys, uint32_t *candidates) {
    int32_t histogram[SPLIT][BINS];
    for (int64_t row = 0; row < rows; row++) {
        const float *values = scores + row * n;
        const uint8_t *allowed = valid ? valid + row * n : NULL;
        int64_t *taken = out + row * k;
        for (int64_t i = 0; i < n; i++) keys[i] = order_key(values[i]);
        if (allowed)
            for (int64_t i = 0; i < n; i++) keys[i] &= -(uint32_t)(allowed[i] != 0);
        int64_t wanted = k; /* how many keys with the threshold's prefix are still to be taken */
        uint32_t threshold = 0, prefix_mask = 0;
        const uint32_t *pool = keys;
        int64_t count = n;
        for (int shift = 32 - DIGIT_BITS; shift >= 0; shift -= DIGIT_BITS) {
            /* Neighbours often share a digit (max-pooling makes plateaus): SPLIT histograms, counted in turns, let
               their increments run without waiting for each other. */
            memset(histogram, 0, sizeof histogram);
            int64_t i = 0;
            for (; i + SPLIT <= count; i += SPLIT)
                for (int part = 0; part < SPLIT; part++) histogram[part][digit_of(pool[i + part], shift)]++;
            for (; i < count; i++) histogram[0][digit_of(pool[i], shift)]++;
            for (int part = 1; part < SPLIT; part++)
                for (int bin = 0; bin < BINS; bin++) histogram[0][bin] += histogram[part][bin];
            uint32_t digit = BINS - 1;
            while (histogram[0][digit] < wanted) wanted -= histogram[0][digit--];
            threshold |= digit << shift;
            prefix_mask |= (uint32_t)(BINS - 1) << shift;
            if (shift == 0) break;
            int64_t kept = 0;
            for (int64_t i = 0; i < count; i++) {
                candidates[kept] = pool[i];
                kept += (pool[i] & prefix_mask) == threshold;
            }
            pool = candidates;
            count = kept;
        }
        /* `wanted` keys equal to the threshold remain to be taken, the earliest first: per block of 64 positions,
           bit masks of the keys above and equal to it, read back lowest bit first. */
        int64_t written = 0;
        for (int64_t block = 0; block < n && written < k; block += 64) {
            int64_t size = n - block < 64 ? n - block : 64;
            uint64_t above = 0, equal = 0;
            for (int64_t i = 0; i < size; i++) {
                above |= (uint64_t)(keys[block + i] > threshold) << i;
                equal |= (uint64_t)(keys[block + i] == threshold) << i;
            }
            for (; equal && wanted > 0; wanted--) { /* the earliest equal keys join the ones above */
                above |= equal & -equal;
                equal &= equal - 1;
            }
            for (; above; above &= above - 1) taken[written++] = block + __builtin_ctzll(above);
        }
    }
}

/* Per row (head) of a batch element, each of the first `length` positions raised to the highest value of its word:
   `words` (batch x length) numbers the words of each batch element, equal along a word, which is a run of
   consecutive positions; positions from `length` on keep their value. `heads` rows share one batch element's words.
   `out` may be `scores`. */
AVX2_CLONE void spread_over_words(const float *scores, const int64_t *words, int64_t batch, int64_t heads, int64_t n,
                       int64_t length, float *out) {
    for (int64_t row = 0; row < batch * heads; row++) {
        const float *values = scores + row * n;
        const int64_t *word = words + (row / heads) * length;
        float *result = out + row * n;
        int64_t start = 0;
        while (start < length) {
            int64_t end = start + 1;
            float best = values[start];
            while (end < length && word[end] == word[start]) {
                if (values[end] > best) best = values[end];
                end++;
            }
            for (int64_t i = start; i < end; i++) result[i] = best;
            start = end;
        }
        if (result != values) memcpy(result + length, values + length, (size_t)(n - length) * sizeof(float));
    }
}

/* Per (batch, head), the rows at `index` (batch x heads x k, each in 0 .. length - 1) of a source whose (batch, head)
   blocks start `batch_stride` / `head_stride` bytes apart and whose rows of `row_bytes` follow each other, into
   `slots` >= k consecutive rows of `out` per (batch, head); the slots from k on repeat the last index's row, so an
   empty slot holds a copy of a real token, never stale or uninitialised memory. Returns 0, or -1 with nothing
   written if an index is out of range. */
int gather_rows(const char *source, int64_t batch_stride, int64_t head_stride, int64_t length, const int64_t *index,
                int64_t batch, int64_t heads, int64_t k, int64_t row_bytes, int64_t slots, char *out) {
    for (int64_t i = 0; i < batch * heads * k; i++)
        if (index[i] < 0 || index[i] >= length) return -1;
    for (int64_t b = 0; b < batch; b++) {
        for (int64_t h = 0; h < heads; h++) {
            const int64_t *rows = index + (b * heads + h) * k;
            const char *block = source + b * batch_stride + h * head_stride;
            char *target = out + (b * heads + h) * slots * row_bytes;
            for (int64_t slot = 0; slot < slots; slot++) {
                int64_t row = rows[slot < k ? slot : k - 1];
                memcpy(target + slot * row_bytes, block + row * row_bytes, (size_t)row_bytes);
            }
        }
    }
    return 0;
}
