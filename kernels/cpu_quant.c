/* QuantizeTokens(x) -> (y, scale, zero_point): each row of x (its last axis, one token's
   features) quantized to uint8 as onnxruntime's DynamicQuantizeLinear quantizes a one-row
   tensor, in one op in place of the 19 ONNX ops compiler/passes/token_quant.py writes for it
   (runtime/model/quant_rows.py rewrites the graph):

     low, high   = min(min(row), 0), max(max(row), 0)
     scale       = (high - low) / 255, or 1 where high == low
     zero point  = rint(clamp(0 - low / scale, 0, 255))
     y           = clamp(rint(x / scale) + zero point, 0, 255)

   Bit for bit the ONNX ops': this file is compiled without -ffast-math (kernels/cpu_op.py,
   EXACT), so x / scale is a division, not a product with 1 / scale, and rintf rounds half to
   even as onnxruntime's Round does. A row's values depend on that row alone. */

#include <math.h>
#include <string.h>

#include "ort_abi.h"

typedef struct {
  const float *x;
  uint8_t *y, *zero_point;
  float *scale;
  int64_t rows, dim, per_item;
} QuantWork;

static void quantize_row(const float *x, int64_t dim, uint8_t *y, float *scale_out,
                         uint8_t *zero_out) {
  float low = 0.0f, high = 0.0f;
  for (int64_t i = 0; i < dim; i++) {
    low = x[i] < low ? x[i] : low;
    high = x[i] > high ? x[i] : high;
  }
  const float span = high - low;
  const float scale = span == 0.0f ? 1.0f : span / 255.0f;
  float zero = 0.0f - low / scale;
  zero = rintf(zero < 0.0f ? 0.0f : zero > 255.0f ? 255.0f : zero);
  for (int64_t i = 0; i < dim; i++) {
    const float q = rintf(x[i] / scale) + zero;
    y[i] = (uint8_t)(q < 0.0f ? 0.0f : q > 255.0f ? 255.0f : q);
  }
  *scale_out = scale;
  *zero_out = (uint8_t)zero;
}

static void quant_item(void *data, size_t item) {
  const QuantWork *w = (const QuantWork *)data;
  const int64_t r0 = (int64_t)item * w->per_item;
  const int64_t r1 = r0 + w->per_item < w->rows ? r0 + w->per_item : w->rows;
  for (int64_t r = r0; r < r1; r++)
    quantize_row(w->x + r * w->dim, w->dim, w->y + r * w->dim, w->scale + r, w->zero_point + r);
}

static OrtStatus *quant_output(OrtKernelContext *ctx, size_t i, const Shape *s, void **data) {
  OrtValue *value = NULL;
  if (!ok(ORT(KERNEL_CONTEXT_GET_OUTPUT, GetOutputFn)(ctx, i, s->dims, s->rank, &value)) ||
      !ok(ORT(GET_TENSOR_MUTABLE_DATA, MutableDataFn)(value, data)))
    return error("QuantizeTokens: cannot create an output");
  return NULL;
}

static OrtStatus *quant_compute(void *kernel, OrtKernelContext *ctx) {
  (void)kernel;
  Shape xs;
  QuantWork w = {NULL, NULL, NULL, NULL, 0, 0, 0};
  w.x = (const float *)input(ctx, 0, &xs);
  if (w.x == NULL || xs.rank < 1) return error("QuantizeTokens: x must be [..., dim]");
  Shape per_row = xs;
  per_row.dims[per_row.rank - 1] = 1;
  void *y = NULL, *scale = NULL, *zero = NULL;
  OrtStatus *status = quant_output(ctx, 0, &xs, &y);
  if (status == NULL) status = quant_output(ctx, 1, &per_row, &scale);
  if (status == NULL) status = quant_output(ctx, 2, &per_row, &zero);
  if (status != NULL) return status;
  w.y = (uint8_t *)y, w.scale = (float *)scale, w.zero_point = (uint8_t *)zero;
  w.dim = xs.dims[xs.rank - 1];
  if (w.dim == 0 || xs.count == 0) return NULL;
  w.rows = xs.count / w.dim;
  run_rows(ctx, quant_item, &w, w.rows, xs.count, &w.per_item);
  return NULL;
}

static OrtStatus *quant_create(const OrtCustomOp *op, const void *api, const OrtKernelInfo *info,
                               void **kernel) {
  (void)op, (void)api, (void)info;
  *kernel = calloc(1, 1);
  return *kernel == NULL ? error("QuantizeTokens: out of memory") : NULL;
}

static void *quant_create_v1(const OrtCustomOp *op, const void *api, const OrtKernelInfo *info) {
  void *kernel = NULL;
  return ok(quant_create(op, api, info, &kernel)) ? kernel : NULL;
}

static const char *quant_name(const OrtCustomOp *op) { (void)op; return "QuantizeTokens"; }
static int quant_in_type(const OrtCustomOp *op, size_t i) { (void)op, (void)i; return ELEM_FLOAT; }
static int quant_out_type(const OrtCustomOp *op, size_t i) {
  (void)op;
  return i == 1 ? ELEM_FLOAT : ELEM_UINT8;
}
static size_t quant_outputs(const OrtCustomOp *op) { (void)op; return 3; }
static void quant_compute_v1(void *kernel, OrtKernelContext *ctx) {
  ok(quant_compute(kernel, ctx));
}

const OrtCustomOp dspark_quantize_tokens_op = {
    API_VERSION, quant_create_v1, quant_name, op_cpu_provider, quant_in_type, op_one_count,
    quant_out_type, quant_outputs, quant_compute_v1, op_free_kernel, op_required, op_required,
    op_required, op_one, op_one, op_one, op_one, quant_create, quant_compute, NULL, NULL, NULL};
