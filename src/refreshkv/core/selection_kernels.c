/* The selection's loops in one pass each, for the CPU (built and loaded by core/native_library.py).

The top K and the spread work on `rows` independent rows of `n` float32 values, row-major and contiguous; the gathers
copy rows of any type. Each computes exactly what the PyTorch reference computes (core/attention_math.py,
core/kvstore.py, methods/refreshkv/partial_cache.py; tests/test_native_selection.py compares them).
Plain C11 with GCC/Clang builtins: it is compiled on the user's machine with the baseline flags of its C compiler. On
x86-64, GCC and Clang also make an AVX2 version of the loops over positions, which the loader picks where the CPU has
AVX2; the attention's two loops also have AVX-512 code of their own (`wide_logits`, `wide_weighted`), which runs
only where the caller asks for it (the loader asks where PyTorch's own kernels are AVX-512: a machine restricted to
AVX2 runs as an AVX2 one). Besides them the one intrinsic is SSE2's streaming store, which every x86-64 CPU has.
`logits_rows` and `weigh_values_rows` are one query token's attention over a float32 cache (every such attention over
1,024 keys or more on the CPU: core/attention_math.py), for some rows of a batch only where asked, read where the rows
lie in the cache (a batch whose rows disagree at a query check: only the rows that refresh read all of C_f).
`quantized_logits_rows`, `quantized_weigh_rows` and `dequantize_rows` are the same full step over a C_f held in codes:
attention read from the codes, and the selected tokens alone dequantized into C_p; `paged_logits` and
`paged_weigh_values` over a serving engine's paged blocks. `quest_pages` is quest's choice of pages at a step (its
bounds, top pages and their positions) in one pass.
Where the loader builds it with OpenMP (only into a process whose PyTorch runs on the same OpenMP runtime, so that the
loops run on PyTorch's own threads), the work of a call is split between `threads` threads: pieces of positions,
rows, pieces of slots; each piece is computed as one thread would, so the results do not depend on the split.
*/
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define WIDE __attribute__((target("avx512f")))
#endif
#if defined(_OPENMP)
#include <omp.h>
#define THREAD_NUMBER() omp_get_thread_num()
#else
#define THREAD_NUMBER() 0
#endif

#if defined(__x86_64__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define AVX2_CLONE __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef AVX2_CLONE
#define AVX2_CLONE
#endif
/* Inlined into each clone, so that it is compiled for the clone's instructions. */
#define INLINE static inline __attribute__((always_inline))

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

/* max as a select, which vectorizes (the values here are never NaN) */
static inline float higher(float a, float b) { return a > b ? a : b; }

/* Scratch space of `bytes`, kept per thread from call to call and grown as needed (NULL if it cannot be): fresh memory
   each call would be first touched, page by page, at every refresh of every layer. */
static void *scratch(size_t bytes) {
    static _Thread_local void *space = NULL;
    static _Thread_local size_t held = 0;
    if (bytes > held) {
        void *grown = realloc(space, bytes);
        if (!grown) return NULL;
        space = grown;
        held = bytes;
    }
    return space;
}

/* The k positions of the highest `keys` (order keys, 0 = excluded) of one row in position order; ties go to the
   earlier position.

   The k-th highest key is found by radix selection on 8-bit digits, highest first: one histogram over the whole row
   (the sign and the top of the exponent), then over only the keys that share the prefix found so far
   (`candidates`, scratch space of n entries). One scan in position order then takes every key above it and, of the
   keys equal to it, the earliest up to k: the order the stores keep, with no sort. k is in 1 .. n. */
INLINE void top_k_of_keys(const uint32_t *keys, int64_t n, int64_t k, int64_t *taken, uint32_t *candidates) {
    int32_t histogram[SPLIT][BINS];
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
    /* `wanted` keys equal to the threshold remain to be taken, the earliest first: per block of 64 positions, bit
       masks of the keys above and equal to it, read back lowest bit first. */
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

/* Per row, the k positions of the highest values in position order (top_k_of_keys); `valid` (rows x n bytes, or
   NULL) excludes the positions where it is 0: they are taken only when fewer than k are valid. Rows are shared out
   between `threads` threads. Returns 0, or -1 if no scratch space could be had (the output is then not to be used). */
AVX2_CLONE int top_k_in_order(const float *scores, const uint8_t *valid, int64_t rows, int64_t n, int64_t k,
                              int64_t *out, int threads) {
    int failed = 0;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows > 1)
    for (int64_t row = 0; row < rows; row++) {
        uint32_t *keys = scratch((size_t)(2 * n) * sizeof(uint32_t)); /* this thread's own */
        if (!keys) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        const float *values = scores + row * n;
        const uint8_t *allowed = valid ? valid + row * n : NULL;
        for (int64_t i = 0; i < n; i++) keys[i] = order_key(values[i]);
        if (allowed)
            for (int64_t i = 0; i < n; i++) keys[i] &= -(uint32_t)(allowed[i] != 0);
        top_k_of_keys(keys, n, k, out + row * k, keys + n);
    }
    return failed ? -1 : 0;
}

/* Quest's pages (methods/quest.py) of `rows` (batch x KV heads) rows that page alike: per row, each of the first
   `pages` pages' bound of its tokens' products with the row's `group` query heads (`query`: rows x group x dim), per
   channel the larger of q x the page's lowest key and q x its highest (`lows`, `highs`: per row dim channels of
   `stride` floats, a channel's pages side by side), summed over the channels in order, then the largest over the
   group (`mean`: their sum over the group / group) into `bounds` (rows x pages). Of those, the k pages with the
   highest bound in page order (ties to the earlier page, as top_k_in_order), then page `pages` (the one being
   written), each as its page_size positions (first + page x page_size + t) into `out` (rows x (k + 1) x page_size).
   Each channel's pass runs along the pages (it vectorizes). Rows are shared out between `threads` threads. 0, or -1
   without scratch space. */
AVX2_CLONE int quest_pages(const float *query, const float *lows, const float *highs, int64_t stride, int64_t rows,
                           int64_t group, int64_t dim, int64_t pages, int64_t k, int mean, int64_t page_size,
                           int64_t first, float *bounds, int64_t *out, int threads) {
    int failed = 0;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows > 1)
    for (int64_t row = 0; row < rows; row++) {
        /* this thread's own: the order keys, top_k_of_keys's candidates, each query head's sums */
        uint32_t *keys = scratch((size_t)(2 * pages) * sizeof(uint32_t) + (size_t)(group * pages) * sizeof(float));
        if (!keys) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        float *sums = (float *)(keys + 2 * pages);
        const float *q = query + row * group * dim;
        memset(sums, 0, (size_t)(group * pages) * sizeof(float));
        for (int64_t d = 0; d < dim; d++)
            for (int64_t g = 0; g < group; g++) {
                float weight = q[g * dim + d];
                const float *side = (weight >= 0.0f ? highs : lows) + (row * dim + d) * stride;
                float *sum = sums + g * pages;
                for (int64_t p = 0; p < pages; p++) sum[p] += weight * side[p];
            }
        float *bound = bounds + row * pages;
        memcpy(bound, sums, (size_t)pages * sizeof(float));
        for (int64_t g = 1; g < group; g++)
            for (int64_t p = 0; p < pages; p++)
                bound[p] = mean ? bound[p] + sums[g * pages + p] : higher(bound[p], sums[g * pages + p]);
        for (int64_t p = 0; p < pages; p++) {
            if (mean) bound[p] /= (float)group;
            keys[p] = order_key(bound[p]);
        }
        int64_t *taken = out + row * (k + 1) * page_size;
        top_k_of_keys(keys, pages, k, taken, keys + pages);
        taken[k] = pages;
        for (int64_t i = k; i >= 0; i--) /* backwards: page i's positions overwrite entries from i on only */
            for (int64_t t = page_size - 1; t >= 0; t--) taken[i * page_size + t] = first + taken[i] * page_size + t;
    }
    return failed ? -1 : 0;
}

/* In `count` rows of n values (one after another), each of the positions lo .. hi - 1 raised to the highest value of
   its word: `word` numbers the words, equal along a word, which is a run of consecutive positions that lies within
   lo .. hi - 1. Two passes, each a chain from position to position: the highest so far within the word, then the
   word's last position's carried back over it. The rows' chains are independent, so they run side by side: per
   head, the word-by-word loop it replaces took 2x the time in the model (its branches mispredict on words of 1-3
   tokens). */
INLINE void spread_rows(float *rows, int64_t count, int64_t n, const int64_t *word, int64_t lo, int64_t hi) {
    float *end = rows + count * n;
    for (int64_t i = lo + 1; i < hi; i++) {
        int same = word[i] == word[i - 1];
        for (float *row = rows; row < end; row += n) row[i] = same ? higher(row[i - 1], row[i]) : row[i];
    }
    for (int64_t i = hi - 2; i >= lo; i--) {
        int same = word[i] == word[i + 1];
        for (float *row = rows; row < end; row += n) row[i] = same ? row[i + 1] : row[i];
    }
}

