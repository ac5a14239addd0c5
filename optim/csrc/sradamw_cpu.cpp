// The CPU kernel of SRAdamW: one call updates every tensor of one specialisation (optim._cpu_kernel).
//
// It computes optim.functional.update_block_ (the definition) element for element, as the Triton
// kernel (optim._sradamw_jit) does on the GPU: every float operation is one correctly rounded float32
// operation, built without contraction (-ffp-contract=off: no fused multiply-add) and without
// -ffast-math, so the compiler may vectorise but not re-associate; sqrtf and the division are the IEEE
// ones (vsqrtps, vdivps). Half-precision values are rounded with the same integer operations as the
// reference (optim.rounding), from the same counter-based noise (one keyed lowbias32 hash per element
// for the two statistics, one for the weight).
//
// Compile-time constants, given as -D definitions by optim._cpu_kernel:
//   the row layout, from optim._rows (W_<WORD> word positions, S_<SLOT> float slot positions,
//   INT_WORDS, ROW_WORDS), and the specialisation (P_KIND, G_KIND, M_KIND, V_KIND: 0 float32,
//   1 bfloat16, 2 float16; MASTER: 0 none, 1 float32, 2 split int16 low halves; SCALE_M, SCALE_V,
//   SR_P, SR_M, SR_V, CLAMP: 0/1; GMUL: 0 none, 1 the row's grad_mul slot, 2 a float32 in memory).
//
// One call: rows x elements are cut into blocks of BLOCK elements; OpenMP threads take blocks. A block
// whose noise indices cross a multiple of 2**32 is run as two ranges with their own key words.

#include <cstdint>
#include <cstring>
#include <cmath>

#include "float_bits.h"

#ifndef BLOCK
#define BLOCK 16384  // elements per block (a thread's unit of work)
#endif
#ifndef MIN_PARALLEL
#define MIN_PARALLEL 65536  // fewer elements in a call: one thread
#endif

// storage types by kind: float32, and the bits of bfloat16 and float16
#define KIND_T_0 float
#define KIND_T_1 uint16_t
#define KIND_T_2 uint16_t
#define KIND_T_(k) KIND_T_##k
#define KIND_T(k) KIND_T_(k)

typedef KIND_T(P_KIND) p_t;
typedef KIND_T(G_KIND) g_t;
typedef KIND_T(M_KIND) m_t;
typedef KIND_T(V_KIND) v_t;
#if MASTER == 1
typedef float w_t;
#else
typedef int16_t w_t;
#endif

// float32 -> float16 bits, round to nearest even (torch's conversion: overflow -> inf, NaN -> 0x7E00):
// the scaled float addition rounds the significand at float16's position, normal and subnormal alike
static inline uint16_t rne_f16(float x) {
    uint32_t w = bits_of(x);
    uint32_t shl1 = w + w;
    uint32_t bias = shl1 & 0xFF000000u;
    bias = bias < 0x71000000u ? 0x71000000u : bias;
    float base = (std::fabs(x) * 0x1p112f) * 0x1p-110f;
    base = float_of((bias >> 1) + 0x07800000u) + base;
    uint32_t b = bits_of(base);
    uint32_t nonsign = ((b >> 13) & 0x7C00u) + (b & 0x0FFFu);
    return (uint16_t)(((w & 0x80000000u) >> 16) | (shl1 > 0xFF000000u ? 0x7E00u : nonsign));
}

template <int KIND, typename T>
static inline float widen(T x) {
    if constexpr (KIND == 0) return x;
    else if constexpr (KIND == 1) return float_of((uint32_t)x << 16);  // bfloat16: exact
    else return widen_f16(x);
}

// optim.rounding._keyed_hash_int: lowbias32 of x + a, b xored in after the first multiplication
static inline uint32_t keyed_hash(uint32_t x, uint32_t a, uint32_t b) {
    x += a;
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= (x >> 15) ^ b;
    x *= 0x846CA68Bu;
    return x ^ (x >> 16);
}

// optim.rounding._round_bf16, proportional, r16 in [0, 2**16): add the noise to the 16 dropped bits
// and truncate; finite overflow saturates, inf stays, NaN becomes the quiet NaN; sign kept
static inline uint16_t sr_bf16(float x, uint32_t r16) {
    uint32_t xb = bits_of(x);
    uint32_t mag = xb & 0x7FFFFFFFu;
    uint32_t rounded = (mag < 0x7F7F0000u ? mag : 0x7F7F0000u) + r16;
    uint32_t special = mag > 0x7F800000u ? 0x7FC00000u : 0x7F800000u;
    uint32_t out = (mag < 0x7F800000u ? rounded : special) | (xb & 0x80000000u);
    return (uint16_t)(out >> 16);
}

