/* Fused CPU kernels for MXFP4 (OCP Microscaling, E2M1 elements, E8M0 scales) weights.
 *
 * Built with fp8_kernels.c into one library by hybridrl/quant/native.py and called through
 * ctypes (GIL released; the Python side splits rows across threads). One pass over each
 * 32-element block does what the torch path of mxfp4.py does in about ten passes (abs,
 * upcast, amax, frexp, where, multiply, bucketize, signbit, pack), with bitwise the same
 * bytes: the tests compare both. The rules (mxfp4.py's docstring has the why):
 *
 *   amax  = max |x| of the block (as bits: NaN sorts above inf, so a NaN/inf block is
 *           the one whose amax has exponent field 255)
 *   scale = E8M0 bits max(E - 2, 0), E = amax's float32 exponent field: floor(log2 amax) - 2
 *           clamped to >= -127, a zero / subnormal amax included; 255 for a NaN/inf block
 *   y     = |x| * 2**(127 - scale)   (a power of two in [2**-125, 2**127]: exact, y < 8)
 *   code  = number of E2M1 round-half-to-even thresholds below y (saturates at 7 = 6.0),
 *           | sign bit of x << 3; a NaN/inf block gets all-zero codes
 *   byte j of a block = code[2j] | code[2j+1] << 4
 *   dequant = E2M1 value * 2**(scale - 127) in float32 (scale 0 -> 2**-127, 255 -> NaN):
 *           exact, also in bfloat16, so the bf16 output is the float32 bits' top half;
 *           a NaN block is 0x7FC00000 / 0xFFFF, what torch writes.
 * No -ffast-math (the multiply must be IEEE's, subnormals included).
 */
#include <stdint.h>
#include <string.h>

#define BLOCK 32
/* Read ahead this far: without it a cold source (the refit's case) ran 1.5-3x slower than a
 * cached one, the hardware prefetcher not keeping up with one cache line per block. */
#define PREFETCH_BYTES 4096
#define NAN_SCALE 255
#define F32_NAN 0x7FC00000u
#define BF16_NAN 0xFFFFu

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* The thresholds of mxfp4._THRESHOLDS as float32 bits, compared as integers (y >= 0) by the
 * scalar path (the AVX2 one lets the FPU round, see codes8):
 * y > 0.25, y >= 0.75, y > 1.25, y >= 1.75, y > 2.5, y >= 3.5, y > 5 ("a >= t" is "a > t - 1 ulp"). */
#define T0 0x3E800000u
#define T1 (0x3F400000u - 1)
#define T2 0x3FA00000u
#define T3 (0x3FE00000u - 1)
#define T4 0x40200000u
#define T5 (0x40600000u - 1)
#define T6 0x40A00000u

static const float E2M1_VALUES[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                      -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

static inline uint32_t scale_bits(uint32_t amax_bits) {
    uint32_t e = amax_bits >> 23;
    return e == 255 ? NAN_SCALE : (e >= 2 ? e - 2 : 0);
}

/* 2**(127 - bits) for bits in [0, 252]: biased exponent 254 - bits, always normal. */
static inline float inv_scale(uint32_t bits) { return u2f((254u - bits) << 23); }

/* 2**(bits - 127); bits 0 is the subnormal 2**-127, 255 NaN. */
static inline float scale_value(uint32_t bits) {
    return u2f(bits == NAN_SCALE ? F32_NAN : (bits ? bits << 23 : 0x00400000u));
}

static inline uint8_t e2m1_code(uint32_t u, float inv) {
    uint32_t y = f2u(u2f(u & 0x7FFFFFFFu) * inv);
    uint32_t c = (y > T0) + (y > T1) + (y > T2) + (y > T3) + (y > T4) + (y > T5) + (y > T6);
    return (uint8_t)(c | ((u >> 28) & 8u));
}

/* One block from its 32 float32 bit patterns (scalar path). */
static inline void quantize_block_scalar(const uint32_t *u, uint8_t *q, uint8_t *s) {
    uint32_t m = 0;
    for (int i = 0; i < BLOCK; i++) { uint32_t a = u[i] & 0x7FFFFFFFu; m = a > m ? a : m; }
    uint32_t bits = scale_bits(m);
    *s = (uint8_t)bits;
    if (bits == NAN_SCALE) { memset(q, 0, BLOCK / 2); return; }
    float inv = inv_scale(bits);
    for (int j = 0; j < BLOCK / 2; j++) q[j] = (uint8_t)(e2m1_code(u[2 * j], inv) | e2m1_code(u[2 * j + 1], inv) << 4);
}

static inline void dequantize_block_scalar(const uint8_t *q, uint32_t bits, void *o, int out_bf16) {
    float s = scale_value(bits);
    for (int j = 0; j < BLOCK / 2; j++) {
        float lo = E2M1_VALUES[q[j] & 15] * s, hi = E2M1_VALUES[q[j] >> 4] * s;
        if (out_bf16) {
            uint16_t *ob = (uint16_t *)o;
            ob[2 * j] = bits == NAN_SCALE ? BF16_NAN : (uint16_t)(f2u(lo) >> 16);
            ob[2 * j + 1] = bits == NAN_SCALE ? BF16_NAN : (uint16_t)(f2u(hi) >> 16);
        } else {
            ((float *)o)[2 * j] = lo;
            ((float *)o)[2 * j + 1] = hi;
        }
    }
}

#if defined(__AVX2__)
#include <immintrin.h>
/* The same results 8 lanes at a time. */
static inline __m256i load8(const void *src, int src_bf16, int64_t i) {
    if (src_bf16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)src + i));
        return _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
    }
    return _mm256_loadu_si256((const __m256i *)((const float *)src + i));
}