/* The first position at or after `at` where a word starts (or `length`): pieces cut there share no word. */
INLINE int64_t word_start(const int64_t *word, int64_t length, int64_t at) {
    while (at > 0 && at < length && word[at] == word[at - 1]) at++;
    return at;
}

/* spread_rows over the first `length` positions, their part `part` of `parts`, cut where words start. */
INLINE void spread_part(float *rows, int64_t count, int64_t n, const int64_t *word, int64_t length, int64_t part,
                        int64_t parts) {
    int64_t lo = word_start(word, length, part * length / parts);
    spread_rows(rows, count, n, word, lo, word_start(word, length, (part + 1) * length / parts));
}

/* Per batch element, spread_part over its `heads` rows with its `words` (batch x length), in `threads` parts;
   positions from `length` on (decoded tokens) keep their value. `out` may be `scores`. */
AVX2_CLONE void spread_over_words(const float *scores, const int64_t *words, int64_t batch, int64_t heads, int64_t n,
                                  int64_t length, float *out, int threads) {
    if (out != scores) memcpy(out, scores, (size_t)(batch * heads * n) * sizeof(float));
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t task = 0; task < batch * threads; task++)
        spread_part(out + task / threads * heads * n, heads, n, words + task / threads * length, length,
                    task % threads, threads);
}

/* One row of `bytes` to `to`: on x86-64 a streaming store where it lies on 16 bytes, which writes without first
   reading the line it replaces (the slots are cold: a refresh at 8K tokens rewrites 1.5 MB of C_p per layer). */
INLINE void copy_row(char *to, const char *from, int64_t bytes) {
#if defined(__SSE2__)
    if (bytes % 16 == 0 && (uintptr_t)to % 16 == 0) {
        for (int64_t at = 0; at < bytes; at += 16)
            _mm_stream_si128((__m128i *)(to + at), _mm_loadu_si128((const __m128i *)(from + at)));
        return;
    }
#endif
    memcpy(to, from, (size_t)bytes);
}

enum { AHEAD = 32 }; /* rows fetched ahead of the copy: they lie anywhere in C_f, where no prefetcher looks */

INLINE void prefetch_rows(const char *key_block, const char *value_block, int64_t row, int64_t row_bytes) {
    for (int64_t at = 0; at < row_bytes; at += 64) {
        __builtin_prefetch(key_block + row * row_bytes + at);
        __builtin_prefetch(value_block + row * row_bytes + at);
    }
}

/* Slots first .. last - 1 of the rows of `row_bytes` at `key_out` / `value_out` from the keys and values at `rows`
   (k of them) of `key_block` / `value_block`; the slots from k on repeat the last index's row, so an empty slot holds
   a copy of a real token, never stale or uninitialised memory. */
INLINE void copy_token_rows(const char *key_block, const char *value_block, const int64_t *rows, int64_t k,
                            int64_t row_bytes, int64_t first, int64_t last, char *key_out, char *value_out) {
    for (int64_t slot = first; slot < first + AHEAD && slot < k && slot < last; slot++)
        prefetch_rows(key_block, value_block, rows[slot], row_bytes);
    for (int64_t slot = first; slot < last; slot++) {
        if (slot + AHEAD < k && slot + AHEAD < last) prefetch_rows(key_block, value_block, rows[slot + AHEAD], row_bytes);
        int64_t row = rows[slot < k ? slot : k - 1];
        copy_row(key_out + slot * row_bytes, key_block + row * row_bytes, row_bytes);
        copy_row(value_out + slot * row_bytes, value_block + row * row_bytes, row_bytes);
    }
#if defined(__SSE2__)
    _mm_sfence(); /* the streamed rows are in memory before anything reads them */
#endif
}

/* Where the keys and values of a (batch, head) block start: byte strides between batch elements and between heads. */
typedef struct {
    int64_t key_batch, key_head, value_batch, value_head;
} BlockStrides;

enum { PIECE = 1024, SLOT_PIECE = 256 }; /* positions and slots of a row that one thread takes at a time */

/* Task `task` of (pieces of PIECE positions) x `heads`, heads varying fastest: its head and positions lo .. hi - 1. */
typedef struct {
    int64_t head, lo, hi;
} Piece;

INLINE Piece piece_of(int64_t task, int64_t heads, int64_t n) {
    int64_t lo = task / heads * PIECE;
    return (Piece){task % heads, lo, lo + PIECE < n ? lo + PIECE : n};
}

/* One decoded token into a slot store (core/kvstore.py's SlotStore: batch x heads rows of `slots` slots of `dim`
   floats, one after another) and its scores (a float per slot): each row's token, `dim` floats of `key` / `value`
   whose (batch, head) rows lie `strides` apart, into slot `slot` of every row, or where `slot` < 0 into each row's
   lowest slot by `eviction` (a float per slot), the first of equal ones and a NaN before any number, as torch.argmin
   picks it; that slot's position `position` and score `score`. A served partial step writes its token so at every
   layer: the same as PyTorch's scatter, without a dozen operators around it. */
void put_token(float *keys, float *values, int64_t *positions, float *scores, const float *eviction, int64_t batch,
               int64_t heads, int64_t slots, int64_t dim, const char *key, const char *value, BlockStrides strides,
               int64_t slot, int64_t position, float score) {
    for (int64_t row = 0; row < batch * heads; row++) {
        int64_t b = row / heads, h = row % heads, at = slot;
        if (at < 0) {
            const float *candidates = eviction + row * slots;
            at = 0;
            for (int64_t s = 0; s < slots && candidates[at] == candidates[at]; s++)
                if (candidates[s] < candidates[at] || candidates[s] != candidates[s]) at = s;
        }
        memcpy(keys + (row * slots + at) * dim, key + b * strides.key_batch + h * strides.key_head,
               (size_t)dim * sizeof(float));
        memcpy(values + (row * slots + at) * dim, value + b * strides.value_batch + h * strides.value_head,
               (size_t)dim * sizeof(float));
        positions[row * slots + at] = position;
        scores[row * slots + at] = score;
    }
}

/* Piece `piece` of the slots of (batch element b, head h): copy_token_rows from the keys and values whose (batch,
   head) blocks lie `strides` apart into the `slots` consecutive rows of that row of `key_out` / `value_out`. */
INLINE void gather_piece(const char *keys, const char *values, BlockStrides strides, int64_t b, int64_t h,
                         int64_t heads, const int64_t *rows, int64_t k, int64_t row_bytes, int64_t slots,
                         int64_t piece, char *key_out, char *value_out) {
    int64_t first = piece * SLOT_PIECE, last = first + SLOT_PIECE < slots ? first + SLOT_PIECE : slots;
    int64_t out = (b * heads + h) * slots * row_bytes;
    copy_token_rows(keys + b * strides.key_batch + h * strides.key_head,
                    values + b * strides.value_batch + h * strides.value_head, rows, k, row_bytes, first, last,
                    key_out + out, value_out + out);
}

/* Per (batch, head), copy_token_rows from the rows at `index` (batch x heads x k, each in 0 .. length - 1) of keys and
   values whose (batch, head) blocks lie `strides` apart, into `slots` >= k consecutive rows per (batch, head) of
   `key_out` / `value_out`, in pieces shared out between `threads` threads. Returns 0, or -1 with nothing written if an
   index is out of range. */
int gather_rows(const char *keys, const char *values, BlockStrides strides, int64_t length, const int64_t *index,
                int64_t batch, int64_t heads, int64_t k, int64_t row_bytes, int64_t slots, char *key_out,
                char *value_out, int threads) {
    for (int64_t i = 0; i < batch * heads * k; i++)
        if (index[i] < 0 || index[i] >= length) return -1;
    int64_t pieces = (slots + SLOT_PIECE - 1) / SLOT_PIECE;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t task = 0; task < batch * heads * pieces; task++) {
        int64_t row = task / pieces;
        gather_piece(keys, values, strides, row / heads, row % heads, heads, index + row * k, k, row_bytes, slots,
                     task % pieces, key_out, value_out);
    }
    return 0;
}

/* A partial cache refreshed in one call, from the attention of a layer's query heads to the filled store: what
   attention_math.selection_scores (max or first aggregation), SelectionRule.refresh and SelectionState.load compute.

   Per (batch, KV head), from `probs` (batch x heads x group x n: each query head's window-mean probabilities): the
   highest over the group (or the first head's with `first_only`), max-pooled over the `before` positions before and
   the `after` after each position, raised to the highest of its word over the first `length` positions where `words`
   (batch x length) is given, -inf where `valid` (batch x n bytes, or NULL) is 0, and with `carry` > 0 at least carry
   x its score in the store where the store holds it with a score below `carried_below` (the selected tokens, not the
   decoded ones), and with `floor_share` > 0 at least floor_share x its score in `floor_positions` and `floor_scores`
   (batch x heads x floor_slots: a selection kept aside, the question's). Its k highest (top_k_of_keys) fill the
   first k of the store's `slots` (keep_held_slots: a token the store holds in one of them stays there, the others
   take the slots left in position order): their positions (`positions`, batch x heads x slots), scores
   (`kept_scores`, likewise) and key and value rows (as gather_rows; not where `key_source` is NULL: the caller
   gathers them). The slots from k on are empty: position -1, score -inf, a copy of the last kept row.
   Per batch element (only those marked in `rows`, batch bytes, where it is not NULL), five steps, each shared out
   between `threads` threads: the group's highest and the pooling in pieces of positions, the spread in parts cut where
   words start, the top K by head, the gather in pieces of slots. Returns 0, or -1 with nothing written if no scratch
   space could be had. */
