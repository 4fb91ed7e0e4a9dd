/* Fused CPU kernels for FP8 (e4m3fn) weight quantization and dequantization.
 *
 * Built on first use by hybridrl/quant/native.py (the system C compiler, no torch
 * headers) and called through ctypes, which releases the GIL: the Python side splits
 * rows across threads. Each function does in one pass over memory what the torch path
 * in fp8.py does in four to six (upcast, abs, amax, divide, clamp, cast; table lookup,
 * multiply, downcast), and produces bitwise the same bytes: the tests compare both.
 *
 * Numerics (must match torch exactly: no -ffast-math; -fno-trapping-math only lets the
 * compiler if-convert the selects, it changes no result):
 *   scale  = max(amax, 1e-12f) / 448.0f              (float32 divide)
 *   q      = e4m3fn(clamp(x / scale, -448, 448))     (float32 divide, round to nearest even)
 *   dequant= out_dtype((float32)q * scale)            (bf16: round to nearest even)
 * Conversions are written branch-free (selects) so the compiler can vectorize them.
 */
#include <stdint.h>
#include <string.h>

#define FP8_MAX 448.0f
#define TINY 1e-12f
#define BLOCK 128

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* float32 -> e4m3fn byte, round to nearest even, saturating as torch's CPU cast:
 * |x| >= 448 (inf included) -> +-448 (0x7E), NaN -> 0x7F (sign kept). */
static inline uint8_t f32_to_e4m3fn(float x) {
    int32_t u = (int32_t)f2u(x);
    int32_t a = u & 0x7FFFFFFF;  /* |x| bits; signed compares are exact below 2^31 and cheap */
    /* Let the FPU round: adding C = 2^(e+20), e = max(exponent of |x|, -6), puts the sum's
     * last mantissa bit at 2^(e-3) — the e4m3 spacing at that exponent (2^-9 in the
     * subnormal range) — so C + |x| = C + m * 2^(e-3) with m rounded to nearest even, and
     * m (0..16) is the low bits of the sum. The code is then exponent * 8 + m. */
    int32_t ex = (a >> 23) > 121 ? (a >> 23) : 121;
    int32_t c_bits = (ex + 20) << 23;
    int32_t m = (int32_t)f2u(u2f((uint32_t)c_bits) + u2f((uint32_t)a)) - c_bits;
    int32_t r = ((ex - 121) << 3) + m;
    r = a >= 0x43E00000 ? 0x7E : r;  /* saturate at 448, inf included */
    r = a > 0x7F800000 ? 0x7F : r;   /* NaN */
    return (uint8_t)(r | ((u >> 24) & 0x80));
}

/* e4m3fn byte -> float32 (exact). 0x7F / 0xFF are NaN (bits 0x7FF00000, as torch). */
static inline float e4m3fn_to_f32(uint8_t b) {
    uint32_t em = b & 0x7Fu;
    uint32_t sign = (uint32_t)(b & 0x80u) << 24;
    uint32_t nrm = (em << 20) + (120u << 23);
    uint32_t sub = f2u((float)em * (1.0f / 512.0f));
    uint32_t r = em < 8u ? sub : nrm;
    r = em == 0x7Fu ? 0x7FF00000u : r;
    return u2f(r | sign);
}

/* float32 -> bfloat16 bits, round to nearest even; NaN -> 0xFFFF, what torch's vectorized CPU cast writes. */
static inline uint16_t f32_to_bf16(float x) {
    uint32_t u = f2u(x);
    uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return (u & 0x7FFFFFFFu) > 0x7F800000u ? (uint16_t)0xFFFFu : (uint16_t)r;
}

/* |x| bit patterns order like |x| for non-NaN floats, so amax is an integer max, which
 * vectorizes without -ffast-math (a float max reduction does not). NaN sorts above inf. */
static inline float amax_f32(const float *restrict x, int64_t n) {
    const uint32_t *restrict u = (const uint32_t *)x;
    uint32_t m = 0;
    for (int64_t c = 0; c < n; c++) { uint32_t a = u[c] & 0x7FFFFFFFu; m = a > m ? a : m; }
    return u2f(m);
}

