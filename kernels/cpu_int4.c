/* MatMulInt4 as an onnxruntime custom op (domain ai.dspark), CPU: y = x W^T for 4-bit (or
   8-bit) weights in blocks of 32.

   What a MatMulNBits (4 or 8 bits, blocks of 32, accuracy level 4) computes, in a layout made
   for few input rows. A draft decode step reads ~80 MB of int4 weights right
   after the main's step evicted them; onnxruntime's kernel spent ~5 ms of SmolLM2's 6.3 ms draft
   forward there. A first version of this op (one streamed run of weight rows per thread, a dot
   product and a horizontal sum per row) took the forward to 4.7 ms, but spent 2.5 ms computing
   even with the weights in the cache: with K = 576 a row is 4.5 vectors, and its setup, tail
   and sum cost as much again. Here 16 weight rows are interleaved so that one vector's 16 int32
   lanes are 16 outputs: no horizontal sums, no tails, each input's 4 int8 values broadcast once
   per 16 outputs. The forward: 4.0 -> 2.7 ms with the weights cached, 6.6-7.0 -> 4.8-5.0 ms
   right after a main step (runtime/model/int4_rows.py rewrites the graph, packs the groups).

   inputs   0 x float [..., K]
            1 w uint8 [ceil(N/16), K/32, record]: per group of 16 outputs, per block of 32
              inputs, the weight vectors (4 of 64 bytes at 4 bits, 8 at 8), then the block's
              16 float16 scales, then with mins its 16 float16 mins (zeros past N)
   output   0 y float [..., N]
   attrs    K, N (int; K a multiple of 32), threads (int, default 1: the groups are split in
            that many runs over onnxruntime's intra-op pool), bits (4 or 8, default 4), mins
            (0 or 1, default 0), isa (below), isa_few (the path for calls of at most FEW_ROWS
            rows, default isa: the faster there, measured at load, runtime/model/int4_rows.py)

   At 4 bits vector v (0..3) of a block holds inputs k0 = 32b + 8v .. k0 + 7 of the group's 16
   rows: bytes 4i .. 4i+3 are row i's, byte 4i + j has input k0 + j in its low nibble and
   k0 + 4 + j in its high nibble, so one vpdpbusd multiplies 16 rows by 4 broadcast inputs. At
   8 bits vector v (0..7) holds inputs 32b + 4v .. +3, one byte each. Without mins a weight is
   scale * (stored - zero), zero 8 at 4 bits (MatMulNBits' symmetric default) and 128 at 8;
   with mins it is scale * stored + min (llama.cpp's Q4_1: a model whose weights came from such
   a file is held exactly, see int4_rows.py). Scales and mins are float16 (2^-11 relative).
   Arithmetic as MatMulNBits' accuracy level 4: each row of x is quantized to int8 per block
   of 32 (scale max|x| / 127), a block's dot product is exact in int32 (a zero point enters as
   -zero times the block's input sum, a min as min times that sum, scaled), and blocks are
   summed in float32, in order, one fused multiply-add each (two with mins). Not MatMulNBits'
   order, so results agree to rounding, not bits (`dsc verify` bounds that by the original's
   own int8 noise); but each row of x is computed alone and the same way whatever rows come
   with it, so a main's verify window scores each position exactly as decoding it would.

   Paths: the plain loops here, x86 vector paths (cpu_int4_x86.c: AVX2, AVX-VNNI, AVX-512,
   AVX-512 VNNI) and an aarch64 one (cpu_int4_arm.c: NEON with the dot product), each built
   for its own instruction set and chosen at run time by what the CPU reports (the best, or
   the one the attribute `isa` names: 0 generic, 1 avx2, 2 avx_vnni, 3 avx512, 4 avx512_vnni,
   5 neon_dotprod; one the CPU lacks is refused). All compute the same blocks in the same
   order and give the same bits. */

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_int4.h"
#include "ort_abi.h"

typedef struct {
  int64_t k, n, threads, bits, mins, isa, isa_few;
} Int4Kernel;