/* scores[at] raised to at least share x score for each (at, score) of `slots` held entries whose score is below
   `below` (selected tokens, not decoded ones) and whose position is one of the n scored. */
INLINE void raise_to_floor(float *scores, int64_t n, const int64_t *held_positions, const float *held_scores,
                           int64_t slots, float share, float below) {
    for (int64_t slot = 0; slot < slots; slot++) {
        int64_t at = held_positions[slot];
        float previous = held_scores[slot];
        if (at >= 0 && at < n && previous < below) scores[at] = higher(share * previous, scores[at]);
    }
}

/* The k positions `taken` (ascending) reordered into the slots they fill: one that `held` (the positions the first k
   slots hold, -1: none) holds stays in its slot, the others take the slots left in slot order, in position order. A
   refresh keeps most of what it held, and a store that gathers from a cache laid out otherwise then reads only the
   new tokens. `slot_of` (n entries, all -1) is left so; `placed` (k entries) is scratch. */
INLINE void keep_held_slots(int64_t *taken, int64_t k, const int64_t *held, int64_t n, int64_t *slot_of,
                            int64_t *placed) {
    for (int64_t slot = 0; slot < k; slot++) {
        placed[slot] = -1;
        if (held[slot] >= 0 && held[slot] < n) slot_of[held[slot]] = slot;
    }
    for (int64_t i = 0; i < k; i++)
        if (slot_of[taken[i]] >= 0) placed[slot_of[taken[i]]] = taken[i];
    for (int64_t i = 0, left = 0; i < k; i++) {
        if (slot_of[taken[i]] >= 0) continue;
        while (placed[left] >= 0) left++;
        placed[left] = taken[i];
    }
    for (int64_t slot = 0; slot < k; slot++)
        if (held[slot] >= 0 && held[slot] < n) slot_of[held[slot]] = -1;
    memcpy(taken, placed, (size_t)k * sizeof(int64_t));
}

AVX2_CLONE int refresh_partial(const float *probs, int64_t batch, int64_t heads, int64_t group, int64_t n,
                               int first_only, int64_t before, int64_t after, const int64_t *words, int64_t length,
                               const uint8_t *valid, int64_t k, const char *key_source, const char *value_source,
                               BlockStrides strides, int64_t row_bytes, int64_t slots, char *key_out, char *value_out,
                               int64_t *positions, float *kept_scores, float carry, float carried_below,
                               const int64_t *floor_positions, const float *floor_scores, int64_t floor_slots,
                               float floor_share, const uint8_t *rows, int threads) {
    /* per batch element: each head's k taken, its group's highest and its scores; per thread: n order keys, n
       candidates, a slot per position (all -1) and k placed slots */
    size_t indices = (size_t)(heads * k) * sizeof(int64_t), floats = (size_t)(2 * heads * n) * sizeof(float);
    size_t per_thread = (size_t)(2 * n) * sizeof(uint32_t) + (size_t)(n + k) * sizeof(int64_t);
    char *space = scratch(indices + floats + (size_t)threads * per_thread);
    if (!space) return -1;
    int64_t *taken = (int64_t *)space;
    float *highest = (float *)(space + indices), *all_scores = highest + heads * n;
    char *thread_space = space + indices + floats;
    for (int t = 0; t < threads; t++) /* the slot of each position: none */
        memset(thread_space + t * per_thread + (size_t)(2 * n) * sizeof(uint32_t), 0xff, (size_t)n * sizeof(int64_t));
    int64_t pieces = (n + PIECE - 1) / PIECE, slot_pieces = (slots + SLOT_PIECE - 1) / SLOT_PIECE;
#pragma omp parallel num_threads(threads) if (threads > 1)
    for (int64_t b = 0; b < batch; b++) {
        if (rows && !rows[b]) continue; /* every thread skips it alike */
#pragma omp for schedule(static)
        for (int64_t task = 0; task < heads * pieces; task++) {
            Piece piece = piece_of(task, heads, n);
            int64_t lo = piece.lo, hi = piece.hi;
            const float *head = probs + (b * heads + piece.head) * group * n;
            float *group_highest = highest + piece.head * n;
            memcpy(group_highest + lo, head + lo, (size_t)(hi - lo) * sizeof(float));
            for (int64_t g = 1; g < (first_only ? 1 : group); g++)
                for (int64_t i = lo; i < hi; i++) group_highest[i] = higher(head[g * n + i], group_highest[i]);
        }
#pragma omp for schedule(static)
        for (int64_t task = 0; task < heads * pieces; task++) {
            /* the window's maximum, one offset at a time (the positions past either end are -inf padding) */
            Piece piece = piece_of(task, heads, n);
            int64_t lo = piece.lo, hi = piece.hi;
            const float *group_highest = highest + piece.head * n;
            float *scores = all_scores + piece.head * n;
            memcpy(scores + lo, group_highest + lo, (size_t)(hi - lo) * sizeof(float));
            for (int64_t offset = 1; offset <= before; offset++)
                for (int64_t i = lo > offset ? lo : offset; i < hi; i++)
                    scores[i] = higher(group_highest[i - offset], scores[i]);
            for (int64_t offset = 1; offset <= after; offset++)
                for (int64_t i = lo, end = hi < n - offset ? hi : n - offset; i < end; i++)
                    scores[i] = higher(group_highest[i + offset], scores[i]);
        }
        if (words) {
#pragma omp for schedule(static)
            for (int64_t part = 0; part < threads; part++)
                spread_part(all_scores, heads, n, words + b * length, length, part, threads);
        }
#pragma omp for schedule(static, 1)
        for (int64_t h = 0; h < heads; h++) {
            float *scores = all_scores + h * n;
            char *own = thread_space + THREAD_NUMBER() * per_thread;
            uint32_t *keys = (uint32_t *)own;
            int64_t *slot_of = (int64_t *)(own + (size_t)(2 * n) * sizeof(uint32_t));
            int64_t out = (b * heads + h) * slots;
            if (valid)
                for (int64_t i = 0; i < n; i++) scores[i] = valid[b * n + i] ? scores[i] : -INFINITY;
            if (carry > 0) /* read before the slots below are rewritten */
                raise_to_floor(scores, n, positions + out, kept_scores + out, slots, carry, carried_below);
            if (floor_share > 0)
                raise_to_floor(scores, n, floor_positions + (b * heads + h) * floor_slots,
                               floor_scores + (b * heads + h) * floor_slots, floor_slots, floor_share, carried_below);
            for (int64_t i = 0; i < n; i++) keys[i] = order_key(scores[i]);
            top_k_of_keys(keys, n, k, taken + h * k, keys + n);
            keep_held_slots(taken + h * k, k, positions + out, n, slot_of, slot_of + n);
            for (int64_t slot = 0; slot < slots; slot++) {
                positions[out + slot] = slot < k ? taken[h * k + slot] : -1;
                kept_scores[out + slot] = slot < k ? scores[taken[h * k + slot]] : -INFINITY;
            }
        }
        if (!key_source) continue; /* the caller gathers the rows (a cache laid out otherwise) */
#pragma omp for schedule(static)
        for (int64_t task = 0; task < heads * slot_pieces; task++) {
            int64_t h = task / slot_pieces;
            gather_piece(key_source, value_source, strides, b, h, heads, taken + h * k, k, row_bytes, slots,
                         task % slot_pieces, key_out, value_out);
        }
    }
    return 0;
}

/* The (batch, KV head) blocks of the batch elements marked in `rows` (batch bytes): their count, `marked` filled. */
static int64_t marked_blocks(const uint8_t *rows, int64_t batch, int64_t heads, int64_t *marked) {
    int64_t count = 0;
    for (int64_t b = 0; b < batch; b++)
        for (int64_t h = 0; rows[b] && h < heads; h++) marked[count++] = b * heads + h;
    return count;
}

enum { LANES = 16 }; /* floats summed side by side in registers: two AVX2 vectors */

/* a . b over dim floats (a multiple of LANES), summed in LANES lanes that stay in registers, then across them. */
INLINE float lanes_dot(const float *a, const float *b, int64_t dim) {
    float lanes[LANES] = {0.0f}, sum = 0.0f;
    for (int64_t d = 0; d < dim; d += LANES)
        for (int64_t l = 0; l < LANES; l++) lanes[l] += a[d + l] * b[d + l];
#pragma omp simd reduction(+ : sum)
    for (int64_t l = 0; l < LANES; l++) sum += lanes[l];
    return sum;
}

#if defined(WIDE)
enum { TILE = 16 }; /* keys whose products one AVX-512 pass sums */

