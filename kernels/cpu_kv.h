/* The KV cache's row storage (cpu_kv.c): float32, float16, or int8 with a float32 scale. */

#ifndef DSPARK_CPU_KV_H
#define DSPARK_CPU_KV_H

#include <stdint.h>

enum { KV_FLOAT32 = 0, KV_FLOAT16 = 1, KV_INT8 = 2 };

/* bytes of one row of `dim` values */
static inline int64_t dspark_kv_row_bytes(int kind, int64_t dim) {
  return kind == KV_FLOAT32 ? 4 * dim : kind == KV_FLOAT16 ? 2 * dim : dim + 4;
}

void dspark_kv_store(int kind, void *row, const float *x, int64_t dim);
void dspark_kv_load(int kind, const void *row, float *out, int64_t dim);
float dspark_half_to_float(uint16_t h);

#endif