static int64_t record_of(const Int4Call *c) { return record_bytes(c->bits, c->mins); }
static int64_t group_bytes(const Int4Call *c) { return c->k / BLOCK * record_of(c); }

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

static float half_at(const uint8_t *p) {
  uint16_t h;
  memcpy(&h, p, sizeof(h));
  return half_float(h);
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
    zx[b] = sum;
  }
}

/* Row i's stored weight for input j (0..31) of a block record. */
static int32_t stored(const uint8_t *rec, int64_t bits, int i, int j) {
  if (bits == 8) return rec[64 * (j / 4) + 4 * i + j % 4];
  const uint8_t byte = rec[64 * (j / 8) + 4 * i + j % 4];
  return j % 8 < 4 ? byte & 15 : byte >> 4;
}

/* Group g against every row of x, plain loops: the same blocks, in the same order. */
static void group_plain(const Int4Call *c, int64_t g) {
  const int64_t k = c->k, blocks = k / BLOCK, record = record_of(c);
  const uint8_t *w = c->w + g * group_bytes(c);
  for (int64_t r = 0; r < c->rows; r++) {
    const int8_t *x8 = c->x8 + r * k;
    for (int i = 0; i < LANES && g * LANES + i < c->n; i++) {
      float acc = 0.f;
      for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *rec = w + b * record;
        const int32_t sum = c->zx[r * blocks + b];
        int32_t dot = -zero_point(c->bits, c->mins) * sum;
        for (int j = 0; j < BLOCK; j++) dot += stored(rec, c->bits, i, j) * x8[b * BLOCK + j];
        const float sx = c->sx[r * blocks + b];
        acc = fmaf((float)dot, half_at(rec + 64 * c->bits + 2 * i) * sx, acc);
        if (c->mins) acc = fmaf(half_at(rec + 64 * c->bits + 32 + 2 * i), sx * (float)sum, acc);
      }
      c->y[r * c->n + g * LANES + i] = acc;
    }
  }
}

/* Which paths this CPU runs: bit i set for path i (the plain loops always). */
int dspark_int4_paths(void) {
  int paths = 1 << ISA_GENERIC;
  for (int isa = ISA_GENERIC + 1; isa < ISA_COUNT; isa++)
    if (int4_x86_supported(isa) || int4_arm_supported(isa)) paths |= 1 << isa;
  return paths;
}

static int best_path(void) {
  const int paths = dspark_int4_paths();
  int best = ISA_GENERIC;
  for (int isa = 0; isa < ISA_COUNT; isa++)
    if (paths & (1 << isa)) best = isa;
  return best;
}

/* Groups g0 .. g1-1 on path `isa` (one this CPU runs). */
static void run_groups(int isa, const Int4Call *c, int64_t g0, int64_t g1) {
  if (isa != ISA_GENERIC &&
      (int4_groups_x86(isa, c, g0, g1) || int4_groups_arm(isa, c, g0, g1)))
    return;
  for (int64_t g = g0; g < g1; g++) group_plain(c, g);
}

typedef struct {
  Int4Call call;
  int isa;
} Int4Work;

static void int4_item(void *data, size_t item) {
  const Int4Work *work = (const Int4Work *)data;
  const Int4Call *c = &work->call;
  const int64_t per = (c->groups + c->items - 1) / c->items;
  const int64_t g0 = (int64_t)item * per;
  const int64_t g1 = g0 + per < c->groups ? g0 + per : c->groups;
  run_groups(work->isa, c, g0, g1);
}

/* One path alone, for the tests: y [rows, n] from x [rows, k] and packed w; 0 if the
   arguments are wrong or this CPU lacks the path. */
