/* MatMulInt4 as an onnxruntime custom op (domain ai.dspark), CPU: y = x W^T for 4-bit weights.

   What a draft model's MatMulNBits (4 bits, blocks of 32, symmetric, accuracy level 4) computes,
   in a layout made for few input rows. A draft decode step reads ~80 MB of int4 weights right
   after the main's step evicted them; onnxruntime's kernel spent ~5 ms of SmolLM2's 6.3 ms draft
   forward there. A first version of this op (one streamed run of weight rows per thread, a dot
   product and a horizontal sum per row) took the forward to 4.7 ms, but spent 2.5 ms computing
   even with the weights in the cache: with K = 576 a row is 4.5 vectors, and its setup, tail
   and sum cost as much again. Here 16 weight rows are interleaved so that one vector's 16 int32
   lanes are 16 outputs: no horizontal sums, no tails, each input's 4 int8 values broadcast once
   per 16 outputs. The forward: 4.0 -> 2.7 ms with the weights cached, 6.6-7.0 -> 4.8-5.0 ms
   right after a main step (runtime/model/int4_rows.py rewrites the graph, packs the groups).

   inputs   0 x float [..., K]
            1 w uint8 [ceil(N/16), K/32, 288]: per group of 16 outputs, per block of 32 inputs,
              4 vectors of 64 bytes, then the block's 16 float16 scales (zeros past N)
   output   0 y float [..., N]
   attrs    K, N (int; K a multiple of 32), threads (int, default 1: the groups are split in
            that many runs over onnxruntime's intra-op pool)

   Vector v (0..3) of block b holds inputs k0 = 32b + 8v .. k0 + 7 of the group's 16 rows:
   bytes 4i .. 4i+3 are row i's, byte 4i + j has input k0 + j in its low nibble and k0 + 4 + j
   in its high nibble, so one vpdpbusd multiplies 16 rows by 4 broadcast inputs. A weight is
   scale * (nibble - 8), MatMulNBits' symmetric 4-bit with its default zero point; its float32
   scales are stored as float16 (2^-11 relative, against int4's 1/16 steps). Arithmetic as
   MatMulNBits' accuracy level 4: each row of x is quantized to int8 per block of 32 (scale
   max|x| / 127), a block's dot product is exact in int32 (the zero point enters as -8 times the
   block's input sum), and blocks are summed in float32, in order, one fused multiply-add each.
   Not MatMulNBits' order, so results agree to rounding, not bits: a draft's proposals only
   (the main verifies every token), never a main's arithmetic.

   With AVX-512 VNNI (dspark_int4_fast() = 1) a block is 4 loads, 8 nibble masks and, per row
   of x (up to 4 per pass over the weights), 8 vpdpbusd on broadcast inputs; elsewhere plain
   loops compute the same blocks, in the same order (the runtime only rewrites graphs where the
   fast path is built). */

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ort_abi.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__)
#include <immintrin.h>
#define INT4_FAST 1
#else
#define INT4_FAST 0
#endif

enum { BLOCK = 32, LANES = 16, RECORD = 288, GROUP = 4, PREFETCH = 8192 };

int dspark_int4_fast(void) { return INT4_FAST; }

typedef struct {
  int64_t k, n, threads;
} Int4Kernel;

/* One call: x quantized (x8 [rows, K] int8, sx [rows, K/32] its scales, zx [rows, K/32] each
   block's zero-point term -8 * sum of its int8 inputs). */
typedef struct {
  const uint8_t *w;
  float *y;
  const int8_t *x8;
  const float *sx;
  const int32_t *zx;
  int64_t k, n, rows, groups, items;
} Int4Call;

static int64_t group_bytes(int64_t k) { return k / BLOCK * RECORD; }

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

static void quantize(const float *x, int64_t k, int8_t *x8, float *sx, int32_t *zx) {
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
    zx[b] = -8 * sum;
  }
}

