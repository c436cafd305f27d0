/* MatMulInt4's x86 paths: cpu_int4_body.h once per instruction set, each function compiled
   for that set alone (a target attribute; the file's own flags are a baseline every x86-64
   has, see kernels/cpu_op.py), chosen at run time by what the CPU reports. As ggml does, so
   one build serves a CPU with AVX-512 and one without, and a test can run every path this
   CPU has.

     path          rows a vector   dot product of a block (4 inputs x 16 rows an instruction)
     avx512_vnni   16              vpdpbusd
     avx512        16              vpmaddubsw + vpmaddwd (AVX-512 BW)
     avx_vnni       8              vpdpbusd (VEX, 256 bits)
     avx2           8              vpmaddubsw + vpmaddwd, F16C for the scales, FMA

   Compiled whole, every path is in one object. The op library compiles it once per path
   instead, side by side (kernels/cpu_op.py): DSPARK_X86_PATH=n (X86_PATHS' order below) keeps
   that path alone, with its entry point extern, and path 0's object also holds the dispatch
   below. One object of the four takes a compiler a third of the whole file's time. */

#include <string.h>

#include "cpu_int4.h"

/* the paths, one bit each: 1 avx512_vnni, 2 avx512, 4 avx_vnni, 8 avx2 */
#ifdef DSPARK_X86_PATH
#define X86_PATHS (1 << DSPARK_X86_PATH)
#define X86_DISPATCH (DSPARK_X86_PATH == 0)
#define PATH_LINK
#else
#define X86_PATHS 15
#define X86_DISPATCH 1
#endif

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

/* ---- 512 bits: 16 rows a vector ---- */
#define W 16
#define VI __m512i
#define VF __m512
#define LOADU(p) _mm512_loadu_si512((const void *)(p))
#define AND(a, b) _mm512_and_si512(a, b)
#define SRLI16(a, n) _mm512_srli_epi16(a, n)
#define SLLI32(a, n) _mm512_slli_epi32(a, n)
#define SET1_I8(v) _mm512_set1_epi8(v)
#define SET1_I16(v) _mm512_set1_epi16(v)
#define SET1_I32(v) _mm512_set1_epi32(v)
#define SETZERO_I() _mm512_setzero_si512()
#define ADD_I16(a, b) _mm512_add_epi16(a, b)
#define ADD_I32(a, b) _mm512_add_epi32(a, b)
#define MADDUBS(a, b) _mm512_maddubs_epi16(a, b)
#define MADD16(a, b) _mm512_madd_epi16(a, b)
#define DPBUSD(acc, a, b) _mm512_dpbusd_epi32(acc, a, b)
#define CVT_F(a) _mm512_cvtepi32_ps(a)
#define SETZERO_F() _mm512_setzero_ps()
#define SET1_F(v) _mm512_set1_ps(v)
#define MUL_F(a, b) _mm512_mul_ps(a, b)
#define FMADD(a, b, c) _mm512_fmadd_ps(a, b, c)
#define STOREU_F(p, v) _mm512_storeu_ps(p, v)
#define LOAD_HALVES(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define PREFETCH_T0(p) _mm_prefetch((const char *)(p), _MM_HINT_T0)
#define SPLIT8 0
#define ROWS 12 /* 32 registers: 12 accumulators beside the unpacked weights */

#define NAME(x) avx512_vnni_##x
#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))
#define VNNI 1
#define INSIDE 0 /* 32 registers hold a block unpacked whole beside the rows */
#define DECODE_LOOP 1
#if X86_PATHS & 1
#include "cpu_int4_body.h"
#endif
#undef NAME
#undef TARGET
#undef VNNI
#undef INSIDE
#undef DECODE_LOOP

#define NAME(x) avx512_##x
#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,f16c,fma")))
#define VNNI 0
#define INSIDE 6 /* gained at 2-5 rows, lost from 9 up */
#define DECODE_LOOP 1
#if X86_PATHS & 2
#include "cpu_int4_body.h"
#endif
#undef NAME
#undef TARGET
#undef VNNI
#undef INSIDE
#undef DECODE_LOOP

#undef W
#undef VI
#undef VF
#undef LOADU
#undef AND
#undef SRLI16
#undef SLLI32
#undef SET1_I8
#undef SET1_I16
#undef SET1_I32
#undef SETZERO_I
#undef ADD_I16
#undef ADD_I32
#undef MADDUBS
#undef MADD16
#undef DPBUSD
#undef CVT_F
#undef SETZERO_F
#undef SET1_F
#undef MUL_F
#undef FMADD
#undef STOREU_F
#undef LOAD_HALVES
#undef ROWS

