/* One vector path of MatMulInt4, included once per instruction set (cpu_int4_x86.c,
   cpu_int4_arm.c) with:

     NAME(x)      the path's function names          TARGET   its target attribute
     W            int32 lanes a vector (16, 8 or 4)  VNNI     1: a 4-byte dot instruction
     VI, VF       its integer and float vector types          (vpdpbusd, sdot), 0: maddubs + madd
     SPLIT8       1 where the dot instruction multiplies signed bytes (sdot): 8-bit weights
                  go in nibbles, as without VNNI
     PREFETCH_T0  a prefetch into the first-level cache
     ROWS         rows of x that share one load of a block's weights, 4 to 12: as many
                  as the registers hold beside the unpacked weights
     INSIDE       up to how many rows (2 and more) go inside the weights' loop, one unpacked
                  pair of vectors at a time (rows_inside); 0: never
     DECODE_LOOP  1: one row (a decode step) runs a loop of its own, outside the rows' switch
     and the operations below (LOADU, AND, SRLI16, ...) spelled in its intrinsics.

   A group's 16 rows take 16 / W vectors ("halves", quarters at 4 lanes); per block and half
   the weights are loaded (and at 4 bits unpacked) once for up to ROWS rows of x. The block's
   dot product is exact in int32 every way: vpdpbusd sums four u8 x s8 products into int32,
   sdot four s8 x s8 (a 4-bit weight or a nibble, 0..15, is a valid s8); without either,
   maddubs sums pairs into int16 (at most 2 * 15 * 127 = 3810 each, eight of them 30480 <
   2^15: no saturation, 8-bit weights split in nibbles) and madd widens them. */

/* Every loop over the R rows unrolled whole, so each row's accumulator stays a register: left
   to GCC's size limits, loops of 8 or 12 rows stayed loops and kept the accumulators on the
   stack. */
#ifndef PATH_LINK
#define PATH_LINK static /* the path's entry point; extern where the paths are compiled apart */
#endif

#ifndef TURN
#define TURN 4 /* blocks a half runs before the other's turn (paths of two halves or more) */
#endif

#ifndef EACH_ROW
#define EACH_ROW _Pragma("GCC unroll 16") for
#endif

static inline TARGET VI NAME(bcast4)(const int8_t *p) {
  int32_t v;
  memcpy(&v, p, sizeof(v));
  return SET1_I32(v);
}

/* The block's dot products for one row of x (its 32 int8 inputs xb) against the unpacked
   weights q[8] (at 8 bits without VNNI or with SPLIT8: low nibbles q[8], high ones hi[8]). */
static inline __attribute__((always_inline)) TARGET VI NAME(dot)(const VI *q, const VI *hi,
                                                                 const int8_t *xb,
                                                                 const int BITS) {
#if VNNI
  /* two chains of four: the dot instruction's latency, not its rate, would bound one of eight */
  VI d0 = SETZERO_I(), d1 = SETZERO_I();
  for (int v = 0; v < 8; v += 2) {
    d0 = DPBUSD(d0, q[v], NAME(bcast4)(xb + 4 * v));
    d1 = DPBUSD(d1, q[v + 1], NAME(bcast4)(xb + 4 * v + 4));
  }
  if (!SPLIT8 || BITS == 4) return ADD_I32(d0, d1);
  VI h0 = SETZERO_I(), h1 = SETZERO_I();
  for (int v = 0; v < 8; v += 2) {
    h0 = DPBUSD(h0, hi[v], NAME(bcast4)(xb + 4 * v));
    h1 = DPBUSD(h1, hi[v + 1], NAME(bcast4)(xb + 4 * v + 4));
  }
  return ADD_I32(ADD_I32(d0, d1), SLLI32(ADD_I32(h0, h1), 4));
#else
  /* two chains of four again (int16 sums of four products stay within 4 * 3810) */
  const VI ones = SET1_I16(1);
  VI l0 = MADDUBS(q[0], NAME(bcast4)(xb)), l1 = MADDUBS(q[1], NAME(bcast4)(xb + 4));
  for (int v = 2; v < 8; v += 2) {
    l0 = ADD_I16(l0, MADDUBS(q[v], NAME(bcast4)(xb + 4 * v)));
    l1 = ADD_I16(l1, MADDUBS(q[v + 1], NAME(bcast4)(xb + 4 * v + 4)));
  }
  const VI lo = ADD_I16(l0, l1);
  if (BITS == 4) return MADD16(lo, ones);
  VI h0 = MADDUBS(hi[0], NAME(bcast4)(xb)), h1 = MADDUBS(hi[1], NAME(bcast4)(xb + 4));
  for (int v = 2; v < 8; v += 2) {
    h0 = ADD_I16(h0, MADDUBS(hi[v], NAME(bcast4)(xb + 4 * v)));
    h1 = ADD_I16(h1, MADDUBS(hi[v + 1], NAME(bcast4)(xb + 4 * v + 4)));
  }
  return ADD_I32(MADD16(lo, ones), SLLI32(MADD16(ADD_I16(h0, h1), ones), 4));
#endif
}

