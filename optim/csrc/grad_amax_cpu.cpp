// The largest gradient magnitude of each of many CPU tensors in one call (optim._cpu_kernel.grad_amax):
// the one read of the gradients that SRAdamW's non-finite check and its float16 state scales share.
//
// Exact, in integer operations: for non-negative floats the order of the bit patterns is the order of
// the values, infinity above every finite value and every NaN above infinity, so the largest magnitude
// pattern (sign bit cleared) is the largest magnitude, or a NaN when the tensor holds one (as torch's
// aminmax propagates NaN). bfloat16 and float16 are reduced on their 16-bit patterns, float32 on its
// 32-bit ones, and the result widened exactly to float32.
//
// Work is cut into blocks of BLOCK elements; OpenMP threads take blocks across all tensors, then each
// tensor's block maxima are combined.

#include <cstdint>

#include "float_bits.h"

#ifndef BLOCK
#define BLOCK 65536
#endif
#ifndef MIN_PARALLEL
#define MIN_PARALLEL 262144  // fewer elements in a call: one thread
#endif

// the largest magnitude pattern (sign bit cleared) of n elements of bit type T
template <typename T>
static uint32_t max_magnitude(const T* x, int64_t n) {
    const T clear_sign = (T)~((T)1 << (8 * sizeof(T) - 1));
    T m = 0;
    for (int64_t j = 0; j < n; ++j) {
        T a = x[j] & clear_sign;
        m = a > m ? a : m;
    }
    return m;
}

static uint32_t block_max(int64_t address, int32_t kind, int64_t start, int64_t n) {
    if (kind == 0) return max_magnitude(reinterpret_cast<const uint32_t*>(address) + start, n);
    return max_magnitude(reinterpret_cast<const uint16_t*>(address) + start, n);
}

// a largest-magnitude pattern of the tensor's dtype as a float32 value (exact)
static float widen(uint32_t m, int32_t kind) {
    if (kind == 0) return float_of(m);
    if (kind == 1) return float_of(m << 16);  // bfloat16
    return widen_f16(m);
}

// ptrs, numels, kinds (0 float32, 1 bfloat16, 2 float16): n tensors; out: float32 [n]
extern "C" int grad_amax_cpu(const int64_t* ptrs, const int64_t* numels, const int32_t* kinds, int64_t n,
                             float* out, int threads) {
    int64_t* starts = new int64_t[n + 1];
    starts[0] = 0;
    int64_t elements = 0;
    for (int64_t t = 0; t < n; ++t) {
        starts[t + 1] = starts[t] + (numels[t] + BLOCK - 1) / BLOCK;
        elements += numels[t];
    }
    int64_t total = starts[n];
    uint32_t* partial = new uint32_t[total > 0 ? total : 1];
    int nthreads = total > 1 && threads > 1 && elements >= MIN_PARALLEL ? (threads < total ? threads : (int)total) : 1;
#pragma omp parallel for schedule(static, 1) num_threads(nthreads) if (nthreads > 1)
    for (int64_t b = 0; b < total; ++b) {
        int64_t lo = 0, hi = n;  // the tensor t with starts[t] <= b < starts[t + 1] (empty ones skipped)
        while (hi - lo > 1) {
            int64_t mid = (lo + hi) / 2;
            if (starts[mid] <= b) lo = mid; else hi = mid;
        }
        int64_t start = (b - starts[lo]) * BLOCK;
        int64_t len = numels[lo] - start < BLOCK ? numels[lo] - start : BLOCK;
        partial[b] = block_max(ptrs[lo], kinds[lo], start, len);
    }
    for (int64_t t = 0; t < n; ++t) {
        uint32_t m = 0;
        for (int64_t b = starts[t]; b < starts[t + 1]; ++b) m = partial[b] > m ? partial[b] : m;
        out[t] = widen(m, kinds[t]);
    }
    delete[] partial;
    delete[] starts;
    return 0;
}