static inline float amax_bf16(const uint16_t *restrict x, int64_t n) {
    uint16_t m = 0;
    for (int64_t c = 0; c < n; c++) { uint16_t a = x[c] & 0x7FFFu; m = a > m ? a : m; }
    return u2f((uint32_t)m << 16);
}

#if defined(__AVX2__)
#include <immintrin.h>
/* AVX2 versions of the conversions above, 8 lanes at a time, same operations in the same
 * order (so the same bits); the compiler's auto-vectorization of the scalar code ran at
 * ~1 ns per element here, these at a fraction of that. */
static inline __m256 bf16x8_to_f32(const uint16_t *x) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)x));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

/* e4m3fn codes (one per int32 lane) of y, where |y| <= 448 or y is NaN (clamped input). */
static inline __m256i e4m3fn_codes_avx2(__m256 y) {
    __m256i u = _mm256_castps_si256(y);
    __m256i a = _mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF));
    __m256i ex = _mm256_max_epi32(_mm256_srli_epi32(a, 23), _mm256_set1_epi32(121));
    __m256i c_bits = _mm256_slli_epi32(_mm256_add_epi32(ex, _mm256_set1_epi32(20)), 23);
    __m256i m = _mm256_sub_epi32(
        _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(c_bits), _mm256_castsi256_ps(a))), c_bits);
    __m256i r = _mm256_add_epi32(_mm256_slli_epi32(_mm256_sub_epi32(ex, _mm256_set1_epi32(121)), 3), m);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7F), _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7F800000)));
    return _mm256_or_si256(r, _mm256_and_si256(_mm256_srli_epi32(u, 24), _mm256_set1_epi32(0x80)));
}

static inline __m256 quantize_clamped_avx2(__m256 x, __m256 s) {
    /* max/min return their second operand when either is NaN: NaN passes, as in clamp_fp8 */
    __m256 y = _mm256_div_ps(x, s);
    y = _mm256_max_ps(_mm256_set1_ps(-FP8_MAX), y);
    return _mm256_min_ps(_mm256_set1_ps(FP8_MAX), y);
}

/* 4 x 8 int32 codes -> 32 bytes, in order. */
static inline void store_codes_x32(__m256i r0, __m256i r1, __m256i r2, __m256i r3, uint8_t *q) {
    __m256i bytes = _mm256_packus_epi16(_mm256_packus_epi32(r0, r1), _mm256_packus_epi32(r2, r3));
    /* packs work per 128-bit lane: dwords come out as r0a r1a r2a r3a | r0b r1b r2b r3b */
    bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, bytes);
}

/* 32 source values, 4 x 8 lanes already float32 -> 32 e4m3fn bytes of clamp(x / s). */
static inline void quantize_x32_avx2(__m256 x0, __m256 x1, __m256 x2, __m256 x3, uint8_t *q, __m256 s) {
    store_codes_x32(e4m3fn_codes_avx2(quantize_clamped_avx2(x0, s)),
                    e4m3fn_codes_avx2(quantize_clamped_avx2(x1, s)),
                    e4m3fn_codes_avx2(quantize_clamped_avx2(x2, s)),
                    e4m3fn_codes_avx2(quantize_clamped_avx2(x3, s)), q);
}

static inline __m256 e4m3fnx8_to_f32(const uint8_t *q) {
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
    __m256i em = _mm256_and_si256(b, _mm256_set1_epi32(0x7F));
    __m256i nrm = _mm256_add_epi32(_mm256_slli_epi32(em, 20), _mm256_set1_epi32(120 << 23));
    __m256i sub = _mm256_castps_si256(_mm256_mul_ps(_mm256_cvtepi32_ps(em), _mm256_set1_ps(1.0f / 512.0f)));
    __m256i r = _mm256_blendv_epi8(nrm, sub, _mm256_cmpgt_epi32(_mm256_set1_epi32(8), em));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FF00000), _mm256_cmpeq_epi32(em, _mm256_set1_epi32(0x7F)));
    return _mm256_castsi256_ps(_mm256_or_si256(r, _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24)));
}

static inline __m256i f32x8_to_bf16_bits(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd), 16);
    __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)), _mm256_set1_epi32(0x7F800000));
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0xFFFF), nan);
}