/* acc + row's block dot product d (int32, before its zero point), scaled by the weights'
   scales ws and the row's block scale; with mins, their share too. */
static inline __attribute__((always_inline)) TARGET VF NAME(scaled)(
    const Int4Call *c, int64_t row, int64_t b, VI d, VF ws, VF ms, VF acc, const int BITS,
    const int MINS) {
  const int64_t blocks = c->k / BLOCK;
  const int32_t sum = c->zx[row * blocks + b];
  const float sx = c->sx[row * blocks + b];
  d = ADD_I32(d, SET1_I32(-zero_point(BITS, MINS) * sum));
  acc = FMADD(CVT_F(d), MUL_F(ws, SET1_F(sx)), acc);
  return MINS ? FMADD(ms, SET1_F(sx * (float)sum), acc) : acc;
}

/* A few rows inside the weights' loop (paths of 16 registers; INSIDE: up to how many rows):
   each row's running sums stay in registers beside one unpacked pair of weight vectors. Unpacked
   whole, the block's weights and R accumulators spilled on AVX2's 16 registers (GCC also summed
   all of a row's products at the end, through the stack; the empty asm keeps each row's running
   sum a register). Each block's int32 is the same in any order: vpdpbusd's sums are exact, and
   without VNNI at most eight maddubs results fit int16 (8 * 3840 < 2^15). Without VNNI at 8
   bits a row keeps two sums, the low and high nibbles' products; with VNNI two rows keep two
   each (the pair's two vectors), so that two chains of the instruction's latency run a row,
   and three rows and more one (the rows' chains overlap).
   AVX2, one thread, new/old: the 8-bit head 0.82-0.90 at 2-9 rows, gate/up 0.93-0.96
   (docs/performance.md). AVX-512 without VNNI gained at 2-5 rows and lost from 9 rows up, so
   more rows than 6 take the whole block unpacked. AVX-VNNI, measured in its stand-in (the
   same code with the EVEX instruction and 16 registers, on AVX-512 VNNI), new/old: 4-bit
   projections 0.93-0.96 at 2-3 rows and 0.80-0.85 at 5-9, the 8-bit head 0.71-0.93 at 2-9
   rows (docs/performance.md). */
