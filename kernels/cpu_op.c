/* SpeculativeVerify as an onnxruntime custom op (domain ai.dspark), CPU, float32.

   With this op registered the whole model runs as one onnxruntime session: no Python between
   layers. Per node (one attention layer), for every sequence s of the flattened batch:

       append: k/v rows qoffs[s] .. qoffs[s]+news[s]-1 -> pool slots of positions
               starts[s] .. starts[s]+news[s]-1 (block tables[s][p / block_size])
       attend: query j of s (position p = starts[s]+j) over keys 0 .. p of its KV head, or
               p-window+1 .. p in a sliding-window layer, softmax(scale * q . K) @ V -> out,
               in the layout of q

   inputs   0 q [1,T,H*d] ("tokens") or [1,H,T,d] ("heads")   1 k, 2 v (same, kv heads)
            3 k_pool, 4 v_pool [blocks, kv, block_size, row]: the arena's own memory, written
              in place (bound by the runtime; onnxruntime never allocates or reuses them);
              a row is one token's d values of one KV head as kv_dtype stores them
              (cpu_kv.c), bound as float32 of row bytes / 4
            5 tables [S, max_blocks], 6 starts [S], 7 qoffs [S], 8 news [S]  (int64)
   output   0 out [1,T,H*d] ("tokens") or [1,H,T,d] ("heads")
   attrs    num_heads, num_kv_heads, head_dim (int), scale (float), softcap (float, default
            0: none; > 0: each score softcap * tanh(score / softcap)), layout ("tokens"|"heads",
            default "heads"), window (int, default 0: every earlier position), kv_dtype
            ("float32" (default), "float16", "int8": what a row holds; keys and values are
            stored so, then read back, by every query, its own included)
   The same contract as kernels/cpu_verify.py and the Triton kernel; the runtime's tests
   compare all of them. Work is split by (sequence, KV head[, query block]) over
   onnxruntime's intra-op pool (OrtApi KernelContext_ParallelFor). head_dim 64 with up to 4
   query heads per KV head (SmolLM2, most Llama-style models) takes attend_fast: 2.2x less
   work than the generic loops, and prefetched rows (SmolLM2, 200 cached tokens, keys and
   values evicted by the weights: 66 -> 37 us a layer on one thread).

   Only onnxruntime's stable C ABI is used: OrtApi is a table of function pointers that only
   ever grows, so a slot index stays valid in every later release (ort_abi.h). The library also
   holds MatMulInt4 (cpu_int4.c); RegisterCustomOps adds both. */

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kv.h"
#include "ort_abi.h"

#if defined(__x86_64__) && (defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__))
#include <immintrin.h>
#endif

void *const *ort;
volatile int dspark_solo;

void dspark_set_solo(int on) { dspark_solo = on; }

typedef struct {
  int64_t heads, kv_heads, dim, window;
  float scale, softcap; /* softcap 0: none */
  int tokens_layout, kind; /* kind: KV_FLOAT32, KV_FLOAT16 or KV_INT8 (cpu_kv.h) */
} Kernel;

/* One call's view of the batch. Rows of q/k/v/out: token t, head h at t * tstride + h * hstride
   (elements); q and out share strides, k and v share theirs. */
typedef struct {
  const float *q, *k, *v;
  char *k_pool, *v_pool; /* rows of row_bytes (cpu_kv.h) */
  float *out;
  const int64_t *tables, *starts, *qoffs, *news;
  int64_t seqs, max_blocks, blocks, block_size, kv, group, dim, row_bytes;
  int kind;
  int64_t q_tstride, q_hstride, k_tstride, k_hstride;
  int64_t query_block, qblocks; /* work item = (sequence, KV head, query block) */
  int64_t window;                /* 0: every earlier position; W: the last W */
  float scale;
  float softcap; /* > 0: scores become softcap * tanh(score / softcap) (Gemma 2) */
} Call;

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* The first key the query at position p attends to. */
static inline int64_t first_key(const Call *c, int64_t p) {
  return c->window > 0 ? max64(0, p - c->window + 1) : 0;
}

static int append(const Call *c, int64_t s) {
  const int64_t *table = c->tables + s * c->max_blocks;
  for (int64_t j = 0; j < c->news[s]; j++) {
    int64_t p = c->starts[s] + j, b = p / c->block_size;
    if (b >= c->max_blocks || table[b] < 0 || table[b] >= c->blocks) return 0;
    for (int64_t g = 0; g < c->kv; g++) {
      int64_t slot = ((table[b] * c->kv + g) * c->block_size + p % c->block_size) * c->row_bytes;
      int64_t src = (c->qoffs[s] + j) * c->k_tstride + g * c->k_hstride;
      dspark_kv_store(c->kind, c->k_pool + slot, c->k + src, c->dim);
      dspark_kv_store(c->kind, c->v_pool + slot, c->v + src, c->dim);
    }
  }
  return 1;
}

