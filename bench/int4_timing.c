/* MatMulInt4's x86 paths without onnxruntime, one thread: this tree's kernels (int4_groups_x86)
   against another revision's (built with old_ prefixes), interleaved, for bench/bench_int4_c.py.

     int4_timing ISA K N BITS MINS REPEATS ROWS...

   One line per row count: "rows old_us new_us same|different" (the best of REPEATS calls each,
   alternating which runs first; "same": both gave the same bits). The weights cycle through
   64 MB of copies, so each call reads them from memory, as a decode step does. */

#define _POSIX_C_SOURCE 199309L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cpu_int4.h"

int old_groups_x86(int isa, const Int4Call *c, int64_t g0, int64_t g1);

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static uint64_t state = 88172645463325252ull;
static uint32_t next(void) {
  state ^= state << 13, state ^= state >> 7, state ^= state << 17;
  return (uint32_t)state;
}

static int run(int which, int isa, const Int4Call *c) {
  return which ? int4_groups_x86(isa, c, 0, c->groups) : old_groups_x86(isa, c, 0, c->groups);
}

int main(int argc, char **argv) {
  if (argc < 8) {
    fprintf(stderr, "usage: int4_timing ISA K N BITS MINS REPEATS ROWS...\n");
    return 2;
  }
  const int isa = atoi(argv[1]), bits = atoi(argv[4]), mins = atoi(argv[5]);
  const int64_t k = atoll(argv[2]), n = atoll(argv[3]), repeats = atoll(argv[6]);
  const int64_t groups = (n + LANES - 1) / LANES, blocks = k / BLOCK;
  const int64_t record = record_bytes(bits, mins), wbytes = groups * blocks * record;
  const int64_t copies = (64 << 20) / wbytes + 1;
  uint8_t *w = (uint8_t *)malloc((size_t)(wbytes * copies));
  if (w == NULL) return 3;
  for (int64_t i = 0; i < wbytes * copies; i++) w[i] = (uint8_t)next();
  for (int64_t c = 0; c < copies; c++) /* finite float16 scales (and mins) */
    for (int64_t r = 0; r < groups * blocks; r++) {
      uint16_t *s = (uint16_t *)(w + c * wbytes + r * record + 64 * bits);
      for (int j = 0; j < 16 * (1 + mins); j++) s[j] = (uint16_t)(0x2000 | (next() & 0x3ff));
    }
  for (int a = 7; a < argc; a++) {
    const int64_t rows = atoll(argv[a]);
    int8_t *x8 = (int8_t *)malloc((size_t)(rows * k));
    float *sx = (float *)malloc((size_t)(rows * blocks) * sizeof(float));
    int32_t *zx = (int32_t *)malloc((size_t)(rows * blocks) * sizeof(int32_t));
    float *y[2] = {(float *)malloc((size_t)(rows * n) * sizeof(float)),
                   (float *)malloc((size_t)(rows * n) * sizeof(float))};
    if (!x8 || !sx || !zx || !y[0] || !y[1]) return 3;
    for (int64_t i = 0; i < rows * k; i++) x8[i] = (int8_t)(next() % 255 - 127);
    for (int64_t r = 0; r < rows; r++)
      for (int64_t b = 0; b < blocks; b++) {
        int32_t s = 0;
        for (int j = 0; j < BLOCK; j++) s += x8[r * k + b * BLOCK + j];
        zx[r * blocks + b] = s, sx[r * blocks + b] = 0.01f;
      }
    double best[2] = {1e30, 1e30};
    for (int64_t rep = 0; rep < repeats; rep++)
      for (int turn = 0; turn < 2; turn++) {
        const int which = (int)((rep + turn) % 2);
        const Int4Call c = {w + (rep % copies) * wbytes, y[which], x8, sx, zx, k, n, rows,
                            groups, 1, bits, mins};
        const double t = now();
        if (!run(which, isa, &c)) return 4;
        const double dt = now() - t;
        if (dt < best[which]) best[which] = dt;
      }
    for (int which = 0; which < 2; which++) { /* the same weights on both sides */
      const Int4Call c = {w, y[which], x8, sx, zx, k, n, rows, groups, 1, bits, mins};
      run(which, isa, &c);
    }
    const int same = memcmp(y[0], y[1], (size_t)(rows * n) * sizeof(float)) == 0;
    printf("%lld %.1f %.1f %s\n", (long long)rows, best[0] * 1e6, best[1] * 1e6,
           same ? "same" : "different");
    free(x8), free(sx), free(zx), free(y[0]), free(y[1]);
  }
  free(w);
  return 0;
}