// round to nearest even float32 -> bfloat16 (torch's conversion: NaN -> 0x7FC0)
static inline uint16_t rne_bf16(float x) {
    uint32_t xb = bits_of(x);
    uint32_t r = (xb + (0x7FFFu + ((xb >> 16) & 1u))) >> 16;
    return (uint16_t)((xb & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : r);
}

// optim.rounding._round_f16, proportional, r16 in [0, 2**16) (its top 13 bits): below 2**-14 the value
// is moved into [2**-14, 2**-13) by one float32 addition (the same 2**-24 spacing), its 13 low bits
// rounded by adding the noise and truncating, and the offset subtracted again (exact)
static inline uint16_t sr_f16(float x, uint32_t r16) {
    float a = std::fabs(x);
    a = a > 65504.0f ? 65504.0f : a;  // finite overflow saturates
    float offset = a < 0x1p-14f ? 0x1p-14f : 0.0f;
    uint32_t shifted = bits_of(a + offset);
    float mag = float_of((shifted + (r16 >> 3)) & ~0x1FFFu) - offset;
    bool finite = (bits_of(x) & 0x7FFFFFFFu) < 0x7F800000u;
    return rne_f16(finite ? std::copysign(mag, x) : x);  // exact: mag is on float16's grid
}

template <int KIND, typename T>
static inline void store(T* dst, float x, uint32_t r16, bool sr) {
    if constexpr (KIND == 0) *dst = x;
    else if constexpr (KIND == 1) *dst = sr ? sr_bf16(x, r16) : rne_bf16(x);
    else *dst = sr ? sr_f16(x, r16) : rne_f16(x);
}

struct Scalars {
    float decay, m_decay, m_in, v_decay, v_in, v_out, neg_step, eps_hat, gmul, clamp_min, clamp_max;
};

// The update of elements [0, n) of one range, whose noise indices have low halves lo0 + j (no wrap
// inside the range) and key words (a ^ hi * golden, b) per stream.
static void update_range(p_t* __restrict p, const g_t* __restrict g, m_t* __restrict m, v_t* __restrict v,
                         w_t* __restrict master, int64_t n, const Scalars sc, uint32_t lo0,
                         uint32_t a_p, uint32_t b_p, uint32_t a_s, uint32_t b_s) {
    (void)master; (void)a_p; (void)b_p; (void)a_s; (void)b_s; (void)lo0;
#pragma GCC ivdep
    for (int64_t j = 0; j < n; ++j) {
        float gf = widen<G_KIND>(g[j]);
#if GMUL
        gf = gf * sc.gmul;
#endif
#if MASTER == 1
        float w = master[j];
#elif MASTER == 2  // optim.master16.join_master
        uint32_t hb = (uint32_t)p[j];
        uint32_t lb = (uint32_t)(uint16_t)master[j];
        float w = float_of(((hb & 0x8000u) << 16) | (((hb & 0x7FFFu) - (lb >> 15)) << 16) | lb);
#else
        float w = widen<P_KIND>(p[j]);
#endif
        float mf = widen<M_KIND>(m[j]);
        float vf = widen<V_KIND>(v[j]);
        w = w * sc.decay;
        mf = mf * sc.m_decay + gf * sc.m_in;
        vf = vf * sc.v_decay + (gf * gf) * sc.v_in;
#if SCALE_V
        float v_true = vf * sc.v_out;
#else
        float v_true = vf;
#endif
        w = w + (mf * sc.neg_step) / (std::sqrt(v_true) + sc.eps_hat);
#if CLAMP
        w = w < sc.clamp_min ? sc.clamp_min : (w > sc.clamp_max ? sc.clamp_max : w);
#endif
        uint32_t lo = lo0 + (uint32_t)j;
        uint32_t h = 0;
#if SR_M || SR_V
        h = keyed_hash(lo, a_s, b_s);
#endif
        store<M_KIND>(&m[j], mf, h >> 16, SR_M);
        store<V_KIND>(&v[j], vf, h & 0xFFFFu, SR_V);
#if MASTER == 1
        master[j] = w;
        store<P_KIND>(&p[j], w, 0u, false);
#elif MASTER == 2  // optim.master16.split_bits: high half nearest (ties away), low half as is
        uint32_t wb = bits_of(w);
        uint32_t mag = wb & 0x7FFFFFFFu;
        uint32_t hi = (mag > 0x7F800000u ? 0x7FC00000u : ((mag + 0x8000u) & 0xFFFF0000u)) | (wb & 0x80000000u);
        p[j] = (uint16_t)(hi >> 16);
        master[j] = (int16_t)(uint16_t)(wb & 0xFFFFu);
#else
        uint32_t hp = 0;
#if SR_P
        hp = keyed_hash(lo, a_p, b_p);
#endif
        store<P_KIND>(&p[j], w, hp >> 16, SR_P);
#endif
    }
}

static inline float slot(const int64_t* row, int s) {
    float x;
    std::memcpy(&x, reinterpret_cast<const char*>(row + INT_WORDS) + 4 * s, 4);
    return x;
}

static inline float scalar_at(int64_t address) { return *reinterpret_cast<const float*>(address); }

static Scalars scalars(const int64_t* row, const float* gmul) {
    Scalars sc;
    sc.decay = slot(row, S_DECAY);
    sc.m_decay = slot(row, S_BETA1);
    sc.m_in = slot(row, S_ONE_MINUS_BETA1);
    sc.v_decay = slot(row, S_BETA2);
    sc.v_in = slot(row, S_ONE_MINUS_BETA2);
    sc.v_out = 1.0f;
    sc.neg_step = slot(row, S_NEG_STEP);
    sc.eps_hat = slot(row, S_EPS_HAT);
    sc.gmul = GMUL == 2 ? *gmul : slot(row, S_GRAD_MUL);
    sc.clamp_min = slot(row, S_CLAMP_MIN);
    sc.clamp_max = slot(row, S_CLAMP_MAX);
    // float16 statistics in their scaled form (optim.functional._scaled): exact power-of-two factors
#if SCALE_M
    {
        float m_new = scalar_at(row[W_M_SCALE_NEW]);
        float m_inv = 1.0f / m_new;
        sc.m_decay = sc.m_decay * (scalar_at(row[W_M_SCALE_OLD]) * m_inv);
        sc.m_in = sc.m_in * m_inv;
        sc.neg_step = sc.neg_step * m_new;
    }
#endif
#if SCALE_V
    {
        float v_new = scalar_at(row[W_V_SCALE_NEW]);
        float v_inv = 1.0f / v_new;
        sc.v_decay = sc.v_decay * (scalar_at(row[W_V_SCALE_OLD]) * v_inv);
        sc.v_in = sc.v_in * v_inv;
        sc.v_out = v_new;
    }
#endif
    return sc;
}

static void run_block(const int64_t* row, const float* gmul, int64_t start, int64_t n) {
    const Scalars sc = scalars(row, gmul);
    p_t* p = reinterpret_cast<p_t*>(row[W_P]) + start;
    const g_t* g = reinterpret_cast<const g_t*>(row[W_G]) + start;
    m_t* m = reinterpret_cast<m_t*>(row[W_M]) + start;
    v_t* v = reinterpret_cast<v_t*>(row[W_V]) + start;
    w_t* master = reinterpret_cast<w_t*>(row[W_MASTER]);
    if (master) master += start;
    uint64_t first = (uint64_t)row[W_NOISE_BASE] + (uint64_t)start;
    while (n > 0) {  // ranges that do not cross a multiple of 2**32 in the noise index
        uint32_t hi = (uint32_t)(first >> 32), lo0 = (uint32_t)first;
        int64_t len = (int64_t)((1ull << 32) - lo0);
        len = len < n ? len : n;
        uint32_t fold = hi * 0x9E3779B9u;  // optim.rounding._segment_word
        update_range(p, g, m, v, master, len, sc, lo0, (uint32_t)row[W_A_P] ^ fold, (uint32_t)row[W_B_P],
                     (uint32_t)row[W_A_S] ^ fold, (uint32_t)row[W_B_S]);
        p += len; g += len; m += len; v += len;
        if (master) master += len;
        first += (uint64_t)len;
        n -= len;
    }
}

extern "C" int sradamw_cpu_step(const int64_t* table, int64_t rows, const float* skip, const float* gmul,
                                int threads) {
    if (skip && *skip != 0.0f) return 0;  // CPU memory: the flag is final when the call is made
    int64_t total = 0;
    for (int64_t r = 0; r < rows; ++r) total += (table[r * ROW_WORDS + W_NUMEL] + BLOCK - 1) / BLOCK;
    if (total == 0) return 0;
    int64_t elements = 0;
    for (int64_t r = 0; r < rows; ++r) elements += table[r * ROW_WORDS + W_NUMEL];
    // block b of the call -> (row, block within the row)
    int64_t* starts = new int64_t[rows + 1];
    starts[0] = 0;
    for (int64_t r = 0; r < rows; ++r)
        starts[r + 1] = starts[r] + (table[r * ROW_WORDS + W_NUMEL] + BLOCK - 1) / BLOCK;
    // small calls stay on the calling thread (waking the team costs more than the work)
    int nthreads = total > 1 && threads > 1 && elements >= MIN_PARALLEL ? (threads < total ? threads : (int)total) : 1;
#pragma omp parallel for schedule(static, 1) num_threads(nthreads) if (nthreads > 1)
    for (int64_t b = 0; b < total; ++b) {
        int64_t lo = 0, hi = rows;  // the row r with starts[r] <= b < starts[r + 1]
        while (hi - lo > 1) {
            int64_t mid = (lo + hi) / 2;
            if (starts[mid] <= b) lo = mid; else hi = mid;
        }
        const int64_t* row = table + lo * ROW_WORDS;
        int64_t start = (b - starts[lo]) * BLOCK;
        int64_t numel = row[W_NUMEL];
        run_block(row, gmul, start, numel - start < BLOCK ? numel - start : BLOCK);
    }
    delete[] starts;
    return 0;
}