/* Lane t of the result: the sum of v[t]'s 16 lanes, in a fixed tree (the same for every t). */
WIDE static inline __m512 lane_sums(const __m512 v[TILE]) {
    __m512 halves[8], quarters[4], eighths[2];
    for (int i = 0; i < 8; i++) /* 128-bit quarters 0+2 and 1+3 of v[2i], then of v[2i+1] */
        halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                                  _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++) /* quarter j: what is left of v[4i + j] */
        quarters[i] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0x88),
                                    _mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++) /* in quarter j, two floats of v[8i + j], two of v[8i + 4 + j] */
        eighths[i] = _mm512_add_ps(_mm512_shuffle_ps(quarters[2 * i], quarters[2 * i + 1], 0x44),
                                   _mm512_shuffle_ps(quarters[2 * i], quarters[2 * i + 1], 0xEE));
    /* lane 4j + k: the sum of v[4k + j] */
    __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(eighths[0], eighths[1], 0x88),
                                _mm512_shuffle_ps(eighths[0], eighths[1], 0xDD));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), sums);
}

/* `logits_piece` in AVX-512, dim a multiple of 16: per query head, the products with TILE keys at once, each in its
   own register (summed over the chunks of 16 of dim in order, then across lanes in `lane_sums`'s tree); a last,
   partial tile reads its last key again for the missing ones and stores only its own. Each key's logit is computed
   the same way wherever it falls. The keys AHEAD of the tile are asked for from memory (as the gathers' rows): without,
   a thread read them at half the speed of a plain sum. */
WIDE static void wide_logits(const float *q, const float *keys, int64_t group, int64_t n, int64_t dim, int64_t lo,
                             int64_t hi, float scale, const uint8_t *kept, float *out) {
    for (int64_t i = lo; i < hi; i += TILE) {
        int64_t count = hi - i < TILE ? hi - i : TILE;
        const float *row[TILE];
        for (int t = 0; t < TILE; t++) row[t] = keys + (i + (t < count ? t : count - 1)) * dim;
        for (int64_t e = 0; i + AHEAD < hi && e < TILE * dim; e += 16) __builtin_prefetch(keys + (i + AHEAD) * dim + e);
        for (int64_t g = 0; g < group; g++) {
            __m512 v[TILE];
            for (int t = 0; t < TILE; t++) v[t] = _mm512_setzero_ps();
            for (int64_t d = 0; d < dim; d += 16) {
                __m512 chunk = _mm512_loadu_ps(q + g * dim + d);
                for (int t = 0; t < TILE; t++) v[t] = _mm512_fmadd_ps(chunk, _mm512_loadu_ps(row[t] + d), v[t]);
            }
            __m512 logits = _mm512_mul_ps(lane_sums(v), _mm512_set1_ps(scale));
            _mm512_mask_storeu_ps(out + g * n + i, (__mmask16)((1u << count) - 1), logits);
            for (int64_t t = 0; kept && t < count; t++)
                if (!kept[i + t]) out[g * n + i + t] = -FLT_MAX;
        }
    }
}
#endif

/* Keys lo .. hi - 1 of one (batch, head) block (`keys`, rows of dim) against its `group` query heads (`q`: group x
   dim), times `scale`, the lowest float where `kept` (n bytes or NULL) is 0, into `out` (group x n). */
INLINE void logits_piece(const float *q, const float *keys, int64_t group, int64_t n, int64_t dim, int64_t lo,
                         int64_t hi, float scale, const uint8_t *kept, float *out) {
    for (int64_t i = lo; i < hi; i++)
        for (int64_t g = 0; g < group; g++) {
            float sum = 0.0f;
            if (dim % LANES == 0)
                sum = lanes_dot(q + g * dim, keys + i * dim, dim);
            else {
#pragma omp simd reduction(+ : sum)
                for (int64_t d = 0; d < dim; d++) sum += q[g * dim + d] * keys[i * dim + d];
            }
            out[g * n + i] = kept && !kept[i] ? -FLT_MAX : sum * scale;
        }
}

/* A full step's logits for the batch elements marked in `rows` (batch bytes), the others not written: per (batch, KV
   head), each of its `group` query heads' query (`query`: batch x heads x group x dim, contiguous) against each of the
   first n keys (float32, their (batch, head) blocks `strides` apart, rows of dim values one after another), times
   `scale`, the lowest float where `valid` (batch x n bytes, batch x heads x n with `valid_per_head`, or NULL) is 0,
   into `logits` (batch x heads x group x n):
   attention_math.logits_of and the mask of attention_probs, each product summed in LANES lanes where dim is a
   multiple of LANES, or with `wide` (the caller's word that AVX-512 may run) and dim a multiple of 16 on a CPU with
   AVX-512, by `wide_logits`. In pieces of positions shared out between `threads` threads. */
AVX2_CLONE void logits_rows(const float *query, const char *key_source, BlockStrides strides, int64_t batch,
                            int64_t heads, int64_t group, int64_t n, int64_t dim, float scale, const uint8_t *valid,
                            int valid_per_head, const uint8_t *rows, float *logits, int wide, int threads) {
    int64_t marked[batch * heads], blocks = marked_blocks(rows, batch, heads, marked);
    int64_t pieces = (n + PIECE - 1) / PIECE;
#if defined(WIDE)
    wide = wide && dim % 16 == 0 && __builtin_cpu_supports("avx512f");
#else
    wide = 0;
#endif
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t task = 0; task < blocks * pieces; task++) {
        int64_t block = marked[task / pieces], b = block / heads, h = block % heads;
        int64_t lo = task % pieces * PIECE, hi = lo + PIECE < n ? lo + PIECE : n;
        const float *keys = (const float *)(key_source + b * strides.key_batch + h * strides.key_head);
        const float *q = query + block * group * dim;
        const uint8_t *kept = valid ? valid + (valid_per_head ? block : b) * n : NULL;
        float *out = logits + block * group * n;
#if defined(WIDE)
        if (wide) {
            wide_logits(q, keys, group, n, dim, lo, hi, scale, kept, out);
            continue;
        }
#endif
        logits_piece(q, keys, group, n, dim, lo, hi, scale, kept, out);
    }
}

enum { WIDTH = 64 }; /* floats of a value row summed at once for two query heads: 16 AVX2 registers */

/* Adds weights0[i] x values[i * dim + d] to sums0[d] and weights1[i] x the same to sums1[d] for i in first .. last - 1,
   d < width, in that order: local arrays, so that the compiler keeps them in registers (through the loop of WIDTH,
   when width is that constant); each value row is loaded once for both heads. */
INLINE void add_weighted(float *sums0, float *sums1, const float *weights0, const float *weights1,
                         const float *values, int64_t dim, int64_t first, int64_t last, int64_t width) {
    for (int64_t i = first; i < last; i++)
        for (int64_t d = 0; d < width; d++) {
            sums0[d] += weights0[i] * values[i * dim + d];
            sums1[d] += weights1[i] * values[i * dim + d];
        }
}

enum { VALUE_SPAN = 512 }; /* positions whose weighted values one task sums (a fixed split, as GROUP_SPAN's below) */

#if defined(WIDE)
enum { HEADS_AT_ONCE = 4 }; /* query heads whose sums one AVX-512 pass keeps in registers, 64 floats each */

/* The sums of one span (`first` .. last - 1) in AVX-512, dim a multiple of 64: for HEADS_AT_ONCE query heads at a
   time (a last, smaller set repeats its last head's weights and stores only its own), each 64 floats of the value
   rows in 4 registers per head, rows in order; the rows AHEAD asked for from memory. */
WIDE static void wide_weighted(const float *weights, const float *values, int64_t group, int64_t n, int64_t dim,
                               int64_t first, int64_t last, float *sums) {
    for (int64_t g = 0; g < group; g += HEADS_AT_ONCE) {
        int64_t count = group - g < HEADS_AT_ONCE ? group - g : HEADS_AT_ONCE;
        const float *weight[HEADS_AT_ONCE];
        for (int k = 0; k < HEADS_AT_ONCE; k++) weight[k] = weights + (g + (k < count ? k : count - 1)) * n;
        for (int64_t lo = 0; lo < dim; lo += 64) {
            __m512 sum[HEADS_AT_ONCE][4];
            for (int k = 0; k < HEADS_AT_ONCE; k++)
                for (int c = 0; c < 4; c++) sum[k][c] = _mm512_setzero_ps();
            for (int64_t i = first; i < last; i++) {
                const float *row = values + i * dim + lo;
                for (int c = 0; i + AHEAD < last && c < 4; c++) __builtin_prefetch(row + AHEAD * dim + 16 * c);
                for (int c = 0; c < 4; c++) {
                    __m512 chunk = _mm512_loadu_ps(row + 16 * c);
                    for (int k = 0; k < HEADS_AT_ONCE; k++)
                        sum[k][c] = _mm512_fmadd_ps(_mm512_set1_ps(weight[k][i]), chunk, sum[k][c]);
                }
            }
            for (int k = 0; k < count; k++)
                for (int c = 0; c < 4; c++) _mm512_storeu_ps(sums + (g + k) * dim + lo + 16 * c, sum[k][c]);
        }
    }
}
#endif

/* `wide` where the caller's word allows AVX-512 and the value loops can take it (dim a multiple of 64). */
static int wide_values(int wide, int64_t dim) {
#if defined(WIDE)
    return wide && dim % 64 == 0 && __builtin_cpu_supports("avx512f");
#else
    (void)dim;
    return 0 * wide;
#endif
}