static inline const char *pool_row(const Call *c, const char *pool, const int64_t *table,
                                   int64_t g, int64_t i) {
  return pool + ((table[i / c->block_size] * c->kv + g) * c->block_size + i % c->block_size) *
                    c->row_bytes;
}

/* a row as float32: the pool's own floats, or its values converted into `tmp` */
static inline const float *row_floats(const Call *c, const char *row, float *tmp) {
  if (c->kind == KV_FLOAT32) return (const float *)row;
  dspark_kv_load(c->kind, row, tmp, c->dim);
  return tmp;
}

/* row[0 .. limit-1] -> softmax of it (soft-capped first where cap > 0), in place */
static inline void softmax(float *row, int64_t limit, float cap) {
  if (cap > 0.0f)
    for (int64_t i = 0; i < limit; i++) row[i] = tanhf(row[i] / cap) * cap;
  float top = row[0], total = 0.0f;
  for (int64_t i = 1; i < limit; i++) top = row[i] > top ? row[i] : top;
  for (int64_t i = 0; i < limit; i++) {
    row[i] = expf(row[i] - top);
    total += row[i];
  }
  const float inv = 1.0f / total;
  for (int64_t i = 0; i < limit; i++) row[i] *= inv;
}

/* Queries j0 .. j1-1 of sequence s against KV head g. scores: [(j1-j0) * group][length];
   tmp: a row's values (dim floats). */
static void attend(const Call *c, int64_t s, int64_t g, int64_t j0, int64_t j1, float *scores,
                   float *acc, float *tmp) {
  const int64_t *table = c->tables + s * c->max_blocks;
  const int64_t start = c->starts[s], qoff = c->qoffs[s], group = c->group, dim = c->dim;
  const int64_t length = start + j1, rows = (j1 - j0) * group, first = first_key(c, start + j0);
  for (int64_t i = first; i < length; i++) {
    const float *key = row_floats(c, pool_row(c, c->k_pool, table, g, i), tmp);
    /* query j sees key i when i <= start + j (and i > start + j - window) */
    const int64_t last = c->window > 0 ? min64(j1, i - start + c->window) : j1;
    for (int64_t j = max64(j0, i - start); j < last; j++) {
      for (int64_t u = 0; u < group; u++) {
        const float *q = c->q + (qoff + j) * c->q_tstride + (g * group + u) * c->q_hstride;
        float dot = 0.0f;
        for (int64_t x = 0; x < dim; x++) dot += q[x] * key[x];
        scores[((j - j0) * group + u) * length + i] = dot * c->scale;
      }
    }
  }
  for (int64_t r = 0; r < rows; r++) {
    const int64_t p = start + j0 + r / group, lo = first_key(c, p);
    softmax(scores + r * length + lo, p + 1 - lo, c->softcap);
  }
  memset(acc, 0, (size_t)(rows * dim) * sizeof(float));
  for (int64_t i = first; i < length; i++) {
    const float *value = row_floats(c, pool_row(c, c->v_pool, table, g, i), tmp);
    const int64_t last = c->window > 0 ? min64(rows, (i - start - j0 + c->window) * group) : rows;
    for (int64_t r = max64(0, i - start - j0) * group; r < last; r++) {
      const float p = scores[r * length + i];
      float *a = acc + r * dim;
      for (int64_t x = 0; x < dim; x++) a[x] += p * value[x];
    }
  }
  for (int64_t r = 0; r < rows; r++) {
    int64_t j = j0 + r / group, h = g * group + r % group;
    memcpy(c->out + (qoff + j) * c->q_tstride + h * c->q_hstride, acc + r * dim,
           (size_t)dim * sizeof(float));
  }
}

/* Rows ahead whose keys and values are prefetched: the pool's 16-row blocks are scattered
   4 KB runs that the weights evicted, and the hardware prefetcher stops at each run's end. */
enum { AHEAD = 16 };

static inline void prefetch_rows(const Call *c, const int64_t *table, int64_t g, int64_t i) {
  const char *k = pool_row(c, c->k_pool, table, g, i);
  const char *v = pool_row(c, c->v_pool, table, g, i);
  for (int64_t x = 0; x < c->row_bytes; x += 64) {
    __builtin_prefetch(k + x, 0, 3);
    __builtin_prefetch(v + x, 0, 2);
  }
}