/* ---- 256 bits: 8 rows a vector, two halves a group ---- */
#define W 8
#define VI __m256i
#define VF __m256
#define LOADU(p) _mm256_loadu_si256((const __m256i *)(p))
#define AND(a, b) _mm256_and_si256(a, b)
#define SRLI16(a, n) _mm256_srli_epi16(a, n)
#define SLLI32(a, n) _mm256_slli_epi32(a, n)
#define SET1_I8(v) _mm256_set1_epi8(v)
#define SET1_I16(v) _mm256_set1_epi16(v)
#define SET1_I32(v) _mm256_set1_epi32(v)
#define SETZERO_I() _mm256_setzero_si256()
#define ADD_I16(a, b) _mm256_add_epi16(a, b)
#define ADD_I32(a, b) _mm256_add_epi32(a, b)
#define MADDUBS(a, b) _mm256_maddubs_epi16(a, b)
#define MADD16(a, b) _mm256_madd_epi16(a, b)
#ifdef DSPARK_AVX_VNNI_AS_EVEX
/* Tests only (tests/test_int4_harness.py): the AVX-VNNI path's code with the EVEX form of the
   same instruction (AVX-512 VL + VNNI), so a CPU with AVX-512 VNNI and without AVX-VNNI runs
   it. Built with xmm16-31 reserved (-ffixed-xmm16 ...) it keeps AVX-VNNI's 16 registers. */
#define DPBUSD(acc, a, b) _mm256_dpbusd_epi32(acc, a, b)
#define AVX_VNNI_TARGET "avx2,avx512vl,avx512vnni,f16c,fma"
#define AVX_VNNI_CPU (__builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
#else
#define DPBUSD(acc, a, b) _mm256_dpbusd_avx_epi32(acc, a, b)
#define AVX_VNNI_TARGET "avx2,avxvnni,f16c,fma"
#define AVX_VNNI_CPU __builtin_cpu_supports("avxvnni")
#endif
#define CVT_F(a) _mm256_cvtepi32_ps(a)
#define SETZERO_F() _mm256_setzero_ps()
#define SET1_F(v) _mm256_set1_ps(v)
#define MUL_F(a, b) _mm256_mul_ps(a, b)
#define FMADD(a, b, c) _mm256_fmadd_ps(a, b, c)
#define STOREU_F(p, v) _mm256_storeu_ps(p, v)
#define LOAD_HALVES(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define ROWS 5 /* 16 registers: rows inside the weights' loop, two registers a row beside one
                  unpacked pair; a 5-token verify in one pass, not 4 + 1 (AVX2, one thread: 5
                  rows 0.84-0.93 of 4 a pass, 9 rows 0.89-0.96, 4 and 12 the same) */
#define INSIDE 5

#define NAME(x) avx_vnni_##x
#define TARGET __attribute__((target(AVX_VNNI_TARGET)))
#define VNNI 1
#define DECODE_LOOP 1 /* the head's one row 8-17% slower inside the switch (the stand-in) */
#if X86_PATHS & 4
#include "cpu_int4_body.h"
#endif
#undef NAME
#undef TARGET
#undef VNNI
#undef DECODE_LOOP

#define NAME(x) avx2_##x
#define TARGET __attribute__((target("avx2,f16c,fma")))
#define VNNI 0
#define DECODE_LOOP 0 /* with its own loop one row measured the slower (at 4 rows a pass) */
#if X86_PATHS & 8
#include "cpu_int4_body.h"
#endif
#undef NAME
#undef TARGET
#undef VNNI
#undef DECODE_LOOP

#if X86_DISPATCH
#ifdef DSPARK_X86_PATH /* the paths compiled in the other objects */
void avx512_vnni_groups(const Int4Call *c, int64_t g0, int64_t g1);
void avx512_groups(const Int4Call *c, int64_t g0, int64_t g1);
void avx_vnni_groups(const Int4Call *c, int64_t g0, int64_t g1);
void avx2_groups(const Int4Call *c, int64_t g0, int64_t g1);
#endif

int int4_x86_supported(int isa) {
  __builtin_cpu_init();
  const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                   __builtin_cpu_supports("f16c");
  const int avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                     __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
  switch (isa) {
    case ISA_AVX2: return avx2;
    case ISA_AVX_VNNI: return avx2 && AVX_VNNI_CPU;
    case ISA_AVX512: return avx512;
    case ISA_AVX512_VNNI: return avx512 && __builtin_cpu_supports("avx512vnni");
    default: return 0;
  }
}

int int4_groups_x86(int isa, const Int4Call *c, int64_t g0, int64_t g1) {
  switch (isa) {
    case ISA_AVX512_VNNI: avx512_vnni_groups(c, g0, g1); return 1;
    case ISA_AVX512: avx512_groups(c, g0, g1); return 1;
    case ISA_AVX_VNNI: avx_vnni_groups(c, g0, g1); return 1;
    case ISA_AVX2: avx2_groups(c, g0, g1); return 1;
    default: return 0;
  }
}
#endif /* X86_DISPATCH */

#elif X86_DISPATCH /* not x86-64 with GCC or clang: the plain loops only */

int int4_x86_supported(int isa) { (void)isa; return 0; }

int int4_groups_x86(int isa, const Int4Call *c, int64_t g0, int64_t g1) {
  (void)isa, (void)c, (void)g0, (void)g1;
  return 0;
}

#endif
