/* MatMulInt4 as an onnxruntime custom op (domain ai.dspark), CPU: y = x W^T for 4-bit weights.

   What a draft model's MatMulNBits (4 bits, blocks of 32, symmetric, accuracy level 4) computes,
   in a layout made for streaming. A draft decode step reads ~80 MB of int4 weights right after
   the main's step evicted them; onnxruntime's kernel spends ~5 ms of SmolLM2's 6.3 ms draft
   forward there. Here each thread streams one contiguous run of weight rows (onnxruntime's
   pool hands it the run as one batch), prefetching 8 KB ahead, with float16 scales (a tenth
   fewer bytes) and two FMA chains a row: the forward after a main step takes 4.7 ms
   (runtime/model/int4_rows.py rewrites the graph and packs the rows).

   inputs   0 x float [..., K]
            1 w uint8 [N, K/2 + K/16]: weight row n = K/2 bytes of 4-bit weights, then K/32
              float16 scales (one per block of 32 inputs)
   output   0 y float [..., N]
   attrs    K, N (int; K a multiple of 64), threads (int, default 1: the rows are split in
            that many runs over onnxruntime's intra-op pool)

   Weights come in chunks of 128 inputs: byte j of a chunk holds input j's weight in its low
   nibble and input 64 + j's in its high nibble; a last chunk of 64 pairs j with 32 + j. A
   weight is scale * (nibble - 8), MatMulNBits' symmetric 4-bit with its default zero point;
   its float32 scales are stored as float16 (2^-11 relative, against int4's 1/16 steps).
   Arithmetic as MatMulNBits' accuracy level 4: each row of x is quantized to int8 per block
   of 32 (scale max|x| / 127), a block's dot product is exact in int32, and blocks are summed
   in float32. The sum's order is not MatMulNBits', so results agree to rounding, not bits: a
   draft's proposals only (the main verifies every token), never a main's arithmetic.

   With AVX-512 VNNI (dspark_int4_fast() = 1) a chunk is one load, two nibble masks and two
   vpdpbusd per row of x, up to 4 rows of x per load of a weight row; elsewhere plain loops
   compute the same blocks (the runtime only rewrites graphs where the fast path is built). */

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ort_abi.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define INT4_FAST 1
#else
#define INT4_FAST 0
#endif

enum { BLOCK = 32, GROUP = 4, PREFETCH = 8192 };

int dspark_int4_fast(void) { return INT4_FAST; }

typedef struct {
  int64_t k, n, threads;
} Int4Kernel;

/* One call: x quantized (x8 [rows, K], sx [rows, K/32]) and each block pair's zero-point
   correction (zv [rows, K/64, 16] int32: lane 0 = -8 * sum of the pair's first block's int8
   inputs, lane 8 = the second's, other lanes 0; vpdpbusd accumulates onto it). */
typedef struct {
  const uint8_t *w;
  float *y;
  const int8_t *x8;
  const float *sx;
  const int32_t *zv;
  int64_t k, n, rows, row_bytes, items;
} Int4Call;

static int64_t row_bytes(int64_t k) { return k / 2 + k / 16; }

/* IEEE half to float, exactly (what F16C's vcvtph2ps gives). */
static inline float half_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  uint32_t bits;
  float f;
  if (exp == 0) { /* zero or subnormal: man * 2^-24 */
    f = ldexpf((float)man, -24);
    memcpy(&bits, &f, sizeof(bits));
    bits |= sign;
  } else {
    bits = sign | (exp == 31 ? 0x7F800000u : (exp + 112) << 23) | man << 13;
  }
  memcpy(&f, &bits, sizeof(f));
  return f;
}

static void quantize(const float *x, int64_t k, int8_t *x8, float *sx, int32_t *zv) {
  memset(zv, 0, (size_t)(k / 64 * 16) * sizeof(int32_t));
  for (int64_t b = 0; b < k / BLOCK; b++) {
    const float *xb = x + b * BLOCK;
    float amax = 0.f;
    for (int i = 0; i < BLOCK; i++) amax = fmaxf(amax, fabsf(xb[i]));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    int32_t sum = 0;
    for (int i = 0; i < BLOCK; i++) {
      const int32_t v = (int32_t)lrintf(xb[i] * inv);
      x8[b * BLOCK + i] = (int8_t)v;
      sum += v;
    }
    sx[b] = amax / 127.f;
    zv[b / 2 * 16 + (b % 2) * 8] = -8 * sum;
  }
}