enum { FAST_DIM = 64, FAST_GROUP = 4, CHUNK = 16 };

#if defined(__GNUC__) && defined(__AVX512F__)
/* head_dim 64, up to 4 query heads per KV head (SmolLM2: 9 heads over 3, Llama-style models):
   a query's rows stay in registers and each key and value row is loaded once for all of
   them. Every row is computed by the same instructions whichever window it sits in (one
   query at a time), so a decode and a verify of the same position agree bit for bit. This
   is the AVX-512 build (16 lanes, 32 registers); below it, 8 lanes for the others. */
typedef float vec16 __attribute__((vector_size(64), aligned(4), may_alias));
typedef int ivec16 __attribute__((vector_size(64)));

static inline vec16 load16(const float *p) { return *(const vec16 *)p; }

/* values 16t .. 16t+15 of a cache row (FAST_DIM values) as floats: float16 through the
   conversion instruction, int8 times the row's scale; `kind` is a constant at each call */
static inline __attribute__((always_inline)) vec16 lrow16(const int kind, const char *row,
                                                          int t) {
  if (kind == KV_FLOAT32) return load16((const float *)row + 16 * t);
  if (kind == KV_FLOAT16)
    return (vec16)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(row + 32 * t)));
  float scale;
  memcpy(&scale, row + FAST_DIM, sizeof(scale));
  return (vec16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
             _mm_loadu_si128((const __m128i *)(row + 16 * t)))) * scale;
}

#if defined(__clang__)
#define SHUFFLE(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#define SHUFFLE2(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(v, ...) __builtin_shuffle(v, (ivec16){__VA_ARGS__})
#define SHUFFLE2(a, b, ...) __builtin_shuffle(a, b, (ivec16){__VA_ARGS__})
#endif

