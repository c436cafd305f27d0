/* MatMulInt4's paths without onnxruntime, for tests/test_int4_harness.py: the same random
   cases on every path this CPU runs, each output printed as a 64-bit FNV-1a hash of its bits.
   Built natively and for aarch64 (run under qemu-user), so one test compares the paths of
   both architectures: every path of every architecture must print the same hashes.

     int4_harness          one line per case and path: "<case> <path> <hash>" */

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_int4.h"

void *const *ort = NULL; /* cpu_int4.c's op half is not used here */
volatile int dspark_solo = 0;

int dspark_int4_paths(void);
int dspark_int4_run(int64_t isa, const float *x, const uint8_t *w, float *y, int64_t rows,
                    int64_t k, int64_t n, int64_t bits, int64_t mins);

static uint64_t state = 0x9E3779B97F4A7C15ull;

static uint32_t next(void) { /* xorshift64*: the same stream on every machine */
  state ^= state >> 12, state ^= state << 25, state ^= state >> 27;
  return (uint32_t)((state * 0x2545F4914F6CDD1Dull) >> 32);
}

/* A float16 of magnitude 2^-8 .. 2^-1, either sign: finite, like real scales and mins. */
static uint16_t half(void) {
  const uint32_t r = next();
  return (uint16_t)((r & 0x8000) | ((7 + (r >> 16) % 8) << 10) | (r & 0x3FF));
}

static uint64_t fnv(const void *data, size_t bytes) {
  const uint8_t *p = (const uint8_t *)data;
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < bytes; i++) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

int main(void) {
  static const char *names[ISA_COUNT] = {"generic", "avx2", "avx_vnni", "avx512", "avx512_vnni",
                                         "neon_dotprod"};
  static const int64_t shapes[][3] = {{32, 3, 1}, {64, 16, 2}, {128, 45, 3}, {96, 17, 4},
                                      {576, 70, 5}, {256, 33, 9}, {64, 20, 13}};  /* k, n, rows */
  const int paths = dspark_int4_paths();
  int cases = 0;
  for (int bits = 4; bits <= 8; bits += 4)
    for (int mins = 0; mins <= 1; mins++)
      for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++, cases++) {
        const int64_t k = shapes[s][0], n = shapes[s][1], rows = shapes[s][2];
        const int64_t groups = (n + LANES - 1) / LANES, blocks = k / BLOCK;
        const int64_t record = record_bytes(bits, mins), wbytes = groups * blocks * record;
        uint8_t *w = (uint8_t *)malloc((size_t)wbytes);
        float *x = (float *)malloc((size_t)(rows * k) * sizeof(float));
        float *y = (float *)malloc((size_t)(rows * n) * sizeof(float));
        if (w == NULL || x == NULL || y == NULL) return 2;
        for (int64_t i = 0; i < wbytes; i++) w[i] = (uint8_t)next();
        for (int64_t r = 0; r < groups * blocks; r++) /* the scales (and mins) of a record */
          for (int j = 0; j < 16 * (1 + mins); j++) {
            const uint16_t h = half();
            memcpy(w + r * record + 64 * bits + 2 * j, &h, 2);
          }
        for (int64_t i = 0; i < rows * k; i++)
          x[i] = ((float)(next() % 20001) - 10000.f) / 997.f;
        for (int isa = 0; isa < ISA_COUNT; isa++) {
          if (!(paths & (1 << isa))) continue;
          memset(y, 0xFF, (size_t)(rows * n) * sizeof(float));
          if (!dspark_int4_run(isa, x, w, y, rows, k, n, bits, mins)) return 3;
          printf("%d %s %016llx\n", cases, names[isa],
                 (unsigned long long)fnv(y, (size_t)(rows * n) * sizeof(float)));
        }
        free(w), free(x), free(y);
      }
  return 0;
}