/* 16 float32 values (two halves of 8 lanes) stored as float32 / as bf16, in order. */
static inline void store_f32x16(float *o, __m256 lo, __m256 hi) {
    _mm256_storeu_ps(o, lo);
    _mm256_storeu_ps(o + 8, hi);
}

static inline void store_bf16x16(uint16_t *o, __m256 lo, __m256 hi) {
    __m256i w = _mm256_packus_epi32(f32x8_to_bf16_bits(lo), f32x8_to_bf16_bits(hi));
    _mm256_storeu_si256((__m256i *)o, _mm256_permute4x64_epi64(w, 0xD8));  /* packs work per 128-bit lane */
}
#endif

static inline float clamp_fp8(float y) { return y < -FP8_MAX ? -FP8_MAX : (y > FP8_MAX ? FP8_MAX : y); }

/* NAME(x, y, n, s): y[c] = ELEMENT for a run of n elements, the scale s (vs in every AVX2 lane).
 * AVX2 STEPs of WIDTH elements go as far as they can, then one element at a time: both give
 * bitwise the same results, so where the split falls does not matter. The two source types of
 * quantize_ differ only in how an element becomes float32 (bf16 -> float32 is exact), the two
 * output types of dequantize_ only in the final cast. */
#if defined(__AVX2__)
#define AVX2_STEPS(WIDTH, STEP) for (__m256 vs = _mm256_set1_ps(s); c + (WIDTH) <= n; c += (WIDTH)) STEP;
#else
#define AVX2_STEPS(WIDTH, STEP)
#endif
#define DEFINE_RUN(NAME, IN_T, OUT_T, WIDTH, STEP, ELEMENT)                                  \
    static inline void NAME(const IN_T *restrict x, OUT_T *restrict y, int64_t n, float s) { \
        int64_t c = 0;                                                                       \
        AVX2_STEPS(WIDTH, STEP)                                                              \
        for (; c < n; c++) y[c] = ELEMENT;                                                   \
    }

/* quantize: e4m3fn(clamp(x / s)) */
#define QUANTIZE_X32(LOAD8) \
    quantize_x32_avx2(LOAD8(x + c), LOAD8(x + c + 8), LOAD8(x + c + 16), LOAD8(x + c + 24), y + c, vs)
DEFINE_RUN(quantize_f32, float, uint8_t, 32, QUANTIZE_X32(_mm256_loadu_ps), f32_to_e4m3fn(clamp_fp8(x[c] / s)))
DEFINE_RUN(quantize_bf16, uint16_t, uint8_t, 32, QUANTIZE_X32(bf16x8_to_f32),
           f32_to_e4m3fn(clamp_fp8(u2f((uint32_t)x[c] << 16) / s)))

/* dequantize: out_dtype((float32)x * s) */
#define DEQUANTIZE_X16(STORE16) \
    STORE16(y + c, _mm256_mul_ps(e4m3fnx8_to_f32(x + c), vs), _mm256_mul_ps(e4m3fnx8_to_f32(x + c + 8), vs))
DEFINE_RUN(dequantize_f32, uint8_t, float, 16, DEQUANTIZE_X16(store_f32x16), e4m3fn_to_f32(x[c]) * s)
DEFINE_RUN(dequantize_bf16, uint8_t, uint16_t, 16, DEQUANTIZE_X16(store_bf16x16), f32_to_bf16(e4m3fn_to_f32(x[c]) * s))

static inline float amax_any(const void *src, int src_bf16, int64_t off, int64_t n) {
    return src_bf16 ? amax_bf16((const uint16_t *)src + off, n) : amax_f32((const float *)src + off, n);
}

static inline void quantize_any(const void *src, int src_bf16, int64_t off, uint8_t *q, int64_t n, float s) {
    if (src_bf16) quantize_bf16((const uint16_t *)src + off, q, n, s);
    else quantize_f32((const float *)src + off, q, n, s);
}

/* NaN amax stays NaN (torch's clamp_ keeps it), so a NaN row quantizes to NaN codes. */
static inline float scale_of(float amax) { return (amax != amax ? amax : (amax > TINY ? amax : TINY)) / FP8_MAX; }

