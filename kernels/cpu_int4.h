/* MatMulInt4's shared definitions: the packed layout, one call's view, and its paths.

   The paths (cpu_int4.c: plain loops; cpu_int4_x86.c and cpu_int4_arm.c: vector paths, each
   compiled for its own instruction set and chosen at run time by what the CPU has) compute the same
   blocks in the same order: every block's dot product is exact in int32, and the float
   steps are the same multiply-adds, so all paths give the same bits. */

#ifndef DSPARK_CPU_INT4_H
#define DSPARK_CPU_INT4_H

#include <stdint.h>

enum { BLOCK = 32, LANES = 16, PREFETCH = 8192, FEW_ROWS = 2 };

/* The paths, worst first (an attribute `isa` forces one; absent: the best the CPU runs). */
enum {
  ISA_GENERIC = 0,
  ISA_AVX2 = 1,        /* AVX2 + FMA + F16C: maddubs/madd on 8 rows a vector */
  ISA_AVX_VNNI = 2,    /* + AVX-VNNI: vpdpbusd on 8 rows a vector */
  ISA_AVX512 = 3,      /* AVX-512 F/BW/VL: maddubs/madd on 16 rows a vector */
  ISA_AVX512_VNNI = 4, /* + AVX-512 VNNI: vpdpbusd on 16 rows a vector */
  ISA_NEON_DOTPROD = 5, /* aarch64 NEON + the dot product (ARMv8.2): sdot on 4 rows a vector */
  ISA_COUNT = 6
};

/* One call: x quantized (x8 [rows, K] int8, sx [rows, K/32] its scales, zx [rows, K/32] each
   block's sum of int8 inputs) against the packed weights w. */
typedef struct {
  const uint8_t *w;
  float *y;
  const int8_t *x8;
  const float *sx;
  const int32_t *zx;
  int64_t k, n, rows, groups, items, bits, mins;
} Int4Call;

/* A record's bytes: its weight vectors (4 of 64 bytes at 4 bits, 8 at 8), 16 float16 scales,
   and with mins 16 float16 mins. */
static inline int64_t record_bytes(int64_t bits, int64_t mins) { return 64 * bits + 32 + 32 * mins; }

/* The weights' zero point: a block's dot product starts at -zero * (its input sum); with mins
   the stored values are the weights' offsets from the block's min, which enters by itself. */
static inline int32_t zero_point(int64_t bits, int64_t mins) {
  return mins ? 0 : bits == 4 ? 8 : 128;
}

/* Groups g0 .. g1-1 against every row of x, on one x86 path; 0 if that path is not built. */
int int4_groups_x86(int isa, const Int4Call *c, int64_t g0, int64_t g1);
/* Whether this CPU runs an x86 path (0 for the others and off x86). */
int int4_x86_supported(int isa);
/* The same for the aarch64 path (cpu_int4_arm.c). */
int int4_groups_arm(int isa, const Int4Call *c, int64_t g0, int64_t g1);
int int4_arm_supported(int isa);

#endif
