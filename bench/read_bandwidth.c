/* The machine's memory read bandwidth, what one decode step's weights stream through:
 * THREADS threads each sum their share of a MIB-MiB buffer (eight independent 64-bit
 * accumulators, so the loads, not the adds, set the pace), best of REPEATS, in GB/s.
 * Built and run by bench/bench_roofline.py:  read_bandwidth MIB THREADS REPEATS */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

static uint64_t *buf;
static size_t words;
static int threads;
static volatile uint64_t sink;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void *read_share(void *arg) {
    size_t id = (size_t)arg, lo = words / threads * id, hi = words / threads * (id + 1);
    uint64_t s[8] = {0};
    for (size_t i = lo; i + 8 <= hi; i += 8)
        for (int k = 0; k < 8; k++) s[k] += buf[i + k];
    sink += s[0] + s[1] + s[2] + s[3] + s[4] + s[5] + s[6] + s[7];
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: read_bandwidth MIB THREADS REPEATS\n");
        return 2;
    }
    size_t bytes = (size_t)atol(argv[1]) << 20;
    threads = atoi(argv[2]);
    int repeats = atoi(argv[3]);
    if (bytes == 0 || threads < 1 || threads > 256 || repeats < 1) {
        fprintf(stderr, "read_bandwidth: MIB, THREADS (1-256) and REPEATS must be positive\n");
        return 2;
    }
    buf = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (buf == MAP_FAILED) {
        perror("read_bandwidth: mmap");
        return 1;
    }
#ifdef MADV_HUGEPAGE
    madvise(buf, bytes, MADV_HUGEPAGE); /* fewer TLB misses, as a large weight file gets */
#endif
    words = bytes / sizeof(uint64_t);
    memset(buf, 1, bytes);
    pthread_t tid[256];
    double best = 0;
    for (int r = 0; r < repeats; r++) {
        double t0 = now();
        for (long i = 0; i < threads; i++) pthread_create(&tid[i], NULL, read_share, (void *)i);
        for (int i = 0; i < threads; i++) pthread_join(tid[i], NULL);
        double gbs = bytes / (now() - t0) / 1e9;
        if (gbs > best) best = gbs;
    }
    printf("%.3f\n", best);
    return 0;
}
