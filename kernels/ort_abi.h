/* onnxruntime's stable C ABI as the CPU custom ops use it (cpu_op.c, cpu_int4.c).

   OrtApi is a table of function pointers that only ever grows, so a slot index stays valid in
   every later release (indices below). No onnxruntime header is needed to build. */

#ifndef DSPARK_ORT_ABI_H
#define DSPARK_ORT_ABI_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

typedef struct OrtStatus OrtStatus;
typedef struct OrtKernelInfo OrtKernelInfo;
typedef struct OrtKernelContext OrtKernelContext;
typedef struct OrtValue OrtValue;
typedef struct OrtSessionOptions OrtSessionOptions;
typedef struct OrtCustomOpDomain OrtCustomOpDomain;
typedef struct OrtShapeInfo OrtShapeInfo;

typedef struct OrtApiBase {
  const void *(*GetApi)(uint32_t version);
  const char *(*GetVersionString)(void);
} OrtApiBase;

/* The custom op descriptor as of API version 17 (onnxruntime reads the fields its version has). */
typedef struct OrtCustomOp {
  uint32_t version;
  void *(*CreateKernel)(const struct OrtCustomOp *op, const void *api, const OrtKernelInfo *info);
  const char *(*GetName)(const struct OrtCustomOp *op);
  const char *(*GetExecutionProviderType)(const struct OrtCustomOp *op);
  int (*GetInputType)(const struct OrtCustomOp *op, size_t index);
  size_t (*GetInputTypeCount)(const struct OrtCustomOp *op);
  int (*GetOutputType)(const struct OrtCustomOp *op, size_t index);
  size_t (*GetOutputTypeCount)(const struct OrtCustomOp *op);
  void (*KernelCompute)(void *kernel, OrtKernelContext *context);
  void (*KernelDestroy)(void *kernel);
  int (*GetInputCharacteristic)(const struct OrtCustomOp *op, size_t index);
  int (*GetOutputCharacteristic)(const struct OrtCustomOp *op, size_t index);
  int (*GetInputMemoryType)(const struct OrtCustomOp *op, size_t index);
  int (*GetVariadicInputMinArity)(const struct OrtCustomOp *op);
  int (*GetVariadicInputHomogeneity)(const struct OrtCustomOp *op);
  int (*GetVariadicOutputMinArity)(const struct OrtCustomOp *op);
  int (*GetVariadicOutputHomogeneity)(const struct OrtCustomOp *op);
  OrtStatus *(*CreateKernelV2)(const struct OrtCustomOp *op, const void *api,
                               const OrtKernelInfo *info, void **kernel);
  OrtStatus *(*KernelComputeV2)(void *kernel, OrtKernelContext *context);
  OrtStatus *(*InferOutputShapeFn)(const struct OrtCustomOp *op, void *context);
  int (*GetStartVersion)(const struct OrtCustomOp *op);
  int (*GetEndVersion)(const struct OrtCustomOp *op);
} OrtCustomOp;

/* OrtApi slots (0-based) and the API version that has them all (ParallelFor: 1.17). */
enum {
  API_VERSION = 17,
  CREATE_STATUS = 0,
  CREATE_CUSTOM_OP_DOMAIN = 26,
  CUSTOM_OP_DOMAIN_ADD = 27,
  ADD_CUSTOM_OP_DOMAIN = 28,
  GET_TENSOR_MUTABLE_DATA = 51,
  GET_DIMENSIONS_COUNT = 61,
  GET_DIMENSIONS = 62,
  GET_TENSOR_TYPE_AND_SHAPE = 65,
  KERNEL_INFO_GET_ATTRIBUTE_FLOAT = 85,
  KERNEL_INFO_GET_ATTRIBUTE_INT64 = 86,
  KERNEL_INFO_GET_ATTRIBUTE_STRING = 87,
  KERNEL_CONTEXT_GET_INPUT = 90,
  KERNEL_CONTEXT_GET_OUTPUT = 91,
  RELEASE_STATUS = 93,
  RELEASE_TENSOR_TYPE_AND_SHAPE_INFO = 99,
  KERNEL_CONTEXT_PARALLEL_FOR = 274,
};

enum { ELEM_FLOAT = 1, ELEM_UINT8 = 2, ELEM_INT64 = 7, ERR_INVALID_ARGUMENT = 2 };

extern void *const *ort; /* the OrtApi table (cpu_op.c sets it) */
/* Nonzero: our ops run their work items in turn on the calling thread, not on onnxruntime's
   pool (dspark_set_solo, runtime/model/load_gate.py: while other processes hold the cores
   the pool counts on). An item is computed the same either way. */
extern volatile int dspark_solo;
#define ORT(slot, type) ((type)ort[slot])