int dspark_int4_run(int64_t isa, const float *x, const uint8_t *w, float *y, int64_t rows,
                    int64_t k, int64_t n, int64_t bits, int64_t mins) {
  if (k % BLOCK != 0 || k < BLOCK || rows < 0 || n < 0 || (bits != 4 && bits != 8) ||
      (mins != 0 && mins != 1) || isa < 0 || isa >= ISA_COUNT ||
      !(dspark_int4_paths() & (1 << isa)))
    return 0;
  int8_t *x8 = (int8_t *)malloc((size_t)(rows * k) + 1);
  float *sx = (float *)malloc((size_t)(rows * k / BLOCK) * sizeof(float) + 4);
  int32_t *zx = (int32_t *)malloc((size_t)(rows * k / BLOCK) * sizeof(int32_t) + 4);
  if (x8 == NULL || sx == NULL || zx == NULL) {
    free(x8), free(sx), free(zx);
    return 0;
  }
  for (int64_t r = 0; r < rows; r++)
    quantize(x + r * k, k, x8 + r * k, sx + r * k / BLOCK, zx + r * k / BLOCK);
  const Int4Call c = {w, y, x8, sx, zx, k, n, rows, (n + LANES - 1) / LANES, 1, bits, mins};
  run_groups((int)isa, &c, 0, c.groups);
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
  if (!ok(ORT(KERNEL_INFO_GET_ATTRIBUTE_INT64, IntAttr)(info, "bits", &k->bits))) k->bits = 4;
  if (!ok(ORT(KERNEL_INFO_GET_ATTRIBUTE_INT64, IntAttr)(info, "mins", &k->mins))) k->mins = 0;
  if (!ok(ORT(KERNEL_INFO_GET_ATTRIBUTE_INT64, IntAttr)(info, "isa", &k->isa))) k->isa = -1;
  if ((k->bits != 4 && k->bits != 8) || (k->mins != 0 && k->mins != 1)) {
    free(k);
    return error("MatMulInt4: bits must be 4 or 8 and mins 0 or 1");
  }
  if (!ok(ORT(KERNEL_INFO_GET_ATTRIBUTE_INT64, IntAttr)(info, "isa_few", &k->isa_few)))
    k->isa_few = -1;
  if (k->isa < 0) k->isa = best_path();
  if (k->isa_few < 0) k->isa_few = k->isa;
  if (k->isa >= ISA_COUNT || !(dspark_int4_paths() & (1 << k->isa)) ||
      k->isa_few >= ISA_COUNT || !(dspark_int4_paths() & (1 << k->isa_few))) {
    free(k);
    return error("MatMulInt4: isa or isa_few names a path this CPU does not run");
  }
  *kernel = k;
  return NULL;
}

static OrtStatus *int4_compute(void *kernel, OrtKernelContext *ctx) {
  const Int4Kernel *kk = (const Int4Kernel *)kernel;
  const int64_t k = kk->k, n = kk->n, groups = (n + LANES - 1) / LANES;
  const int64_t record = record_bytes(kk->bits, kk->mins);
  Shape xs, ws;
  const float *x = (const float *)input(ctx, 0, &xs);
  const uint8_t *w = (const uint8_t *)input(ctx, 1, &ws);
  if (x == NULL || w == NULL) return error("MatMulInt4: an input is missing");
  if (xs.rank < 1 || xs.dims[xs.rank - 1] != k || ws.rank != 3 || ws.dims[0] != groups ||
      ws.dims[1] != k / BLOCK || ws.dims[2] != record)
    return error("MatMulInt4: x must be [..., K] and w [ceil(N/16), K/32, record] (record: "
                 "288 bytes at 4 bits, 544 at 8, 32 more with mins)");
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
  /* one contiguous run of groups per thread: each streams its own */
  const int64_t items = kk->threads < groups ? kk->threads : groups;
  Int4Work work = {{w, (float *)out, x8, sx, zx, k, n, rows, groups, items, kk->bits, kk->mins},
                   (int)(rows <= FEW_ROWS ? kk->isa_few : kk->isa)};
  if (items < 2 || dspark_solo ||
      !ok(ORT(KERNEL_CONTEXT_PARALLEL_FOR, ParallelForFn)(ctx, int4_item, (size_t)items,
                                                          (size_t)items, &work)))
    for (int64_t i = 0; i < items; i++) int4_item(&work, (size_t)i);
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