/* Input e's nibble in a packed row (the layout above). */
static inline int nibble(const uint8_t *w, int64_t k, int64_t e) {
  const int64_t full = k / 128 * 128;
  const int64_t chunk = e < full ? e / 128 : full / 128, j = e - chunk * 128;
  const int64_t half = e < full ? 64 : 32;
  const uint8_t byte = w[chunk * 64 + j % half];
  return j >= half ? byte >> 4 : byte & 15;
}

static void row_plain(const Int4Call *c, const uint8_t *w, int64_t n) {
  const int64_t k = c->k, blocks = k / BLOCK;
  const uint16_t *d = (const uint16_t *)(w + k / 2);
  for (int64_t r = 0; r < c->rows; r++) {
    const int8_t *x8 = c->x8 + r * k;
    float acc = 0.f;
    for (int64_t b = 0; b < blocks; b++) {
      int32_t dot = 0;
      for (int64_t i = b * BLOCK; i < (b + 1) * BLOCK; i++) dot += (nibble(w, k, i) - 8) * x8[i];
      acc += half_float(d[b]) * c->sx[r * blocks + b] * (float)dot;
    }
    c->y[r * c->n + n] = acc;
  }
}

#if INT4_FAST
/* Rows r0 .. r0+R-1 of x against weight row n: the weights are unpacked once for all R. */
static inline __attribute__((always_inline)) void row_fast(const Int4Call *c, const uint8_t *w,
                                                           int64_t n, int64_t r0, int R) {
  const int64_t k = c->k, chunks = k / 128, blocks = k / BLOCK, pairs = k / 64;
  const uint16_t *d = (const uint16_t *)(w + k / 2);
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i first = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const __m512i second = _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  __m512 acc[GROUP], acc2[GROUP]; /* two chains a row: an FMA's latency, not its rate, bounds one */
  for (int r = 0; r < R; r++) acc[r] = acc2[r] = _mm512_setzero_ps();
  for (int64_t ch = 0; ch < chunks; ch++) {
    const __m512i v = _mm512_loadu_si512(w + 64 * ch);
    const __m512i lo = _mm512_and_si512(v, low);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    const __m128 dw = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(d + 4 * ch)));
    for (int r = 0; r < R; r++) {
      const int64_t row = r0 + r;
      const int8_t *x8 = c->x8 + row * k + 128 * ch;
      const int32_t *zv = c->zv + (row * pairs + 2 * ch) * 16;
      const __m512i dl = _mm512_dpbusd_epi32(_mm512_loadu_si512(zv), lo, _mm512_loadu_si512(x8));
      const __m512i dh =
          _mm512_dpbusd_epi32(_mm512_loadu_si512(zv + 16), hi, _mm512_loadu_si512(x8 + 64));
      const __m512 s4 = _mm512_castps128_ps512(
          _mm_mul_ps(dw, _mm_loadu_ps(c->sx + row * blocks + 4 * ch)));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dl), _mm512_permutexvar_ps(first, s4), acc[r]);
      acc2[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dh), _mm512_permutexvar_ps(second, s4), acc2[r]);
    }
  }
  if (k % 128) { /* a last chunk of 64: two blocks, 32 bytes */
    const int64_t ch = chunks, b = 4 * ch;
    const __m256i v = _mm256_loadu_si256((const __m256i *)(w + 64 * ch));
    const __m256i low8 = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_and_si256(v, low8);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low8);
    for (int r = 0; r < R; r++) {
      const int64_t row = r0 + r;
      const int8_t *x8 = c->x8 + row * k + 128 * ch;
      const int32_t *zv = c->zv + (row * pairs + 2 * ch) * 16;
      const __m256i dl = _mm256_dpbusd_epi32(_mm256_loadu_si256((const __m256i *)zv), lo,
                                             _mm256_loadu_si256((const __m256i *)x8));
      const __m256i dh = _mm256_dpbusd_epi32(_mm256_loadu_si256((const __m256i *)(zv + 8)), hi,
                                             _mm256_loadu_si256((const __m256i *)(x8 + 32)));
      const float *sx = c->sx + row * blocks + b;
      const __m256 t = _mm256_fmadd_ps(
          _mm256_cvtepi32_ps(dh), _mm256_set1_ps(half_float(d[b + 1]) * sx[1]),
          _mm256_mul_ps(_mm256_cvtepi32_ps(dl), _mm256_set1_ps(half_float(d[b]) * sx[0])));
      acc[r] = _mm512_add_ps(acc[r], _mm512_zextps256_ps512(t));
    }
  }
  for (int r = 0; r < R; r++)
    c->y[(r0 + r) * c->n + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r], acc2[r]));
}