/* `target` (size floats): the sum of `parts` consecutive partial sums of that size, added in order. */
INLINE void add_in_order(float *target, const float *partials, int64_t parts, int64_t size) {
    memcpy(target, partials, (size_t)size * sizeof(float));
    for (int64_t part = 1; part < parts; part++)
        for (int64_t e = 0; e < size; e++) target[e] += partials[part * size + e];
}

/* The sums over positions first .. last - 1 of each query head's weights (`weights`: group x n) times the value rows
   (`values`, rows of dim floats) into `sums` (group x dim): with `wide` (dim a multiple of 64, AVX-512 checked) by
   `wide_weighted`, else two query heads at a time in registers. */
INLINE void weigh_span(const float *weights, const float *values, int64_t group, int64_t n, int64_t dim, int64_t first,
                       int64_t last, float *sums, int wide) {
#if defined(WIDE)
    if (wide) {
        wide_weighted(weights, values, group, n, dim, first, last, sums);
        return;
    }
#else
    (void)wide;
#endif
    for (int64_t g = 0; g < group; g += 2) {
        int64_t other = g + 1 < group ? g + 1 : g; /* an odd group's last head is summed twice, kept once */
        for (int64_t lo = 0; lo < dim; lo += WIDTH) {
            int64_t width = lo + WIDTH < dim ? WIDTH : dim - lo;
            float sums0[WIDTH] = {0.0f}, sums1[WIDTH] = {0.0f};
            if (width == WIDTH)
                add_weighted(sums0, sums1, weights + g * n, weights + other * n, values + lo, dim, first, last, WIDTH);
            else
                add_weighted(sums0, sums1, weights + g * n, weights + other * n, values + lo, dim, first, last, width);
            memcpy(sums + g * dim + lo, sums0, width * sizeof(float));
            memcpy(sums + other * dim + lo, sums1, width * sizeof(float));
        }
    }
}

/* A full step's output for the batch elements marked in `rows`, the others not written: per (batch, KV head), each
   query head's probabilities (`probs`: batch x heads x group x n) times the first n values (float32, as the keys of
   logits_rows), into `out` (batch x heads x group x dim): attention_math.weighted_values. Each task sums a span of
   VALUE_SPAN positions of one block, in order, into its own partial sums, whole value rows at a time (a row read in
   pieces by several tasks was read at half the bandwidth), with `wide` and dim a multiple of 64 on a CPU with
   AVX-512 by `wide_weighted`; the spans are then added in order: the split does not depend on `threads`. 0, or 1
   without scratch space. */
AVX2_CLONE int weigh_values_rows(const float *probs, const char *value_source, BlockStrides strides, int64_t batch,
                                 int64_t heads, int64_t group, int64_t n, int64_t dim, const uint8_t *rows,
                                 float *out, int wide, int threads) {
    int64_t marked[batch * heads], blocks = marked_blocks(rows, batch, heads, marked);
    int64_t spans = (n + VALUE_SPAN - 1) / VALUE_SPAN;
    float *partials = malloc((size_t)(blocks * spans * group * dim + 1) * sizeof(float));
    if (!partials) return 1;
    wide = wide_values(wide, dim);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t task = 0; task < blocks * spans; task++) {
        int64_t block = marked[task / spans], b = block / heads, h = block % heads;
        int64_t first = task % spans * VALUE_SPAN, last = first + VALUE_SPAN < n ? first + VALUE_SPAN : n;
        const float *values = (const float *)(value_source + b * strides.value_batch + h * strides.value_head);
        const float *weights = probs + block * group * n;
        float *sums = partials + task * group * dim;
        weigh_span(weights, values, group, n, dim, first, last, sums, wide);
    }
    for (int64_t k = 0; k < blocks; k++)
        add_in_order(out + marked[k] * group * dim, partials + k * spans * group * dim, spans, group * dim);
    free(partials);
    return 0;
}

/* One request's full step over a paged cache where it lies (vLLM's CPU layout, serving/paged_store.py): its n tokens
   in the blocks `block_ids` (block_size tokens each, in position order), each (block, KV head) `strides` apart (the
   `batch` strides are those between blocks), its keys channel-major (dim rows of block_size floats), its values
   token-major (block_size rows of dim floats). `paged_logits`: each query head's products with the n keys, times
   `scale`, into `logits` (heads x group x n), per (head, block), each product summed over dim in order, block_size
   positions side by side. `paged_weigh_values`: the probabilities (as `logits`) times the values into `out` (heads x
   group x dim), a partial sum per block (`weigh_span`), the blocks then added in order: the split does not depend on
   `threads`. 0, or 1 without scratch space. */
enum { KEYS_AT_ONCE = 32 }; /* a block's keys whose products one pass sums in registers (4 AVX2 vectors) */

/* Adds q[d] x channels[d * stride + t] to sums[t] for d < dim in order, t < width: a local array the compiler keeps in
   registers (through the loop of KEYS_AT_ONCE, when width is that constant). */
INLINE void add_channels(float *sums, const float *q, const float *channels, int64_t stride, int64_t dim,
                         int64_t width) {
    for (int64_t d = 0; d < dim; d++)
        for (int64_t t = 0; t < width; t++) sums[t] += q[d] * channels[d * stride + t];
}

#if defined(WIDE)
enum { KEY_VECTORS = 8, WIDE_KEYS = 16 * KEY_VECTORS, WIDE_HEADS = 3 }; /* keys (8 registers) and query heads whose
   products one pass keeps: 24 of the 32 registers, so that a block of 128 keys is read in one sweep */

/* `wide_paged_logits` of WIDE_KEYS keys against WIDE_HEADS query heads, no mask: every bound a constant, so that the
   sums stay in registers (in the general loop the compiler kept them in memory, a store per product). */
WIDE static inline __attribute__((always_inline)) void wide_block_logits(const float *q, const float *keys,
                                                                         int64_t block_size, int64_t n, int64_t dim,
                                                                         float scale, float *out) {
    __m512 sum[WIDE_HEADS][KEY_VECTORS];
#pragma GCC unroll 8
    for (int k = 0; k < WIDE_HEADS; k++)
#pragma GCC unroll 8
        for (int c = 0; c < KEY_VECTORS; c++) sum[k][c] = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; d++) {
        const float *row = keys + d * block_size;
#pragma GCC unroll 8
        for (int c = 0; c < KEY_VECTORS; c++) {
            __m512 channel = _mm512_loadu_ps(row + 16 * c);
#pragma GCC unroll 8
            for (int k = 0; k < WIDE_HEADS; k++)
                sum[k][c] = _mm512_fmadd_ps(_mm512_set1_ps(q[k * dim + d]), channel, sum[k][c]);
        }
    }
#pragma GCC unroll 8
    for (int k = 0; k < WIDE_HEADS; k++)
#pragma GCC unroll 8
        for (int c = 0; c < KEY_VECTORS; c++)
            _mm512_storeu_ps(out + k * n + 16 * c, _mm512_mul_ps(sum[k][c], _mm512_set1_ps(scale)));
}

/* `paged_logits` of one (head, block) in AVX-512: WIDE_KEYS keys at a time against WIDE_HEADS query heads, each key
   channel row loaded once for them all (a last, partial set of keys masked); each product summed over dim in order
   with fused multiply-adds. */
WIDE static void wide_paged_logits(const float *q, const float *keys, int64_t block_size, int64_t count, int64_t group,
                                   int64_t n, int64_t dim, float scale, float *out) {
    for (int64_t first = 0; first < count; first += WIDE_KEYS) {
        __mmask16 mask[KEY_VECTORS];
        int live = 0; /* the registers that hold keys: a short run (quest's page) loads and sums only those */
        for (int c = 0; c < KEY_VECTORS; c++) {
            int64_t left = count - first - 16 * c;
            mask[c] = left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
            live += left > 0;
        }
        for (int64_t g = 0; g < group; g += WIDE_HEADS) {
            int64_t heads_here = group - g < WIDE_HEADS ? group - g : WIDE_HEADS;
            if (heads_here == WIDE_HEADS && mask[KEY_VECTORS - 1] == 0xFFFF) { /* a whole block: the common case */
                wide_block_logits(q + g * dim, keys + first, block_size, n, dim, scale, out + g * n + first);
                continue;
            }
            __m512 sum[WIDE_HEADS][KEY_VECTORS];
            for (int k = 0; k < WIDE_HEADS; k++)
                for (int c = 0; c < KEY_VECTORS; c++) sum[k][c] = _mm512_setzero_ps();
            for (int64_t d = 0; d < dim; d++) {
                __m512 weight[WIDE_HEADS];
                for (int k = 0; k < heads_here; k++) weight[k] = _mm512_set1_ps(q[(g + k) * dim + d]);
                for (int c = 0; c < live; c++) {
                    __m512 row = _mm512_maskz_loadu_ps(mask[c], keys + d * block_size + first + 16 * c);
                    for (int k = 0; k < heads_here; k++) sum[k][c] = _mm512_fmadd_ps(weight[k], row, sum[k][c]);
                }
            }
            for (int k = 0; k < heads_here; k++)
                for (int c = 0; c < live; c++)
                    _mm512_mask_storeu_ps(out + (g + k) * n + first + 16 * c, mask[c],
                                          _mm512_mul_ps(sum[k][c], _mm512_set1_ps(scale)));
        }
    }
}
#endif

