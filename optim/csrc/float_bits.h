// Bit-level float helpers shared by the CPU kernels (sradamw_cpu.cpp, grad_amax_cpu.cpp).
#pragma once

#include <cstdint>

static inline uint32_t bits_of(float x) { return __builtin_bit_cast(uint32_t, x); }
static inline float float_of(uint32_t x) { return __builtin_bit_cast(float, x); }

// float16 bits -> float32, exact, in integer operations (no denormal arithmetic: a flush-to-zero
// mode cannot change it): normal values by rebiasing the exponent, subnormal ones as m * 2**-24
static inline float widen_f16(uint32_t h) {
    uint32_t em = h & 0x7FFFu;
    uint32_t normal = (em << 13) + 0x38000000u;
    uint32_t sub = bits_of((float)(int32_t)em * 0x1p-24f);
    uint32_t mag = em >= 0x7C00u ? ((em << 13) | 0x7F800000u) : (em < 0x0400u ? sub : normal);
    return float_of(mag | ((h & 0x8000u) << 16));
}