static void rows_fast(const Int4Call *c, int64_t n0, int64_t n1) {
  const uint8_t *start = c->w + n0 * c->row_bytes;
  for (int64_t o = 0; o < PREFETCH; o += 64) _mm_prefetch((const char *)(start + o), _MM_HINT_T0);
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t *w = c->w + n * c->row_bytes;
    if (n + 1 < c->n) /* the next 8 KB: stay ahead of the loads, past the item's end too */
      for (int64_t o = 0; o < c->row_bytes; o += 64)
        _mm_prefetch((const char *)(w + PREFETCH + o), _MM_HINT_T0);
    for (int64_t r0 = 0; r0 < c->rows; r0 += GROUP) {
      switch (c->rows - r0 < GROUP ? c->rows - r0 : GROUP) {
        case 1: row_fast(c, w, n, r0, 1); break;
        case 2: row_fast(c, w, n, r0, 2); break;
        case 3: row_fast(c, w, n, r0, 3); break;
        default: row_fast(c, w, n, r0, 4); break;
      }
    }
  }
}
#endif

static void int4_item(void *data, size_t item) {
  const Int4Call *c = (const Int4Call *)data;
  const int64_t per = (c->n + c->items - 1) / c->items;
  const int64_t n0 = (int64_t)item * per;
  const int64_t n1 = n0 + per < c->n ? n0 + per : c->n;
#if INT4_FAST
  rows_fast(c, n0, n1);
#else
  for (int64_t n = n0; n < n1; n++) row_plain(c, c->w + n * c->row_bytes, n);
#endif
}

/* The plain loops, for the tests: y [rows, n] from x [rows, k] and packed w. */
int dspark_int4_reference(const float *x, const uint8_t *w, float *y, int64_t rows, int64_t k,
                          int64_t n) {
  if (k % 64 != 0 || rows < 0 || n < 0) return 0;
  int8_t *x8 = (int8_t *)malloc((size_t)(rows * k) + 1);
  float *sx = (float *)malloc((size_t)(rows * k / BLOCK) * sizeof(float) + 4);
  int32_t *zv = (int32_t *)malloc((size_t)(rows * k / 64 * 16) * sizeof(int32_t) + 4);
  if (x8 == NULL || sx == NULL || zv == NULL) {
    free(x8), free(sx), free(zv);
    return 0;
  }
  for (int64_t r = 0; r < rows; r++)
    quantize(x + r * k, k, x8 + r * k, sx + r * k / BLOCK, zv + r * k / 64 * 16);
  const Int4Call c = {w, y, x8, sx, zv, k, n, rows, row_bytes(k), 1};
  for (int64_t i = 0; i < n; i++) row_plain(&c, w + i * c.row_bytes, i);
  free(x8), free(sx), free(zv);
  return 1;
}

static OrtStatus *int4_create(const OrtCustomOp *op, const void *api, const OrtKernelInfo *info,
                              void **kernel) {
  (void)op;
  (void)api;
  typedef OrtStatus *(*IntAttr)(const OrtKernelInfo *, const char *, int64_t *);
  Int4Kernel *k = (Int4Kernel *)calloc(1, sizeof(Int4Kernel));
  if (k == NULL) return error("MatMulInt4: out of memory");
  if (!ok(ORT(KERNEL_INFO_GET_ATTRIBUTE_INT64, IntAttr)(info, "K", &k->k)) ||
      !ok(ORT(KERNEL_INFO_GET_ATTRIBUTE_INT64, IntAttr)(info, "N", &k->n)) || k->k < 64 ||
      k->k % 64 != 0 || k->n < 1) {
    free(k);
    return error("MatMulInt4: attributes K (a multiple of 64) and N (>= 1) are needed");
  }
  if (!ok(ORT(KERNEL_INFO_GET_ATTRIBUTE_INT64, IntAttr)(info, "threads", &k->threads)) ||
      k->threads < 1)
    k->threads = 1;
  *kernel = k;
  return NULL;
}

