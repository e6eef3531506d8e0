/* trace-replay: copy token ids into staging memory and return the largest of them, in one pass
 * over the source. Built and loaded by host_copy.py (plain C, no Python API; ctypes releases
 * the GIL around each call).
 *
 * Staging must copy every trace and refuse ids that are negative or too large. numpy does that
 * as a copy and then a max over the copy, reading the bytes twice. Here each vector of ids is
 * loaded once, folded into a running max and stored. On x86-64 with AVX2 the stores are
 * non-temporal: the staging buffer is read next by the GPU's copy engine, not by this CPU, so
 * its lines need not be read into the cache before they are overwritten. stage_many of 64
 * traces x 8K int32 ids (2 MiB) inside the staging benchmark's loop on an H200 host, p50 of 30,
 * two runs: 274 and 411 us with these stores, 411 and 593 us with a max over each 16 KiB
 * piece followed by memcpy of it (cached stores), 422 and 556 us with numpy's copy and max.
 *
 * Every function returns the largest value read, as an unsigned integer of the source's width:
 * a negative int32 or int64 id reads as at least 2**31 or 2**63, so one comparison of the
 * result with the id limit (at most 2**31) checks both bounds.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(TRACE_REPLAY_PORTABLE)
#define HAVE_X86_AVX2_PATH 1
#include <immintrin.h>
#endif

/* Portable paths (and the tails of the vector ones). */
static uint32_t copy_u32_scalar(uint32_t *restrict dst, const uint32_t *restrict src, int64_t n, uint32_t m) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t v = src[i];
        dst[i] = v;
        m = v > m ? v : m;
    }
    return m;
}

static uint64_t copy_u64_scalar(uint32_t *restrict dst, const uint64_t *restrict src, int64_t n, uint64_t m) {
    for (int64_t i = 0; i < n; i++) {
        uint64_t v = src[i];
        dst[i] = (uint32_t)v;
        m = v > m ? v : m;
    }
    return m;
}

#ifdef HAVE_X86_AVX2_PATH
static int has_avx2(void) {
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx2") ? 1 : 0;
    }
    return known;
}

__attribute__((target("avx2"))) static uint32_t copy_u32_avx2(uint32_t *dst, const uint32_t *src, int64_t n) {
    uint32_t m = 0;
    int64_t i = 0;
    int64_t head = (int64_t)((32 - ((uintptr_t)dst & 31)) & 31) / 4;   /* to a 32-byte boundary of dst */
    if (((uintptr_t)dst & 3) == 0 && head < n) {
        m = copy_u32_scalar(dst, src, head, m);
        i = head;
        __m256i vm = _mm256_setzero_si256();
        for (; i + 32 <= n; i += 32) {
            __m256i a = _mm256_loadu_si256((const __m256i *)(src + i));
            __m256i b = _mm256_loadu_si256((const __m256i *)(src + i + 8));
            __m256i c = _mm256_loadu_si256((const __m256i *)(src + i + 16));
            __m256i d = _mm256_loadu_si256((const __m256i *)(src + i + 24));
            _mm256_stream_si256((__m256i *)(dst + i), a);
            _mm256_stream_si256((__m256i *)(dst + i + 8), b);
            _mm256_stream_si256((__m256i *)(dst + i + 16), c);
            _mm256_stream_si256((__m256i *)(dst + i + 24), d);
            vm = _mm256_max_epu32(vm, _mm256_max_epu32(_mm256_max_epu32(a, b), _mm256_max_epu32(c, d)));
        }
        _mm_sfence();    /* the streamed stores are visible before this returns */
        uint32_t lanes[8];
        _mm256_storeu_si256((__m256i *)lanes, vm);
        for (int j = 0; j < 8; j++) m = lanes[j] > m ? lanes[j] : m;
    }
    return copy_u32_scalar(dst + i, src + i, n - i, m);
}