typedef OrtStatus *(*GetInputFn)(const OrtKernelContext *, size_t, const OrtValue **);
typedef OrtStatus *(*GetOutputFn)(OrtKernelContext *, size_t, const int64_t *, size_t,
                                  OrtValue **);
typedef OrtStatus *(*MutableDataFn)(OrtValue *, void **);
typedef OrtStatus *(*TypeShapeFn)(const OrtValue *, OrtShapeInfo **);
typedef OrtStatus *(*DimsCountFn)(const OrtShapeInfo *, size_t *);
typedef OrtStatus *(*DimsFn)(const OrtShapeInfo *, int64_t *, size_t);
typedef void (*ReleaseShapeFn)(OrtShapeInfo *);
typedef void (*ReleaseStatusFn)(OrtStatus *);
typedef OrtStatus *(*ParallelForFn)(const OrtKernelContext *, void (*)(void *, size_t), size_t,
                                    size_t, void *);

typedef OrtStatus *(*CreateStatusFn)(int, const char *);

static inline OrtStatus *error(const char *what) {
  return ORT(CREATE_STATUS, CreateStatusFn)(ERR_INVALID_ARGUMENT, what);
}

static inline int ok(OrtStatus *status) {
  if (status == NULL) return 1;
  ORT(RELEASE_STATUS, ReleaseStatusFn)(status);
  return 0;
}

enum { MAX_RANK = 8 };

typedef struct {
  int64_t dims[MAX_RANK];
  size_t rank;
  int64_t count;
} Shape;

static inline int shape_of(const OrtValue *value, Shape *shape) {
  OrtShapeInfo *info = NULL;
  if (!ok(ORT(GET_TENSOR_TYPE_AND_SHAPE, TypeShapeFn)(value, &info))) return 0;
  int good = ok(ORT(GET_DIMENSIONS_COUNT, DimsCountFn)(info, &shape->rank)) &&
             shape->rank <= MAX_RANK &&
             ok(ORT(GET_DIMENSIONS, DimsFn)(info, shape->dims, shape->rank));
  ORT(RELEASE_TENSOR_TYPE_AND_SHAPE_INFO, ReleaseShapeFn)(info);
  shape->count = 1;
  for (size_t i = 0; good && i < shape->rank; i++) shape->count *= shape->dims[i];
  return good;
}

/* Input i's data (NULL if it is missing), its shape into `shape` if given. An empty tensor
   (a mixture of experts' expert that no token picked) may have no buffer; its callers read
   nothing from it, so it gets a valid address all the same. */
static inline const void *input(OrtKernelContext *ctx, size_t i, Shape *shape) {
  static const int64_t empty[1] = {0};
  const OrtValue *value = NULL;
  void *data = NULL;
  Shape local;
  if (!ok(ORT(KERNEL_CONTEXT_GET_INPUT, GetInputFn)(ctx, i, &value)) || value == NULL) return NULL;
  if (shape != NULL && !shape_of(value, shape)) return NULL;
  if (!ok(ORT(GET_TENSOR_MUTABLE_DATA, MutableDataFn)((OrtValue *)value, &data))) return NULL;
  if (data != NULL) return data;
  if (shape == NULL && !shape_of(value, &local)) return NULL;
  return (shape != NULL ? shape : &local)->count == 0 ? (const void *)empty : NULL;
}

/* Descriptor callbacks every CPU op here shares: kernels freed with free(), the CPU provider,
   every input and output required, each variadic field 1, one output. */
static inline void op_free_kernel(void *kernel) { free(kernel); }
static inline const char *op_cpu_provider(const OrtCustomOp *op) {
  (void)op;
  return "CPUExecutionProvider";
}
static inline int op_required(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return 0; }
static inline int op_one(const OrtCustomOp *op) { (void)op; return 1; }
static inline size_t op_one_count(const OrtCustomOp *op) { (void)op; return 1; }

/* A row op's rows as work items of `per_item` rows: a prompt's many rows (more than 65536
   values) on onnxruntime's pool in up to 64 items, a few rows (or any, while the solo switch
   is on) in one item on the calling thread. An item's rows are computed the same either way. */
enum { ROW_PARALLEL_VALUES = 1 << 16 };

static inline void run_rows(OrtKernelContext *ctx, void (*fn)(void *, size_t), void *data,
                            int64_t rows, int64_t values, int64_t *per_item) {
  const int64_t items = dspark_solo || values < ROW_PARALLEL_VALUES ? 1 : rows < 64 ? rows : 64;
  *per_item = (rows + items - 1) / items;
  if (items < 2 || !ok(ORT(KERNEL_CONTEXT_PARALLEL_FOR, ParallelForFn)(ctx, fn, (size_t)items,
                                                                       0, data)))
    for (int64_t i = 0; i < items; i++) fn(data, (size_t)i);
}
#endif