/* `wide` where the caller's word allows AVX-512 and the CPU has it: the key loops over channel-major blocks. */
static int wide_paged(int wide) {
#if defined(WIDE)
    return wide && __builtin_cpu_supports("avx512f");
#else
    return 0 * wide;
#endif
}

/* The logits of `count` consecutive keys of one (block, head), `keys` at the first one's place in its channel rows
   (block_size apart), against `group` query heads (`q`: group x dim), times `scale`, into `out` (rows n apart): with
   `wide` by `wide_paged_logits`, else KEYS_AT_ONCE keys at a time in registers. */
INLINE void paged_run_logits(const float *q, const float *keys, int64_t block_size, int64_t count, int64_t group,
                             int64_t n, int64_t dim, float scale, float *out, int wide) {
#if defined(WIDE)
    if (wide) {
        wide_paged_logits(q, keys, block_size, count, group, n, dim, scale, out);
        return;
    }
#else
    (void)wide;
#endif
    for (int64_t g = 0; g < group; g++)
        for (int64_t first = 0; first < count; first += KEYS_AT_ONCE) {
            int64_t width = count - first < KEYS_AT_ONCE ? count - first : KEYS_AT_ONCE;
            float sums[KEYS_AT_ONCE] = {0.0f};
            if (width == KEYS_AT_ONCE)
                add_channels(sums, q + g * dim, keys + first, block_size, dim, KEYS_AT_ONCE);
            else
                add_channels(sums, q + g * dim, keys + first, block_size, dim, width);
            for (int64_t t = 0; t < width; t++) out[g * n + first + t] = sums[t] * scale;
        }
}

AVX2_CLONE void paged_logits(const float *query, const char *key_source, BlockStrides strides, const int64_t *block_ids,
                             int64_t block_size, int64_t n, int64_t heads, int64_t group, int64_t dim, float scale,
                             float *logits, int wide, int threads) {
    int64_t blocks = (n + block_size - 1) / block_size;
    wide = wide_paged(wide);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t task = 0; task < heads * blocks; task++) {
        int64_t h = task / blocks, j = task % blocks, lo = j * block_size;
        int64_t count = lo + block_size < n ? block_size : n - lo;
        const float *keys = (const float *)(key_source + block_ids[j] * strides.key_batch + h * strides.key_head);
        paged_run_logits(query + h * group * dim, keys, block_size, count, group, n, dim, scale,
                         logits + h * group * n + lo, wide);
    }
}

AVX2_CLONE int paged_weigh_values(const float *probs, const char *value_source, BlockStrides strides,
                                  const int64_t *block_ids, int64_t block_size, int64_t n, int64_t heads,
                                  int64_t group, int64_t dim, float *out, int wide, int threads) {
    int64_t blocks = (n + block_size - 1) / block_size;
    float *partials = malloc((size_t)(heads * blocks * group * dim + 1) * sizeof(float));
    if (!partials) return 1;
    wide = wide_values(wide, dim);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t task = 0; task < heads * blocks; task++) {
        int64_t h = task / blocks, j = task % blocks, lo = j * block_size;
        int64_t count = lo + block_size < n ? block_size : n - lo;
        const float *values = (const float *)(value_source + block_ids[j] * strides.value_batch + h * strides.value_head);
        weigh_span(probs + h * group * n + lo, values, group, n, dim, 0, count, partials + task * group * dim, wide);
    }
    for (int64_t h = 0; h < heads; h++)
        add_in_order(out + h * group * dim, partials + h * blocks * group * dim, blocks, group * dim);
    free(partials);
    return 0;
}

/* Where the token at `position` of a request (its blocks `block_ids`, block_size tokens each) lies for KV head h in
   `source` (its keys: `row` 1, the first of its channel floats, block_size apart; its values: `row` dim, its row). */
INLINE const float *token_at(const char *source, int64_t batch_stride, int64_t head_stride, const int64_t *block_ids,
                             int64_t block_size, int64_t h, int64_t position, int64_t row) {
    const char *block = source + block_ids[position / block_size] * batch_stride + h * head_stride;
    return (const float *)block + position % block_size * row;
}

/* The keys and values of each KV head's `k` positions (`index`: heads x k) of one request's paged cache (as
   paged_logits's) into the first k of `slots` rows per head of `key_out` / `value_out` (heads x slots x dim). With
   `held` (heads x held_slots, or NULL): the positions of the tokens those rows hold now (-1: none); a row that holds
   the position asked for is left as it is. A refresh leaves each token it keeps in its slot (keep_held_slots), and a
   block's keys lie channel-major, a float per line for one token: only the new tokens are read from the blocks. */
enum { TOKENS_AHEAD = 4 }; /* tokens read from the blocks whose lines are asked for before they are copied */

INLINE int row_holds(const int64_t *held, int64_t held_slots, int64_t slot, int64_t position) {
    return held && slot < held_slots && held[slot] == position;
}

void paged_gather(const char *key_source, const char *value_source, BlockStrides strides, const int64_t *block_ids,
                  int64_t block_size, const int64_t *index, int64_t heads, int64_t k, int64_t dim, int64_t slots,
                  const int64_t *held, int64_t held_slots, float *key_out, float *value_out) {
    for (int64_t h = 0; h < heads; h++) {
        const int64_t *positions = index + h * k, *held_here = held ? held + h * held_slots : NULL;
        float *keys_here = key_out + h * slots * dim, *values_here = value_out + h * slots * dim;
        for (int64_t slot = 0, cursor = 0, ahead = 0; slot < k; slot++) {
            if (row_holds(held_here, held_slots, slot, positions[slot])) continue;
            /* the lines of the tokens read next, asked for ahead: a token's keys lie a line per channel */
            for (; ahead < TOKENS_AHEAD && cursor < k; cursor++) {
                if (cursor < slot || row_holds(held_here, held_slots, cursor, positions[cursor])) continue;
                const float *keys = token_at(key_source, strides.key_batch, strides.key_head, block_ids, block_size,
                                             h, positions[cursor], 1);
                const float *values = token_at(value_source, strides.value_batch, strides.value_head, block_ids,
                                               block_size, h, positions[cursor], dim);
                for (int64_t d = 0; d < dim; d++) __builtin_prefetch(keys + d * block_size);
                for (int64_t d = 0; d < dim; d += 16) __builtin_prefetch(values + d);
                ahead++;
            }
            ahead--;
            const float *keys = token_at(key_source, strides.key_batch, strides.key_head, block_ids, block_size, h,
                                         positions[slot], 1);
            const float *values = token_at(value_source, strides.value_batch, strides.value_head, block_ids,
                                           block_size, h, positions[slot], dim);
            float *key_row = keys_here + slot * dim;
            for (int64_t d = 0; d < dim; d++) key_row[d] = keys[d * block_size];
            memcpy(values_here + slot * dim, values, (size_t)dim * sizeof(float));
        }
    }
}

/* A C_f held in `bits` bits (core/quantized_store.py) as this file sees it: per (batch, KV head) block, `stored`
   groups of `quant` tokens, of which the first `groups` are filled. Keys: codes (stored x quant * bits / 8 x dim
   bytes; byte row j of a group holds, in its r-th `bits` bits, token r * rows + j, rows = quant * bits / 8), a scale
   and a minimum per channel and group (stored x dim floats). Values: the same codes; a scale and a minimum per token
   and `quant` channels (stored * quant x dim / quant floats). A code c reads back as c x scale + minimum. */
typedef struct {
    const uint8_t *codes;
    const float *scales, *minimums;
} QuantizedPart;

typedef struct {
    QuantizedPart keys, values;
    int64_t stored, groups, quant, bits;
} QuantizedCache;

/* The codes of byte row `row` (dim bytes) as floats: codes[r * dim + d], the r-th `bits` bits of byte d. */
INLINE void decode_row(const uint8_t *row, int64_t dim, int64_t per_byte, int64_t bits, float *codes) {
    int mask = (1 << bits) - 1;
    for (int64_t r = 0; r < per_byte; r++) {
        int shift = (int)(r * bits);
        for (int64_t d = 0; d < dim; d++) codes[r * dim + d] = (float)((row[d] >> shift) & mask);
    }
}

enum { GROUP_PIECE = 16 }; /* groups of positions of a block that one thread takes at a time (logits) */

/* A full step's logits over the quantized groups of C_f, for the batch elements marked in `rows` (batch bytes), as
   logits_rows computes them over the dequantized keys, in another order of sums: per group, q . (c x s + m) as
   (q x s) . c + q . m. `query`: batch x heads x members x dim, dim a multiple of LANES; `logits`: batch x heads x
   members x n, n >= groups * quant (its positions past them not written). The dot products of a byte row's tokens
   with each query head are summed in LANES lanes (`lanes_dot`), not one after another. */