#if INSIDE && VNNI && SPLIT8
#error "rows inside the weights' loop: no form for 8-bit weights split in nibbles with a dot instruction"
#endif
static inline __attribute__((always_inline)) TARGET void NAME(rows_inside)(
    const Int4Call *c, const uint8_t *rec, int h, int64_t b, int64_t r0, int R, VF *acc,
    const int BITS, const int MINS) {
  const int64_t k = c->k;
  const VI low = SET1_I8(0x0F);
  VI l[ROWS], lh[ROWS];
  EACH_ROW (int r = 0; r < R; r++) l[r] = lh[r] = SETZERO_I();
  if (BITS == 4) {
    for (int v = 0; v < 4; v++) {
      const VI packed = LOADU(rec + 64 * v + 4 * W * h);
      const VI qa = AND(packed, low), qb = AND(SRLI16(packed, 4), low);
      EACH_ROW (int r = 0; r < R; r++) {
        const int8_t *xb = c->x8 + (r0 + r) * k + b * BLOCK + 8 * v;
#if VNNI
        if (R <= 2) {
          l[r] = DPBUSD(l[r], qa, NAME(bcast4)(xb));
          lh[r] = DPBUSD(lh[r], qb, NAME(bcast4)(xb + 4));
          __asm__("" : "+v"(l[r]), "+v"(lh[r]));
        } else {
          l[r] = DPBUSD(DPBUSD(l[r], qa, NAME(bcast4)(xb)), qb, NAME(bcast4)(xb + 4));
          __asm__("" : "+v"(l[r]));
        }
#else
        l[r] = ADD_I16(l[r], ADD_I16(MADDUBS(qa, NAME(bcast4)(xb)),
                                     MADDUBS(qb, NAME(bcast4)(xb + 4))));
        __asm__("" : "+v"(l[r]));
#endif
      }
    }
  } else {
    for (int v = 0; v < 8; v++) {
      const VI packed = LOADU(rec + 64 * v + 4 * W * h);
#if VNNI
      EACH_ROW (int r = 0; r < R; r++) {
        const VI xv = NAME(bcast4)(c->x8 + (r0 + r) * k + b * BLOCK + 4 * v);
        if (R <= 2 && v % 2) {
          lh[r] = DPBUSD(lh[r], packed, xv);
          __asm__("" : "+v"(lh[r]));
        } else {
          l[r] = DPBUSD(l[r], packed, xv);
          __asm__("" : "+v"(l[r]));
        }
      }
#else
      const VI qa = AND(packed, low), qb = AND(SRLI16(packed, 4), low);
      EACH_ROW (int r = 0; r < R; r++) {
        const VI xv = NAME(bcast4)(c->x8 + (r0 + r) * k + b * BLOCK + 4 * v);
        l[r] = ADD_I16(l[r], MADDUBS(qa, xv));
        lh[r] = ADD_I16(lh[r], MADDUBS(qb, xv));
        __asm__("" : "+v"(l[r]), "+v"(lh[r]));
      }
#endif
    }
  }
  const VF ws = LOAD_HALVES(rec + 64 * BITS + 2 * W * h);
  const VF ms = MINS ? LOAD_HALVES(rec + 64 * BITS + 32 + 2 * W * h) : SETZERO_F();
  EACH_ROW (int r = 0; r < R; r++) {
#if VNNI
    const VI d = R <= 2 ? ADD_I32(l[r], lh[r]) : l[r];
#else
    const VI ones = SET1_I16(1);
    VI d = MADD16(l[r], ones);
    if (BITS == 8) d = ADD_I32(d, SLLI32(MADD16(lh[r], ones), 4));
#endif
    acc[r] = NAME(scaled)(c, r0 + r, b, d, ws, ms, acc[r], BITS, MINS);
  }
}

/* Block b of group g, half h (its W outputs), for rows r0 .. r0+R-1 of x: acc[r] += the
   rows' dot products, scaled. BITS and MINS are constants in every call. */
