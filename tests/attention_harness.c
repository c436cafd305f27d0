/* The CPU attention (kernels/cpu_op.c) without onnxruntime, for builds the test machine
   cannot load: aarch64 under qemu-user, or any -march. Per case it runs one sequence's
   verify window over a cached context, then the same positions one decode step at a time,
   and checks what speculation's losslessness rests on: every query's output is the same
   bits in the window as in its own step, and in any split of the window into query
   blocks; and that all of them agree with the plain loops (attend) to rounding.
   Prints the path it was built with, then one line per case ("ok" or "FAIL ..."); the exit
   status counts the failures. */

#include <math.h>
#include <stdio.h>

#include "cpu_kv.c"
#include "cpu_op.c"

const OrtCustomOp dspark_int4_op; /* RegisterCustomOps' other op (cpu_int4.c): never called here */
const OrtCustomOp dspark_rms_norm_op, dspark_skip_rms_norm_op, dspark_silu_op; /* cpu_rows.c: nor these */
const OrtCustomOp dspark_quantize_tokens_op; /* cpu_quant.c: nor this */

static uint64_t state = 88172645463325252ull;

static float uniform(void) { /* xorshift64: the same numbers on every machine */
  state ^= state << 13;
  state ^= state >> 7;
  state ^= state << 17;
  return (float)((state >> 40) & 0xFFFFFF) / (float)0x1000000 * 2.0f - 1.0f;
}

typedef struct {
  const char *name;
  int64_t kv, group, cached, news, window;
} Case;

enum { DIM = 64, BLOCK_SIZE = 16 };

typedef struct {
  int64_t blocks, max_blocks, *table;
  float *k_pool, *v_pool;
} Pool;

static void pool_copy(Pool *to, const Pool *from, int64_t kv) {
  const size_t floats = (size_t)(from->blocks * kv * BLOCK_SIZE * DIM);
  memcpy(to->k_pool, from->k_pool, floats * sizeof(float));
  memcpy(to->v_pool, from->v_pool, floats * sizeof(float));
}

/* Rows [j0, j0 + n) of the case's new tokens as one call; query_block 0: as compute() picks
   for a short window (the whole window in one block). */
static int run(const Case *t, Pool *pool, const float *q, const float *k, const float *v,
               int64_t j0, int64_t n, int64_t query_block, int plain, float *out) {
  const int64_t heads = t->kv * t->group;
  int64_t start = t->cached + j0, qoff = 0, news = n;
  Call c;
  memset(&c, 0, sizeof(c));
  c.q = q + j0 * heads * DIM;
  c.k = k + j0 * t->kv * DIM;
  c.v = v + j0 * t->kv * DIM;
  c.k_pool = (char *)pool->k_pool;
  c.v_pool = (char *)pool->v_pool;
  c.out = out + j0 * heads * DIM;
  c.tables = pool->table;
  c.starts = &start;
  c.qoffs = &qoff;
  c.news = &news;
  c.seqs = 1;
  c.max_blocks = pool->max_blocks;
  c.blocks = pool->blocks;
  c.block_size = BLOCK_SIZE;
  c.kv = t->kv;
  c.group = t->group;
  c.dim = DIM;
  c.row_bytes = DIM * (int64_t)sizeof(float);
  c.kind = KV_FLOAT32;
  c.scale = 0.125f;
  c.window = t->window;
  c.q_tstride = heads * DIM;
  c.q_hstride = DIM;
  c.k_tstride = t->kv * DIM;
  c.k_hstride = DIM;
  c.query_block = query_block > 0 ? query_block : n;
  c.qblocks = (n + c.query_block - 1) / c.query_block;
  if (!append(&c, 0)) return 0;
  if (plain) {
    const int64_t length = start + n, rows = n * t->group;
    float *buffer = (float *)malloc((size_t)(rows * length + rows * DIM + DIM) * sizeof(float));
    for (int64_t g = 0; g < t->kv; g++)
      attend(&c, 0, g, 0, n, buffer, buffer + rows * length, buffer + rows * (length + DIM));
    free(buffer);
  } else {
    for (size_t item = 0; item < (size_t)(t->kv * c.qblocks); item++) attend_item(&c, item);
  }
  return 1;
}