AVX2_CLONE void quantized_logits_rows(const float *query, QuantizedCache cache, int64_t batch, int64_t heads,
                                      int64_t members, int64_t n, int64_t dim, float scale, const uint8_t *valid,
                                      const uint8_t *rows, float *logits, int threads) {
    int64_t marked[batch * heads], blocks = marked_blocks(rows, batch, heads, marked);
    int64_t pieces = (cache.groups + GROUP_PIECE - 1) / GROUP_PIECE, per_byte = 8 / cache.bits;
    int64_t byte_rows = cache.quant / per_byte;
    int64_t code_block = cache.stored * byte_rows * dim, scale_block = cache.stored * dim;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t task = 0; task < blocks * pieces; task++) {
        int64_t block = marked[task / pieces], b = block / heads;
        int64_t first = task % pieces * GROUP_PIECE;
        int64_t last = first + GROUP_PIECE < cache.groups ? first + GROUP_PIECE : cache.groups;
        const float *q = query + block * members * dim;
        float *out = logits + block * members * n;
        float scaled[members * dim], offset[members], codes[per_byte * dim];
        for (int64_t g = first; g < last; g++) {
            const float *s = cache.keys.scales + block * scale_block + g * dim;
            const float *m = cache.keys.minimums + block * scale_block + g * dim;
            for (int64_t h = 0; h < members; h++) {
                float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                for (int64_t d = 0; d < dim; d++) {
                    scaled[h * dim + d] = q[h * dim + d] * s[d];
                    sum += q[h * dim + d] * m[d];
                }
                offset[h] = sum;
            }
            const uint8_t *group_codes = cache.keys.codes + block * code_block + g * byte_rows * dim;
            for (int64_t j = 0; j < byte_rows; j++) {
                decode_row(group_codes + j * dim, dim, per_byte, cache.bits, codes);
                for (int64_t r = 0; r < per_byte; r++) {
                    int64_t i = g * cache.quant + r * byte_rows + j;
                    for (int64_t h = 0; h < members; h++) {
                        float sum = lanes_dot(scaled + h * dim, codes + r * dim, dim);
                        out[h * n + i] = valid && !valid[b * n + i] ? -FLT_MAX : (sum + offset[h]) * scale;
                    }
                }
            }
        }
    }
}

enum { GROUP_SPAN = 64 }; /* groups of positions whose weighted values one task sums (a fixed split: see below) */

/* A full step's output over the quantized groups of C_f, for the batch elements marked in `rows`: per (batch, KV head)
   and query head, the probabilities (`probs`: batch x heads x members x n) of the first groups x quant positions
   times their values, c x s + m summed as (p x s) . c + p . m, into `out` (batch x heads x members x dim, written
   whole for the marked blocks). Each task sums a span of GROUP_SPAN groups of one block into its own partial sums,
   which are then added in span order: the split does not depend on `threads`. 0, or 1 without scratch space. */
AVX2_CLONE int quantized_weigh_rows(const float *probs, QuantizedCache cache, int64_t batch, int64_t heads,
                                    int64_t members, int64_t n, int64_t dim, const uint8_t *rows, float *out,
                                    int threads) {
    int64_t marked[batch * heads], blocks = marked_blocks(rows, batch, heads, marked);
    int64_t spans = (cache.groups + GROUP_SPAN - 1) / GROUP_SPAN, per_byte = 8 / cache.bits;
    int64_t byte_rows = cache.quant / per_byte, channel_groups = dim / cache.quant;
    int64_t code_block = cache.stored * byte_rows * dim, scale_block = cache.stored * cache.quant * channel_groups;
    int64_t partial_size = members * (dim + channel_groups);
    float *partials = malloc((size_t)(blocks * spans * partial_size + 1) * sizeof(float));
    if (!partials) return 1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t task = 0; task < blocks * spans; task++) {
        int64_t block = marked[task / spans];
        int64_t first = task % spans * GROUP_SPAN;
        int64_t last = first + GROUP_SPAN < cache.groups ? first + GROUP_SPAN : cache.groups;
        float *sums = partials + task * partial_size, *offsets = sums + members * dim, codes[per_byte * dim];
        memset(sums, 0, (size_t)partial_size * sizeof(float));
        const float *weights = probs + block * members * n;
        for (int64_t g = first; g < last; g++) {
            const uint8_t *group_codes = cache.values.codes + block * code_block + g * byte_rows * dim;
            for (int64_t j = 0; j < byte_rows; j++) {
                decode_row(group_codes + j * dim, dim, per_byte, cache.bits, codes);
                for (int64_t r = 0; r < per_byte; r++) {
                    int64_t i = g * cache.quant + r * byte_rows + j;
                    const float *s = cache.values.scales + block * scale_block + i * channel_groups;
                    const float *m = cache.values.minimums + block * scale_block + i * channel_groups;
                    for (int64_t h = 0; h < members; h++) {
                        float p = weights[h * n + i];
                        for (int64_t c = 0; c < channel_groups; c++) {
                            float w = p * s[c], *row = sums + h * dim + c * cache.quant;
                            const float *code = codes + r * dim + c * cache.quant;
#pragma omp simd
                            for (int64_t d = 0; d < cache.quant; d++) row[d] += w * code[d];
                            offsets[h * channel_groups + c] += p * m[c];
                        }
                    }
                }
            }
        }
    }
    for (int64_t k = 0; k < blocks; k++) {
        float *target = out + marked[k] * members * dim;
        memset(target, 0, (size_t)(members * dim) * sizeof(float));
        for (int64_t span = 0; span < spans; span++) {
            const float *sums = partials + (k * spans + span) * partial_size, *offsets = sums + members * dim;
            for (int64_t h = 0; h < members; h++)
                for (int64_t d = 0; d < dim; d++)
                    target[h * dim + d] += sums[h * dim + d] + offsets[h * channel_groups + d / cache.quant];
        }
    }
    free(partials);
    return 0;
}

/* The keys and values of the tokens at `index` (batch x heads x k positions, each below groups x quant + the
   `pending` tokens of the residual) into the first k of `slots` rows of `key_out` and `value_out` (batch x heads x
   slots x dim), for the batch elements marked in `rows` (batch bytes, or NULL: all), read back as
   quantized_store.view reads them: c x scale, then + minimum (two roundings, as there), or copied from the residual
   (`residual_keys`, `residual_values`: batch x heads x quant x dim). In pieces of tokens shared out between threads. */
AVX2_CLONE void dequantize_rows(QuantizedCache cache, const float *residual_keys, const float *residual_values,
                                const int64_t *index, int64_t batch, int64_t heads, int64_t k, int64_t dim,
                                int64_t slots, const uint8_t *rows, float *key_out, float *value_out,
                                int threads) {
    int64_t per_byte = 8 / cache.bits, byte_rows = cache.quant / per_byte, mask = (1 << cache.bits) - 1;
    int64_t channel_groups = dim / cache.quant, quantized = cache.groups * cache.quant;
    int64_t code_block = cache.stored * byte_rows * dim, key_scale_block = cache.stored * dim;
    int64_t value_scale_block = cache.stored * cache.quant * channel_groups, residual_block = cache.quant * dim;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t row = 0; row < batch * heads * k; row++) {
        int64_t block = row / k, i = index[row], slot = block * slots + row % k;
        if (rows && !rows[block / heads]) continue;
        float *key = key_out + slot * dim, *value = value_out + slot * dim;
        if (i >= quantized) {
            memcpy(key, residual_keys + block * residual_block + (i - quantized) * dim, (size_t)dim * sizeof(float));
            memcpy(value, residual_values + block * residual_block + (i - quantized) * dim,
                   (size_t)dim * sizeof(float));
            continue;
        }
        int64_t g = i / cache.quant, token = i % cache.quant;
        int shift = (int)(token / byte_rows * cache.bits);
        int64_t line = block * code_block + (g * byte_rows + token % byte_rows) * dim;
        const uint8_t *key_codes = cache.keys.codes + line, *value_codes = cache.values.codes + line;
        const float *s = cache.keys.scales + block * key_scale_block + g * dim;
        const float *m = cache.keys.minimums + block * key_scale_block + g * dim;
        for (int64_t d = 0; d < dim; d++) {
            float scaled = (float)((key_codes[d] >> shift) & mask) * s[d];
            key[d] = scaled + m[d];
        }
        const float *vs = cache.values.scales + block * value_scale_block + i * channel_groups;
        const float *vm = cache.values.minimums + block * value_scale_block + i * channel_groups;
        for (int64_t c = 0; c < channel_groups; c++)
            for (int64_t d = c * cache.quant; d < (c + 1) * cache.quant; d++) {
                float scaled = (float)((value_codes[d] >> shift) & mask) * vs[c];
                value[d] = scaled + vm[c];
            }
    }
}

/* Partial steps of n requests in one call (a serving engine's batch, serving/held_steps.py): request r's query token
   (`query`: n x heads x group x dim, contiguous) against the first lengths[r] tokens of its own store, whose keys and
   values lie at key_sources[r] and value_sources[r] (heads blocks of head_strides[r] floats, token rows of dim).
   `logits_stores`: the products times `scale` into `logits` (n x heads x group x width, width >= every length; the
   positions past a request's length -inf: they weigh 0 in the softmax), as logits_rows computes them.
   `weigh_stores`: the probabilities (as `logits`) times the values into `out` (n x heads x group x dim), each
   (request, head) as one span of `weigh_span`. One task per (request, head), shared between `threads` threads. */