/* Codes of 8 elements. Instead of the seven threshold compares of e2m1_code (20% slower
 * here), let the FPU round, as fp8_kernels.c does: with e = max(floor(log2 y), 0) in
 * {0, 1, 2} (y < 8), the E2M1 spacing at y is 2**(e-1), and adding C = 2**(e-1+23) rounds
 * y to a multiple of it, to nearest even (the default rounding mode, as torch assumes too):
 * the sum's low bits are m = round(y / 2**(e-1)) (0..4 for e = 0, 2..4 above), and the code
 * is m + 2e, 8 (the round-up from 7 <= y < 8) saturating to 7. Same bytes (tested). */
static inline __m256i codes8(__m256i u, __m256 inv) {
    __m256i a = _mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF));
    __m256 y = _mm256_mul_ps(_mm256_castsi256_ps(a), inv);
    __m256i ex = _mm256_max_epi32(_mm256_srli_epi32(_mm256_castps_si256(y), 23), _mm256_set1_epi32(127));  /* 127 + e */
    __m256i c_bits = _mm256_slli_epi32(_mm256_add_epi32(ex, _mm256_set1_epi32(22)), 23);
    __m256i m = _mm256_sub_epi32(_mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(c_bits), y)), c_bits);
    __m256i c = _mm256_add_epi32(m, _mm256_slli_epi32(_mm256_sub_epi32(ex, _mm256_set1_epi32(127)), 1));
    c = _mm256_min_epi32(c, _mm256_set1_epi32(7));
    return _mm256_or_si256(c, _mm256_and_si256(_mm256_srli_epi32(u, 28), _mm256_set1_epi32(8)));
}

static inline void quantize_block_avx2(const void *src, int src_bf16, int64_t off, uint8_t *q, uint8_t *s) {
    __m256i u0 = load8(src, src_bf16, off), u1 = load8(src, src_bf16, off + 8);
    __m256i u2 = load8(src, src_bf16, off + 16), u3 = load8(src, src_bf16, off + 24);
    __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF);
    __m256i m = _mm256_max_epu32(_mm256_max_epu32(_mm256_and_si256(u0, abs_mask), _mm256_and_si256(u1, abs_mask)),
                                 _mm256_max_epu32(_mm256_and_si256(u2, abs_mask), _mm256_and_si256(u3, abs_mask)));
    m = _mm256_max_epu32(m, _mm256_permute2x128_si256(m, m, 1));
    m = _mm256_max_epu32(m, _mm256_shuffle_epi32(m, 0x4E));
    m = _mm256_max_epu32(m, _mm256_shuffle_epi32(m, 0xB1));
    uint32_t bits = scale_bits((uint32_t)_mm256_cvtsi256_si32(m));
    *s = (uint8_t)bits;
    if (bits == NAN_SCALE) { memset(q, 0, BLOCK / 2); return; }
    __m256 inv = _mm256_set1_ps(inv_scale(bits));
    /* 4 x 8 int32 codes -> 32 bytes in order (packs work per 128-bit lane, the permute undoes it) */
    __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(codes8(u0, inv), codes8(u1, inv)),
                                    _mm256_packus_epi32(codes8(u2, inv), codes8(u3, inv)));
    b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    /* 16-bit lane j holds code[2j] | code[2j+1] << 8 -> code[2j] | code[2j+1] << 4, then to bytes */
    __m256i w = _mm256_and_si256(_mm256_or_si256(b, _mm256_srli_epi16(b, 4)), _mm256_set1_epi16(0xFF));
    _mm_storeu_si128((__m128i *)q, _mm_packus_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
}