static inline float sum16(vec16 v) { /* a fixed tree: halves, quarters, pairs, lanes */
  v += SHUFFLE(v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += SHUFFLE(v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += SHUFFLE(v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v += SHUFFLE(v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return v[0];
}

/* sum16 of sixteen vectors at once: lane t is sum16(d[t]), bit for bit (the same tree:
   halves, quarters, pairs, lanes), for two shuffles and an add a vector a level where sum16
   spends eight operations on each. */
static inline vec16 sums16(const vec16 *d) {
  vec16 x[8], y[4], z[2];
  for (int t = 0; t < 8; t++)
    x[t] = SHUFFLE2(d[2 * t], d[2 * t + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22,
                    23) +
           SHUFFLE2(d[2 * t], d[2 * t + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                    30, 31);
  for (int t = 0; t < 4; t++)
    y[t] = SHUFFLE2(x[2 * t], x[2 * t + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25,
                    26, 27) +
           SHUFFLE2(x[2 * t], x[2 * t + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29,
                    30, 31);
  for (int t = 0; t < 2; t++)
    z[t] = SHUFFLE2(y[2 * t], y[2 * t + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25,
                    28, 29) +
           SHUFFLE2(y[2 * t], y[2 * t + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27,
                    30, 31);
  return SHUFFLE2(z[0], z[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         SHUFFLE2(z[0], z[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* `group` is a constant at every call (attend_fast): the rows' loops unroll and the query and
   accumulator rows stay in registers (a runtime count kept them on the stack: 1.6x slower).
   Where CHUNK keys fill a run of one cache block, their scores are reduced together (sums16:
   the same bits as one by one, a 9-token verify window over 500-1900 keys 1.22-1.34x
   faster); a position's split into runs depends on the position alone, so a decode and a
   verify of it take the same path. */
static inline __attribute__((always_inline)) void attend_group(
    const Call *c, int64_t s, int64_t g, int64_t j0, int64_t j1, float *scores,
    const int64_t group, const int kind) {
  const int64_t *table = c->tables + s * c->max_blocks;
  const int64_t start = c->starts[s], qoff = c->qoffs[s], stride = c->row_bytes;
  const int64_t length = start + j1, first = first_key(c, start + j0);
  for (int64_t i = first; i < first + AHEAD && i < length; i++) prefetch_rows(c, table, g, i);
  for (int64_t j = j0; j < j1; j++) {
    const int64_t limit = start + j + 1, lo = first_key(c, limit - 1);
    vec16 q[FAST_GROUP][4];
    for (int64_t u = 0; u < group; u++) {
      const float *row = c->q + (qoff + j) * c->q_tstride + (g * group + u) * c->q_hstride;
      for (int t = 0; t < 4; t++) q[u][t] = load16(row + 16 * t);
    }
    float *sc = scores + (j - j0) * group * length;
    for (int64_t i = lo; i < limit;) {
      const char *key = pool_row(c, c->k_pool, table, g, i);
      if (c->block_size % CHUNK == 0 && i % CHUNK == 0 && i + CHUNK <= limit) {
        /* CHUNK keys of one block (contiguous rows): their scores reduced together */
        if (j == j0)
          for (int64_t t = i + AHEAD; t < i + AHEAD + CHUNK && t < length; t++)
            prefetch_rows(c, table, g, t);
        for (int64_t u = 0; u < group; u++) {
          vec16 d[CHUNK];
          for (int t = 0; t < CHUNK; t++) {
            const char *row = key + t * stride;
            d[t] = (lrow16(kind, row, 0) * q[u][0] + lrow16(kind, row, 1) * q[u][1]) +
                   (lrow16(kind, row, 2) * q[u][2] + lrow16(kind, row, 3) * q[u][3]);
          }
          *(vec16 *)(sc + u * length + i) = sums16(d) * c->scale;
        }
        i += CHUNK;
        continue;
      }
      if (j == j0 && i + AHEAD < length) prefetch_rows(c, table, g, i + AHEAD);
      const vec16 k0 = lrow16(kind, key, 0), k1 = lrow16(kind, key, 1),
                  k2 = lrow16(kind, key, 2), k3 = lrow16(kind, key, 3);
      for (int64_t u = 0; u < group; u++)
        sc[u * length + i] =
            sum16((k0 * q[u][0] + k1 * q[u][1]) + (k2 * q[u][2] + k3 * q[u][3])) * c->scale;
      i++;
    }
    for (int64_t u = 0; u < group; u++) softmax(sc + u * length + lo, limit - lo, c->softcap);
    vec16 acc[FAST_GROUP][4];
    memset(acc, 0, sizeof(acc));
    for (int64_t i = lo; i < limit; i++) {
      const char *value = pool_row(c, c->v_pool, table, g, i);
      const vec16 v0 = lrow16(kind, value, 0), v1 = lrow16(kind, value, 1),
                  v2 = lrow16(kind, value, 2), v3 = lrow16(kind, value, 3);
      for (int64_t u = 0; u < group; u++) {
        const float p = sc[u * length + i];
        acc[u][0] += p * v0;
        acc[u][1] += p * v1;
        acc[u][2] += p * v2;
        acc[u][3] += p * v3;
      }
    }
    for (int64_t u = 0; u < group; u++) {
      vec16 *out = (vec16 *)(c->out + (qoff + j) * c->q_tstride + (g * group + u) * c->q_hstride);
      for (int t = 0; t < 4; t++) out[t] = acc[u][t];
    }
  }
}

#elif defined(__GNUC__)
/* The same for CPUs without AVX-512 (AVX2's 16 registers of 8 lanes; NEON takes a vector as
   two): each 16-lane vector of the path above is two of 8 (lo: lanes 0-7, hi: 8-15) and the
   sums use sum16's tree (the halves added first), so a row gets the values that path gives
   it. The query rows are read from memory where the AVX-512 path holds them, and the
   output rows are summed in two halves of 32 dims, 4 vectors per query head. Compiled from
   the 16-lane code, AVX2 took 3.6x as long for a 9-token verify at 1000 cached tokens
   (DSPARK_CPU_MARCH=haswell on an AVX-512 machine: 52 against 14.5 ms for the int4 main). */
typedef float vec8 __attribute__((vector_size(32), aligned(4), may_alias));
typedef int ivec8 __attribute__((vector_size(32)));

static inline vec8 load8(const float *p) { return *(const vec8 *)p; }

/* values 8t .. 8t+7 of a cache row (FAST_DIM values) as floats, as lrow16 reads them: the
   conversion instructions where the CPU has them, else the values converted one by one */
static inline __attribute__((always_inline)) vec8 lrow8(const int kind, const char *row,
                                                        int t) {
  if (kind == KV_FLOAT32) return load8((const float *)row + 8 * t);
#if defined(__F16C__)
  if (kind == KV_FLOAT16)
    return (vec8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 16 * t)));
#endif
  float scale;
  memcpy(&scale, row + FAST_DIM, sizeof(scale));
#if defined(__AVX2__)
  if (kind == KV_INT8)
    return (vec8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
               _mm_loadl_epi64((const __m128i *)(row + 8 * t)))) * scale;
#endif
  float out[8];
  if (kind == KV_FLOAT16) {
    uint16_t h[8];
    memcpy(h, row + 16 * t, sizeof(h));
    for (int x = 0; x < 8; x++) out[x] = dspark_half_to_float(h[x]);
  } else {
    for (int x = 0; x < 8; x++) out[x] = (float)((const int8_t *)row)[8 * t + x] * scale;
  }
  return load8(out);
}

#if defined(__clang__)
#define SHUFFLE8(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#else
#define SHUFFLE8(v, ...) __builtin_shuffle(v, (ivec8){__VA_ARGS__})
#endif

static inline float sum16_halves(vec8 lo, vec8 hi) { /* halves, quarters, pairs, lanes */
  vec8 v = lo + hi;
  v += SHUFFLE8(v, 4, 5, 6, 7, 0, 1, 2, 3);
  v += SHUFFLE8(v, 2, 3, 0, 1, 6, 7, 4, 5);
  v += SHUFFLE8(v, 1, 0, 3, 2, 5, 4, 7, 6);
  return v[0];
}

static inline __attribute__((always_inline)) void attend_group(
    const Call *c, int64_t s, int64_t g, int64_t j0, int64_t j1, float *scores,
    const int64_t group, const int kind) {
  const int64_t *table = c->tables + s * c->max_blocks;
  const int64_t start = c->starts[s], qoff = c->qoffs[s];
  const int64_t length = start + j1, first = first_key(c, start + j0);
  for (int64_t i = first; i < first + AHEAD && i < length; i++) prefetch_rows(c, table, g, i);
  for (int64_t j = j0; j < j1; j++) {
    const int64_t limit = start + j + 1, lo = first_key(c, limit - 1);
    const float *q[FAST_GROUP];
    for (int64_t u = 0; u < group; u++)
      q[u] = c->q + (qoff + j) * c->q_tstride + (g * group + u) * c->q_hstride;
    float *sc = scores + (j - j0) * group * length;
    for (int64_t i = lo; i < limit; i++) {
      if (j == j0 && i + AHEAD < length) prefetch_rows(c, table, g, i + AHEAD);
      const char *key = pool_row(c, c->k_pool, table, g, i);
      const vec8 k0 = lrow8(kind, key, 0), k1 = lrow8(kind, key, 1), k2 = lrow8(kind, key, 2),
                 k3 = lrow8(kind, key, 3), k4 = lrow8(kind, key, 4), k5 = lrow8(kind, key, 5),
                 k6 = lrow8(kind, key, 6), k7 = lrow8(kind, key, 7);
      for (int64_t u = 0; u < group; u++) {
        const float *r = q[u];
        const vec8 dlo = (k0 * load8(r) + k2 * load8(r + 16)) +
                         (k4 * load8(r + 32) + k6 * load8(r + 48));
        const vec8 dhi = (k1 * load8(r + 8) + k3 * load8(r + 24)) +
                         (k5 * load8(r + 40) + k7 * load8(r + 56));
        sc[u * length + i] = sum16_halves(dlo, dhi) * c->scale;
      }
    }
    for (int64_t u = 0; u < group; u++) softmax(sc + u * length + lo, limit - lo, c->softcap);
    for (int64_t half = 0; half < FAST_DIM; half += FAST_DIM / 2) {
      vec8 acc[FAST_GROUP][4];
      memset(acc, 0, sizeof(acc));
      const int part = (int)(half / 8);
      for (int64_t i = lo; i < limit; i++) {
        const char *value = pool_row(c, c->v_pool, table, g, i);
        const vec8 v0 = lrow8(kind, value, part), v1 = lrow8(kind, value, part + 1),
                   v2 = lrow8(kind, value, part + 2), v3 = lrow8(kind, value, part + 3);
        for (int64_t u = 0; u < group; u++) {
          const float p = sc[u * length + i];
          acc[u][0] += p * v0;
          acc[u][1] += p * v1;
          acc[u][2] += p * v2;
          acc[u][3] += p * v3;
        }
      }
      for (int64_t u = 0; u < group; u++) {
        vec8 *out = (vec8 *)(c->out + (qoff + j) * c->q_tstride + (g * group + u) * c->q_hstride +
                             half);
        for (int t = 0; t < 4; t++) out[t] = acc[u][t];
      }
    }
  }
}

#endif

#if defined(__GNUC__)
#define GROUPS(kind)                                                    \
  switch (c->group) {                                                   \
    case 1: attend_group(c, s, g, j0, j1, scores, 1, kind); break;      \
    case 2: attend_group(c, s, g, j0, j1, scores, 2, kind); break;      \
    case 3: attend_group(c, s, g, j0, j1, scores, 3, kind); break;      \
    default: attend_group(c, s, g, j0, j1, scores, 4, kind); break;     \
  }

static void attend_fast(const Call *c, int64_t s, int64_t g, int64_t j0, int64_t j1,
                        float *scores) {
  if (c->kind == KV_FLOAT16) {
    GROUPS(KV_FLOAT16)
  } else if (c->kind == KV_INT8) {
    GROUPS(KV_INT8)
  } else {
    GROUPS(KV_FLOAT32)
  }
}
#define HAVE_FAST 1
#else
#define HAVE_FAST 0
#define attend_fast(c, s, g, j0, j1, scores) attend(c, s, g, j0, j1, scores, NULL, NULL)
#endif

enum { STACK_FLOATS = 16384 };

static void attend_item(void *data, size_t item) {
  const Call *c = (const Call *)data;
  int64_t per_seq = c->kv * c->qblocks;
  int64_t s = (int64_t)item / per_seq, rest = (int64_t)item % per_seq;
  int64_t g = rest / c->qblocks, j0 = (rest % c->qblocks) * c->query_block;
  if (j0 >= c->news[s]) return;
  int64_t j1 = min64(c->news[s], j0 + c->query_block);
  int64_t rows = (j1 - j0) * c->group, length = c->starts[s] + j1;
  size_t need = (size_t)(rows * length + rows * c->dim + c->dim);
  float stack[STACK_FLOATS];
  float *buffer = need <= STACK_FLOATS ? stack : (float *)malloc(need * sizeof(float));
  if (buffer == NULL) { /* cannot report from a pool thread: leave this item's rows zero */
    for (int64_t j = j0; j < j1; j++)
      for (int64_t u = 0; u < c->group; u++)
        memset(c->out + (c->qoffs[s] + j) * c->q_tstride + (g * c->group + u) * c->q_hstride, 0,
               (size_t)c->dim * sizeof(float));
    return;
  }
  if (HAVE_FAST && c->dim == FAST_DIM && c->group <= FAST_GROUP)
    attend_fast(c, s, g, j0, j1, buffer);
  else
    attend(c, s, g, j0, j1, buffer, buffer + rows * length, buffer + rows * (length + c->dim));
  if (buffer != stack) free(buffer);
}

static OrtStatus *create_kernel(const OrtCustomOp *op, const void *api,
                                const OrtKernelInfo *info, void **kernel) {
  (void)op;
  (void)api;
  typedef OrtStatus *(*IntAttr)(const OrtKernelInfo *, const char *, int64_t *);
  typedef OrtStatus *(*FloatAttr)(const OrtKernelInfo *, const char *, float *);
  typedef OrtStatus *(*StrAttr)(const OrtKernelInfo *, const char *, char *, size_t *);
  Kernel *k = (Kernel *)calloc(1, sizeof(Kernel));
  char layout[16] = {0};
  size_t size = sizeof(layout);
  if (k == NULL) return error("SpeculativeVerify: out of memory");
  if (!ok(ORT(KERNEL_INFO_GET_ATTRIBUTE_INT64, IntAttr)(info, "num_heads", &k->heads)) ||
      !ok(ORT(KERNEL_INFO_GET_ATTRIBUTE_INT64, IntAttr)(info, "num_kv_heads", &k->kv_heads)) ||
      !ok(ORT(KERNEL_INFO_GET_ATTRIBUTE_INT64, IntAttr)(info, "head_dim", &k->dim)) ||
      !ok(ORT(KERNEL_INFO_GET_ATTRIBUTE_FLOAT, FloatAttr)(info, "scale", &k->scale)) ||
      k->heads < 1 || k->kv_heads < 1 || k->dim < 1 || k->heads % k->kv_heads != 0) {
    free(k);
    return error("SpeculativeVerify: num_heads, num_kv_heads, head_dim and scale are needed "
                 "(num_heads a multiple of num_kv_heads)");
  }
  if (ok(ORT(KERNEL_INFO_GET_ATTRIBUTE_STRING, StrAttr)(info, "layout", layout, &size)))
    k->tokens_layout = strcmp(layout, "tokens") == 0; /* absent: "heads", as exported */
  char dtype[16] = {0};
  size = sizeof(dtype);
  k->kind = KV_FLOAT32; /* absent: float32 */
  if (ok(ORT(KERNEL_INFO_GET_ATTRIBUTE_STRING, StrAttr)(info, "kv_dtype", dtype, &size))) {
    if (strcmp(dtype, "float16") == 0) {
      k->kind = KV_FLOAT16;
    } else if (strcmp(dtype, "int8") == 0 && k->dim % 4 == 0) {
      k->kind = KV_INT8;
    } else if (strcmp(dtype, "float32") != 0) {
      free(k);
      return error("SpeculativeVerify: kv_dtype must be float32, float16 or int8 (int8: "
                   "head_dim a multiple of 4)");
    }
  }
  if (!ok(ORT(KERNEL_INFO_GET_ATTRIBUTE_INT64, IntAttr)(info, "window", &k->window)))
    k->window = 0; /* absent: every earlier position */
  if (!ok(ORT(KERNEL_INFO_GET_ATTRIBUTE_FLOAT, FloatAttr)(info, "softcap", &k->softcap)))
    k->softcap = 0.0f; /* absent: no soft-cap */
  if (!(k->softcap >= 0.0f)) {
    free(k);
    return error("SpeculativeVerify: softcap must be >= 0");
  }
  if (k->window < 0) {
    free(k);
    return error("SpeculativeVerify: window must be >= 0");
  }
  *kernel = k;
  return NULL;
}

static OrtStatus *compute(void *kernel, OrtKernelContext *ctx) {
  const Kernel *k = (const Kernel *)kernel;
  Shape qs, ks, ps, ts, ss;
  Call c;
  memset(&c, 0, sizeof(c));
  c.q = (const float *)input(ctx, 0, &qs);
  c.k = (const float *)input(ctx, 1, &ks);
  c.v = (const float *)input(ctx, 2, NULL);
  c.k_pool = (char *)input(ctx, 3, &ps);
  c.v_pool = (char *)input(ctx, 4, NULL);
  c.tables = (const int64_t *)input(ctx, 5, &ts);
  c.starts = (const int64_t *)input(ctx, 6, &ss);
  c.qoffs = (const int64_t *)input(ctx, 7, NULL);
  c.news = (const int64_t *)input(ctx, 8, NULL);
  OrtValue *out_value = NULL;
  void *out = NULL;
  if (c.q == NULL || c.k == NULL || c.v == NULL || c.k_pool == NULL || c.v_pool == NULL ||
      c.tables == NULL || c.starts == NULL || c.qoffs == NULL || c.news == NULL)
    return error("SpeculativeVerify: an input is missing");
  const int64_t tokens = qs.count / (k->heads * k->dim);
  const int64_t row_bytes = dspark_kv_row_bytes(k->kind, k->dim);
  if (ps.rank != 4 || ts.rank != 2 || ps.dims[1] != k->kv_heads ||
      ps.dims[3] * (int64_t)sizeof(float) != row_bytes ||
      qs.count != tokens * k->heads * k->dim || ks.count != tokens * k->kv_heads * k->dim ||
      ts.dims[0] != ss.count)
    return error("SpeculativeVerify: q/k/v, the pools or the tables do not match the op's "
                 "heads and head_dim");
  /* out: [1, T, H*d] (tokens) or [1, H, T, d] (heads), whatever view of q the graph gave */
  const int64_t tokens_dims[3] = {1, tokens, k->heads * k->dim};
  const int64_t heads_dims[4] = {1, k->heads, tokens, k->dim};
  if (!ok(ORT(KERNEL_CONTEXT_GET_OUTPUT, GetOutputFn)(
          ctx, 0, k->tokens_layout ? tokens_dims : heads_dims, k->tokens_layout ? 3 : 4,
          &out_value)) ||
      !ok(ORT(GET_TENSOR_MUTABLE_DATA, MutableDataFn)(out_value, &out)))
    return error("SpeculativeVerify: cannot create the output");
  c.out = (float *)out;
  c.seqs = ss.count;
  c.max_blocks = ts.dims[1];
  c.blocks = ps.dims[0];
  c.block_size = ps.dims[2];
  c.kv = k->kv_heads;
  c.group = k->heads / k->kv_heads;
  c.dim = k->dim;
  c.row_bytes = row_bytes;
  c.kind = k->kind;
  c.scale = k->scale;
  c.softcap = k->softcap;
  c.window = k->window;
  c.q_tstride = k->tokens_layout ? k->heads * k->dim : k->dim;
  c.q_hstride = k->tokens_layout ? k->dim : tokens * k->dim;
  c.k_tstride = k->tokens_layout ? k->kv_heads * k->dim : k->dim;
  c.k_hstride = k->tokens_layout ? k->dim : tokens * k->dim;
  int64_t longest = 1, work = 0;
  for (int64_t s = 0; s < c.seqs; s++) {
    if (c.qoffs[s] < 0 || c.news[s] < 1 || c.qoffs[s] + c.news[s] > tokens || c.starts[s] < 0 ||
        !append(&c, s))
      return error("SpeculativeVerify: a sequence's token rows or cache blocks are out of range");
    longest = max64(longest, c.news[s]);
    work += c.news[s] * (c.starts[s] + c.news[s]);
  }
  /* Work items over the intra-op pool: one per (sequence, KV head) for decode and verify
     windows over a short context, (sequence, KV head, block of queries) past it: blocks of 16
     for long windows (prefill), and a verify window cut until the batch has about SPREAD
     items (as one item per KV head, SmolLM2's 3 left one of 2 threads idle a third of the
     time: 9 queries over 1900 keys took 1.09x as long). Spreading even a single decode's 3
     KV heads over 2 threads took SmolLM2's step from 19.1 to 18.3 ms: the keys and values
     come from memory, after the weights evicted them. Each query is computed the same in
     any block. */
  enum { SPREAD = 8 };
  const int small = work * c.group * c.dim < (1 << 18);
  const int64_t per_window = c.seqs * c.kv, cuts = (SPREAD + per_window - 1) / per_window;
  c.query_block = small ? longest : min64(16, (longest + cuts - 1) / cuts);
  c.qblocks = (longest + c.query_block - 1) / c.query_block;
  size_t items = (size_t)(c.seqs * c.kv * c.qblocks);
  if (items < 2 || dspark_solo || !ok(ORT(KERNEL_CONTEXT_PARALLEL_FOR, ParallelForFn)(ctx, attend_item, items, 0, &c)))
    for (size_t i = 0; i < items; i++) attend_item(&c, i);
  return NULL;
}

static void *create_kernel_v1(const OrtCustomOp *op, const void *api, const OrtKernelInfo *info) {
  void *kernel = NULL;
  return ok(create_kernel(op, api, info, &kernel)) ? kernel : NULL;
}

static void compute_v1(void *kernel, OrtKernelContext *ctx) { ok(compute(kernel, ctx)); }

static const char *op_name(const OrtCustomOp *op) { (void)op; return "SpeculativeVerify"; }
static int input_type(const OrtCustomOp *op, size_t i) { (void)op; return i < 5 ? ELEM_FLOAT : ELEM_INT64; }
static size_t input_count(const OrtCustomOp *op) { (void)op; return 9; }
static int output_type(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return ELEM_FLOAT; }

static OrtCustomOp verify_op = {
    API_VERSION, create_kernel_v1, op_name, op_cpu_provider, input_type, input_count,
    output_type, op_one_count, compute_v1, op_free_kernel, op_required, op_required,
    op_required, op_one, op_one, op_one, op_one,
    create_kernel, compute, NULL, NULL, NULL};
static OrtCustomOpDomain *domain;
extern const OrtCustomOp dspark_int4_op; /* cpu_int4.c */
extern const OrtCustomOp dspark_rms_norm_op, dspark_skip_rms_norm_op, dspark_silu_op; /* cpu_rows.c */
extern const OrtCustomOp dspark_quantize_tokens_op; /* cpu_quant.c */

OrtStatus *RegisterCustomOps(OrtSessionOptions *options, const OrtApiBase *base) {
  typedef OrtStatus *(*CreateDomainFn)(const char *, OrtCustomOpDomain **);
  typedef OrtStatus *(*DomainAddFn)(OrtCustomOpDomain *, const OrtCustomOp *);
  typedef OrtStatus *(*AddDomainFn)(OrtSessionOptions *, OrtCustomOpDomain *);
  const void *api = base->GetApi(API_VERSION);
  if (api == NULL) {
    void *const *v1 = (void *const *)base->GetApi(1);
    return ((CreateStatusFn)v1[CREATE_STATUS])(ERR_INVALID_ARGUMENT,
                                               "dspark: onnxruntime >= 1.17 is needed");
  }
  ort = (void *const *)api;
  if (domain == NULL) {
    OrtStatus *status = ORT(CREATE_CUSTOM_OP_DOMAIN, CreateDomainFn)("ai.dspark", &domain);
    if (status != NULL) return status;
    status = ORT(CUSTOM_OP_DOMAIN_ADD, DomainAddFn)(domain, &verify_op);
    const OrtCustomOp *ours[] = {&dspark_int4_op, &dspark_rms_norm_op, &dspark_skip_rms_norm_op,
                                 &dspark_silu_op, &dspark_quantize_tokens_op};
    for (size_t i = 0; status == NULL && i < sizeof(ours) / sizeof(ours[0]); i++)
      status = ORT(CUSTOM_OP_DOMAIN_ADD, DomainAddFn)(domain, ours[i]);
    if (status != NULL) return status;
  }
  return ORT(ADD_CUSTOM_OP_DOMAIN, AddDomainFn)(options, domain);
}