AVX2_CLONE void logits_stores(const float *query, const int64_t *key_sources, const int64_t *head_strides,
                              const int64_t *lengths, int64_t n, int64_t heads, int64_t group, int64_t dim,
                              int64_t width, float scale, float *logits, int wide, int threads) {
#if defined(WIDE)
    wide = wide && dim % 16 == 0 && __builtin_cpu_supports("avx512f");
#else
    wide = 0;
#endif
#pragma omp parallel for schedule(dynamic) num_threads(threads) if (threads > 1 && n * heads > 1)
    for (int64_t task = 0; task < n * heads; task++) {
        int64_t r = task / heads, h = task % heads;
        const float *keys = (const float *)key_sources[r] + h * head_strides[r];
        const float *q = query + task * group * dim;
        float *out = logits + task * group * width;
        for (int64_t g = 0; g < group; g++)
            for (int64_t i = lengths[r]; i < width; i++) out[g * width + i] = -INFINITY;
#if defined(WIDE)
        if (wide) {
            wide_logits(q, keys, group, width, dim, 0, lengths[r], scale, NULL, out);
            continue;
        }
#endif
        logits_piece(q, keys, group, width, dim, 0, lengths[r], scale, NULL, out);
    }
}

AVX2_CLONE void weigh_stores(const float *probs, const int64_t *value_sources, const int64_t *head_strides,
                             const int64_t *lengths, int64_t n, int64_t heads, int64_t group, int64_t dim,
                             int64_t width, float *out, int wide, int threads) {
    wide = wide_values(wide, dim);
#pragma omp parallel for schedule(dynamic) num_threads(threads) if (threads > 1 && n * heads > 1)
    for (int64_t task = 0; task < n * heads; task++) {
        int64_t r = task / heads, h = task % heads;
        const float *values = (const float *)value_sources[r] + h * head_strides[r];
        weigh_span(probs + task * group * width, values, group, width, dim, 0, lengths[r], out + task * group * dim,
                   wide);
    }
}

/* The attention of n requests' query tokens, each over its own positions of one layer's paged cache where they lie
   (as paged_logits's), quest's pages (PagedAt: request r's query, heads x group x dim; its block table of `blocks`
   blocks; its k positions per head, `index` heads x k, ascending per head, those at or past its `tokens` not tokens
   (the page being written runs past them): never read, not attended; `valid`, heads x k bytes, 0 where a position
   is not attended, or 0: all are; `out`, heads x group x dim). Each run of consecutive positions in one block is
   read as paged_logits reads a block, its keys' channel rows at once. `paged_logits_at`: the products times `scale`
   into `logits` (n x heads x group x width, width >= every k; -inf where not attended and past k), or 1 with nothing
   read where a token lies outside its request's blocks. `paged_weigh_at`: the probabilities (as `logits`) times the
   values into each `out`, each run's sums (`weigh_span`) added in order. One task per (request, head). */
typedef struct {
    int64_t query, table, blocks, index, valid, k, tokens, out; /* addresses, and counts */
} PagedAt;

/* The positions from the i-th on that lie one after another in one block, all before `tokens`; 0 where the i-th is
   not a token. */
static int64_t run_length(const int64_t *positions, int64_t i, int64_t k, int64_t block_size, int64_t tokens) {
    if (positions[i] >= tokens) return 0;
    int64_t count = 1, block = positions[i] / block_size;
    while (i + count < k && positions[i + count] == positions[i] + count && positions[i + count] / block_size == block &&
           positions[i + count] < tokens)
        count++;
    return count;
}

enum { RUNS_AHEAD = 4 }; /* runs whose lines are asked for before they are summed */

/* Asks for the cache lines of the runs of `positions` (as run_length's) from `*cursor` on in head h's part of
   `source` (its keys: `row` 1, `lines` dim rows block_size floats apart; or its values: `row` dim floats a token,
   one line of rows) until `*ahead` runs are asked for, moving `*cursor`: a quest page's rows lie too far apart, and
   its pages too, for the hardware's own prefetch to guess them. */
INLINE void prefetch_runs(const char *source, int64_t batch_stride, int64_t head_stride, const int64_t *block_ids,
                          int64_t block_size, const int64_t *positions, int64_t k, int64_t tokens, int64_t h,
                          int64_t row, int64_t dim, int64_t *cursor, int64_t *ahead) {
    for (; *ahead < RUNS_AHEAD && *cursor < k; (*ahead)++) {
        int64_t count = run_length(positions, *cursor, k, block_size, tokens);
        if (count == 0) { /* not a token: nothing to read */
            *cursor += 1;
            continue;
        }
        const float *first =
            token_at(source, batch_stride, head_stride, block_ids, block_size, h, positions[*cursor], row);
        int64_t lines = row == 1 ? dim : 1, stride = row == 1 ? block_size : 0, width = row == 1 ? count : count * dim;
        for (int64_t r = 0; r < lines; r++)
            for (int64_t f = 0; f < width; f += 16) __builtin_prefetch(first + r * stride + f);
        *cursor += count;
    }
}

AVX2_CLONE int paged_logits_at(const PagedAt *requests, int64_t n, const char *key_source, BlockStrides strides,
                               int64_t block_size, int64_t heads, int64_t group, int64_t dim, int64_t width,
                               float scale, float *logits, int wide, int threads) {
    for (int64_t r = 0; r < n; r++) {
        const int64_t *index = (const int64_t *)requests[r].index, end = requests[r].blocks * block_size;
        for (int64_t i = 0; i < heads * requests[r].k; i++)
            if (index[i] < 0 || index[i] < requests[r].tokens && index[i] >= end) return 1;
    }
    wide = wide_paged(wide);
#pragma omp parallel for schedule(dynamic) num_threads(threads) if (threads > 1 && n * heads > 1)
    for (int64_t task = 0; task < n * heads; task++) {
        const PagedAt *at = requests + task / heads;
        int64_t h = task % heads, k = at->k;
        const int64_t *positions = (const int64_t *)at->index + h * k, *table = (const int64_t *)at->table;
        const float *q = (const float *)at->query + h * group * dim;
        float *out = logits + task * group * width;
        int64_t cursor = 0, ahead = 0;
        for (int64_t i = 0, count; i < k; i += count, ahead--) {
            prefetch_runs(key_source, strides.key_batch, strides.key_head, table, block_size, positions, k, at->tokens,
                          h, 1, dim, &cursor, &ahead);
            count = run_length(positions, i, k, block_size, at->tokens);
            if (count == 0) { /* not a token */
                for (int64_t g = 0; g < group; g++) out[g * width + i] = -INFINITY;
                count = 1;
                continue;
            }
            const float *keys =
                token_at(key_source, strides.key_batch, strides.key_head, table, block_size, h, positions[i], 1);
            paged_run_logits(q, keys, block_size, count, group, width, dim, scale, out + i, wide);
        }
        const uint8_t *valid = at->valid ? (const uint8_t *)at->valid + h * k : NULL;
        for (int64_t g = 0; g < group; g++) {
            for (int64_t i = 0; valid && i < k; i++)
                if (!valid[i]) out[g * width + i] = -INFINITY;
            for (int64_t i = k; i < width; i++) out[g * width + i] = -INFINITY;
        }
    }
    return 0;
}

AVX2_CLONE void paged_weigh_at(const PagedAt *requests, int64_t n, const float *probs, const char *value_source,
                               BlockStrides strides, int64_t block_size, int64_t heads, int64_t group, int64_t dim,
                               int64_t width, int wide, int threads) {
    wide = wide_values(wide, dim);
#pragma omp parallel for schedule(dynamic) num_threads(threads) if (threads > 1 && n * heads > 1)
    for (int64_t task = 0; task < n * heads; task++) {
        const PagedAt *at = requests + task / heads;
        int64_t h = task % heads, k = at->k;
        const int64_t *positions = (const int64_t *)at->index + h * k, *table = (const int64_t *)at->table;
        float *sums = (float *)at->out + h * group * dim, run[group * dim]; /* one run's sums */
        memset(sums, 0, (size_t)(group * dim) * sizeof(float));
        int64_t cursor = 0, ahead = 0;
        for (int64_t i = 0, count; i < k; i += count, ahead--) {
            prefetch_runs(value_source, strides.value_batch, strides.value_head, table, block_size, positions, k,
                          at->tokens, h, dim, dim, &cursor, &ahead);
            count = run_length(positions, i, k, block_size, at->tokens);
            if (count == 0) { /* not a token: weighs 0 */
                count = 1;
                continue;
            }
            const float *values =
                token_at(value_source, strides.value_batch, strides.value_head, table, block_size, h, positions[i], dim);
            weigh_span(probs + task * group * width + i, values, group, width, dim, 0, count, run, wide);
            for (int64_t e = 0; e < group * dim; e++) sums[e] += run[e];
        }
    }
}