static inline __attribute__((always_inline)) TARGET void NAME(half_block)(
    const Int4Call *c, const uint8_t *rec, int h, int64_t b, int64_t r0, int R, VF *acc,
    const int BITS, const int MINS) {
  const int64_t k = c->k;
  const VI low = SET1_I8(0x0F);
#if INSIDE
  if (R > 1 && R <= INSIDE) {
    NAME(rows_inside)(c, rec, h, b, r0, R, acc, BITS, MINS);
    return;
  }
#endif
  /* vector v holds inputs 4v .. 4v+3 of the block for this half's outputs */
  VI q[8], hi[8];
  if (BITS == 4) {
    for (int v = 0; v < 4; v++) {
      const VI packed = LOADU(rec + 64 * v + 4 * W * h);
      q[2 * v] = AND(packed, low);
      q[2 * v + 1] = AND(SRLI16(packed, 4), low);
    }
  } else {
    for (int v = 0; v < 8; v++) {
      q[v] = LOADU(rec + 64 * v + 4 * W * h);
      if (!VNNI || SPLIT8) {
        hi[v] = AND(SRLI16(q[v], 4), low);
        q[v] = AND(q[v], low);
      }
    }
  }
  const VF ws = LOAD_HALVES(rec + 64 * BITS + 2 * W * h);
  const VF ms = MINS ? LOAD_HALVES(rec + 64 * BITS + 32 + 2 * W * h) : SETZERO_F();
  EACH_ROW (int r = 0; r < R; r++) {
    const VI d = NAME(dot)(q, hi, c->x8 + (r0 + r) * k + b * BLOCK, BITS);
    acc[r] = NAME(scaled)(c, r0 + r, b, d, ws, ms, acc[r], BITS, MINS);
  }
}

/* acc[r] (half h of group g) into y's rows r0 .. r0+R-1. */
static inline __attribute__((always_inline)) TARGET void NAME(store)(
    const Int4Call *c, int64_t g, int h, int64_t r0, int R, const VF *acc) {
  const int64_t outs = c->n - g * LANES < LANES ? c->n - g * LANES : LANES;
  const int64_t left = outs - h * W;
  EACH_ROW (int r = 0; r < R; r++) {
    float *y = c->y + (r0 + r) * c->n + g * LANES + h * W;
    if (left >= W) {
      STOREU_F(y, acc[r]);
    } else if (left > 0) {
      float tmp[16];
      STOREU_F(tmp, acc[r]);
      memcpy(y, tmp, (size_t)left * sizeof(float));
    }
  }
}

static inline __attribute__((always_inline)) TARGET void NAME(prefetch)(const uint8_t *rec,
                                                                         int64_t record) {
  for (int64_t o = 0; o < record; o += 64) PREFETCH_T0(rec + PREFETCH + o);
}

/* Rows r0 .. r0+R-1 of x against group g. One row: both halves in one pass over the
   weights. Several: a half at a time, its R accumulators and unpacked weights held in
   registers (both halves at once spilled on AVX2's 16 registers: 4 rows ran 1.2-1.4x
   MatMulNBits; a half a pass for one row read each cache line twice: the 8-bit head 0.77x
   of MatMulNBits instead of 0.67x). The halves take turns every TURN blocks, the second
   reading what the first brought into L1 while the prefetches keep memory busy: a whole
   pass per half left the second's arithmetic after the stream from memory had ended (AVX2,
   one thread, weights from memory: 2 and 3 rows 8-12% faster, the 8-bit head and the 4-bit
   projections alike; 5 and 9 rows the same). */
static inline __attribute__((always_inline)) TARGET void NAME(group)(
    const Int4Call *c, int64_t g, int64_t r0, int R, const int BITS, const int MINS) {
  enum { HALVES = 16 / W };
  const int64_t blocks = c->k / BLOCK, record = record_bytes(BITS, MINS);
  const uint8_t *w = c->w + g * (blocks * record);
  if (R == 1) {
    VF acc[HALVES];
    for (int h = 0; h < HALVES; h++) acc[h] = SETZERO_F();
    for (int64_t b = 0; b < blocks; b++) {
      NAME(prefetch)(w + b * record, record);
      for (int h = 0; h < HALVES; h++)
        NAME(half_block)(c, w + b * record, h, b, r0, 1, &acc[h], BITS, MINS);
    }
    for (int h = 0; h < HALVES; h++) NAME(store)(c, g, h, r0, 1, &acc[h]);
    return;
  }
  VF acc[HALVES][ROWS];
  for (int h = 0; h < HALVES; h++)
    EACH_ROW (int r = 0; r < R; r++) acc[h][r] = SETZERO_F();
  const int64_t chunk = HALVES == 1 ? blocks : TURN;
  for (int64_t b0 = 0; b0 < blocks; b0 += chunk) {
    const int64_t b1 = b0 + chunk < blocks ? b0 + chunk : blocks;
    for (int h = 0; h < HALVES; h++) {
      VF a[ROWS];
      EACH_ROW (int r = 0; r < R; r++) a[r] = acc[h][r];
      for (int64_t b = b0; b < b1; b++) {
        if (h == 0) NAME(prefetch)(w + b * record, record);
        NAME(half_block)(c, w + b * record, h, b, r0, R, a, BITS, MINS);
      }
      EACH_ROW (int r = 0; r < R; r++) acc[h][r] = a[r];
    }
  }
  for (int h = 0; h < HALVES; h++) NAME(store)(c, g, h, r0, R, acc[h]);
}

