// The exact-rows kernels (patches/llama-cpp-python-exact-rows.patch) against the one-row kernels plain decoding uses,
// on one thread, without a model: a Q6_K matrix (ggml_vec_dot_rows_q6_K_q8_K against ggml_vec_dot_q6_K_q8_K) and a
// repacked Q4_K one (ggml_gemv_rows_q4_K_8x8_q8_K against ggml_gemv_q4_K_8x8_q8_K), M rows of 1536 random weights
// each, for 1-16 rows of activations: the best of 5 times, what each row past the first adds, and how many rows'
// outputs differ in any bit from the one-row kernel's (0 is the contract). Build against the library ./dev.sh installed:
//
//   L=.venv/lib/python3.11/site-packages/llama_cpp/lib
//   gcc -O2 -o /tmp/rows_kernels_bench scripts/rows_kernels_bench.c -L$L -l:libggml-cpu.so -l:libggml-base.so -Wl,-rpath,$L
//   /tmp/rows_kernels_bench [M]      (default 65536: weights far larger than the caches)
//
// The block layouts below are llama.cpp's (ggml-common.h, repack.h).
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define QK_K 256
#define K 1536
#define MAX_ROWS 16
#define REPEATS 5

typedef struct { uint8_t ql[QK_K / 2]; uint8_t qh[QK_K / 4]; int8_t scales[QK_K / 16]; uint16_t d; } block_q6_K;
typedef struct { float d; int8_t qs[QK_K]; int16_t bsums[QK_K / 16]; } block_q8_K;
typedef struct { uint16_t d[8]; uint16_t dmin[8]; uint8_t scales[96]; uint8_t qs[1024]; } block_q4_Kx8;

void ggml_vec_dot_q6_K_q8_K(int n, float * s, size_t bs, const void * vx, size_t bx, const void * vy, size_t by, int nrc);
void ggml_vec_dot_rows_q6_K_q8_K(int n, float * s, size_t bs, const void * vx, const void * vy, size_t by, int nr);
void ggml_gemv_q4_K_8x8_q8_K(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc);
void ggml_gemv_rows_q4_K_8x8_q8_K(int n, float * s, size_t bs, const void * vx, const void * vy, size_t vy_stride, int nr, int nc);
void quantize_row_q8_K(const float * x, void * y, int64_t k);
void ggml_cpu_init(void);

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

// random bytes (main then sets each fp16 scale to a small normal number: random bits could be inf or NaN)
static void fill(void * p, size_t n) {
    for (size_t i = 0; i < n; i++) ((uint8_t *) p)[i] = rand();
}

int main(int argc, char ** argv) {
    const int M = argc > 1 ? atoi(argv[1]) : 65536, nb = K / QK_K;
    if (M <= 0 || M % 8) { fprintf(stderr, "M must be a positive multiple of 8\n"); return 2; }
    ggml_cpu_init();  // its fp16 table: without it every Q6_K scale reads as 0, and every Q6_K output is 0
    srand(1);
    block_q6_K * w6 = aligned_alloc(64, (size_t) M * nb * sizeof(block_q6_K));
    fill(w6, (size_t) M * nb * sizeof(block_q6_K));
    for (size_t i = 0; i < (size_t) M * nb; i++) w6[i].d = 0x1c00 + (rand() & 0xff);
    const size_t n4 = (size_t) (M / 8) * nb;
    block_q4_Kx8 * w4 = aligned_alloc(64, n4 * sizeof(block_q4_Kx8));
    fill(w4, n4 * sizeof(block_q4_Kx8));
    for (size_t i = 0; i < n4; i++) {
        for (int c = 0; c < 8; c++) { w4[i].d[c] = 0x1c00 + (rand() & 0xff); w4[i].dmin[c] = 0x1800 + (rand() & 0xff); }
    }
    const size_t by = nb * sizeof(block_q8_K);
    block_q8_K * y = aligned_alloc(64, MAX_ROWS * by);
    float x[K];
    for (int r = 0; r < MAX_ROWS; r++) {
        for (int k = 0; k < K; k++) x[k] = (rand() / (float) RAND_MAX - 0.5f) * 4;
        quantize_row_q8_K(x, (char *) y + r * by, K);
    }
    // row r's outputs at r * 2M: the Q6_K matrix's M, then the Q4_K one's
    const size_t stride = 2 * (size_t) M;
    float * one = malloc(sizeof(float) * stride * MAX_ROWS), * rows = malloc(sizeof(float) * stride * MAX_ROWS);
    double t6 = 1e9, t4 = 1e9;
    for (int rep = 0; rep < REPEATS; rep++) {
        const double t0 = now();
        for (int m = 0; m < M; m++) ggml_vec_dot_q6_K_q8_K(K, one + m, 0, w6 + (size_t) m * nb, 0, y, 0, 1);
        const double t1 = now();
        ggml_gemv_q4_K_8x8_q8_K(K, one + M, 0, w4, y, 1, M);
        const double t2 = now();
        if (t1 - t0 < t6) t6 = t1 - t0;
        if (t2 - t1 < t4) t4 = t2 - t1;
    }
    for (int r = 1; r < MAX_ROWS; r++) {
        const char * yr = (const char *) y + r * by;
        for (int m = 0; m < M; m++) ggml_vec_dot_q6_K_q8_K(K, one + r * stride + m, 0, w6 + (size_t) m * nb, 0, yr, 0, 1);
        ggml_gemv_q4_K_8x8_q8_K(K, one + r * stride + M, 0, w4, yr, 1, M);
    }
    printf("%d x %d weights each, one thread; one row: Q6_K %.2f ms, Q4_K (repacked) %.2f ms\n", M, K, t6 * 1e3, t4 * 1e3);
    printf("| rows | Q6_K ms | Q6_K per added row | Q4_K ms | Q4_K per added row | rows differing |\n|---|---|---|---|---|---|\n");
    const int sizes[] = {1, 2, 3, 4, 8, 16};
    for (size_t si = 0; si < sizeof(sizes) / sizeof(sizes[0]); si++) {
        const int nr = sizes[si];
        double b6 = 1e9, b4 = 1e9;
        for (int rep = 0; rep < REPEATS; rep++) {
            const double t0 = now();
            for (int m = 0; m < M; m++) ggml_vec_dot_rows_q6_K_q8_K(K, rows + m, stride, w6 + (size_t) m * nb, y, by, nr);
            const double t1 = now();
            ggml_gemv_rows_q4_K_8x8_q8_K(K, rows + M, stride, w4, y, by, nr, M);
            const double t2 = now();
            if (t1 - t0 < b6) b6 = t1 - t0;
            if (t2 - t1 < b4) b4 = t2 - t1;
        }
        int differing = 0;
        for (int r = 0; r < nr; r++) differing += memcmp(one + r * stride, rows + r * stride, sizeof(float) * stride) != 0;
        if (nr == 1) {
            printf("| 1 | %.2f | - | %.2f | - | %d |\n", b6 * 1e3, b4 * 1e3, differing);
        } else {
            printf("| %d | %.2f | %.2f | %.2f | %.2f | %d |\n", nr, b6 * 1e3, (b6 - t6) / (nr - 1) * 1e3, b4 * 1e3,
                   (b4 - t4) / (nr - 1) * 1e3, differing);
        }
    }
    return 0;
}