/* Group g against every row of x, plain loops: the same blocks, in the same order. */
static void group_plain(const Int4Call *c, int64_t g) {
  const int64_t k = c->k, blocks = k / BLOCK;
  const uint8_t *w = c->w + g * group_bytes(k);
  for (int64_t r = 0; r < c->rows; r++) {
    const int8_t *x8 = c->x8 + r * k;
    for (int i = 0; i < LANES && g * LANES + i < c->n; i++) {
      float acc = 0.f;
      for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *rec = w + b * RECORD;
        int32_t dot = c->zx[r * blocks + b];
        for (int v = 0; v < 4; v++)
          for (int j = 0; j < 4; j++) {
            const uint8_t byte = rec[64 * v + 4 * i + j];
            const int64_t k0 = b * BLOCK + 8 * v;
            dot += (byte & 15) * x8[k0 + j] + (byte >> 4) * x8[k0 + 4 + j];
          }
        uint16_t h;
        memcpy(&h, rec + 256 + 2 * i, sizeof(h));
        acc = fmaf((float)dot, half_float(h) * c->sx[r * blocks + b], acc);
      }
      c->y[r * c->n + g * LANES + i] = acc;
    }
  }
}

#if INT4_FAST
static inline __m512i broadcast4(const int8_t *p) {
  int32_t v;
  memcpy(&v, p, sizeof(v));
  return _mm512_set1_epi32(v);
}

/* Rows r0 .. r0+R-1 of x against group g: each block's weights unpacked once for all R. */
static inline __attribute__((always_inline)) void group_fast(const Int4Call *c, int64_t g,
                                                             int64_t r0, int R) {
  const int64_t k = c->k, blocks = k / BLOCK;
  const uint8_t *w = c->w + g * group_bytes(k);
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[GROUP];
  for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; b++) {
    const uint8_t *rec = w + b * RECORD;
    for (int o = 0; o < RECORD; o += 64) _mm_prefetch((const char *)rec + PREFETCH + o, _MM_HINT_T0);
    __m512i lo[4], hi[4];
    for (int v = 0; v < 4; v++) {
      const __m512i q = _mm512_loadu_si512(rec + 64 * v);
      lo[v] = _mm512_and_si512(q, low);
      hi[v] = _mm512_and_si512(_mm512_srli_epi16(q, 4), low);
    }
    const __m512 ws = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + 256)));
    for (int r = 0; r < R; r++) {
      const int64_t row = r0 + r;
      const int8_t *xb = c->x8 + row * k + b * BLOCK;
      /* two chains of four: vpdpbusd's latency, not its rate, would bound one of eight */
      __m512i d0 = _mm512_set1_epi32(c->zx[row * blocks + b]), d1 = _mm512_setzero_si512();
      for (int v = 0; v < 4; v++) {
        d0 = _mm512_dpbusd_epi32(d0, lo[v], broadcast4(xb + 8 * v));
        d1 = _mm512_dpbusd_epi32(d1, hi[v], broadcast4(xb + 8 * v + 4));
      }
      const __m512 scale = _mm512_mul_ps(ws, _mm512_set1_ps(c->sx[row * blocks + b]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(d0, d1)), scale, acc[r]);
    }
  }
  const int64_t outs = c->n - g * LANES < LANES ? c->n - g * LANES : LANES;
  const __mmask16 mask = (__mmask16)(outs >= LANES ? 0xFFFF : (1u << outs) - 1);
  for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(c->y + (r0 + r) * c->n + g * LANES, mask, acc[r]);
}

static void groups_fast(const Int4Call *c, int64_t g0, int64_t g1) {
  const uint8_t *start = c->w + g0 * group_bytes(c->k);
  for (int64_t o = 0; o < PREFETCH; o += 64) _mm_prefetch((const char *)(start + o), _MM_HINT_T0);
  for (int64_t g = g0; g < g1; g++)
    for (int64_t r0 = 0; r0 < c->rows; r0 += GROUP) {
      switch (c->rows - r0 < GROUP ? c->rows - r0 : GROUP) {
        case 1: group_fast(c, g, r0, 1); break;
        case 2: group_fast(c, g, r0, 2); break;
        case 3: group_fast(c, g, r0, 3); break;
        default: group_fast(c, g, r0, 4); break;
      }
    }
}
#endif

static void int4_item(void *data, size_t item) {
  const Int4Call *c = (const Int4Call *)data;
  const int64_t per = (c->groups + c->items - 1) / c->items;
  const int64_t g0 = (int64_t)item * per;
  const int64_t g1 = g0 + per < c->groups ? g0 + per : c->groups;
#if INT4_FAST
  groups_fast(c, g0, g1);
#else
  for (int64_t g = g0; g < g1; g++) group_plain(c, g);
#endif
}