static int check(const Case *t) {
  const int64_t heads = t->kv * t->group, total = t->cached + t->news;
  Pool base = {0}, pool = {0};
  base.max_blocks = pool.max_blocks = (total + BLOCK_SIZE - 1) / BLOCK_SIZE;
  base.blocks = base.max_blocks + 3; /* spare blocks; the table scatters over them, */
  while (base.blocks % 7 == 0) base.blocks++; /* one to one (7 and the count coprime) */
  pool.blocks = base.blocks;
  base.table = pool.table = (int64_t *)malloc((size_t)base.max_blocks * sizeof(int64_t));
  for (int64_t b = 0; b < base.max_blocks; b++) base.table[b] = (b * 7 + 2) % base.blocks;
  const size_t pool_floats = (size_t)(base.blocks * t->kv * BLOCK_SIZE * DIM);
  base.k_pool = (float *)malloc(pool_floats * sizeof(float));
  base.v_pool = (float *)malloc(pool_floats * sizeof(float));
  pool.k_pool = (float *)malloc(pool_floats * sizeof(float));
  pool.v_pool = (float *)malloc(pool_floats * sizeof(float));
  for (size_t i = 0; i < pool_floats; i++) base.k_pool[i] = uniform();
  for (size_t i = 0; i < pool_floats; i++) base.v_pool[i] = uniform();
  const size_t q_floats = (size_t)(t->news * heads * DIM), kv_floats =
      (size_t)(t->news * t->kv * DIM);
  float *q = (float *)malloc(q_floats * sizeof(float)), *k = (float *)malloc(kv_floats * 4),
        *v = (float *)malloc(kv_floats * 4);
  for (size_t i = 0; i < q_floats; i++) q[i] = 2.0f * uniform();
  for (size_t i = 0; i < kv_floats; i++) k[i] = uniform();
  for (size_t i = 0; i < kv_floats; i++) v[i] = uniform();
  float *window = (float *)calloc(q_floats, 4), *steps = (float *)calloc(q_floats, 4),
        *split = (float *)calloc(q_floats, 4), *plain = (float *)calloc(q_floats, 4);
  int fine = 1;
  pool_copy(&pool, &base, t->kv);
  fine &= run(t, &pool, q, k, v, 0, t->news, 0, 0, window);
  pool_copy(&pool, &base, t->kv);
  for (int64_t j = 0; j < t->news; j++) fine &= run(t, &pool, q, k, v, j, 1, 0, 0, steps);
  pool_copy(&pool, &base, t->kv);
  fine &= run(t, &pool, q, k, v, 0, t->news, 2, 0, split);
  pool_copy(&pool, &base, t->kv);
  fine &= run(t, &pool, q, k, v, 0, t->news, 0, 1, plain);
  double worst = 0.0;
  for (size_t i = 0; i < q_floats; i++) {
    const double d = fabs((double)window[i] - (double)plain[i]) / (fabs((double)plain[i]) + 1e-3);
    worst = d > worst ? d : worst;
  }
  const int steps_same = memcmp(window, steps, q_floats * 4) == 0;
  if (getenv("HARNESS_DEBUG"))
    for (size_t i = 0; i < q_floats; i++)
      if (memcmp(window + i, steps + i, 4) != 0) {
        printf("  first difference: token %lld head %lld dim %lld: %.9g vs %.9g\n",
               (long long)(i / (heads * DIM)), (long long)(i / DIM % heads),
               (long long)(i % DIM), window[i], steps[i]);
        break;
      }
  const int split_same = memcmp(window, split, q_floats * 4) == 0;
  const int ok_case = fine && steps_same && split_same && worst < 1e-4;
  if (ok_case)
    printf("%s ok %.3g\n", t->name, worst);
  else
    printf("%s FAIL ran=%d steps_same=%d split_same=%d worst=%.3g\n", t->name, fine, steps_same,
           split_same, worst);
  free(base.table), free(base.k_pool), free(base.v_pool), free(pool.k_pool), free(pool.v_pool);
  free(q), free(k), free(v), free(window), free(steps), free(split), free(plain);
  return ok_case;
}

int main(void) {
#if defined(__GNUC__) && defined(__AVX512F__)
  printf("path 16-lane\n");
#elif defined(__GNUC__)
  printf("path 8-lane\n");
#else
  printf("path plain\n");
#endif
  const Case cases[] = {
      {"smollm2_g3_203", 3, 3, 203, 9, 0}, /* SmolLM2: 9 heads over 3, a long context */
      {"g4_40", 2, 4, 40, 9, 0},
      {"g1_window16_300", 1, 1, 300, 9, 16}, /* a sliding window the verify crosses */
      {"g2_short", 3, 2, 5, 7, 0},
      {"g3_window5_33", 3, 3, 33, 9, 5},
  };
  int failed = 0;
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) failed += !check(&cases[i]);
  return failed;
}