__attribute__((target("avx2"))) static uint64_t copy_u64_avx2(uint32_t *dst, const uint64_t *src, int64_t n) {
    uint64_t m = 0;
    int64_t i = 0;
    int64_t head = (int64_t)((32 - ((uintptr_t)dst & 31)) & 31) / 4;
    if (((uintptr_t)dst & 3) == 0 && head < n) {
        m = copy_u64_scalar(dst, src, head, m);
        i = head;
        /* AVX2 compares 64-bit lanes as signed: the running max is kept with the sign bit
         * flipped, so a signed compare orders the lanes as unsigned. */
        const __m256i flip = _mm256_set1_epi64x((long long)0x8000000000000000ULL);
        const __m256i low_halves = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
        __m256i vm = flip;   /* 0, flipped */
        for (; i + 8 <= n; i += 8) {
            __m256i a = _mm256_loadu_si256((const __m256i *)(src + i));
            __m256i b = _mm256_loadu_si256((const __m256i *)(src + i + 4));
            __m256i fa = _mm256_xor_si256(a, flip), fb = _mm256_xor_si256(b, flip);
            __m256i fab = _mm256_blendv_epi8(fb, fa, _mm256_cmpgt_epi64(fa, fb));
            vm = _mm256_blendv_epi8(vm, fab, _mm256_cmpgt_epi64(fab, vm));
            __m256i la = _mm256_permutevar8x32_epi32(a, low_halves);   /* low 32 bits in lanes 0-3 */
            __m256i lb = _mm256_permutevar8x32_epi32(b, low_halves);
            _mm256_stream_si256((__m256i *)(dst + i), _mm256_permute2x128_si256(la, lb, 0x20));
        }
        _mm_sfence();
        uint64_t lanes[4];
        _mm256_storeu_si256((__m256i *)lanes, _mm256_xor_si256(vm, flip));
        for (int j = 0; j < 4; j++) m = lanes[j] > m ? lanes[j] : m;
    }
    return copy_u64_scalar(dst + i, src + i, n - i, m);
}
#endif

static uint32_t copy_u32_row(uint32_t *dst, const uint32_t *src, int64_t n) {
#ifdef HAVE_X86_AVX2_PATH
    if (has_avx2()) return copy_u32_avx2(dst, src, n);
#endif
    return copy_u32_scalar(dst, src, n, 0);
}

static uint64_t copy_u64_row(uint32_t *dst, const uint64_t *src, int64_t n) {
#ifdef HAVE_X86_AVX2_PATH
    if (has_avx2()) return copy_u64_avx2(dst, src, n);
#endif
    return copy_u64_scalar(dst, src, n, 0);
}

/* Copy rows x cols 32-bit ids from src to dst; strides are in elements, between row starts. */
uint32_t trace_replay_copy_u32(uint32_t *dst, int64_t dst_stride, const uint32_t *src, int64_t src_stride,
                               int64_t rows, int64_t cols) {
    if (rows > 1 && dst_stride == cols && src_stride == cols) {
        cols *= rows;   /* both contiguous: one long row */
        rows = 1;
    }
    uint32_t m = 0;
    for (int64_t r = 0; r < rows; r++) {
        uint32_t c = copy_u32_row(dst + r * dst_stride, src + r * src_stride, cols);
        m = c > m ? c : m;
    }
    return m;
}

/* Copy rows x cols 64-bit ids from src to dst, keeping the low 32 bits of each (the caller
 * refuses the call when the result is 2**31 or more, so no kept id has lost a bit). */
uint64_t trace_replay_copy_u64(uint32_t *dst, int64_t dst_stride, const uint64_t *src, int64_t src_stride,
                               int64_t rows, int64_t cols) {
    if (rows > 1 && dst_stride == cols && src_stride == cols) {
        cols *= rows;
        rows = 1;
    }
    uint64_t m = 0;
    for (int64_t r = 0; r < rows; r++) {
        uint64_t c = copy_u64_row(dst + r * dst_stride, src + r * src_stride, cols);
        m = c > m ? c : m;
    }
    return m;
}