/* The plain loops, for the tests: y [rows, n] from x [rows, k] and packed w. */
int dspark_int4_reference(const float *x, const uint8_t *w, float *y, int64_t rows, int64_t k,
                          int64_t n) {
  if (k % BLOCK != 0 || k < BLOCK || rows < 0 || n < 0) return 0;
  int8_t *x8 = (int8_t *)malloc((size_t)(rows * k) + 1);
  float *sx = (float *)malloc((size_t)(rows * k / BLOCK) * sizeof(float) + 4);
  int32_t *zx = (int32_t *)malloc((size_t)(rows * k / BLOCK) * sizeof(int32_t) + 4);
  if (x8 == NULL || sx == NULL || zx == NULL) {
    free(x8), free(sx), free(zx);
    return 0;
  }
  for (int64_t r = 0; r < rows; r++)
    quantize(x + r * k, k, x8 + r * k, sx + r * k / BLOCK, zx + r * k / BLOCK);
  const Int4Call c = {w, y, x8, sx, zx, k, n, rows, (n + LANES - 1) / LANES, 1};
  for (int64_t g = 0; g < c.groups; g++) group_plain(&c, g);
  free(x8), free(sx), free(zx);
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
      !ok(ORT(KERNEL_INFO_GET_ATTRIBUTE_INT64, IntAttr)(info, "N", &k->n)) || k->k < BLOCK ||
      k->k % BLOCK != 0 || k->n < 1) {
    free(k);
    return error("MatMulInt4: attributes K (a multiple of 32) and N (>= 1) are needed");
  }
  if (!ok(ORT(KERNEL_INFO_GET_ATTRIBUTE_INT64, IntAttr)(info, "threads", &k->threads)) ||
      k->threads < 1)
    k->threads = 1;
  *kernel = k;
  return NULL;
}

static OrtStatus *int4_compute(void *kernel, OrtKernelContext *ctx) {
  const Int4Kernel *kk = (const Int4Kernel *)kernel;
  const int64_t k = kk->k, n = kk->n, groups = (n + LANES - 1) / LANES;
  Shape xs, ws;
  const float *x = (const float *)input(ctx, 0, &xs);
  const uint8_t *w = (const uint8_t *)input(ctx, 1, &ws);
  if (x == NULL || w == NULL) return error("MatMulInt4: an input is missing");
  if (xs.rank < 1 || xs.dims[xs.rank - 1] != k || ws.rank != 3 || ws.dims[0] != groups ||
      ws.dims[1] != k / BLOCK || ws.dims[2] != RECORD)
    return error("MatMulInt4: x must be [..., K] and w [ceil(N/16), K/32, 288]");
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
  /* one buffer: x8, then sx, then zx (64-byte aligned pieces) */
  const size_t x8_bytes = (size_t)(rows * k + 63) / 64 * 64;
  const size_t sx_bytes = (size_t)(rows * k / BLOCK * 4 + 63) / 64 * 64;
  const size_t zx_bytes = (size_t)(rows * k / BLOCK * 4 + 63) / 64 * 64;
  uint8_t *buffer = (uint8_t *)aligned_alloc(64, x8_bytes + sx_bytes + zx_bytes);
  if (buffer == NULL) return error("MatMulInt4: out of memory");
  int8_t *x8 = (int8_t *)buffer;
  float *sx = (float *)(buffer + x8_bytes);
  int32_t *zx = (int32_t *)(buffer + x8_bytes + sx_bytes);
  for (int64_t r = 0; r < rows; r++)
    quantize(x + r * k, k, x8 + r * k, sx + r * k / BLOCK, zx + r * k / BLOCK);
  Int4Call c = {w, (float *)out, x8, sx, zx, k, n, rows, groups, 1};
  /* one contiguous run of groups per thread: each streams its own */
  const int64_t items = kk->threads < groups ? kk->threads : groups;
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

const OrtCustomOp dspark_int4_op = {
    API_VERSION, int4_create_v1, int4_name, op_cpu_provider, int4_input_type, int4_input_count,
    int4_output_type, op_one_count, int4_compute_v1, op_free_kernel, op_required,
    op_required, op_required, op_one, op_one, op_one, op_one, int4_create,
    int4_compute, NULL, NULL, NULL};