static OrtStatus *int4_compute(void *kernel, OrtKernelContext *ctx) {
  const Int4Kernel *kk = (const Int4Kernel *)kernel;
  const int64_t k = kk->k, n = kk->n;
  Shape xs, ws;
  const float *x = (const float *)input(ctx, 0, &xs);
  const uint8_t *w = (const uint8_t *)input(ctx, 1, &ws);
  if (x == NULL || w == NULL) return error("MatMulInt4: an input is missing");
  if (xs.rank < 1 || xs.dims[xs.rank - 1] != k || ws.rank != 2 || ws.dims[0] != n ||
      ws.dims[1] != row_bytes(k))
    return error("MatMulInt4: x must be [..., K] and w [N, K/2 + K/16]");
  int64_t dims[MAX_RANK];
  memcpy(dims, xs.dims, xs.rank * sizeof(int64_t));
  dims[xs.rank - 1] = n;
  OrtValue *out_value = NULL;
  void *out = NULL;
  if (!ok(ORT(KERNEL_CONTEXT_GET_OUTPUT, GetOutputFn)(ctx, 0, dims, xs.rank, &out_value)) ||
      !ok(ORT(GET_TENSOR_MUTABLE_DATA, MutableDataFn)(out_value, &out)))
    return error("MatMulInt4: cannot create the output");
  const int64_t rows = xs.count / k;
  if (rows == 0) return NULL;
  /* one buffer: x8, then sx, then zv (64-byte aligned pieces) */
  const size_t x8_bytes = (size_t)(rows * k + 63) / 64 * 64;
  const size_t sx_bytes = (size_t)(rows * k / BLOCK * 4 + 63) / 64 * 64;
  const size_t zv_bytes = (size_t)(rows * k / 64 * 16 * 4);
  uint8_t *buffer = (uint8_t *)aligned_alloc(64, x8_bytes + sx_bytes + zv_bytes);
  if (buffer == NULL) return error("MatMulInt4: out of memory");
  Int4Call c = {w, (float *)out, (const int8_t *)buffer, (const float *)(buffer + x8_bytes),
                (const int32_t *)(buffer + x8_bytes + sx_bytes), k, n, rows, row_bytes(k), 1};
  for (int64_t r = 0; r < rows; r++)
    quantize(x + r * k, k, (int8_t *)buffer + r * k, (float *)(buffer + x8_bytes) + r * k / BLOCK,
             (int32_t *)(buffer + x8_bytes + sx_bytes) + r * k / 64 * 16);
  /* one contiguous run of rows per thread: each streams its own */
  const int64_t items = kk->threads < n ? kk->threads : n;
  c.items = items;
  if (items < 2 ||
      !ok(ORT(KERNEL_CONTEXT_PARALLEL_FOR, ParallelForFn)(ctx, int4_item, (size_t)items, (size_t)items, &c)))
    for (int64_t i = 0; i < items; i++) int4_item(&c, (size_t)i);
  free(buffer);
  return NULL;
}

static void *int4_create_v1(const OrtCustomOp *op, const void *api, const OrtKernelInfo *info) {
  void *kernel = NULL;
  return ok(int4_create(op, api, info, &kernel)) ? kernel : NULL;
}

static void int4_compute_v1(void *kernel, OrtKernelContext *ctx) { ok(int4_compute(kernel, ctx)); }
static const char *int4_name(const OrtCustomOp *op) { (void)op; return "MatMulInt4"; }
static int int4_input_type(const OrtCustomOp *op, size_t i) { (void)op; return i == 0 ? ELEM_FLOAT : ELEM_UINT8; }
static size_t int4_input_count(const OrtCustomOp *op) { (void)op; return 2; }
static int int4_output_type(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return ELEM_FLOAT; }
static size_t int4_output_count(const OrtCustomOp *op) { (void)op; return 1; }

const OrtCustomOp dspark_int4_op = {
    API_VERSION, int4_create_v1, int4_name, op_cpu_provider, int4_input_type, int4_input_count,
    int4_output_type, int4_output_count, int4_compute_v1, op_free_kernel, op_required,
    op_required, op_required, op_one, op_one, op_one, op_one, int4_create,
    int4_compute, NULL, NULL, NULL};
