/* A KV cache row's storage: one token's keys (or values) for one KV head, as the arena holds
   them (runtime/cache/layout.py):

     float32   dim floats, as given
     float16   dim halves, each the float rounded to nearest, ties to even (IEEE binary16,
               subnormals and overflow to infinity as a cast does)
     int8      dim signed bytes, then the row's float32 scale:
                 scale = max|x| / 127;  q = clamp(rint(x / scale), -127, 127);  0 where
                 scale is 0;  the value read back is q * scale

   What a row holds is what attention reads, in every layer and at every position, so a
   model with a float16 or int8 cache is one function whichever window a token is computed
   in. Compiled without -ffast-math and without contraction (kernels/cpu_op.py, EXACT): a
   division, not a product with 1 / scale, and rintf's ties to even, as the ONNX ops
   (Div, Round) that compute the same rounding in dsc verify's reference
   (compiler/kv_rounding.py) and numpy (runtime/cache/kv_rows.py) do. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_kv.h"

static uint16_t half_of(float x) {
  uint32_t f;
  memcpy(&f, &x, sizeof(f));
  const uint32_t sign = (f >> 16) & 0x8000u, abs = f & 0x7fffffffu;
  if (abs >= 0x7f800000u) /* inf or nan (a quiet nan keeps its top payload bits) */
    return (uint16_t)(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u | ((abs >> 13) & 0x3ffu) : 0u));
  if (abs >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds past 65504: inf */
  if (abs < 0x38800000u) {                                  /* below 2^-14: a subnormal */
    if (abs < 0x33000000u) return (uint16_t)sign;           /* under half the least: 0 */
    const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const int shift = 126 - (int)(abs >> 23); /* 14 .. 24 */
    const uint32_t kept = mant >> shift, rest = mant & ((1u << shift) - 1),
                   half = 1u << (shift - 1);
    return (uint16_t)(sign | (kept + (rest > half || (rest == half && (kept & 1u)))));
  }
  const uint32_t rebased = abs - 0x38000000u; /* exponent 127 -> 15 */
  const uint32_t kept = rebased >> 13, rest = rebased & 0x1fffu;
  return (uint16_t)(sign | (kept + (rest > 0x1000u || (rest == 0x1000u && (kept & 1u)))));
}

float dspark_half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu,
                 mant = h & 0x3ffu;
  uint32_t f;
  if (exp == 0x1f) {
    f = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    f = sign | ((exp + 112u) << 23) | (mant << 13);
  } else if (mant == 0) {
    f = sign;
  } else { /* a subnormal: normalise */
    int e = -1;
    uint32_t m = mant;
    do {
      e++;
      m <<= 1;
    } while (!(m & 0x400u));
    f = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3ffu) << 13);
  }
  float x;
  memcpy(&x, &f, sizeof(x));
  return x;
}

void dspark_kv_store(int kind, void *row, const float *x, int64_t dim) {
  if (kind == KV_FLOAT32) {
    memcpy(row, x, (size_t)dim * sizeof(float));
  } else if (kind == KV_FLOAT16) {
    uint16_t *h = (uint16_t *)row;
    for (int64_t i = 0; i < dim; i++) h[i] = half_of(x[i]);
  } else {
    int8_t *q = (int8_t *)row;
    float top = 0.0f;
    for (int64_t i = 0; i < dim; i++) top = fabsf(x[i]) > top ? fabsf(x[i]) : top;
    const float scale = top / 127.0f;
    for (int64_t i = 0; i < dim; i++) {
      const float r = scale == 0.0f ? 0.0f : rintf(x[i] / scale);
      q[i] = (int8_t)(r < -127.0f ? -127.0f : r > 127.0f ? 127.0f : r);
    }
    memcpy(q + dim, &scale, sizeof(scale));
  }
}

void dspark_kv_load(int kind, const void *row, float *out, int64_t dim) {
  if (kind == KV_FLOAT32) {
    memcpy(out, row, (size_t)dim * sizeof(float));
  } else if (kind == KV_FLOAT16) {
    const uint16_t *h = (const uint16_t *)row;
    for (int64_t i = 0; i < dim; i++) out[i] = dspark_half_to_float(h[i]);
  } else {
    const int8_t *q = (const int8_t *)row;
    float scale;
    memcpy(&scale, q + dim, sizeof(scale));
    for (int64_t i = 0; i < dim; i++) out[i] = (float)q[i] * scale;
  }
}

/* ctypes entry points for the tests (tests/test_kv_rows.py): rows of x through a store and
   a load. */
void dspark_kv_round(int kind, const float *x, float *out, int64_t rows, int64_t dim,
                     void *scratch) {
  const int64_t bytes = dspark_kv_row_bytes(kind, dim);
  for (int64_t r = 0; r < rows; r++) {
    dspark_kv_store(kind, (char *)scratch + r * bytes, x + r * dim, dim);
    dspark_kv_load(kind, (char *)scratch + r * bytes, out + r * dim, dim);
  }
}
