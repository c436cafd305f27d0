/* Row-wise ops of our own, in place of onnxruntime's norms and SiLU in a fused CPU model
   (runtime/model/row_ops.py rewrites the graph):

     RmsNorm(x, scale) -> y                 y = x / sqrt(mean(x^2) + epsilon) * scale
     SkipRmsNorm(x, skip, scale) -> (y, s)  s = x + skip, y = RmsNorm(s, scale)
     Silu(x) -> y                           y = x * sigmoid(x) = x / (1 + exp(-x))

   Why ours: onnxruntime's SimplifiedLayerNormalization and QuickGelu hand a forward of two or
   more rows to the intra-op pool, so while other processes hold the cores (load_gate.py) a
   verify woke the pool's threads, which then spun against the forwards after it (SmolLM2 int4
   under load: decodes after a 4-token verify 8.7 ms, after a decode 5.7). These run on the pool
   only for many rows (a prompt), never while the library's solo switch is on.

   Every row and element is computed by the same code wherever it sits: sums in 16 fixed lanes
   and the elementwise work in blocks of 16, a row's last partial block through a zero-padded
   copy. So a token's values do not depend on the rows beside it or on the addresses (a vector
   expf and a scalar one may differ in the last bit), and a verify gives a decode's bits. */

#include <math.h>
#include <string.h>

#include "ort_abi.h"

enum { LANES16 = 16 };

typedef enum { RMS_NORM, SKIP_RMS_NORM, SILU } RowKind;

typedef struct {
  RowKind kind;
  float epsilon;
} RowKernel;

typedef struct {
  const RowKernel *k;
  const float *x, *skip, *scale;
  float *y, *sum;
  int64_t rows, dim, per_item;
} RowWork;

/* sum of squares of 16 values into the 16 lanes */
static inline void square_into(const float *v, float *acc) {
  for (int j = 0; j < LANES16; j++) acc[j] += v[j] * v[j];
}

static inline float lanes_total(const float *acc) {
  float half[8];
  for (int j = 0; j < 8; j++) half[j] = acc[j] + acc[j + 8];
  for (int j = 0; j < 4; j++) half[j] += half[j + 4];
  return (half[0] + half[2]) + (half[1] + half[3]);
}

static inline void scale16(const float *v, float inv, const float *w, float *out) {
  for (int j = 0; j < LANES16; j++) out[j] = v[j] * inv * w[j];
}

static inline void silu16(const float *v, float *out) {
  for (int j = 0; j < LANES16; j++) out[j] = v[j] / (1.0f + expf(-v[j]));
}

static void norm_row(const RowKernel *k, const float *x, const float *scale, float *y,
                     int64_t dim) {
  float acc[LANES16] = {0};
  int64_t i = 0;
  for (; i + LANES16 <= dim; i += LANES16) square_into(x + i, acc);
  float pad[LANES16] = {0}, wpad[LANES16] = {0}, out[LANES16];
  const int64_t tail = dim - i;
  if (tail) {
    memcpy(pad, x + i, (size_t)tail * sizeof(float));
    square_into(pad, acc);
  }
  const float inv = 1.0f / sqrtf(lanes_total(acc) / (float)dim + k->epsilon);
  for (i = 0; i + LANES16 <= dim; i += LANES16) scale16(x + i, inv, scale + i, y + i);
  if (tail) {
    memcpy(wpad, scale + i, (size_t)tail * sizeof(float));
    scale16(pad, inv, wpad, out);
    memcpy(y + i, out, (size_t)tail * sizeof(float));
  }
}

static void silu_row(const float *x, float *y, int64_t dim) {
  int64_t i = 0;
  for (; i + LANES16 <= dim; i += LANES16) silu16(x + i, y + i);
  if (i < dim) {
    float pad[LANES16] = {0}, out[LANES16];
    memcpy(pad, x + i, (size_t)(dim - i) * sizeof(float));
    silu16(pad, out);
    memcpy(y + i, out, (size_t)(dim - i) * sizeof(float));
  }
}

static void row_item(void *data, size_t item) {
  const RowWork *w = (const RowWork *)data;
  const int64_t r0 = (int64_t)item * w->per_item;
  const int64_t r1 = r0 + w->per_item < w->rows ? r0 + w->per_item : w->rows;
  for (int64_t r = r0; r < r1; r++) {
    const int64_t at = r * w->dim;
    if (w->k->kind == SILU) {
      silu_row(w->x + at, w->y + at, w->dim);
      continue;
    }
    const float *x = w->x + at;
    if (w->k->kind == SKIP_RMS_NORM) {
      for (int64_t i = 0; i < w->dim; i++) w->sum[at + i] = x[i] + w->skip[at + i];
      x = w->sum + at;
    }
    norm_row(w->k, x, w->scale, w->y + at, w->dim);
  }
}