/* Per-output-channel: rows [r0, r1) of a row-major [N, K] source (row stride src_stride
 * elements, float32 or bfloat16) into dst (row stride dst_stride bytes); scale[r] per row. */
void hrl_quantize_channel(const void *src, int src_bf16, int64_t src_stride, uint8_t *dst,
                          int64_t dst_stride, float *scale, int64_t r0, int64_t r1, int64_t n_cols) {
    for (int64_t r = r0; r < r1; r++) {
        float s = scale_of(amax_any(src, src_bf16, r * src_stride, n_cols));
        scale[r] = s;
        quantize_any(src, src_bf16, r * src_stride, dst + r * dst_stride, n_cols, s);
    }
}

/* 128x128 blocks: row stripes [stripe0, stripe1) (each BLOCK rows, the last may be short)
 * of an [n_rows, n_cols] source; scale is [ceil(N/128), ceil(K/128)] row-major. */
void hrl_quantize_block(const void *src, int src_bf16, int64_t src_stride, uint8_t *dst,
                        int64_t dst_stride, float *scale, int64_t stripe0, int64_t stripe1,
                        int64_t n_rows, int64_t n_cols) {
    int64_t n_tiles = (n_cols + BLOCK - 1) / BLOCK;
    for (int64_t t = stripe0; t < stripe1; t++) {
        int64_t r_lo = t * BLOCK, r_hi = r_lo + BLOCK < n_rows ? r_lo + BLOCK : n_rows;
        float *s_row = scale + t * n_tiles;
        for (int64_t j = 0; j < n_tiles; j++) {
            int64_t c0 = j * BLOCK, n = (c0 + BLOCK < n_cols ? c0 + BLOCK : n_cols) - c0;
            float m = 0.0f;
            for (int64_t r = r_lo; r < r_hi; r++) {
                float a = amax_any(src, src_bf16, r * src_stride + c0, n);
                m = a > m || a != a ? a : m;  /* NaN propagates, as torch's amax */
            }
            s_row[j] = scale_of(m);
        }
        for (int64_t r = r_lo; r < r_hi; r++)
            for (int64_t j = 0; j < n_tiles; j++) {
                int64_t c0 = j * BLOCK, n = (c0 + BLOCK < n_cols ? c0 + BLOCK : n_cols) - c0;
                quantize_any(src, src_bf16, r * src_stride + c0, dst + r * dst_stride + c0, n, s_row[j]);
            }
    }
}

/* Dequantize rows [r0, r1): out[r, c] = (float)w[r, c] * scale, scale per channel
 * (scale[r], block == 0) or per 128x128 tile (scale[(r/128) * scale_cols + c/128]).
 * out is float32 (out_bf16 == 0) or bfloat16, row stride out_stride elements. */
void hrl_dequantize(const uint8_t *w, int64_t w_stride, const float *scale, int block,
                    int64_t scale_cols, void *out, int out_bf16, int64_t out_stride,
                    int64_t r0, int64_t r1, int64_t n_cols) {
    int64_t span = block ? BLOCK : n_cols;  /* columns sharing one scale */
    for (int64_t r = r0; r < r1; r++) {
        for (int64_t c0 = 0; c0 < n_cols; c0 += span) {
            int64_t n = (c0 + span < n_cols ? c0 + span : n_cols) - c0;
            float s = block ? scale[(r / BLOCK) * scale_cols + c0 / BLOCK] : scale[r];
            const uint8_t *q = w + r * w_stride + c0;
            if (out_bf16) dequantize_bf16(q, (uint16_t *)out + r * out_stride + c0, n, s);
            else dequantize_f32(q, (float *)out + r * out_stride + c0, n, s);
        }
    }
}

/* Elementwise conversions, for the exhaustive tests. */
void hrl_f32_to_e4m3fn(const float *x, uint8_t *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = f32_to_e4m3fn(x[i]);
}

void hrl_e4m3fn_to_f32(const uint8_t *x, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = e4m3fn_to_f32(x[i]);
}

void hrl_f32_to_bf16(const float *x, uint16_t *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = f32_to_bf16(x[i]);
}
