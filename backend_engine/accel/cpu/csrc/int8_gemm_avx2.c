/* Exact int8 x int8 -> int32 matrix products on AVX2 (no VNNI): C[m][n] = sum_k A[m][k] B[n][k].
 *
 * A (the activations) holds values in [-127, 127]; B (the weights) any int8. Each pair of
 * products is formed by vpmaddubsw over |b| (unsigned) and a with b's sign moved onto it: the
 * factors are at most 128 and 127 in magnitude, so a pair sums to at most 32,512 and the 16-bit
 * step never saturates (the u8 x s8 kernels of oneDNN and FBGEMM take a + 128, whose pairs
 * reach 64,770, and saturate without VNNI). Pairs are then summed in 32 bits (vpmaddwd against
 * ones). Every sum is exact, so any blocking or thread count gives the same result.
 *
 * Blocking: a tile of up to 3 rows of A by 3 rows of B keeps its 9 accumulators in registers
 * over the whole of K; B's rows are split across threads in blocks of N_BLOCK, A's rows walked
 * in panels of M_PANEL that stay in cache, the next tiles' rows of B prefetched (at a few rows of A
 * the kernel streams B from memory). K's tail (K % 32) is summed in scalar code.
 */
#include <immintrin.h>
#include <stdint.h>

#define MR 3
#define NR 3
#define M_PANEL 48
#define N_BLOCK 48
#define PREFETCH_ROWS 6  /* two tiles of B ahead: at one row of A the loads wait on memory */

static inline int32_t hsum(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

/* rows a[0..mr) of A times rows b[0..nr) of B into c; mr, nr <= 3 (constants after inlining) */
static inline __attribute__((always_inline)) void tile(
        const int8_t *a, const int8_t *b, int64_t k, int64_t lda, int64_t ldb, int32_t *c,
        int64_t ldc, const int mr, const int nr) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc[MR][NR];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) acc[i][j] = _mm256_setzero_si256();
    const int64_t k32 = k & ~(int64_t)31;
    for (int64_t p = 0; p < k32; p += 32) {
        if (!(p & 63))  /* a cache line of each row PREFETCH_ROWS on (past B's end: ignored) */
            for (int j = 0; j < nr; j++)
                _mm_prefetch((const char *)(b + (j + PREFETCH_ROWS) * ldb + p), _MM_HINT_T0);
        __m256i bv[NR], ub[NR];
        for (int j = 0; j < nr; j++) {
            bv[j] = _mm256_loadu_si256((const __m256i *)(b + j * ldb + p));
            ub[j] = _mm256_abs_epi8(bv[j]);
        }
        for (int i = 0; i < mr; i++) {
            const __m256i av = _mm256_loadu_si256((const __m256i *)(a + i * lda + p));
            for (int j = 0; j < nr; j++) {
                const __m256i pairs = _mm256_maddubs_epi16(ub[j], _mm256_sign_epi8(av, bv[j]));
                acc[i][j] = _mm256_add_epi32(acc[i][j], _mm256_madd_epi16(pairs, ones));
            }
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) {
            int32_t s = hsum(acc[i][j]);
            for (int64_t p = k32; p < k; p++) s += (int32_t)a[i * lda + p] * b[j * ldb + p];
            c[i * ldc + j] = s;
        }
}

#define TILE(M, N)                                                                            \
    static void tile_##M##x##N(const int8_t *a, const int8_t *b, int64_t k, int64_t lda,      \
                               int64_t ldb, int32_t *c, int64_t ldc) {                        \
        tile(a, b, k, lda, ldb, c, ldc, M, N);                                                \
    }
TILE(1, 1) TILE(1, 2) TILE(1, 3) TILE(2, 1) TILE(2, 2) TILE(2, 3) TILE(3, 1) TILE(3, 2)
TILE(3, 3)

typedef void (*tile_fn)(const int8_t *, const int8_t *, int64_t, int64_t, int64_t, int32_t *,
                        int64_t);
static const tile_fn TILES[MR][NR] = {{tile_1x1, tile_1x2, tile_1x3},
                                      {tile_2x1, tile_2x2, tile_2x3},
                                      {tile_3x1, tile_3x2, tile_3x3}};

/* C [m, n] = A [m, k] . B [n, k]^T; rows of A, B and C lie lda, ldb, ldc elements apart. */
void kvgate_int8_gemm(const int8_t *a, const int8_t *b, int32_t *c, int64_t m, int64_t n,
                      int64_t k, int64_t lda, int64_t ldb, int64_t ldc, int threads) {
    const int64_t blocks = (n + N_BLOCK - 1) / N_BLOCK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t blk = 0; blk < blocks; blk++) {
        const int64_t n0 = blk * N_BLOCK, n1 = n0 + N_BLOCK < n ? n0 + N_BLOCK : n;
        for (int64_t m0 = 0; m0 < m; m0 += M_PANEL) {
            const int64_t m1 = m0 + M_PANEL < m ? m0 + M_PANEL : m;
            for (int64_t j = n0; j < n1; j += NR) {
                const int nr = n1 - j < NR ? (int)(n1 - j) : NR;
                for (int64_t i = m0; i < m1; i += MR) {
                    const int mr = m1 - i < MR ? (int)(m1 - i) : MR;
                    TILES[mr - 1][nr - 1](a + i * lda, b + j * ldb, k, lda, ldb,
                                          c + i * ldc + j, ldc);
                }
            }
        }
    }
}