static OrtStatus *row_create(const OrtCustomOp *op, const void *api, const OrtKernelInfo *info,
                             void **kernel, RowKind kind) {
  (void)op;
  (void)api;
  typedef OrtStatus *(*FloatAttr)(const OrtKernelInfo *, const char *, float *);
  RowKernel *k = (RowKernel *)calloc(1, sizeof(RowKernel));
  if (k == NULL) return error("dspark row op: out of memory");
  k->kind = kind;
  if (kind != SILU &&
      (!ok(ORT(KERNEL_INFO_GET_ATTRIBUTE_FLOAT, FloatAttr)(info, "epsilon", &k->epsilon)) ||
       !(k->epsilon >= 0.0f))) {
    free(k);
    return error("RmsNorm: attribute epsilon (>= 0) is needed");
  }
  *kernel = k;
  return NULL;
}

static OrtStatus *row_output(OrtKernelContext *ctx, size_t i, const Shape *s, float **data) {
  OrtValue *value = NULL;
  void *out = NULL;
  if (!ok(ORT(KERNEL_CONTEXT_GET_OUTPUT, GetOutputFn)(ctx, i, s->dims, s->rank, &value)) ||
      !ok(ORT(GET_TENSOR_MUTABLE_DATA, MutableDataFn)(value, &out)))
    return error("dspark row op: cannot create an output");
  *data = (float *)out;
  return NULL;
}

static OrtStatus *row_compute(void *kernel, OrtKernelContext *ctx) {
  const RowKernel *k = (const RowKernel *)kernel;
  Shape xs, ss, ws;
  RowWork w = {k, NULL, NULL, NULL, NULL, NULL, 0, 0, 0};
  w.x = (const float *)input(ctx, 0, &xs);
  if (w.x == NULL || xs.rank < 1) return error("dspark row op: x must be [..., dim]");
  w.dim = xs.dims[xs.rank - 1];
  if (k->kind == SKIP_RMS_NORM) {
    w.skip = (const float *)input(ctx, 1, &ss);
    if (w.skip == NULL || ss.count != xs.count)
      return error("SkipRmsNorm: skip must have x's shape");
  }
  if (k->kind != SILU) {
    w.scale = (const float *)input(ctx, k->kind == SKIP_RMS_NORM ? 2 : 1, &ws);
    if (w.scale == NULL || ws.count != w.dim)
      return error("RmsNorm: scale must hold x's last dimension");
  }
  OrtStatus *status = row_output(ctx, 0, &xs, &w.y);
  if (status == NULL && k->kind == SKIP_RMS_NORM) status = row_output(ctx, 1, &xs, &w.sum);
  if (status != NULL) return status;
  if (w.dim == 0 || xs.count == 0) return NULL;
  w.rows = xs.count / w.dim;
  run_rows(ctx, row_item, &w, w.rows, xs.count, &w.per_item);
  return NULL;
}

#define ROW_OP(prefix, NAME, KIND, INPUTS, OUTPUTS)                                            \
  static OrtStatus *prefix##_create(const OrtCustomOp *op, const void *api,                  \
                                    const OrtKernelInfo *info, void **kernel) {              \
    return row_create(op, api, info, kernel, KIND);                                          \
  }                                                                                          \
  static void *prefix##_create_v1(const OrtCustomOp *op, const void *api,                    \
                                  const OrtKernelInfo *info) {                               \
    void *kernel = NULL;                                                                     \
    return ok(prefix##_create(op, api, info, &kernel)) ? kernel : NULL;                      \
  }                                                                                          \
  static const char *prefix##_name(const OrtCustomOp *op) { (void)op; return NAME; }         \
  static size_t prefix##_inputs(const OrtCustomOp *op) { (void)op; return INPUTS; }          \
  static size_t prefix##_outputs(const OrtCustomOp *op) { (void)op; return OUTPUTS; }        \
  const OrtCustomOp dspark_##prefix##_op = {                                                 \
      API_VERSION, prefix##_create_v1, prefix##_name, op_cpu_provider, row_type,             \
      prefix##_inputs, row_type, prefix##_outputs, row_compute_v1, op_free_kernel,           \
      op_required, op_required, op_required, op_one, op_one, op_one, op_one,                 \
      prefix##_create, row_compute, NULL, NULL, NULL};

static int row_type(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return ELEM_FLOAT; }
static void row_compute_v1(void *kernel, OrtKernelContext *ctx) { ok(row_compute(kernel, ctx)); }

ROW_OP(rms_norm, "RmsNorm", RMS_NORM, 2, 1)
ROW_OP(skip_rms_norm, "SkipRmsNorm", SKIP_RMS_NORM, 3, 2)
ROW_OP(silu, "Silu", SILU, 1, 1)