static inline __attribute__((always_inline)) TARGET void NAME(groups_of)(
    const Int4Call *c, int64_t g0, int64_t g1, const int BITS, const int MINS) {
#if DECODE_LOOP
  /* a decode step, in a loop of its own: inside the larger switch one row measured 2-4%
     slower on AVX-512 VNNI, 8-17% on AVX-VNNI's stand-in (on AVX2, at 4 rows a pass, the
     loop of its own was the slower one) */
  if (c->rows == 1) {
    for (int64_t g = g0; g < g1; g++) NAME(group)(c, g, 0, 1, BITS, MINS);
    return;
  }
#endif
  /* as few passes as ROWS allows, with rows as even as can be: at 5 a pass, 12 rows as
     4 + 4 + 4, not 5 + 5 + 2 (a pass of few rows unpacks the weights for little) */
  const int64_t passes = (c->rows + ROWS - 1) / ROWS;
  for (int64_t g = g0; g < g1; g++)
    for (int64_t r0 = 0, p = passes, take; p > 0; r0 += take, p--) {
      take = (c->rows - r0 + p - 1) / p;
      switch (take) {
        case 1: NAME(group)(c, g, r0, 1, BITS, MINS); break;
        case 2: NAME(group)(c, g, r0, 2, BITS, MINS); break;
        case 3: NAME(group)(c, g, r0, 3, BITS, MINS); break;
#if ROWS > 4
        case 4: NAME(group)(c, g, r0, 4, BITS, MINS); break;
#endif
#if ROWS > 5
        case 5: NAME(group)(c, g, r0, 5, BITS, MINS); break;
#endif
#if ROWS > 6
        case 6: NAME(group)(c, g, r0, 6, BITS, MINS); break;
#endif
#if ROWS > 7
        case 7: NAME(group)(c, g, r0, 7, BITS, MINS); break;
#endif
#if ROWS > 8
        case 8: NAME(group)(c, g, r0, 8, BITS, MINS); break;
#endif
#if ROWS > 9
        case 9: NAME(group)(c, g, r0, 9, BITS, MINS); break;
#endif
#if ROWS > 10
        case 10: NAME(group)(c, g, r0, 10, BITS, MINS); break;
#endif
#if ROWS > 11
        case 11: NAME(group)(c, g, r0, 11, BITS, MINS); break;
#endif
        default: NAME(group)(c, g, r0, ROWS, BITS, MINS); break;
      }
    }
}

PATH_LINK TARGET void NAME(groups)(const Int4Call *c, int64_t g0, int64_t g1) {
  const uint8_t *start = c->w + g0 * (c->k / BLOCK * record_bytes(c->bits, c->mins));
  for (int64_t o = 0; o < PREFETCH; o += 64) PREFETCH_T0(start + o);
  if (c->bits == 4 && !c->mins) NAME(groups_of)(c, g0, g1, 4, 0);
  else if (c->bits == 4) NAME(groups_of)(c, g0, g1, 4, 1);
  else if (!c->mins) NAME(groups_of)(c, g0, g1, 8, 0);
  else NAME(groups_of)(c, g0, g1, 8, 1);
}