/* 8 codes (one per int32 lane) -> float32 values * s. permutevar reads an index's low 3 bits. */
static inline __m256 values8(__m256i c, __m256 s) {
    __m256 mag = _mm256_permutevar8x32_ps(_mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f), c);
    __m256i sign = _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(8)), 28);
    return _mm256_mul_ps(_mm256_or_ps(mag, _mm256_castsi256_ps(sign)), s);
}

static inline void dequantize_block_avx2(const uint8_t *q, uint32_t bits, void *o, int out_bf16) {
    if (bits == NAN_SCALE) { dequantize_block_scalar(q, bits, o, out_bf16); return; }
    __m128i b = _mm_loadu_si128((const __m128i *)q);
    __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0F)), hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
    __m128i c01 = _mm_unpacklo_epi8(lo, hi), c23 = _mm_unpackhi_epi8(lo, hi);  /* codes 0-15, 16-31 in order */
    __m256 s = _mm256_set1_ps(scale_value(bits));
    __m256 v[4] = {values8(_mm256_cvtepu8_epi32(c01), s), values8(_mm256_cvtepu8_epi32(_mm_srli_si128(c01, 8)), s),
                   values8(_mm256_cvtepu8_epi32(c23), s), values8(_mm256_cvtepu8_epi32(_mm_srli_si128(c23, 8)), s)};
    if (!out_bf16) {
        for (int i = 0; i < 4; i++) _mm256_storeu_ps((float *)o + 8 * i, v[i]);
        return;
    }
    for (int i = 0; i < 4; i += 2) {  /* exact values: bf16 is the top half of the float32 bits */
        __m256i h = _mm256_packus_epi32(_mm256_srli_epi32(_mm256_castps_si256(v[i]), 16),
                                        _mm256_srli_epi32(_mm256_castps_si256(v[i + 1]), 16));
        _mm256_storeu_si256((__m256i *)((uint16_t *)o + 8 * i), _mm256_permute4x64_epi64(h, 0xD8));
    }
}
#endif

static inline void quantize_block(const void *src, int src_bf16, int64_t off, uint8_t *q, uint8_t *s) {
    const char *ahead = (const char *)src + (off << (src_bf16 ? 1 : 2)) + PREFETCH_BYTES;
    __builtin_prefetch(ahead);  /* the block's 64 (bf16) or 128 (float32) bytes, PREFETCH_BYTES on */
    if (!src_bf16) __builtin_prefetch(ahead + 64);
#if defined(__AVX2__)
    quantize_block_avx2(src, src_bf16, off, q, s);
#else
    uint32_t u[BLOCK];
    if (src_bf16)
        for (int i = 0; i < BLOCK; i++) u[i] = (uint32_t)((const uint16_t *)src)[off + i] << 16;
    else
        memcpy(u, (const float *)src + off, sizeof u);
    quantize_block_scalar(u, q, s);
#endif
}

/* Rows [r0, r1) of a row-major [n_rows, n_cols] source (float32 or bfloat16, row stride
 * src_stride elements; n_cols a multiple of 32) into blocks (row stride blocks_stride bytes,
 * n_cols / 2 used) and scales (row stride scales_stride bytes, n_cols / 32 used). */
void hrl_mxfp4_quantize(const void *src, int src_bf16, int64_t src_stride, uint8_t *blocks,
                        int64_t blocks_stride, uint8_t *scales, int64_t scales_stride,
                        int64_t r0, int64_t r1, int64_t n_cols) {
    for (int64_t r = r0; r < r1; r++)
        for (int64_t j = 0; j < n_cols / BLOCK; j++)
            quantize_block(src, src_bf16, r * src_stride + j * BLOCK, blocks + r * blocks_stride + j * (BLOCK / 2),
                           scales + r * scales_stride + j);
}

/* Rows [r0, r1): out[r, c] = E2M1 value * 2**(scale - 127); out float32 (out_bf16 == 0) or
 * bfloat16, row stride out_stride elements. */
void hrl_mxfp4_dequantize(const uint8_t *blocks, int64_t blocks_stride, const uint8_t *scales,
                          int64_t scales_stride, void *out, int out_bf16, int64_t out_stride,
                          int64_t r0, int64_t r1, int64_t n_cols) {
    size_t esize = out_bf16 ? 2 : 4;
    for (int64_t r = r0; r < r1; r++)
        for (int64_t j = 0; j < n_cols / BLOCK; j++) {
            const uint8_t *q = blocks + r * blocks_stride + j * (BLOCK / 2);
            void *o = (char *)out + (r * out_stride + j * BLOCK) * esize;
#if defined(__AVX2__)
            dequantize_block_avx2(q, scales[r * scales_stride + j], o, out_bf16);
#else
            dequantize_block_scalar(q, scales[r * scales_stride + j], o, out_bf16);
#endif
        }
}
