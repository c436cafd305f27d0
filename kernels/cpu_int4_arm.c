/* MatMulInt4's aarch64 path: cpu_int4_body.h with NEON and the dot-product extension
   (ARMv8.2 `sdot`: Graviton 2 and later, Ampere Altra, Apple M1 and later, Cortex-A76 and
   later), compiled for that extension alone (a target attribute) and chosen at run time when
   the CPU reports it (HWCAP_ASIMDDP), as ggml does.

     path           rows a vector   dot product of a block (4 inputs x 4 rows an instruction)
     neon_dotprod    4              sdot (signed bytes: 8-bit weights go in nibbles)

   The same blocks, the same int32 dot products and the same float multiply-adds in the same
   order as every other path: the same bits. */

#include <string.h>

#include "cpu_int4.h"

#if defined(__aarch64__) && defined(__GNUC__)
#include <arm_neon.h>
#if defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#endif

#define W 4
#define VI int32x4_t
#define VF float32x4_t
#define LOADU(p) vreinterpretq_s32_u8(vld1q_u8((const uint8_t *)(p)))
#define AND(a, b) vandq_s32(a, b)
#define SRLI16(a, n) vreinterpretq_s32_u16(vshrq_n_u16(vreinterpretq_u16_s32(a), n))
#define SLLI32(a, n) vshlq_n_s32(a, n)
#define SET1_I8(v) vreinterpretq_s32_s8(vdupq_n_s8(v))
#define SET1_I32(v) vdupq_n_s32(v)
#define SETZERO_I() vdupq_n_s32(0)
#define ADD_I32(a, b) vaddq_s32(a, b)
#define DPBUSD(acc, a, b) vdotq_s32(acc, vreinterpretq_s8_s32(a), vreinterpretq_s8_s32(b))
#define CVT_F(a) vcvtq_f32_s32(a)
#define SETZERO_F() vdupq_n_f32(0.f)
#define SET1_F(v) vdupq_n_f32(v)
#define MUL_F(a, b) vmulq_f32(a, b)
#define FMADD(a, b, c) vfmaq_f32(c, a, b)
#define STOREU_F(p, v) vst1q_f32(p, v)
#define LOAD_HALVES(p) vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)(p))))
#define PREFETCH_T0(p) __builtin_prefetch((const void *)(p), 0, 3)
#define SPLIT8 1
#define ROWS 4
#define INSIDE 0
#define DECODE_LOOP 0

#define NAME(x) neon_dotprod_##x
#define TARGET __attribute__((target("arch=armv8.2-a+dotprod+fp16")))
#define VNNI 1
#include "cpu_int4_body.h"

int int4_arm_supported(int isa) {
  if (isa != ISA_NEON_DOTPROD) return 0;
#if defined(__linux__)
  return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#elif defined(__APPLE__)
  return 1; /* every Apple arm64 CPU has the dot product */
#else
  return 0;
#endif
}

int int4_groups_arm(int isa, const Int4Call *c, int64_t g0, int64_t g1) {
  if (isa != ISA_NEON_DOTPROD) return 0;
  neon_dotprod_groups(c, g0, g1);
  return 1;
}

#else /* not aarch64 with GCC or clang */

int int4_arm_supported(int isa) { (void)isa; return 0; }

int int4_groups_arm(int isa, const Int4Call *c, int64_t g0, int64_t g1) {
  (void)isa, (void)c, (void)g0, (void)g1;
  return 0;
}

#endif
