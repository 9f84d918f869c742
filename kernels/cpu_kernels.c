/* The engine's CPU kernels where PyTorch's eager ops would be many small calls: decode attention
 * over the paged KV cache, RMSNorm with its residual add, rotary embedding and SwiGLU. Built by
 * kernels/cpu_kernels.py with the machine's C compiler; no Python or torch headers needed.
 *
 * Why C: at decode sizes (a few to a few dozen rows) each torch op costs microseconds of
 * dispatch for nanoseconds of arithmetic. Attention gathered every sequence's K/V rows into a
 * padded copy before scaled_dot_product_attention (~400 us a layer for ~3 MFLOP at 16 sequences
 * of the demo model); an RMSNorm is nine ops, rotary ten, SwiGLU three. Here each is one call.
 *
 * Tensors are float32, or bfloat16 when `bf16` != 0 (raw uint16); arithmetic is float32. Where
 * the torch reference rounds an intermediate to bfloat16, the kernels round it the same way, so
 * their outputs stay within a rounding of the reference's. Functions return 0, or -1 for shapes
 * they do not handle or a failed allocation (the caller then runs the torch reference).
 */
#include <math.h>
#include <omp.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Decode attention's arguments. Layouts (all contiguous): q, out [batch, heads, dim]; k_cache,
 * v_cache [slots, kv_heads, dim]; slots [batch, width] int64 (row b's first lengths[b] entries
 * are its keys, in order); lengths [batch] int64. */
typedef struct {
    const void *q, *k_cache, *v_cache;
    void *out;
    const int64_t *slots, *lengths;
    int64_t batch, heads, kv_heads, dim, width;
    float scale;
    int bf16;
} Job;

/* Float32 vectors as GCC vector extensions, one native register wide: the same source runs on
 * AVX-512, AVX2 and SSE (a vector wider than the registers would be split and spilled). */
#if defined(__AVX512F__)
#define LANES 16
#elif defined(__AVX__)
#define LANES 8
#else
#define LANES 4
#endif
typedef float vf __attribute__((vector_size(LANES * 4)));
typedef uint32_t vu32 __attribute__((vector_size(LANES * 4)));
typedef uint16_t vu16 __attribute__((vector_size(LANES * 2)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef int32_t i32x4 __attribute__((vector_size(16)));
typedef float f32x4 __attribute__((vector_size(16)));

#define MAX_DIM 512 /* head dims up to this (a multiple of 16); others take the torch path */
#define MAX_CHUNKS (MAX_DIM / LANES)

/* LANES values at `offset` of a float32 or bfloat16 array, as float32. */
static inline vf load_vec(const void *base, int64_t offset, int bf16) {
    vf out;
#if LANES == 16
    /* One widening move (GCC 12 splits the generic conversion into two halves and an insert). */
    if (bf16) {
        const __m512i bits = _mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)((const uint16_t *)base + offset))), 16);
        memcpy(&out, &bits, sizeof out);
        return out;
    }
#endif
    if (bf16) {
        vu16 half;
        memcpy(&half, (const uint16_t *)base + offset, sizeof half);
        const vu32 bits = __builtin_convertvector(half, vu32) << 16;
        memcpy(&out, &bits, sizeof out);
    } else {
        memcpy(&out, (const float *)base + offset, sizeof out);
    }
    return out;
}

/* v rounded to bfloat16 (nearest even, NaN kept), as float32 bits with the low half zero. */
static inline vu32 bf16_bits(vf v) {
    vu32 u;
    memcpy(&u, &v, sizeof u);
    const vu32 nan = (vu32)((u & 0x7fffffffu) > 0x7f800000u);
    const vu32 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    return (rounded & ~nan) | ((u | 0x400000u) & 0xffff0000u & nan);
}

/* v rounded to bfloat16 and back: where the reference holds an intermediate in bfloat16. */
static inline vf round_bf16(vf v) {
    const vu32 bits = bf16_bits(v);
    memcpy(&v, &bits, sizeof v);
    return v;
}

static inline void store_vec(void *base, int64_t offset, int bf16, vf v) {
    if (bf16) {
        const vu16 half = __builtin_convertvector(bf16_bits(v) >> 16, vu16);
        memcpy((uint16_t *)base + offset, &half, sizeof half);
    } else {
        memcpy((float *)base + offset, &v, sizeof v);
    }
}

/* The sum of the lanes, halving the vector with shuffles. */
static inline float sum_lanes(vf v) {
#if LANES >= 8
    f32x8 s;
    memcpy(&s, &v, sizeof s);
#if LANES == 16
    f32x8 hi;
    memcpy(&hi, (const char *)&v + sizeof s, sizeof hi);
    s += hi;
#endif
    s += __builtin_shuffle(s, (i32x8){4, 5, 6, 7, 0, 1, 2, 3});
    f32x4 r;
    memcpy(&r, &s, sizeof r);
#else
    f32x4 r = v;
#endif
    r += __builtin_shuffle(r, (i32x4){2, 3, 0, 1});
    r += __builtin_shuffle(r, (i32x4){1, 0, 3, 2});
    return r[0];
}

/* 2^f on [-0.5, 0.5] by Horner's rule, for a float or a vector of them. */
#define EXP2_POLY(f)                                                                             \
    ((((((1.5353362e-4f * (f) + 1.3398874e-3f) * (f) + 9.6181291e-3f) * (f) + 5.5504109e-2f) *   \
           (f) + 2.4022651e-1f) * (f) + 6.9314718e-1f) * (f) + 1.0f)

/* exp(x) for x <= 0 (the softmax's shifted scores), vectorisable: 2^(x*log2 e) split into an
 * integer power (the exponent bits) and a degree-6 polynomial for 2^f on [-0.5, 0.5]; relative
 * error about 2e-7, like expf. Below -87 (2^-126) it returns 0. */
static inline float exp_nonpositive(float x) {
    float t = x * 1.44269504088896341f;
    t = t < -126.0f ? -126.0f : t;
    const float n = __builtin_roundf(t), f = t - n, p = EXP2_POLY(f);
    union { uint32_t u; float f; } scale;
    scale.u = (uint32_t)((int32_t)n + 127) << 23;
    return x < -87.0f ? 0.0f : p * scale.f;
}

/* Keys ahead of the one being scored whose K and V cache lines are requested early: a step's
 * K/V rows lie in blocks scattered over a cache far larger than the CPU's, so without this each
 * row waits for memory in turn (16 ahead, V during the K pass: 4.0 -> 3.0 ms of attention a
 * step at 16 sequences of the demo model, against 8 ahead for K alone). */
#define PREFETCH 16

static inline void prefetch_row(const void *cache, int64_t slot, const Job *job, int64_t h,
                                int64_t bytes) {
    const char *p = (const char *)cache + (slot * job->kv_heads + h) * bytes;
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 1);
}

typedef int32_t vi32 __attribute__((vector_size(LANES * 4)));

/* Lane by lane, `yes` where mask is set (all ones), else `no`. */
static inline vf select_vec(vi32 mask, vf yes, vf no) {
    vi32 a, b;
    memcpy(&a, &yes, sizeof a);
    memcpy(&b, &no, sizeof b);
    a = (a & mask) | (b & ~mask);
    memcpy(&yes, &a, sizeof yes);
    return yes;
}

/* exp_nonpositive on a vector (x <= 0, or -inf for 0): the same integer power and polynomial,
 * with n = ceil(x*log2 e - 0.5) by truncation (x <= 0), so f stays in (-0.5, 0.5]. */
static inline vf exp_nonpositive_vec(vf x) {
    vf t = x * 1.44269504088896341f;
    t = select_vec(t < -126.0f, (vf){0} - 126.0f, t);
    const vi32 n = __builtin_convertvector(t - 0.5f, vi32);
    const vf f = t - __builtin_convertvector(n, vf), p = EXP2_POLY(f);
    const vi32 bits = (n + 127) << 23;
    vf power;
    memcpy(&power, &bits, sizeof power);
    return select_vec(x < -87.0f, (vf){0}, p * power);
}

#if LANES == 16
/* Lane j of the result is sum_lanes(v[j]), added in the same pairs and order (lane i with i+8,
 * then i+4, i+2, i+1), so each sum is bit for bit the one sum_lanes gives; two shuffles and an
 * add per pair of vectors, 45 operations for 16 sums against about 9 per sum_lanes. v is
 * overwritten. */
static inline vf pair_sums(vf a, vf b, vi32 lo, vi32 hi) {
    return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
}

static inline vf sum_lanes_of(vf *v) {
    const vi32 a_lo = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const vi32 a_hi = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const vi32 b_lo = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
    const vi32 b_hi = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
    const vi32 c_lo = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
    const vi32 c_hi = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
    const vi32 d_lo = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
    const vi32 d_hi = {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31};
    for (int j = 0; j < 8; j++) v[j] = pair_sums(v[j], v[j + 8], a_lo, a_hi);
    for (int j = 0; j < 4; j++) v[j] = pair_sums(v[j], v[j + 4], b_lo, b_hi);
    for (int j = 0; j < 2; j++) v[j] = pair_sums(v[j], v[j + 2], c_lo, c_hi);
    return pair_sums(v[0], v[1], d_lo, d_hi);
}
#endif

/* Query heads whose value sums are accumulated together in one pass over the values: as many
 * as keep group x chunks accumulators in registers. */
#define ACC_VECS 16

/* The scores' row stride: whole vectors, the padding scored -inf (weight 0). */
static inline int64_t score_stride(int64_t len) { return (len + LANES - 1) / LANES * LANES; }

/* Key t of a (sequence, KV head) against each query head of its group: the dot products'
 * lane-wise partial sums, head g's at out[g * out_stride]; later keys' rows are requested ahead. */
static inline __attribute__((always_inline)) void key_dots(
        const Job *job, const int64_t *slots, int64_t t, int64_t len, int64_t h, const vf *qf,
        int64_t group, int64_t bytes, vf *out, int64_t out_stride, const int chunks) {
    const int64_t row = (slots[t] * job->kv_heads + h) * job->dim;
    if (t + PREFETCH < len) {
        prefetch_row(job->k_cache, slots[t + PREFETCH], job, h, bytes);
        prefetch_row(job->v_cache, slots[t + PREFETCH], job, h, bytes);
    }
    vf key[MAX_CHUNKS];
    for (int c = 0; c < chunks; c++) key[c] = load_vec(job->k_cache, row + LANES * c, job->bf16);
    for (int64_t g = 0; g < group; g++) {
        vf dot = qf[g * chunks] * key[0];
        for (int c = 1; c < chunks; c++) dot += qf[g * chunks + c] * key[c];
        out[g * out_stride] = dot;
    }
}

/* One (sequence, KV head), `chunks` = dim / LANES: each key is read and converted once and scored
 * against every query head that shares it (grouped-query attention); softmax in float32, its
 * exponentials a vector at a time; each value row is read once for the query heads that share
 * it, their sums held in registers. `qf` holds the group's queries, `scores` group x
 * score_stride(len) floats. A constant `chunks` (the inlined cases below) unrolls the inner
 * loops. */
static inline __attribute__((always_inline)) void attend_chunks(
        const Job *job, int64_t b, int64_t h, vf *qf, float *scores, const int chunks) {
    const int64_t dim = job->dim, group = job->heads / job->kv_heads, len = job->lengths[b];
    const int64_t stride = score_stride(len);
    const int64_t *slots = job->slots + b * job->width;
    const int64_t first_q = (b * job->heads + h * group) * dim;
    for (int64_t i = 0; i < group * chunks; i++) qf[i] = load_vec(job->q, first_q + LANES * i, job->bf16);
    const int64_t bytes = dim * (job->bf16 ? 2 : 4);
    vf *dots = qf + group * chunks;
#if LANES == 16
    /* A vector of keys at a time: each query head's LANES dot-product vectors are summed across
     * together (sum_lanes_of), not one horizontal sum per key. */
    for (int64_t t0 = 0; t0 < len; t0 += LANES) {
        const int64_t n = len - t0 < LANES ? len - t0 : LANES;
        for (int64_t j = 0; j < n; j++)
            key_dots(job, slots, t0 + j, len, h, qf, group, bytes, dots + j, LANES, chunks);
        for (int64_t j = n; j < LANES; j++)
            for (int64_t g = 0; g < group; g++) dots[g * LANES + j] = (vf){0};
        for (int64_t g = 0; g < group; g++) {
            const vf sums = sum_lanes_of(dots + g * LANES) * job->scale;
            memcpy(scores + g * stride + t0, &sums, sizeof sums);
        }
    }
#else
    for (int64_t t = 0; t < len; t++) {
        key_dots(job, slots, t, len, h, qf, group, bytes, dots, 1, chunks);
        for (int64_t g = 0; g < group; g++) scores[g * stride + t] = sum_lanes(dots[g]) * job->scale;
    }
#endif
    float inv[group];
    for (int64_t g = 0; g < group; g++) {
        float *sg = scores + g * stride;
        for (int64_t t = len; t < stride; t++) sg[t] = -INFINITY;
        /* The largest score a vector at a time (a scalar max is a chain of dependent steps). */
        vf most = (vf){0} - INFINITY;
        for (int64_t t = 0; t < stride; t += LANES) {
            vf x;
            memcpy(&x, sg + t, sizeof x);
            most = select_vec(x > most, x, most);
        }
        float top = most[0];
        for (int i = 1; i < LANES; i++) top = most[i] > top ? most[i] : top;
        vf total = (vf){0};
        for (int64_t t = 0; t < stride; t += LANES) {
            vf e;
            memcpy(&e, sg + t, sizeof e);
            e = exp_nonpositive_vec(e - top);
            memcpy(sg + t, &e, sizeof e);
            total += e;
        }
        inv[g] = 1.0f / sum_lanes(total);
    }
    const int64_t heads_per_pass = chunks >= ACC_VECS ? 1 : ACC_VECS / chunks;
    for (int64_t g0 = 0; g0 < group; g0 += heads_per_pass) {
        const int64_t pass = group - g0 < heads_per_pass ? group - g0 : heads_per_pass;
        vf acc[ACC_VECS > MAX_CHUNKS ? ACC_VECS : MAX_CHUNKS];
        for (int64_t i = 0; i < pass * chunks; i++) acc[i] = (vf){0};
        for (int64_t t = 0; t < len; t++) {
            const int64_t row = (slots[t] * job->kv_heads + h) * dim;
            if (g0 == 0 && t + PREFETCH < len)
                prefetch_row(job->v_cache, slots[t + PREFETCH], job, h, bytes);
            vf value[MAX_CHUNKS];
            for (int c = 0; c < chunks; c++) value[c] = load_vec(job->v_cache, row + LANES * c, job->bf16);
            for (int64_t g = 0; g < pass; g++) {
                const float p = scores[(g0 + g) * stride + t];
                for (int c = 0; c < chunks; c++) acc[g * chunks + c] += p * value[c];
            }
        }
        for (int64_t g = 0; g < pass; g++)
            for (int c = 0; c < chunks; c++)
                store_vec(job->out, first_q + (g0 + g) * dim + LANES * c, job->bf16,
                          acc[g * chunks + c] * inv[g0 + g]);
    }
}

static void attend(const Job *job, int64_t b, int64_t h, vf *qf, float *scores) {
    switch (job->dim) {  /* the common head dims get their own unrolled copies */
    case 64: attend_chunks(job, b, h, qf, scores, 64 / LANES); break;
    case 128: attend_chunks(job, b, h, qf, scores, 128 / LANES); break;
    default: attend_chunks(job, b, h, qf, scores, (int)(job->dim / LANES)); break;
    }
}

/* Returns 0 on success, -1 when the shapes are outside what the kernel handles or a buffer could
 * not be allocated (the caller then runs the torch path).
 *
 * Threads: an OpenMP loop over the (sequence, KV head) tasks. Built with -fopenmp, this library
 * needs libgomp.so.1; PyTorch's Linux wheels load their own copy under that name first, so the
 * loop runs on PyTorch's own worker threads (no second pool spinning against them), at the
 * thread count torch.set_num_threads gave. */
int decode_attention(const void *q, const void *k_cache, const void *v_cache, void *out,
                     const int64_t *slots, const int64_t *lengths, int64_t batch, int64_t heads,
                     int64_t kv_heads, int64_t dim, int64_t width, float scale, int bf16,
                     int threads) {
    if (dim % 16 != 0 || dim / LANES > MAX_CHUNKS || heads % kv_heads != 0) return -1;
    const Job job = {q, k_cache, v_cache, out, slots, lengths, batch, heads, kv_heads, dim,
                     width, scale, bf16};
    const int64_t group = heads / kv_heads, tasks = batch * kv_heads;
    int64_t longest = 1;
    for (int64_t b = 0; b < batch; b++) longest = lengths[b] > longest ? lengths[b] : longest;
    int failed = 0;
    if (threads < 1) threads = 1;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        vf *qf = aligned_alloc(sizeof(vf), sizeof(vf) * (size_t)(group * (dim / LANES + LANES)));
        float *scores = malloc(sizeof(float) * (size_t)(group * score_stride(longest)));
        failed = qf == NULL || scores == NULL;
        /* Tasks dealt round-robin: neighbouring sequences have similar lengths, so the
         * threads' shares come out even without sorting. */
#pragma omp for schedule(static, 1)
        for (int64_t task = 0; task < tasks; task++)
            if (!failed) attend(&job, task / kv_heads, task % kv_heads, qf, scores);
        free(qf);
        free(scores);
    }
    return failed ? -1 : 0;
}

/* RMSNorm of rows [rows, width] of x (+ residual when not NULL), as the reference computes it:
 * the sum rounded to the dtype and written to res_out (the next residual), then
 * weight * (sum / rms) with the normalised value rounded to the dtype before the weight. */
int rms_norm(const void *x, const void *residual, const void *weight, void *out, void *res_out,
             int64_t rows, int64_t width, float eps, int bf16, int threads) {
    if (width % LANES != 0) return -1;
    if (threads < 1) threads = 1;
#pragma omp parallel for num_threads(threads) if (rows >= 32)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t base = r * width;
        const void *sum = residual ? res_out : x;
        vf squares = {0};
        for (int64_t c = 0; c < width; c += LANES) {
            vf v = load_vec(x, base + c, bf16);
            if (residual) {
                v += load_vec(residual, base + c, bf16);
                store_vec(res_out, base + c, bf16, v);
                if (bf16) v = round_bf16(v);
            }
            squares += v * v;
        }
        const float inv = 1.0f / sqrtf(sum_lanes(squares) / (float)width + eps);
        for (int64_t c = 0; c < width; c += LANES) {
            vf normed = load_vec(sum, base + c, bf16) * inv;
            if (bf16) normed = round_bf16(normed);
            store_vec(out, base + c, bf16, normed * load_vec(weight, c, bf16));
        }
    }
    return 0;
}

/* Rotary embedding (the rotate_half convention) of q [n, heads, dim] and k [n, kv_heads, dim],
 * whose tokens are q_stride / k_stride elements apart (views into the fused QKV output), into
 * contiguous q_out and k_out; cos and sin [n, dim]. x * cos + rotate_half(x) * sin, with each
 * product and the sum rounded to the dtype as the reference's three ops do. */
int rotary(const void *q, const void *k, const void *cos, const void *sin, void *q_out,
           void *k_out, int64_t n, int64_t heads, int64_t kv_heads, int64_t dim,
           int64_t q_stride, int64_t k_stride, int bf16, int threads) {
    const int64_t half = dim / 2;
    if (dim % 2 != 0 || half % LANES != 0) return -1;
    if (threads < 1) threads = 1;
#pragma omp parallel for num_threads(threads) if (n >= 32)
    for (int64_t t = 0; t < n; t++) {
        for (int64_t h = 0; h < heads + kv_heads; h++) {
            const int is_q = h < heads;
            const void *src = is_q ? q : k;
            void *dst = is_q ? q_out : k_out;
            const int64_t from = t * (is_q ? q_stride : k_stride) + (is_q ? h : h - heads) * dim;
            const int64_t to = (t * (is_q ? heads : kv_heads) + (is_q ? h : h - heads)) * dim;
            for (int64_t c = 0; c < half; c += LANES) {
                const vf x1 = load_vec(src, from + c, bf16), x2 = load_vec(src, from + half + c, bf16);
                const vf c1 = load_vec(cos, t * dim + c, bf16), c2 = load_vec(cos, t * dim + half + c, bf16);
                const vf s1 = load_vec(sin, t * dim + c, bf16), s2 = load_vec(sin, t * dim + half + c, bf16);
                vf a1 = x1 * c1, b1 = -(x2 * s1), a2 = x2 * c2, b2 = x1 * s2;
                if (bf16) {
                    a1 = round_bf16(a1), b1 = round_bf16(b1), a2 = round_bf16(a2), b2 = round_bf16(b2);
                }
                store_vec(dst, to + c, bf16, a1 + b1);
                store_vec(dst, to + half + c, bf16, a2 + b2);
            }
        }
    }
    return 0;
}

/* ---- a draft tree's next tokens ----
 * Each row's k largest softmax probabilities, largest first, and their columns, as
 * torch.softmax(x).topk(k) gives them, for x [rows, n] float32 with row stride `stride` and
 * k <= 64: one pass keeps the k largest scores (a vector of scores is looked at one by one only
 * where one beats the k-th so far, which after the first few vectors is rare) and finds the
 * maximum, one sums the exponentials. Equal scores rank by column, the lower first. A row with
 * a NaN returns -1 (the caller's torch path says what it says). */
#define TOPK_MAX 64

static inline void keep_largest(float *best, int64_t *at, int *have, int k, float x, int64_t col) {
    int p;
    if (*have < k)
        p = (*have)++;
    else if (x > best[k - 1])
        p = k - 1;
    else
        return;
    while (p > 0 && best[p - 1] < x) {
        best[p] = best[p - 1];
        at[p] = at[p - 1];
        p--;
    }
    best[p] = x;
    at[p] = col;
}

int softmax_topk(const float *x, int64_t rows, int64_t n, int64_t stride, int64_t k,
                 float *probs, int64_t *cols) {
    if (k < 1 || k > TOPK_MAX || k > n) return -1;
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * stride;
        float best[TOPK_MAX];
        int64_t at[TOPK_MAX];
        int have = 0;
        vi32 nan = (vi32){0};
        int64_t i = 0;
        for (; i + LANES <= n; i += LANES) {
            vf v;
            memcpy(&v, row + i, sizeof v);
            nan |= (vi32)(v != v);
            const float floor = have < k ? -INFINITY : best[k - 1];
            const vi32 above = (vi32)(v > floor);
            int any = 0;
            for (int j = 0; j < LANES; j++) any |= above[j];
            if (!any) continue;
            for (int j = 0; j < LANES; j++)
                if (above[j]) keep_largest(best, at, &have, (int)k, v[j], i + j);
        }
        for (; i < n; i++) {
            if (row[i] != row[i]) return -1;
            keep_largest(best, at, &have, (int)k, row[i], i);
        }
        for (int j = 0; j < LANES; j++)
            if (nan[j]) return -1;
        if (have < k) return -1; /* every score -inf */
        const float top = best[0];
        vf total = (vf){0};
        float tail = 0.0f;
        for (i = 0; i + LANES <= n; i += LANES) {
            vf v;
            memcpy(&v, row + i, sizeof v);
            total += exp_nonpositive_vec(v - top);
        }
        for (; i < n; i++) tail += exp_nonpositive(row[i] - top);
        const float inv = 1.0f / (sum_lanes(total) + tail);
        for (int j = 0; j < k; j++) {
            probs[r * k + j] = exp_nonpositive(best[j] - top) * inv;
            cols[r * k + j] = at[j];
        }
    }
    return 0;
}

/* g * sigmoid(g) lane by lane, with the exponential's argument never positive. */
static inline vf silu_vec(vf g) {
    vf out = g; /* every lane is set below (GCC could not tell) */
    for (int i = 0; i < LANES; i++) {
        const float e = exp_nonpositive(-fabsf(g[i]));
        out[i] = (g[i] >= 0.0f ? g[i] : g[i] * e) / (1.0f + e);
    }
    return out;
}

/* A scratch buffer of bfloat16 parts, counts[i] values each, every part starting 64-byte
 * aligned: their starts into part[0..n-1]; the buffer (free it) or NULL. */
static uint16_t *scratch_parts(const int64_t *counts, int n, uint16_t **part) {
    int64_t total = 0;
    for (int i = 0; i < n; i++) total += (counts[i] + 31) / 32 * 32;
    uint16_t *scratch = aligned_alloc(64, (size_t)total * 2);
    for (int64_t i = 0, at = 0; i < n && scratch != NULL; at += (counts[i] + 31) / 32 * 32, i++)
        part[i] = scratch + at;
    return scratch;
}

/* SwiGLU of rows [rows, 2 * width] (gate, then up) into out [rows, width]: silu(gate) * up, the
 * silu rounded to the dtype before the product as the reference's two ops do. */
int silu_and_mul(const void *x, void *out, int64_t rows, int64_t width, int bf16, int threads) {
    if (width % LANES != 0) return -1;
    if (threads < 1) threads = 1;
#pragma omp parallel for num_threads(threads) if (rows >= 32)
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t c = 0; c < width; c += LANES) {
            const vf gate = load_vec(x, r * 2 * width + c, bf16);
            const vf up = load_vec(x, r * 2 * width + width + c, bf16);
            vf silu = silu_vec(gate);
            if (bf16) silu = round_bf16(silu);
            store_vec(out, r * width + c, bf16, silu * up);
        }
    }
    return 0;
}

/* Shared by the weights' tile kernels, AVX512-BF16's and AVX2's. */

enum { WEIGHT_BF16, WEIGHT_INT8, WEIGHT_INT4 };

static inline float bf16_to_f32(uint16_t half) {
    const uint32_t bits = (uint32_t)half << 16;
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

/* Where row `row` of tile t's 16 outputs starts in y [rows, out] (bfloat16 or float32). */
static inline void *tile_output(void *y, int64_t row, int64_t out, int64_t t, int y_bf16) {
    return y_bf16 ? (void *)((uint16_t *)y + row * out + t * 16)
                  : (void *)((float *)y + row * out + t * 16);
}

/* This thread's contiguous range of `tiles`, as a static schedule splits them (called inside a
 * parallel region). */
static inline void thread_tiles(int64_t tiles, int64_t *begin, int64_t *end) {
    const int64_t n = omp_get_num_threads(), i = omp_get_thread_num();
    *begin = tiles * i / n;
    *end = tiles * (i + 1) / n;
}

/* How far ahead in a thread's weight stream its next lines are asked into L2, during a tile's
 * first row block (later blocks find the tile in cache). A decode step's weights stream from
 * memory, and from about 8 rows a pass the hardware prefetcher alone left the products waiting
 * on it: the demo model's 30 layers' bfloat16 linears with cold weights took 14.2 ms at 16 rows
 * against 9.4 with them in cache and 7.6 at 1 row (a Zen 4 EPYC, 2 threads); asked 8 KB ahead,
 * 10.8 ms (12 rows 11.1 -> 8.6, 24 rows 16.9 -> 15.0; 2-16 KB ahead into L1 or L2 within a few
 * percent of each other, 64 KB worse; benchmarks/tile_kernel_rows.py --cold). The AVX2 loops
 * ask the same way in their first pass over a tile (their build on that Zen 4: bfloat16 4-16
 * rows 1.25-1.39x, int4 1 row 1.33x). Past a tile's end the address is the next tile's (this
 * thread's next) or past the weight, which a prefetch may reach: it never faults. Always
 * inlined: as a function of its own GCC found it free of side effects and dropped every call
 * (no prefetch instruction was emitted, at -O1 or -O3). */
#define WEIGHT_AHEAD 8192

static inline __attribute__((always_inline)) void prefetch_weight(const void *at) {
    __builtin_prefetch((const char *)at + WEIGHT_AHEAD, 0, 2); /* into L2 */
}

/* The same for a loop that reads nt tiles side by side (nt streams, each `tile_bytes` long, at
 * `offset` bytes into its tile): each stream asks its share of WEIGHT_AHEAD ahead, and past
 * its tile's end it goes on in tile j + nt, the one it reads next (tile j + 1 is being read
 * now, by its neighbour stream). prefetch_weight's fixed distance landed there, so int4 at 1-2
 * rows (8 and 4 tiles at once) gained nothing from it. `share` divides the distance for a
 * stream with fewer bytes (int4's scales and mins: an eighth of its codes'). Measured with cold
 * weights (benchmarks/tile_kernel_rows.py --cold, the Zen 4 EPYC, alternating in one process):
 * int4 1 row 90 -> 68 us a layer, 2 rows 87 -> 67 (its codes' streams alone 0.91x, its scales'
 * alone 0.91x); bfloat16 1 row 0.93x; int8 with its tile groups (int8_tile_group_rows) 1 row
 * 126 -> 105 us. Twice or four times the distance was no better. The AVX2 pair loop (4 / 2 tiles
 * at 1 / 2 rows), its build on that CPU: bfloat16 1-2 rows 0.87-0.93x, int8 0.82-0.94x. */
static inline __attribute__((always_inline)) void prefetch_tile_stream(
    const void *at, int64_t offset, int64_t tile_bytes, int nt, int64_t share) {
    int64_t ahead = WEIGHT_AHEAD / nt / share;
    if (offset + ahead >= tile_bytes) ahead += (int64_t)(nt - 1) * tile_bytes;
    __builtin_prefetch((const char *)at + ahead, 0, 2); /* into L2 */
}

/* ---- int4 weights times bfloat16 activations (AVX512-BF16) ----
 * y[rows, out] = x[rows, in] @ W^T, with W held as 4-bit codes in groups of `group` inputs:
 * w = code * scale + min (llama.cpp's Q4_1 and the engine's int4). PyTorch's CPU int4 matmul
 * is 2-3x slower than oneDNN bfloat16 from 16 rows up, and decodes every weight to float.
 *
 * Here the codes never become weights. Each code c enters VDPBF16PS (products of bfloat16
 * pairs summed in float32) as the bfloat16 number 128 + c, whose bits are 0x4300 | c: one
 * integer OR. A group's dot products with those, then, per output lane,
 *     sum_k x_k (c_k s + min) = s * sum_k x_k (128 + c_k) + (min - 128 s) * sum_k x_k,
 * so the scale and min cost two FMAs per row per group, and the decode two integer ops per 32
 * codes, whatever the number of rows. The 128 offset is exact in bfloat16 products and its sum
 * is removed in float32 (a relative error near 2^-16 of the output, below bfloat16's rounding).
 *
 * Layout (kernels/cpu_quant.py's pack writes it): outputs in tiles of 16, inputs in pairs, pairs
 * in twos. codes [tiles, pairs / 2, 32] bytes: byte e of double pair d holds in its low nibble
 * element e of pair 2d and in its high nibble element e of pair 2d + 1, where element e of pair
 * p is output 16t + e/2 at input 2p + e%2 (the order VDPBF16PS pairs them with a broadcast
 * activation pair). scales, mins: float16 [tiles, groups, 16]. x: bfloat16 [rows, in] (inputs
 * padded to whole groups), read as one 32-bit word per input pair. */
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define TILE_KERNELS 1

/* One row's 16 outputs of a tile, rounded to bfloat16 or kept in float32. */
static inline void store_tile_row(void *y, __m512 v, int y_bf16) {
    if (y_bf16)
        _mm256_storeu_si256((__m256i *)y, (__m256i)_mm512_cvtneps_pbh(v));
    else
        _mm512_storeu_ps((float *)y, v);
}

/* The tile loops below share one shape: a tile is 16 outputs, its weight one 64-byte vector per
 * input pair, and each product is VDPBF16PS of that vector with one row's activation pair
 * broadcast to all lanes. Two details made the bfloat16 loop beat oneDNN at 16 rows (the demo
 * model's 30 layers' linears, cold weights, a Zen 4 EPYC): with a pointer per row and
 * _mm512_set1_epi32 it ran at oneDNN's speed (1.01x);
 * - a row block's activations laid out pair-major ([pairs, block] words, by_pair), so the mb
 *   broadcasts of a pair are one base address plus constants instead of mb row pointers that
 *   spilled: 1.12x;
 * - each activation pair entering VDPBF16PS as an embedded broadcast from memory ({1to16}), where
 *   GCC emitted a separate VPBROADCASTD per product for _mm512_set1_epi32: 1.29x.
 * OpenMP's dynamic schedule was slower, with or without another process taking a tenth of a
 * core: the tiles are split statically. */
#define ROW_BLOCK 16 /* rows per pass: one float32 accumulator each, in registers */

#define DP_BROADCAST(acc, w, word)                                                       \
    __asm__("vdpbf16ps %[x]%{1to16%}, %[wv], %[a]" : [a] "+v"(acc) : [wv] "v"(w),        \
            [x] "m"(*(word)))

/* x [rows, pairs] words rearranged as blocks of `block` rows, each [pairs, mb] (mb: the block's
 * rows), in parallel over blocks; xt has rows * pairs words. Called inside a parallel region. */
static inline void by_pair(const uint32_t *x, uint32_t *xt, int64_t rows, int64_t pairs,
                           int block) {
#pragma omp for schedule(static)
    for (int64_t r0 = 0; r0 < rows; r0 += block) {
        const int64_t mb = rows - r0 < block ? rows - r0 : block;
        uint32_t *dst = xt + r0 * pairs;
        for (int64_t p = 0; p < pairs; p++)
            for (int64_t m = 0; m < mb; m++) dst[p * mb + m] = x[(r0 + m) * pairs + p];
    }
}

/* 16 bfloat16 values as float32 (a bias, an int8 tile's scales). */
static inline __m512 load_bf16x16(const uint16_t *at) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)at)), 16));
}

/* ---- bfloat16 weights times bfloat16 activations ----
 * Faster than oneDNN's packed bfloat16 matmul at decode sizes and as fast at prefill sizes on a
 * Zen 4 EPYC (kernels/cpu_linear.py has the figures), so one layout serves every step.
 * w [tiles, pairs, 32] bfloat16, element e of pair p being output 16t + e/2 at input 2p + e%2
 * (int8_linear's layout); bias bfloat16 [out] or NULL, added in float32 before the output's
 * rounding. */
static inline __attribute__((always_inline)) void bf16_tile_rows(
    const int mb, const uint32_t *xt, int64_t pairs, const uint16_t *w, const uint16_t *bias,
    void *y, int64_t out, int y_bf16, int prefetch) {
    __m512 acc[ROW_BLOCK];
    const __m512 start = bias == NULL ? _mm512_setzero_ps() : load_bf16x16(bias);
    for (int m = 0; m < mb; m++) acc[m] = start;
    for (int64_t p = 0; p < pairs; p++) {
        if (prefetch) prefetch_weight(w + p * 32);
        const __m512bh wv = (__m512bh)_mm512_loadu_si512((const void *)(w + p * 32));
        const uint32_t *words = xt + p * mb;
        for (int m = 0; m < mb; m++) DP_BROADCAST(acc[m], wv, words + m);
    }
    for (int m = 0; m < mb; m++)
        store_tile_row(tile_output(y, m, out, 0, y_bf16), acc[m], y_bf16);
}

/* A last, partial row block (mb rows) for nt tiles at once, mb * nt <= 16: one accumulator
 * chain per row and tile. A lone row's chain waits on each VDPBF16PS before the next can start
 * (its latency), so a row past the full blocks cost what a whole pass of one row does: a
 * demo-model layer's matmuls took 1.27x as long for 17 rows as for 16 on the Zen 4 EPYC, which
 * priced any draft out of a step of 16 sequences. Chains side by side hide the latency (1 row:
 * 8 tiles, 2: 4, 3-4: 4, GROUP_TILES; from 5 rows a tile has chains enough): 17 rows 0.86x,
 * 1 row 0.57x (warm caches, benchmarks/tile_kernel_rows.py). Each output still sums its pairs
 * in the same order from the same start, so its value is the one a full block gives it, to the
 * bit. */
static inline __attribute__((always_inline)) void bf16_tile_group_rows(
    const int mb, const int nt, const uint32_t *xt, int64_t pairs, const uint16_t *w,
    const uint16_t *bias, void *y, int64_t out, int y_bf16, int prefetch) {
    __m512 acc[ROW_BLOCK];
    for (int j = 0; j < nt; j++) {
        const __m512 start = bias == NULL ? _mm512_setzero_ps() : load_bf16x16(bias + j * 16);
        for (int m = 0; m < mb; m++) acc[j * mb + m] = start;
    }
    for (int64_t p = 0; p < pairs; p++) {
        const uint32_t *words = xt + p * mb;
        for (int j = 0; j < nt; j++) {
            if (prefetch && p % 2 == 0) /* every other line (each line asked: 1 row 0.94x) */
                prefetch_tile_stream(w + (j * pairs + p) * 32, p * 64, pairs * 64, nt, 1);
            const __m512bh wv =
                (__m512bh)_mm512_loadu_si512((const void *)(w + (j * pairs + p) * 32));
            for (int m = 0; m < mb; m++) DP_BROADCAST(acc[j * mb + m], wv, words + m);
        }
    }
    for (int j = 0; j < nt; j++)
        for (int m = 0; m < mb; m++)
            store_tile_row(tile_output(y, m, out, j, y_bf16), acc[j * mb + m], y_bf16);
}

/* How many tiles take the `rem` rows of a last, partial row block at once: enough accumulator
 * chains side by side to hide VDPBF16PS's latency (bf16_tile_group_rows says why); 1 where the
 * block has chains enough, or there is none. A macro: the loops' switch cases pass it as a
 * constant for their row count, which must be what the loop advanced its tiles by. */
#define TILES_AT_ONCE(rem) ((rem) == 1 ? 8 : (rem) == 2 ? 4 : (rem) == 3 || (rem) == 4 ? 2 : 1)

/* The same for the bfloat16 and int8 loops (tiles_linear), whose ROW_BLOCK accumulators take 3-4
 * rows of 4 tiles at once (int4's INT4_ROW_BLOCK takes 2): a draft tree's verify step is 3-5
 * rows more often than anything else, and with 4 tiles rather than 2 side by side the demo
 * model's whole decode stack at 3 and 4 rows took 0.88x and 0.87x the time on a quiet Zen 4
 * EPYC, 0.93-1.02x busy (its real verify calls replayed with both builds in one process,
 * benchmarks/verify_stack.py; 1 and 5 rows, unchanged, within 2%); 8 tiles at 2 rows gained
 * nothing and 16 at 1 row lost 9%. */
#define GROUP_TILES(rem) ((rem) <= 2 ? TILES_AT_ONCE(rem) : (rem) <= 4 ? 4 : 1)

#define INT4_ROW_BLOCK 8 /* rows per pass: two float32 accumulators each, in registers */

/* The 16 outputs of each of `nt` consecutive tiles for `mb` rows (constants at each call site,
 * so the accumulators stay in registers; nt * mb <= INT4_ROW_BLOCK). xt: the row block in
 * by_pair's layout; xsum: [rows, groups] sums of the rows' bfloat16 inputs per group. Several
 * tiles at once serve a row block of 1-4 rows (a batch-1 decode step's): a lone row's partial
 * sum is one chain of VDPBF16PS, each waiting on the one before, and the int4 weight's stream
 * is a quarter of bfloat16's, so the chain's latency, not memory, set the pace; chains side by
 * side hide it (benchmarks/tile_kernel_rows.py --kernel int4). Each output sums in the same
 * order whatever nt is, so its value does not depend on it. */
static inline __attribute__((always_inline)) void int4_tile_rows(
    const int mb, const int nt, const uint32_t *xt, int64_t pairs, const float *xsum,
    int64_t groups, const uint8_t *codes, const uint16_t *scales, const uint16_t *mins,
    int64_t group_pairs, void *y, int64_t out, int y_bf16, int prefetch) {
    __m512 acc[INT4_ROW_BLOCK], part[INT4_ROW_BLOCK];
    for (int i = 0; i < nt * mb; i++) acc[i] = _mm512_setzero_ps();
    const __m512i nibble = _mm512_set1_epi16(15), offset = _mm512_set1_epi16(0x4300);
    for (int64_t g = 0; g < groups; g++) {
        for (int i = 0; i < nt * mb; i++) part[i] = _mm512_setzero_ps();
        for (int64_t p = g * group_pairs; p < (g + 1) * group_pairs; p += 2) {
            const uint32_t *words = xt + p * mb;
            for (int j = 0; j < nt; j++) {
                if (prefetch && p % 4 == 0) /* a line per four pairs */
                    prefetch_tile_stream(codes + j * pairs * 16 + p * 16, p * 16, pairs * 16,
                                         nt, 1);
                const __m512i v = _mm512_cvtepu8_epi16(
                    _mm256_loadu_si256((const __m256i *)(codes + j * pairs * 16 + p * 16)));
                /* (v & 15) | 0x4300 in one ternary-logic op; the high nibbles need only the OR. */
                const __m512bh w0 = (__m512bh)_mm512_ternarylogic_epi32(v, nibble, offset, 0xEA);
                const __m512bh w1 = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(v, 4), offset);
                for (int m = 0; m < mb; m++) {
                    DP_BROADCAST(part[j * mb + m], w0, words + m);
                    DP_BROADCAST(part[j * mb + m], w1, words + mb + m);
                }
            }
        }
        for (int j = 0; j < nt; j++) {
            const int64_t at = j * groups * 16 + g * 16;
            if (prefetch && g % 2 == 0) { /* a line per two groups, of each */
                prefetch_tile_stream(scales + at, g * 32, groups * 32, nt, group_pairs / 2);
                prefetch_tile_stream(mins + at, g * 32, groups * 32, nt, group_pairs / 2);
            }
            const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + at)));
            const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mins + at)));
            const __m512 shift = _mm512_fnmadd_ps(_mm512_set1_ps(128.0f), s, mn); /* min-128s */
            for (int m = 0; m < mb; m++) {
                __m512 *a = &acc[j * mb + m];
                *a = _mm512_fmadd_ps(part[j * mb + m], s, *a);
                *a = _mm512_fmadd_ps(shift, _mm512_set1_ps(xsum[m * groups + g]), *a);
            }
        }
    }
    for (int j = 0; j < nt; j++)
        for (int m = 0; m < mb; m++)
            store_tile_row(tile_output(y, m, out, j, y_bf16), acc[j * mb + m], y_bf16);
}

#define INT4_ROWS(n, nt_)                                                      \
    case n:                                                                    \
        int4_tile_rows(n, nt_, xr, pairs, xs, groups, tile_codes, tile_scales, \
                       tile_mins, group / 2, yr, out, y_bf16, first);          \
        break;

int int4_linear(const void *x, const uint8_t *codes, const uint16_t *scales,
                const uint16_t *mins, void *y, int64_t rows, int64_t in_padded, int64_t out,
                int64_t group, int y_bf16, int threads) {
    if (out % 16 || group % 32 || in_padded % group) return -1;
    if (rows == 0) return 0;
    const int64_t tiles = out / 16, pairs = in_padded / 2, groups = in_padded / group;
    float *xsum = malloc(sizeof(float) * rows * groups);
    uint32_t *xt = malloc(sizeof(uint32_t) * rows * pairs);
    if (xsum == NULL || xt == NULL) {
        free(xsum);
        free(xt);
        return -1;
    }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < groups; g++) {
            float sum = 0.0f;
            for (int64_t k = g * group; k < (g + 1) * group; k++)
                sum += bf16_to_f32(((const uint16_t *)x)[r * in_padded + k]);
            xsum[r * groups + g] = sum;
        }
    const int64_t rem = rows % INT4_ROW_BLOCK, full = rows - rem;
    const int at_once = TILES_AT_ONCE(rem);
#pragma omp parallel num_threads(threads)
    {
        by_pair((const uint32_t *)x, xt, rows, pairs, INT4_ROW_BLOCK);
        int64_t t0, t_end;
        thread_tiles(tiles, &t0, &t_end);
        while (t0 < t_end) {
            const int nt = t0 + at_once <= t_end ? at_once : 1;
            for (int64_t t = t0; t < t0 + nt; t++)
                for (int64_t r = 0; r < (nt > 1 ? full : rows); r += INT4_ROW_BLOCK) {
                    const uint8_t *tile_codes = codes + t * pairs * 16;
                    const uint16_t *tile_scales = scales + t * groups * 16;
                    const uint16_t *tile_mins = mins + t * groups * 16;
                    const uint32_t *xr = xt + r * pairs;
                    const float *xs = xsum + r * groups;
                    void *yr = tile_output(y, r, out, t, y_bf16);
                    const int first = r == 0; /* the tile's first pass: prefetch its codes */
                    switch (rows - r < INT4_ROW_BLOCK ? rows - r : INT4_ROW_BLOCK) {
                        INT4_ROWS(1, 1) INT4_ROWS(2, 1) INT4_ROWS(3, 1) INT4_ROWS(4, 1)
                        INT4_ROWS(5, 1) INT4_ROWS(6, 1) INT4_ROWS(7, 1) INT4_ROWS(8, 1)
                    }
                }
            if (nt > 1) { /* the partial block of the group's tiles at once */
                const uint8_t *tile_codes = codes + t0 * pairs * 16;
                const uint16_t *tile_scales = scales + t0 * groups * 16;
                const uint16_t *tile_mins = mins + t0 * groups * 16;
                const uint32_t *xr = xt + full * pairs;
                const float *xs = xsum + full * groups;
                void *yr = tile_output(y, full, out, t0, y_bf16);
                const int first = full == 0;
                switch (rem) {
                    INT4_ROWS(1, TILES_AT_ONCE(1)) INT4_ROWS(2, TILES_AT_ONCE(2))
                    INT4_ROWS(3, TILES_AT_ONCE(3)) INT4_ROWS(4, TILES_AT_ONCE(4))
                }
            }
            t0 += nt;
        }
    }
    free(xsum);
    free(xt);
    return 0;
}

/* Weight tile t as bfloat16 in the tile layout ([pairs, 32] at tile_w), int4_dequantize's
 * values: serves it and int4_amx_linear, which decodes a tile pair at a time into cache. */
static inline void int4_decode_tile(const uint8_t *codes, const uint16_t *scales,
                                    const uint16_t *mins, uint16_t *tile_w, int64_t t,
                                    int64_t pairs, int64_t groups, int64_t group) {
    const __m512i nibble = _mm512_set1_epi32(15);
    for (int64_t g = 0; g < groups; g++) {
        const __m512 s = _mm512_cvtph_ps(
            _mm256_loadu_si256((const __m256i *)(scales + (t * groups + g) * 16)));
        const __m512 mn = _mm512_cvtph_ps(
            _mm256_loadu_si256((const __m256i *)(mins + (t * groups + g) * 16)));
        for (int64_t p = g * (group / 2); p < (g + 1) * (group / 2); p += 2) {
            const __m512i v = _mm512_cvtepu8_epi16(
                _mm256_loadu_si256((const __m256i *)(codes + (t * pairs + p) * 16)));
            /* Pair p's codes in the low nibbles, pair p + 1's in the high ones; as 32-bit
             * lanes, lane i holds input 2p's code in its low half, 2p + 1's in its high. */
            const __m512i halves[2] = {v, _mm512_srli_epi16(v, 4)};
            for (int h = 0; h < 2; h++) {
                const __m512i even = _mm512_and_si512(halves[h], nibble);
                const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(halves[h], 16), nibble);
                const __m512 even_w = _mm512_fmadd_ps(_mm512_cvtepi32_ps(even), s, mn);
                const __m512 odd_w = _mm512_fmadd_ps(_mm512_cvtepi32_ps(odd), s, mn);
                const __m512i word = _mm512_or_si512(
                    _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(even_w)),
                    _mm512_slli_epi32(
                        _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(odd_w)), 16));
                _mm512_storeu_si512((void *)(tile_w + (p + h) * 32), word);
            }
        }
    }
}

/* ---- int8 weights (per output channel) times bfloat16 activations ----
 * y = s[n] * sum_k x_k c_k: the scale is one multiply per output at the end, so each code only
 * has to become bfloat16 (exact: integers up to 256 are), which costs 5 vector ops per 32 codes
 * shared by up to 16 rows. PyTorch's `_weight_int8pack_mm` ran the demo model's 49152-row LM
 * head (int8 under every quantized format) at 13.8 ms for 16 rows against oneDNN bfloat16's 3.9.
 * codes [tiles, pairs, 32] int8, element e of pair p being output 16t + e/2 at input 2p + e%2;
 * scales bfloat16 [out] (as PyTorch's op holds them); x bfloat16 [rows, in_padded] (inputs
 * padded to an even count). */
/* A pair's 32 int8 codes (32 bytes at c) as bfloat16, exact. */
static inline __m512bh int8_pair_bf16(const int8_t *c) {
    const __m512 low =
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)c)));
    const __m512 high =
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(c + 16))));
    return _mm512_cvtne2ps_pbh(high, low);
}

static inline __attribute__((always_inline)) void int8_tile_rows(
    const int mb, const uint32_t *xt, int64_t pairs, const int8_t *codes, const uint16_t *scales,
    void *y, int64_t out, int y_bf16, int prefetch) {
    __m512 acc[ROW_BLOCK];
    for (int m = 0; m < mb; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        if (prefetch && p % 2 == 0) prefetch_weight(codes + p * 32); /* a line per two pairs */
        const __m512bh w = int8_pair_bf16(codes + p * 32);
        const uint32_t *words = xt + p * mb;
        for (int m = 0; m < mb; m++) DP_BROADCAST(acc[m], w, words + m);
    }
    const __m512 s = load_bf16x16(scales);
    for (int m = 0; m < mb; m++)
        store_tile_row(tile_output(y, m, out, 0, y_bf16), _mm512_mul_ps(acc[m], s), y_bf16);
}

/* int8_tile_rows for a last, partial row block of mb rows, nt tiles at once (mb * nt <= 16),
 * as bf16_tile_group_rows does for bfloat16 weights: a lone row's one chain of VDPBF16PS waited
 * on each product, so a batch-1 step's int8 matmuls (the int4 and int8 formats' LM head) ran at
 * the chain's latency. Each output sums its pairs in the same order, its value the same. */
static inline __attribute__((always_inline)) void int8_tile_group_rows(
    const int mb, const int nt, const uint32_t *xt, int64_t pairs, const int8_t *codes,
    const uint16_t *scales, void *y, int64_t out, int y_bf16, int prefetch) {
    __m512 acc[ROW_BLOCK];
    for (int i = 0; i < nt * mb; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        const uint32_t *words = xt + p * mb;
        for (int j = 0; j < nt; j++) {
            const int8_t *c = codes + (j * pairs + p) * 32;
            if (prefetch && p % 2 == 0) /* a line per two pairs */
                prefetch_tile_stream(c, p * 32, pairs * 32, nt, 1);
            const __m512bh w = int8_pair_bf16(c);
            for (int m = 0; m < mb; m++) DP_BROADCAST(acc[j * mb + m], w, words + m);
        }
    }
    for (int j = 0; j < nt; j++) {
        const __m512 s = load_bf16x16(scales + j * 16);
        for (int m = 0; m < mb; m++)
            store_tile_row(tile_output(y, m, out, j, y_bf16), _mm512_mul_ps(acc[j * mb + m], s),
                           y_bf16);
    }
}

/* Rows r.. r + mb of tile t, for a weight kind (a constant wherever this is inlined). per_out:
 * the bfloat16 weight's bias (or NULL), the int8 weight's scales. */
static inline __attribute__((always_inline)) void tile_rows(
    int kind, const int mb, const uint32_t *xt, int64_t pairs, int64_t t, const void *w,
    const uint16_t *per_out, void *y, int64_t out, int y_bf16, int prefetch) {
    if (kind == WEIGHT_BF16)
        bf16_tile_rows(mb, xt, pairs, (const uint16_t *)w + t * pairs * 32,
                       per_out == NULL ? NULL : per_out + t * 16, y, out, y_bf16, prefetch);
    else
        int8_tile_rows(mb, xt, pairs, (const int8_t *)w + t * pairs * 32, per_out + t * 16, y,
                       out, y_bf16, prefetch);
}

#define GROUP_ROWS(n, nt_)                                                                     \
    case n:                                                                                    \
        if (kind == WEIGHT_BF16)                                                               \
            bf16_tile_group_rows(n, nt_, xr, pairs, (const uint16_t *)w + t0 * pairs * 32,     \
                                 per_out == NULL ? NULL : per_out + t0 * 16, yr, out, y_bf16,  \
                                 full == 0);                                                   \
        else                                                                                   \
            int8_tile_group_rows(n, nt_, xr, pairs, (const int8_t *)w + t0 * pairs * 32,       \
                                 per_out + t0 * 16, yr, out, y_bf16, full == 0);               \
        break;

#define TILE_ROWS(n)                                                                       \
    case n:                                                                                \
        tile_rows(kind, n, xt + r * pairs, pairs, t, w, per_out, yr, out, y_bf16, r == 0); \
        break;

/* y [rows, out] = x [rows, in_padded] @ W^T for the weights in tiles of 32 values a pair. */
static inline __attribute__((always_inline)) int tiles_linear(
    int kind, const void *x, const void *w, const uint16_t *per_out, void *y, int64_t rows,
    int64_t in_padded, int64_t out, int y_bf16, int threads) {
    if (out % 16 || in_padded % 2) return -1;
    if (rows == 0) return 0;
    const int64_t tiles = out / 16, pairs = in_padded / 2;
    uint32_t *xt = malloc(sizeof(uint32_t) * rows * pairs);
    if (xt == NULL) return -1;
    const int64_t rem = rows % ROW_BLOCK, full = rows - rem;
    const int group = GROUP_TILES(rem);
#pragma omp parallel num_threads(threads)
    {
        by_pair((const uint32_t *)x, xt, rows, pairs, ROW_BLOCK);
        int64_t t0, t_end;
        thread_tiles(tiles, &t0, &t_end);
        while (t0 < t_end) {
            const int nt = t0 + group <= t_end ? group : 1;
            for (int64_t t = t0; t < t0 + nt; t++)
                for (int64_t r = 0; r < (nt > 1 ? full : rows); r += ROW_BLOCK) {
                    void *yr = tile_output(y, r, out, t, y_bf16);
                    switch (rows - r < ROW_BLOCK ? rows - r : ROW_BLOCK) {
                        TILE_ROWS(1) TILE_ROWS(2) TILE_ROWS(3) TILE_ROWS(4)
                        TILE_ROWS(5) TILE_ROWS(6) TILE_ROWS(7) TILE_ROWS(8)
                        TILE_ROWS(9) TILE_ROWS(10) TILE_ROWS(11) TILE_ROWS(12)
                        TILE_ROWS(13) TILE_ROWS(14) TILE_ROWS(15) TILE_ROWS(16)
                    }
                }
            if (nt > 1) { /* the partial block of the group's tiles at once */
                const uint32_t *xr = xt + full * pairs;
                void *yr = tile_output(y, full, out, t0, y_bf16);
                switch (rem) {
                    GROUP_ROWS(1, GROUP_TILES(1)) GROUP_ROWS(2, GROUP_TILES(2))
                    GROUP_ROWS(3, GROUP_TILES(3)) GROUP_ROWS(4, GROUP_TILES(4))
                }
            }
            t0 += nt;
        }
    }
    free(xt);
    return 0;
}

int bf16_linear(const void *x, const uint16_t *w, const uint16_t *bias, void *y, int64_t rows,
                int64_t in_padded, int64_t out, int y_bf16, int threads) {
    return tiles_linear(WEIGHT_BF16, x, w, bias, y, rows, in_padded, out, y_bf16, threads);
}

int int8_linear(const void *x, const int8_t *codes, const uint16_t *scales, void *y, int64_t rows,
                int64_t in_padded, int64_t out, int y_bf16, int threads) {
    return tiles_linear(WEIGHT_INT8, x, codes, scales, y, rows, in_padded, out, y_bf16, threads);
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1

/* ---- bfloat16 weights on AMX's tile units (Xeons from Sapphire Rapids on) ----
 * bf16_linear's tile layout is AMX's bfloat16 B-tile format: 16 consecutive pairs of a weight
 * tile (1 KB, contiguous) are one B tile of 16 rows of 64 bytes, row k holding the 16 outputs'
 * weights at inputs (2k, 2k + 1). So TDPBF16PS multiplies up to 16 activation rows (an A tile of
 * 32 inputs) by it straight from the weight, with no repacking. Two weight tiles are taken at a
 * time into two accumulator tiles, sharing the A tile; rows go in blocks of 16 inside each pair
 * of weight tiles, so a prefill's weight tile stays in cache across its row blocks. On a 2-core
 * Xeon with AMX it ran the demo model's 30 layers' linears (cold weights) 1.5-2.2x faster than
 * oneDNN's packed bfloat16 matmul from 1 to 512 rows. Tile registers: 0 and 1 accumulate the
 * two weight tiles' outputs, 2 holds the activations, 3 and 4 the two weight tiles (GCC's tile
 * intrinsics take the register number as a literal). */

/* Linux hands out AMX's tile state only to a process that asks (else its first tile
 * instruction is SIGILL): 0 once granted. */
int amx_enable(void) {
    const long arch_req_xcomp_perm = 0x1023, xfeature_xtiledata = 18;
    return syscall(SYS_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata) == 0 ? 0 : -1;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} __attribute__((packed)) TileConfig;

/* How far ahead (in 1 KB steps of each weight tile) the AMX kernel asks for its weights: tile
 * loads alone left the hardware prefetcher behind, and the demo model's linears read their
 * weights at 14-16 GB/s where two cores stream 21-27; two steps ahead made them 1.15-1.28x
 * faster at 1 and 16 rows (one to four steps ahead were within noise of each other, 16 lost
 * most of it). */
#define AMX_PREFETCH_STEPS 2

static void amx_configure(int mb) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    const int rows[] = {mb, mb, mb, 16, 16};
    for (int i = 0; i < 5; i++) {
        cfg.rows[i] = (uint8_t)rows[i];
        cfg.bytes_per_row[i] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* Output tiles t and t + 1 (count 2; count 1: t alone) for every row: y [rows, out] = x [rows,
 * in_padded] (bfloat16) @ W^T + bias, with w0 and w1 the two tiles' weights in the tile layout
 * ([pairs, 32] each), times scale per output (an int8 weight's; NULL: 1). prefetch: ask for the
 * weights ahead (they stream from memory); configured: the row count the tile registers are set
 * up for (0: none yet), kept across calls. */
static inline void amx_tile_pair(const void *x, const uint16_t *w0, const uint16_t *w1,
                                 int count, const uint16_t *scale, const uint16_t *bias, void *y,
                                 int64_t t, int64_t rows, int64_t in_padded, int64_t out,
                                 int y_bf16, int prefetch, int *configured) {
    const int64_t pairs = in_padded / 2;
    float acc[2][16 * 16] __attribute__((aligned(64)));
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        const int mb = rows - r0 < 16 ? (int)(rows - r0) : 16;
        if (*configured != mb) {
            amx_configure(mb);
            *configured = mb;
        }
        _tile_zero(0);
        _tile_zero(1);
        const uint16_t *xr = (const uint16_t *)x + r0 * in_padded;
        for (int64_t p = 0; p < pairs; p += 16) {
            if (prefetch && r0 == 0) { /* later row blocks find the weight tiles in cache */
                /* Past a tile's end this reaches the next tile (this thread's next pair) or
                 * past the weight, which a prefetch may: it never faults. */
                const char *f0 = (const char *)(w0 + (p + 16 * AMX_PREFETCH_STEPS) * 32);
                const char *f1 = (const char *)(w1 + (p + 16 * AMX_PREFETCH_STEPS) * 32);
                for (int l = 0; l < 1024; l += 64) {
                    _mm_prefetch(f0 + l, _MM_HINT_T0);
                    _mm_prefetch(f1 + l, _MM_HINT_T0);
                }
            }
            _tile_loadd(2, xr + 2 * p, in_padded * 2);
            _tile_loadd(3, w0 + p * 32, 64);
            _tile_loadd(4, w1 + p * 32, 64);
            _tile_dpbf16ps(0, 2, 3);
            _tile_dpbf16ps(1, 2, 4);
        }
        _tile_stored(0, acc[0], 64);
        _tile_stored(1, acc[1], 64);
        for (int k = 0; k < count; k++) {
            const __m512 b = bias == NULL ? _mm512_setzero_ps() : load_bf16x16(bias + (t + k) * 16);
            const __m512 sc =
                scale == NULL ? _mm512_set1_ps(1.0f) : load_bf16x16(scale + (t + k) * 16);
            for (int m = 0; m < mb; m++)
                store_tile_row(tile_output(y, r0 + m, out, t + k, y_bf16),
                               _mm512_fmadd_ps(_mm512_load_ps(acc[k] + m * 16), sc, b), y_bf16);
        }
    }
}

/* y [rows, out] = x [rows, in_padded] (bfloat16) @ W^T + bias, W in bf16_linear's tile layout;
 * in_padded a multiple of 32 (whole A tiles). */
int bf16_amx_linear(const void *x, const uint16_t *w, const uint16_t *bias, void *y,
                    int64_t rows, int64_t in_padded, int64_t out, int y_bf16, int threads) {
    if (out % 16 || in_padded % 32) return -1;
    if (rows == 0) return 0;
    const int64_t tiles = out / 16, pairs = in_padded / 2, tile_pairs = (tiles + 1) / 2;
#pragma omp parallel num_threads(threads)
    {
        int configured = 0;
#pragma omp for schedule(static)
        for (int64_t s = 0; s < tile_pairs; s++) {
            const int64_t t = 2 * s;
            const int count = t + 1 < tiles ? 2 : 1; /* an odd last tile is computed twice */
            const uint16_t *w0 = w + t * pairs * 32;
            amx_tile_pair(x, w0, count == 2 ? w0 + pairs * 32 : w0, count, NULL, bias, y, t,
                          rows, in_padded, out, y_bf16, 1, &configured);
        }
        if (configured) _tile_release();
    }
    return 0;
}

/* int8_linear's codes of weight tile t as bfloat16 in the tile layout (exact: integers of 8
 * bits are bfloat16 numbers), the scales left for the product's epilogue. */
static inline void int8_decode_tile(const int8_t *codes, uint16_t *tile_w, int64_t t,
                                    int64_t pairs) {
    const int8_t *c = codes + t * pairs * 32;
    for (int64_t p = 0; p < pairs; p++) {
        const __m512 low = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(c + p * 32))));
        const __m512 high = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(c + p * 32 + 16))));
        _mm512_storeu_si512((void *)(tile_w + p * 32), (__m512i)_mm512_cvtne2ps_pbh(high, low));
    }
}

/* A quantized weight on AMX: each pair of weight tiles is decoded into a thread's buffer, which
 * stays in cache, and multiplied there for every row. Decoding the whole weight to memory first
 * (int4_dequantize, then bf16_amx_linear) wrote and read back four times an int4 weight's bytes
 * per call; this reads the quantized bytes once. kind: WEIGHT_INT4 (codes, scales, mins in
 * int4_linear's layout, `group` inputs a group) or WEIGHT_INT8 (codes and per-output scales in
 * int8_linear's). */
static int quantized_amx_linear(int kind, const void *x, const void *codes,
                                const uint16_t *scales, const uint16_t *mins, void *y,
                                int64_t rows, int64_t in_padded, int64_t out, int64_t group,
                                int y_bf16, int threads) {
    if (out % 16 || in_padded % 32) return -1;
    if (kind == WEIGHT_INT4 && (group % 32 || in_padded % group)) return -1;
    if (rows == 0) return 0;
    const int64_t tiles = out / 16, pairs = in_padded / 2, tile_pairs = (tiles + 1) / 2,
                  tile_words = pairs * 32;
    /* Two decoded tiles per thread, allocated before the parallel region: every thread must
     * reach the loop's work sharing. */
    uint16_t *buffers = aligned_alloc(64, (size_t)(threads * 2 * tile_words) * 2);
    if (buffers == NULL) return -1;
#pragma omp parallel num_threads(threads)
    {
        int configured = 0;
        uint16_t *w0 = buffers + omp_get_thread_num() * 2 * tile_words, *w1 = w0 + tile_words;
#pragma omp for schedule(static)
        for (int64_t s = 0; s < tile_pairs; s++) {
            const int64_t t = 2 * s;
            const int count = t + 1 < tiles ? 2 : 1; /* an odd last tile is computed twice */
            for (int k = 0; k < count; k++) {
                if (kind == WEIGHT_INT4)
                    int4_decode_tile(codes, scales, mins, k ? w1 : w0, t + k, pairs,
                                     in_padded / group, group);
                else
                    int8_decode_tile(codes, k ? w1 : w0, t + k, pairs);
            }
            amx_tile_pair(x, w0, count == 2 ? w1 : w0, count,
                          kind == WEIGHT_INT8 ? scales : NULL, NULL, y, t, rows, in_padded, out,
                          y_bf16, 0, &configured);
        }
        if (configured) _tile_release();
    }
    free(buffers);
    return 0;
}

/* y [rows, out] = x [rows, in_padded] (bfloat16) @ W^T for an int4 weight in int4_linear's
 * layout, on AMX (quantized_amx_linear). */
int int4_amx_linear(const void *x, const uint8_t *codes, const uint16_t *scales,
                    const uint16_t *mins, void *y, int64_t rows, int64_t in_padded, int64_t out,
                    int64_t group, int y_bf16, int threads) {
    return quantized_amx_linear(WEIGHT_INT4, x, codes, scales, mins, y, rows, in_padded, out,
                                group, y_bf16, threads);
}

/* int8_linear's product on AMX (quantized_amx_linear); in_padded a multiple of 32. */
int int8_amx_linear(const void *x, const int8_t *codes, const uint16_t *scales, void *y,
                    int64_t rows, int64_t in_padded, int64_t out, int y_bf16, int threads) {
    return quantized_amx_linear(WEIGHT_INT8, x, codes, scales, NULL, y, rows, in_padded, out, 0,
                                y_bf16, threads);
}
#endif
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

/* ---- the weights' tile kernels on AVX2 with FMA (x86 CPUs without AVX512-BF16) ----
 * The layouts and signatures of the AVX512-BF16 kernels above, so one packing serves both.
 * Before them a 2-core Zen 2 EPYC (AVX2, no AVX-512) ran int4 / int8 weights through PyTorch's
 * packed ops and bfloat16 ones through F.linear (oneDNN refuses bfloat16 there), so float32 was
 * the faster default; benchmarks/cpu_avx2.py has the figures.
 *
 * bfloat16 and int8 weights: each bfloat16 activation becomes float32 once per call (exact),
 * each weight is decoded to float32 in registers, and each product is one FMA into a float32
 * accumulator per row and 8 outputs, inputs in order. int4 weights multiply 16-bit integer
 * activations (avx2_w4a16_rows says why and how). Either way an output's value does not depend
 * on the call's row count or on how many tiles a pass takes: a draft's verification rows get a
 * lone decode row's bits. */
#define AVX2_ROWS 4 /* rows per pass: two accumulators each (a tile's 16 outputs) */

/* 8 bfloat16 values as float32 (activations, a bias, int8 scales). */
static inline __m256 load_bf16x8(const uint16_t *at) {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)at)), 16));
}

/* 8 float16 values as float32 (int4 scales and mins). */
static inline __m256 f16x8(const uint16_t *at) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)at));
}

/* Rows [0, rows) of x (bfloat16, [rows, n]) as float32 into xf, split over the team (called
 * inside a parallel region). */
static inline void rows_to_f32(const uint16_t *x, float *xf, int64_t rows, int64_t n) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        int64_t k = 0;
        for (; k + 8 <= n; k += 8) _mm256_storeu_ps(xf + r * n + k, load_bf16x8(x + r * n + k));
        for (; k < n; k++) xf[r * n + k] = bf16_to_f32(x[r * n + k]);
    }
}

/* Row m's 8 outputs h of tile j (relative to y, the pass's first row and tile). */
static inline void store_half(void *y, int64_t m, int64_t out, int64_t j, int h, __m256 v,
                              int y_bf16) {
    vf lanes;
    memcpy(&lanes, &v, sizeof lanes);
    store_vec(tile_output(y, m, out, j, y_bf16), 8 * h, y_bf16, lanes);
}

/* Pair p's weights of a tile's 8 outputs h as float32, for its inputs 2p and 2p + 1: bfloat16
 * words (input 2p in the low half) or int8 code pairs (int8_linear's layout). */
static inline void bf16_pair(const uint16_t *w, int64_t p, int h, __m256 *w0, __m256 *w1) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)(w + p * 32 + h * 16));
    *w0 = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    *w1 = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
}

static inline void int8_pair(const int8_t *w, int64_t p, int h, __m256 *w0, __m256 *w1) {
    const __m256i v =
        _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)(w + p * 32 + h * 16)));
    *w0 = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 24), 24));
    *w1 = _mm256_cvtepi32_ps(_mm256_srai_epi32(v, 8));
}

/* Rows [0, mb) of `nt` consecutive tiles (constants at each call site; mb * nt <= AVX2_ROWS),
 * bfloat16 or int8 weights (kind). Several tiles at once serve 1-2 rows: a lone row's sum is a
 * chain of FMAs, each waiting on the one before, and chains side by side hide that latency. */
static inline __attribute__((always_inline)) void avx2_pair_rows(
    int kind, const int mb, const int nt, const float *xf, int64_t in, const void *w,
    const uint16_t *per_out, void *y, int64_t out, int y_bf16, int prefetch) {
    const int64_t pairs = in / 2;
    __m256 acc[AVX2_ROWS][2];
    for (int j = 0; j < nt; j++)
        for (int h = 0; h < 2; h++) {
            const __m256 start = kind == WEIGHT_BF16 && per_out != NULL
                                     ? load_bf16x8(per_out + j * 16 + h * 8)
                                     : _mm256_setzero_ps();
            for (int m = 0; m < mb; m++) acc[j * mb + m][h] = start;
        }
    for (int64_t p = 0; p < pairs; p++)
        for (int j = 0; j < nt; j++) {
            __m256 w0[2], w1[2];
            if (prefetch && (kind == WEIGHT_BF16 || p % 2 == 0)) { /* a line a pair, int8 two */
                const int64_t bytes = kind == WEIGHT_BF16 ? 64 : 32; /* a pair's */
                prefetch_tile_stream((const char *)w + (j * pairs + p) * bytes, p * bytes,
                                     pairs * bytes, nt, 1);
            }
            for (int h = 0; h < 2; h++) {
                if (kind == WEIGHT_BF16)
                    bf16_pair((const uint16_t *)w + j * pairs * 32, p, h, &w0[h], &w1[h]);
                else
                    int8_pair((const int8_t *)w + j * pairs * 32, p, h, &w0[h], &w1[h]);
            }
            for (int m = 0; m < mb; m++) {
                const __m256 x0 = _mm256_broadcast_ss(xf + m * in + 2 * p);
                const __m256 x1 = _mm256_broadcast_ss(xf + m * in + 2 * p + 1);
                for (int h = 0; h < 2; h++) {
                    acc[j * mb + m][h] = _mm256_fmadd_ps(w0[h], x0, acc[j * mb + m][h]);
                    acc[j * mb + m][h] = _mm256_fmadd_ps(w1[h], x1, acc[j * mb + m][h]);
                }
            }
        }
    for (int j = 0; j < nt; j++)
        for (int h = 0; h < 2; h++) {
            const __m256 scale = kind == WEIGHT_INT8 ? load_bf16x8(per_out + j * 16 + h * 8)
                                                     : _mm256_set1_ps(1.0f);
            for (int m = 0; m < mb; m++)
                store_half(y, m, out, j, h, _mm256_mul_ps(acc[j * mb + m][h], scale), y_bf16);
        }
}

/* Double pair d's 4 inputs of a tile's 8 outputs h as float32 codes: an output's 16-bit word
 * holds inputs 4d, 4d + 2, 4d + 1, 4d + 3 in its nibbles from the lowest (pack's layout). */
static inline void int4_codes(const uint8_t *codes, int64_t d, int h, __m256 c[4]) {
    const __m256i v =
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(codes + d * 32 + h * 16)));
    const __m256i nibble = _mm256_set1_epi32(15);
    c[0] = _mm256_cvtepi32_ps(_mm256_and_si256(v, nibble));
    c[1] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 8), nibble));
    c[2] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 4), nibble));
    c[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 12));
}

/* int4 weights on AVX2 multiply 16-bit activations in integers. Decoding each code to float32
 * and multiplying it there took about 24 vector ops per 32 products, so int4 decoded slower
 * than bfloat16 (whose stream is 3.5x the bytes). Here each row's activations are quantized per
 * block of 32 inputs, q = round(x / d) with d = max|x| / 32767: an error of at most a 65534th
 * of the block's largest activation, 128x below that activation's own bfloat16 rounding (inputs
 * over 128x smaller than their block's largest come out coarser than bfloat16; perplexity did
 * not move). 8-bit ones, as llama.cpp's Q8_1, moved the demo model's logits 0.045 nats from
 * PyTorch's int4 op. VPMADDWD multiplies two codes (<= 15) by two q's into one exact 32-bit
 * sum per output. Per block, then,
 *     sum_k x_k (c_k s + min) ~ s d sum_k c_k q_k + min sum_k x_k
 * (the min's term takes the float32 sum of the block's activations). A row's values depend
 * on its own activations only, so a draft's verification rows still get a lone row's bits. */
#define AVX2_W4A16_ROWS 8 /* rows per pass */
#define W4A16_BLOCK 32    /* inputs per activation scale */

/* Row r's activations as int16 q [rows, n], with d [rows, n / 32] (q * d ~ x) and the float32
 * sum of x over each block, xsum [rows, n / 32]; split over the team (inside a parallel region). */
static inline void rows_to_q16(const uint16_t *x, int16_t *q, float *d, float *xsum,
                               int64_t rows, int64_t n) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < n / W4A16_BLOCK; b++) {
            const uint16_t *xb = x + r * n + b * W4A16_BLOCK;
            float v[W4A16_BLOCK], amax = 0.0f, sum = 0.0f;
            for (int i = 0; i < W4A16_BLOCK; i++) {
                v[i] = bf16_to_f32(xb[i]);
                const float a = fabsf(v[i]);
                amax = a > amax ? a : amax;
                sum += v[i];
            }
            const float inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
            for (int i = 0; i < W4A16_BLOCK; i++)
                q[r * n + b * W4A16_BLOCK + i] = (int16_t)lrintf(v[i] * inv);
            d[r * (n / W4A16_BLOCK) + b] = amax / 32767.0f;
            xsum[r * (n / W4A16_BLOCK) + b] = sum;
        }
}

/* Rows [0, mb) (a constant <= AVX2_W4A16_ROWS) of one int4 tile, a half tile (8 outputs) at a
 * time: a row's two halves' integer sums side by side, with the codes and broadcasts, took more
 * than the 16 registers from 3 rows on, and GCC spilled sums in the inner loop. The float sums
 * live in acc (memory, touched once per block). */
static inline __attribute__((always_inline)) void avx2_w4a16_rows(
    const int mb, const int16_t *q, const float *d, const float *xsum, int64_t in,
    const uint8_t *codes, const uint16_t *scales, const uint16_t *mins, int64_t group, void *y,
    int64_t out, int y_bf16, int prefetch) {
    const int64_t blocks = in / W4A16_BLOCK, per_group = group / W4A16_BLOCK;
    const __m256i nibble = _mm256_set1_epi16(15);
    for (int h = 0; h < 2; h++) {
        float acc[AVX2_W4A16_ROWS][8] __attribute__((aligned(32))) = {{0}};
        for (int64_t g = 0; g < in / group; g++)
            for (int64_t b = g * per_group; b < (g + 1) * per_group; b++) {
                __m256i sums[AVX2_W4A16_ROWS];
#pragma GCC unroll 8
                for (int m = 0; m < mb; m++) sums[m] = _mm256_setzero_si256();
                for (int64_t dp = b * (W4A16_BLOCK / 4); dp < (b + 1) * (W4A16_BLOCK / 4); dp++) {
                    if (prefetch && h == 0 && dp % 2 == 0) /* the first half reads every line */
                        prefetch_weight(codes + dp * 32);
                    /* per 32-bit lane an output's codes at inputs (4dp, 4dp + 1) in the low
                     * nibbles and (4dp + 2, 4dp + 3) in the high ones */
                    const __m256i v = _mm256_cvtepu8_epi16(
                        _mm_loadu_si128((const __m128i *)(codes + dp * 32 + h * 16)));
                    const __m256i lo = _mm256_and_si256(v, nibble), hi = _mm256_srli_epi16(v, 4);
#pragma GCC unroll 8
                    for (int m = 0; m < mb; m++) {
                        int32_t pair0, pair1;
                        memcpy(&pair0, q + m * in + 4 * dp, sizeof pair0);
                        memcpy(&pair1, q + m * in + 4 * dp + 2, sizeof pair1);
                        sums[m] = _mm256_add_epi32(
                            sums[m], _mm256_madd_epi16(lo, _mm256_set1_epi32(pair0)));
                        sums[m] = _mm256_add_epi32(
                            sums[m], _mm256_madd_epi16(hi, _mm256_set1_epi32(pair1)));
                    }
                }
                const __m256 s = f16x8(scales + g * 16 + h * 8), mn = f16x8(mins + g * 16 + h * 8);
#pragma GCC unroll 8
                for (int m = 0; m < mb; m++) {
                    const __m256 sd = _mm256_mul_ps(s, _mm256_set1_ps(d[m * blocks + b]));
                    const __m256 a = _mm256_fmadd_ps(sd, _mm256_cvtepi32_ps(sums[m]),
                                                     _mm256_load_ps(acc[m]));
                    _mm256_store_ps(acc[m],
                                    _mm256_fmadd_ps(mn, _mm256_set1_ps(xsum[m * blocks + b]), a));
                }
            }
#pragma GCC unroll 8
        for (int m = 0; m < mb; m++) store_half(y, m, out, 0, h, _mm256_load_ps(acc[m]), y_bf16);
    }
}

#define AVX2_W4A16_CASE(n)                                                                      \
    case n:                                                                                    \
        avx2_w4a16_rows(n, q + r * in, d + r * (in / W4A16_BLOCK), xsum + r * (in / W4A16_BLOCK), \
                       in, codes + t * pairs * 16, scales + t * groups * 16,                   \
                       mins + t * groups * 16, group, tile_output(y, r, out, t, y_bf16), out,  \
                       y_bf16, r == 0);                                                        \
        break;

/* A thread's int4 tiles [t0, t_end) for all rows (inside a parallel region, after rows_to_q16). */
static inline void avx2_w4a16_tiles(const int16_t *q, const float *d, const float *xsum,
                                   int64_t in, const uint8_t *codes, const uint16_t *scales,
                                   const uint16_t *mins, int64_t group, void *y, int64_t rows,
                                   int64_t out, int64_t t0, int64_t t_end, int y_bf16) {
    const int64_t pairs = in / 2, groups = in / group;
    for (int64_t t = t0; t < t_end; t++)
        for (int64_t r = 0; r < rows; r += AVX2_W4A16_ROWS)
            switch (rows - r < AVX2_W4A16_ROWS ? rows - r : AVX2_W4A16_ROWS) {
                AVX2_W4A16_CASE(1) AVX2_W4A16_CASE(2) AVX2_W4A16_CASE(3) AVX2_W4A16_CASE(4)
                AVX2_W4A16_CASE(5) AVX2_W4A16_CASE(6) AVX2_W4A16_CASE(7) AVX2_W4A16_CASE(8)
            }
}

/* How many tiles take the `rem` rows of a last, partial row block at once (avx2_pair_rows says
 * why); a macro for the switch cases' constants. */
#define AVX2_TILES_AT_ONCE(rem) ((rem) == 1 ? 4 : (rem) == 2 ? 2 : 1)

/* Rows r.. r + mb of tiles t.. t + nt, for a weight kind (a constant wherever this is inlined).
 * per_out: the bfloat16 weight's bias (or NULL), the int8 weight's scales, the int4 weight's. */
static inline __attribute__((always_inline)) void avx2_pass(
    int kind, const int mb, const int nt, const float *xf, int64_t in, int64_t r, int64_t t,
    const void *w, const uint16_t *per_out, void *y, int64_t out, int y_bf16, int prefetch) {
    const int64_t pairs = in / 2;
    const void *wt = kind == WEIGHT_BF16 ? (const void *)((const uint16_t *)w + t * pairs * 32)
                                         : (const void *)((const int8_t *)w + t * pairs * 32);
    avx2_pair_rows(kind, mb, nt, xf + r * in, in, wt, per_out == NULL ? NULL : per_out + t * 16,
                   tile_output(y, r, out, t, y_bf16), out, y_bf16, prefetch);
}

#define AVX2_PASS(n, nt_, r_, t_)                                                         \
    case n:                                                                               \
        avx2_pass(kind, n, nt_, xf, in, r_, t_, w, per_out, y, out, y_bf16, (r_) == 0);    \
        break;

/* One thread's share of y [rows, out] = x [rows, in] @ W^T (x bfloat16, W in the tile layouts
 * above), called inside a parallel region, `kind` a constant: AVX2_LINEAR puts the region in each
 * kernel, so that each outlined region is compiled for its own weight kind. */
static inline __attribute__((always_inline)) void avx2_team(
    int kind, const void *x, float *xf, const void *w, const uint16_t *per_out,
    const uint16_t *mins, int64_t group, void *y, int64_t rows, int64_t in, int64_t out,
    int y_bf16) {
    int64_t t0, t_end;
    thread_tiles(out / 16, &t0, &t_end);
    if (kind == WEIGHT_INT4) { /* xf holds q, then d and xsum (rows_to_q16) */
        int16_t *q = (int16_t *)xf;
        float *d = (float *)(q + rows * in), *xsum = d + rows * (in / W4A16_BLOCK);
        rows_to_q16((const uint16_t *)x, q, d, xsum, rows, in);
        avx2_w4a16_tiles(q, d, xsum, in, (const uint8_t *)w, per_out, mins, group, y, rows, out,
                        t0, t_end, y_bf16);
        return;
    }
    const int64_t rem = rows % AVX2_ROWS, full = rows - rem;
    const int at_once = AVX2_TILES_AT_ONCE(rem);
    rows_to_f32((const uint16_t *)x, xf, rows, in);
    while (t0 < t_end) {
        const int nt = t0 + at_once <= t_end ? at_once : 1;
        for (int64_t t = t0; t < t0 + nt; t++)
            for (int64_t r = 0; r < (nt > 1 ? full : rows); r += AVX2_ROWS)
                switch (rows - r < AVX2_ROWS ? rows - r : AVX2_ROWS) {
                    AVX2_PASS(1, 1, r, t) AVX2_PASS(2, 1, r, t)
                    AVX2_PASS(3, 1, r, t) AVX2_PASS(4, 1, r, t)
                }
        if (nt > 1) /* the partial block of the group's tiles at once */
            switch (rem) {
                AVX2_PASS(1, AVX2_TILES_AT_ONCE(1), full, t0)
                AVX2_PASS(2, AVX2_TILES_AT_ONCE(2), full, t0)
            }
        t0 += nt;
    }
}

/* A kernel's body: the shapes it takes, the activations' copy (float32; for int4, int16 with the
 * blocks' scales and sums, which take less room), its parallel region. */
#define AVX2_LINEAR(kind, w, per_out, mins, group)                                            \
    if (out % 16 || in_padded % 2) return -1;                                               \
    if ((kind) == WEIGHT_INT4 && ((group) % 32 || in_padded % (group))) return -1;          \
    if (rows == 0) return 0;                                                                \
    float *xf = malloc(sizeof(float) * rows * in_padded);                                   \
    if (xf == NULL) return -1;                                                              \
    _Pragma("omp parallel num_threads(threads)")                                            \
    avx2_team(kind, x, xf, w, per_out, mins, group, y, rows, in_padded, out, y_bf16);       \
    free(xf);                                                                               \
    return 0;

int bf16_linear(const void *x, const uint16_t *w, const uint16_t *bias, void *y, int64_t rows,
                int64_t in_padded, int64_t out, int y_bf16, int threads) {
    AVX2_LINEAR(WEIGHT_BF16, w, bias, NULL, 2)
}

int int8_linear(const void *x, const int8_t *codes, const uint16_t *scales, void *y, int64_t rows,
                int64_t in_padded, int64_t out, int y_bf16, int threads) {
    AVX2_LINEAR(WEIGHT_INT8, codes, scales, NULL, 2)
}

int int4_linear(const void *x, const uint8_t *codes, const uint16_t *scales,
                const uint16_t *mins, void *y, int64_t rows, int64_t in_padded, int64_t out,
                int64_t group, int y_bf16, int threads) {
    AVX2_LINEAR(WEIGHT_INT4, codes, scales, mins, group)
}
/* Weight tile t as bfloat16 in the tile layout ([pairs, 32] at tile_w), code * scale + min
 * rounded once, each pair's 16 outputs as (input 2p, 2p + 1) words: int4_dequantize's values. */
static inline void int4_decode_tile(const uint8_t *codes, const uint16_t *scales,
                                    const uint16_t *mins, uint16_t *tile_w, int64_t t,
                                    int64_t pairs, int64_t groups, int64_t group) {
    for (int64_t g = 0; g < groups; g++)
        for (int h = 0; h < 2; h++) {
            const int64_t at = (t * groups + g) * 16 + h * 8;
            const __m256 s = f16x8(scales + at), mn = f16x8(mins + at);
            for (int64_t d = g * group / 4; d < (g + 1) * group / 4; d++) {
                __m256 c[4];
                int4_codes(codes + t * pairs * 16, d, h, c);
                for (int k = 0; k < 2; k++) { /* pair 2d + k: inputs 4d + 2k, 4d + 2k + 1 */
                    vf even, odd;
                    const __m256 e = _mm256_fmadd_ps(c[2 * k], s, mn);
                    const __m256 o = _mm256_fmadd_ps(c[2 * k + 1], s, mn);
                    memcpy(&even, &e, sizeof even);
                    memcpy(&odd, &o, sizeof odd);
                    const vu32 word = (bf16_bits(even) >> 16) | bf16_bits(odd);
                    memcpy(tile_w + (2 * d + k) * 32 + h * 16, &word, sizeof word);
                }
            }
        }
}
#define TILE_KERNELS 1
#else
/* Without AVX512-BF16 or AVX2, int4 and int8 weights keep PyTorch's packed ops (kernels/quant.py)
 * and bfloat16 ones oneDNN or F.linear. */
int int4_linear(const void *x, const uint8_t *codes, const uint16_t *scales,
                const uint16_t *mins, void *y, int64_t rows, int64_t in_padded, int64_t out,
                int64_t group, int y_bf16, int threads) {
    return -1;
}

int int8_linear(const void *x, const int8_t *codes, const uint16_t *scales, void *y, int64_t rows,
                int64_t in_padded, int64_t out, int y_bf16, int threads) {
    return -1;
}

int bf16_linear(const void *x, const uint16_t *w, const uint16_t *bias, void *y, int64_t rows,
                int64_t in_padded, int64_t out, int y_bf16, int threads) {
    return -1;
}
#endif

/* The weight as bfloat16 in bf16_linear's tile layout [tiles, pairs, 32], code * scale + min
 * rounded once (for prefill-sized batches, which the bfloat16 tile loop runs faster than the
 * int4 one: 8-row blocks there, and the decode redone per block). Lane i of pair p's word is
 * output 16t + i at inputs (2p, 2p + 1), so each decoded pair is one contiguous 64-byte store. */
int int4_dequantize(const uint8_t *codes, const uint16_t *scales, const uint16_t *mins,
                    uint16_t *w, int64_t in_padded, int64_t out, int64_t group, int threads) {
#ifdef TILE_KERNELS
    if (out % 16 || group % 32 || in_padded % group) return -1;
    const int64_t tiles = out / 16, pairs = in_padded / 2, groups = in_padded / group;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tiles; t++)
        int4_decode_tile(codes, scales, mins, w + t * pairs * 32, t, pairs, groups, group);
    return 0;
#else
    return -1; /* without AVX512-BF16 or AVX2 (int4 weights keep PyTorch's packed op) */
#endif
}

#ifndef HAVE_AMX
/* Without AMX (or a compiler that knows it) bfloat16 weights keep the tile loop or oneDNN. */
int amx_enable(void) { return -1; }

int bf16_amx_linear(const void *x, const uint16_t *w, const uint16_t *bias, void *y,
                    int64_t rows, int64_t in_padded, int64_t out, int y_bf16, int threads) {
    return -1;
}

int int4_amx_linear(const void *x, const uint8_t *codes, const uint16_t *scales,
                    const uint16_t *mins, void *y, int64_t rows, int64_t in_padded, int64_t out,
                    int64_t group, int y_bf16, int threads) {
    return -1;
}

int int8_amx_linear(const void *x, const int8_t *codes, const uint16_t *scales, void *y,
                    int64_t rows, int64_t in_padded, int64_t out, int y_bf16, int threads) {
    return -1;
}
#endif

/* ---- a step's decoder layers in one call ----
 * The Llama decoder layer of engine/model.py, layer after layer, for a step of decode rows (one
 * query each) and prefill chunks, bfloat16 activations, weights in the tile kernels' layouts
 * (bfloat16, int4, per-channel int8): the same kernels the model calls one by one from Python,
 * in the same order on the same values, so the result is the same to the bit. From Python each
 * layer was ten calls (norms, four linears, rotary, the cache write, attention, SwiGLU) at 20-40
 * us of call overhead each against a few us of arithmetic for the small ones; here a step's
 * layers are one call.
 *
 * table: per layer, the input norm, the post-attention norm, the k and v caches ([slots,
 * kv_heads, dim]), then the qkv, o, gate_up and down linears as LINEAR_FIELDS values each: the
 * kind (LINEAR_BF16: tiles, bias or 0; LINEAR_INT4: codes, scales, mins, group size;
 * LINEAR_INT8: codes, scales). h [n, hidden] is the embeddings in and the last layer's output
 * out; residual [n, hidden] the residual stream out (the model's final norm adds the two). cos,
 * sin [n, dim]; slot_mapping [n]. The step's decode rows: decode_rows of them, slots
 * [decode_rows, width] and lengths [decode_rows] as decode_attention takes them, at rows
 * decode_index [decode_rows] of the step (ignored where every row is a decode row, in order);
 * its prefill chunks: chunks of them, chunk_info [chunks, 5] the first row, the rows, the keys,
 * the keys' slots (an int64 pointer) and the mask ([rows, keys] bytes; 0: causal) of each, as
 * prefill_attention takes them. amx: bfloat16 products with whole A tiles on AMX's tile units (bf16_amx_linear);
 * int4_path: how int4 weights are multiplied (INT4_TILES, INT4_WHOLE, INT4_AMX: kernels/
 * cpu_quant.py's int4_path for this many rows); int8_amx: int8 weights by int8_amx_linear
 * rather than int8_linear (its on_amx).
 * Returns 0, or -1 (a kernel refused or no memory): the caller then runs the step the long
 * way, which rewrites the cache slots this call may have written with the same values. */
typedef int (*LinearFn)(const void *, const uint16_t *, const uint16_t *, void *, int64_t,
                        int64_t, int64_t, int, int);
enum { LINEAR_BF16 = 0, LINEAR_INT4 = 1, LINEAR_INT8 = 2, LINEAR_FIELDS = 5, LAYER_FIELDS = 24 };
/* How int4 weights are multiplied (kernels/cpu_quant.py's int4_path): int4_linear's tile loop,
 * decoded whole into bfloat16 tiles for the bfloat16 kernels, or int4_amx_linear. */
enum { INT4_TILES = 0, INT4_WHOLE = 1, INT4_AMX = 2 };

static int layer_linear(const int64_t *d, const void *x, void *y, int64_t rows, int64_t in,
                        int64_t out, int amx, int int4_path, int int8_amx, uint16_t **decoded,
                        int64_t *decoded_size, int threads) {
    /* bfloat16 tiles on AMX's units where the inputs are whole A tiles, as bf16_forward picks */
    const LinearFn bf16 = amx && in % 32 == 0 ? bf16_amx_linear : bf16_linear;
    switch (d[0]) {
    case LINEAR_BF16:
        return bf16(x, (const uint16_t *)d[1], (const uint16_t *)d[2], y, rows, in, out, 1,
                    threads);
    case LINEAR_INT4:
        if (int4_path == INT4_AMX)
            return int4_amx_linear(x, (const uint8_t *)d[1], (const uint16_t *)d[2],
                                   (const uint16_t *)d[3], y, rows, in, out, d[4], 1, threads);
        if (int4_path == INT4_WHOLE) {
            if (*decoded_size < out * in) { /* one buffer, grown to the largest weight */
                free(*decoded);
                *decoded = aligned_alloc(64, (size_t)(out * in) * 2);
                *decoded_size = *decoded == NULL ? 0 : out * in;
                if (*decoded == NULL) return -1;
            }
            if (int4_dequantize((const uint8_t *)d[1], (const uint16_t *)d[2],
                                (const uint16_t *)d[3], *decoded, in, out, d[4], threads))
                return -1;
            return bf16(x, *decoded, NULL, y, rows, in, out, 1, threads);
        }
        return int4_linear(x, (const uint8_t *)d[1], (const uint16_t *)d[2],
                           (const uint16_t *)d[3], y, rows, in, out, d[4], 1, threads);
    case LINEAR_INT8:
        return (int8_amx ? int8_amx_linear : int8_linear)(
            x, (const int8_t *)d[1], (const uint16_t *)d[2], y, rows, in, out, 1, threads);
    }
    return -1;
}

int prefill_attention(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                      uint16_t *out, const int64_t *slots, const uint8_t *mask, int64_t n,
                      int64_t ctx, int64_t heads, int64_t kv_heads, int64_t dim, float scale,
                      int threads);

/* A layer's attention for a step of decode rows and prefill chunks (decode_layers says how
 * they are given). Decode rows that are not the whole step are gathered into dq and their
 * outputs scattered back from dout. The rows and chunks must cover the step's rows once each
 * (kernels/cpu_layers.py checks): a row left out would pass uninitialised scratch on. */
static int step_attention(const uint16_t *q_out, const uint16_t *k_cache, const uint16_t *v_cache,
                          uint16_t *attn, int64_t n, int64_t decode_rows,
                          const int64_t *decode_index, const int64_t *slots,
                          const int64_t *lengths, int64_t width, int64_t chunks,
                          const int64_t *chunk_info, uint16_t *dq, uint16_t *dout, int64_t heads,
                          int64_t kv_heads, int64_t dim, float scale, int threads) {
    const int64_t q_size = heads * dim;
    int failed = 0;
    if (decode_rows == n && chunks == 0)
        return decode_attention(q_out, k_cache, v_cache, attn, slots, lengths, n, heads, kv_heads,
                                dim, width, scale, 1, threads);
    if (decode_rows > 0) {
        for (int64_t r = 0; r < decode_rows; r++)
            memcpy(dq + r * q_size, q_out + decode_index[r] * q_size, (size_t)q_size * 2);
        failed |= decode_attention(dq, k_cache, v_cache, dout, slots, lengths, decode_rows, heads,
                                   kv_heads, dim, width, scale, 1, threads);
        for (int64_t r = 0; r < decode_rows && !failed; r++)
            memcpy(attn + decode_index[r] * q_size, dout + r * q_size, (size_t)q_size * 2);
    }
    for (int64_t c = 0; c < chunks && !failed; c++) {
        const int64_t *info = chunk_info + 5 * c; /* start, rows, keys, slots, mask or 0 */
        failed |= prefill_attention(q_out + info[0] * q_size, k_cache, v_cache,
                                    attn + info[0] * q_size, (const int64_t *)info[3],
                                    (const uint8_t *)info[4], info[1], info[2], heads, kv_heads,
                                    dim, scale, threads);
    }
    return failed ? -1 : 0;
}

int decode_layers(const int64_t *table, int64_t layers, void *h, void *residual,
                  const void *cos, const void *sin, const int64_t *slot_mapping,
                  const int64_t *slots, const int64_t *lengths, int64_t n, int64_t hidden,
                  int64_t heads, int64_t kv_heads, int64_t dim, int64_t inter, int64_t width,
                  int64_t decode_rows, const int64_t *decode_index, int64_t chunks,
                  const int64_t *chunk_info, const int64_t *aux, float eps, float scale,
                  int amx, int int4_path, int int8_amx, int threads) {
    const int64_t q_size = heads * dim, kv_size = kv_heads * dim, qkv_width = q_size + 2 * kv_size;
    const int64_t gathered = decode_rows == n && chunks == 0 ? 0 : decode_rows;
    const int64_t counts[] = {n * hidden, n * qkv_width, n * q_size, n * kv_size, n * q_size,
                              n * 2 * inter, n * inter, gathered * q_size, gathered * q_size};
    uint16_t *part[9];
    uint16_t *scratch = scratch_parts(counts, 9, part);
    if (scratch == NULL) return -1;
    uint16_t *x = part[0], *qkv = part[1], *q_out = part[2], *k_out = part[3], *attn = part[4],
             *gate_up = part[5], *act = part[6], *dq = part[7], *dout = part[8];
    uint16_t *decoded = NULL;
    int64_t decoded_size = 0;
    int failed = 0;
#define LINEAR(i, from, to, in, out)                                                             \
    layer_linear(p + 4 + (i) * LINEAR_FIELDS, from, to, n, in, out, amx, int4_path, int8_amx,     \
                 &decoded, &decoded_size, threads)
    for (int64_t l = 0; l < layers && !failed; l++) {
        const int64_t *p = table + LAYER_FIELDS * l;
        const uint16_t *input_norm = (const uint16_t *)p[0], *post_norm = (const uint16_t *)p[1];
        uint16_t *k_cache = (uint16_t *)p[2], *v_cache = (uint16_t *)p[3];
        /* The first layer's residual is its input (the model's rms_norm without one). */
        failed |= rms_norm(h, l == 0 ? NULL : residual, input_norm, x, residual, n, hidden, eps, 1,
                           threads);
        if (l == 0) memcpy(residual, h, (size_t)(n * hidden) * 2);
        failed |= LINEAR(0, x, qkv, hidden, qkv_width);
        failed |= rotary(qkv, qkv + q_size, cos, sin, q_out, k_out, n, heads, kv_heads, dim,
                         qkv_width, qkv_width, 1, threads);
        if (failed) break;
        for (int64_t t = 0; t < n; t++) {
            memcpy(k_cache + slot_mapping[t] * kv_size, k_out + t * kv_size, (size_t)kv_size * 2);
            memcpy(v_cache + slot_mapping[t] * kv_size, qkv + t * qkv_width + q_size + kv_size,
                   (size_t)kv_size * 2);
        }
        failed |= step_attention(q_out, k_cache, v_cache, attn, n, decode_rows, decode_index,
                                 slots, lengths, width, chunks, chunk_info, dq, dout, heads,
                                 kv_heads, dim, scale, threads);
        failed |= LINEAR(1, attn, h, q_size, hidden);
        failed |= rms_norm(h, residual, post_norm, x, residual, n, hidden, eps, 1, threads);
        failed |= LINEAR(2, x, gate_up, hidden, 2 * inter);
        failed |= silu_and_mul(gate_up, act, n, inter, 1, threads);
        failed |= LINEAR(3, act, h, inter, hidden);
        /* aux[l] (a bfloat16 [n, hidden] array, 0 for none): the residual stream after layer l,
         * for a draft that reads middle layers (EAGLE-3's features); h and residual untouched. */
        if (aux != NULL && aux[l] != 0 && !failed)
            for (int64_t i = 0; i < n * hidden; i += LANES)
                store_vec((void *)aux[l], i, 1, load_vec(h, i, 1) + load_vec(residual, i, 1));
    }
#undef LINEAR
    free(decoded);
    free(scratch);
    return failed ? -1 : 0;
}

/* ---- one level of the hidden-state draft (engine/spec/hidden_draft.py) in one call ----
 * For each of `rows` rows, from its draft state s [hidden] (float32) and the token it continues:
 * the next state f(s, x) = s + fc2(silu(fc1([s, norm(E[x]) * embed_norm]) + b1)) + b2 (norm:
 * the embedding row over its root mean square) into s_out, its scores over the draft vocabulary
 * through the head (the first `vocab` of its head_out outputs), and their k largest softmax
 * probabilities and columns into probs, cols [rows, k]: draft_step, scores and top_tokens. The
 * same roundings as that composition of torch ops: each matmul's input bfloat16, its output and
 * the bias added to it bfloat16, the state, the norm and SiLU float32.
 * w: fc1's int4 codes, scales, mins (int4_linear's layout) and bfloat16 bias; the same for fc2;
 * the head's codes, scales and mins; the embedding (bfloat16 [*, hidden]); embed_norm (float32).
 * All three matmuls take int4 weights of group size `group`, inputs unpadded.
 * Why one call: a level was about twenty torch ops and three matmul calls from Python, and on
 * the 2-core EPYC half of its time went to the calls rather than the arithmetic.
 * Returns 0, or -1 (a kernel refused, no memory, a NaN score): the caller composes the level
 * from its ops. */
int draft_level(const int64_t *w, const float *s, const int64_t *tokens, int64_t rows,
                int64_t hidden, int64_t width, int64_t head_out, int64_t vocab, int64_t group,
                float eps, int64_t k, float *s_out, float *probs, int64_t *cols, int threads) {
    if (hidden % LANES || width % LANES || head_out % LANES || vocab > head_out) return -1;
    const uint16_t *b1 = (const uint16_t *)w[3], *b2 = (const uint16_t *)w[7];
    const uint16_t *embed = (const uint16_t *)w[11];
    const float *embed_norm = (const float *)w[12];
    const int64_t in1 = 2 * hidden;
    /* bfloat16 scratch: fc1's input, its output, fc2's input, its output, the head's input and
     * output; then the scores as float32 */
    const int64_t sizes[] = {rows * in1, rows * width, rows * width, rows * hidden,
                             rows * hidden, rows * head_out};
    uint16_t *part[6];
    uint16_t *scratch = scratch_parts(sizes, 6, part);
    float *scores = aligned_alloc(64, (size_t)((rows * head_out + 15) / 16 * 16) * 4);
    if (scratch == NULL || scores == NULL) {
        free(scratch);
        free(scores);
        return -1;
    }
    uint16_t *x = part[0], *y1 = part[1], *a = part[2], *y2 = part[3], *sb = part[4], *sc = part[5];
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *e = embed + tokens[r] * hidden;
        vf squares = (vf){0};
        for (int64_t c = 0; c < hidden; c += LANES) {
            const vf v = load_vec(e, c, 1);
            squares += v * v;
            store_vec(x, r * in1 + c, 1, load_vec(s, r * hidden + c, 0));
        }
        const float inv = 1.0f / sqrtf(sum_lanes(squares) / (float)hidden + eps);
        for (int64_t c = 0; c < hidden; c += LANES)
            store_vec(x, r * in1 + hidden + c, 1,
                      load_vec(e, c, 1) * inv * load_vec(embed_norm, c, 0));
    }
    int failed = int4_linear(x, (const uint8_t *)w[0], (const uint16_t *)w[1],
                             (const uint16_t *)w[2], y1, rows, in1, width, group, 1, threads);
    for (int64_t r = 0; r < rows && !failed; r++)
        for (int64_t c = 0; c < width; c += LANES)
            store_vec(a, r * width + c, 1,
                      silu_vec(round_bf16(load_vec(y1, r * width + c, 1) + load_vec(b1, c, 1))));
    failed = failed || int4_linear(a, (const uint8_t *)w[4], (const uint16_t *)w[5],
                                   (const uint16_t *)w[6], y2, rows, width, hidden, group, 1,
                                   threads);
    for (int64_t r = 0; r < rows && !failed; r++)
        for (int64_t c = 0; c < hidden; c += LANES) {
            const vf next = load_vec(s, r * hidden + c, 0)
                            + round_bf16(load_vec(y2, r * hidden + c, 1) + load_vec(b2, c, 1));
            store_vec(s_out, r * hidden + c, 0, next);
            store_vec(sb, r * hidden + c, 1, next);
        }
    failed = failed || int4_linear(sb, (const uint8_t *)w[8], (const uint16_t *)w[9],
                                   (const uint16_t *)w[10], sc, rows, hidden, head_out, group, 1,
                                   threads);
    for (int64_t i = 0; i < rows * head_out && !failed; i += LANES)
        store_vec(scores, i, 0, load_vec(sc, i, 1));
    failed = failed || softmax_topk(scores, rows, vocab, head_out, k, probs, cols);
    free(scratch);
    free(scores);
    return failed ? -1 : 0;
}

/* ---- prefill attention: a chunk of queries over its keys, bfloat16, on VDPBF16PS ----
 * torch's scaled_dot_product_attention took 0.4 ms a layer for a 110-token prompt of the demo
 * model (9 heads of 64) on the 2-core EPYC, 30 GFLOP/s, and 13.7 ms at 1,000 tokens (84
 * GFLOP/s): a fifth of a short prompt's prefill and two fifths of a long one's. Here the scores
 * and the value sums are the tile kernels' products: a block of 16 keys is a "weight tile" (16
 * lanes, one 64-byte vector per pair of head dims) that the queries' dim pairs multiply,
 * broadcast to all lanes, and the values, two keys a pair, are the tiles the probabilities
 * multiply. Softmax online over blocks of PF_KEYS keys (flash attention), in float32; the
 * probabilities are rounded to bfloat16 for the value products, as bfloat16 flash kernels do.
 *
 * A row's arithmetic depends only on its own keys: key blocks start at key 0 whatever the
 * chunk, so a query gets the same output alone or with others, in one chunk or split. */
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define PF_QUERIES 16 /* query positions per task */
#define PF_KEYS 256   /* keys per online-softmax block */
#define PF_MAX_DIM 256
#define PF_REPACK_BYTES ((int64_t)256 << 20) /* K and V repacked at most this large */

typedef struct {
    const uint16_t *q;
    uint16_t *out;
    const uint32_t *kt, *vp; /* repacked keys and values (prefill_attention says how) */
    const uint8_t *mask;     /* [n, ctx] or NULL: causal */
    int64_t n, ctx, tiles, heads, kv_heads, dim;
    float scale;
} Prefill;

/* The products below are _mm512_dpbf16_ps with a broadcast operand, not DP_BROADCAST's embedded
 * broadcast: inlined into this kernel's larger loop nest, GCC kept the asm's accumulators on the
 * stack (a load and a store around every product) and the kernel ran at 0.55x. */

/* Scores of mb query rows against one tile of 16 keys: xt the rows' dim pairs pair-major
 * ([pairs][stride] words), kt the tile ([pairs][16] words); s rows s_stride floats apart. */
static inline __attribute__((always_inline)) void pf_scores(
    const int mb, const uint32_t *xt, int64_t stride, int64_t pairs, const uint32_t *kt,
    float *s, int64_t s_stride, float scale) {
    __m512 acc[16];
#pragma GCC unroll 16
    for (int m = 0; m < mb; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        const __m512bh wv = (__m512bh)_mm512_loadu_si512((const void *)(kt + p * 16));
        const uint32_t *words = xt + p * stride;
#pragma GCC unroll 16
        for (int m = 0; m < mb; m++) acc[m] = _mm512_dpbf16_ps(acc[m], wv, (__m512bh)_mm512_set1_epi32((int)words[m]));
    }
    const __m512 sc = _mm512_set1_ps(scale);
#pragma GCC unroll 16
    for (int m = 0; m < mb; m++) _mm512_storeu_ps(s + m * s_stride, _mm512_mul_ps(acc[m], sc));
}

#define PF_SCORE_ROWS(n_)                                                         \
    case n_:                                                                      \
        pf_scores(n_, xt + r, rows, pairs, kt, s + r * PF_KEYS + t * 16, PF_KEYS, \
                  job->scale);                                                    \
        break;

/* o[mr rows][dim] += P (mr rows of bfloat16 probabilities, as key-pair words pw_stride apart)
 * times the values' key pairs vp ([key_pairs][dim] words); chunks = dim / 16, mr * chunks <= 16
 * (pf_values_rows). Where chunks is not a constant (prefill_attention's default case: head sizes
 * other than 64 and 128), GCC unrolls the loops 16 x 16 and warns of reads past acc and of
 * uninitialized ones in copies the bound never reaches (hundreds of warnings, and an
 * `if (mr * chunks > 16) __builtin_unreachable();` did not quiet them); they are silenced here
 * alone, so that a real warning elsewhere in the file stands out. */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Warray-bounds"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
static inline __attribute__((always_inline)) void pf_values(
    const int mr, const int chunks, const uint32_t *pw, int64_t pw_stride, const uint32_t *vp,
    int64_t key_pairs, int64_t dim, float *o) {
    __m512 acc[16];
#pragma GCC unroll 16
    for (int m = 0; m < mr; m++)
#pragma GCC unroll 16
        for (int c = 0; c < chunks; c++) acc[m * chunks + c] = _mm512_loadu_ps(o + m * dim + 16 * c);
    for (int64_t jp = 0; jp < key_pairs; jp++)
#pragma GCC unroll 16
        for (int c = 0; c < chunks; c++) {
            const __m512bh wv = (__m512bh)_mm512_loadu_si512((const void *)(vp + jp * dim + 16 * c));
#pragma GCC unroll 16
            for (int m = 0; m < mr; m++) acc[m * chunks + c] = _mm512_dpbf16_ps(acc[m * chunks + c], wv, (__m512bh)_mm512_set1_epi32((int)pw[m * pw_stride + jp]));
        }
#pragma GCC unroll 16
    for (int m = 0; m < mr; m++)
#pragma GCC unroll 16
        for (int c = 0; c < chunks; c++) _mm512_storeu_ps(o + m * dim + 16 * c, acc[m * chunks + c]);
}
#pragma GCC diagnostic pop

/* All rows' o += P V for one key block: rows in passes that keep 16 accumulators. */
static inline __attribute__((always_inline)) void pf_values_rows(
    const int chunks, int64_t rows, const uint32_t *pw, const uint32_t *vp, int64_t key_pairs,
    int64_t dim, float *o) {
    const int per = 16 / chunks;
    int64_t r = 0;
    for (; r + per <= rows; r += per)
        pf_values(per, chunks, pw + r * (PF_KEYS / 2), PF_KEYS / 2, vp, key_pairs, dim, o + r * dim);
    for (; r < rows; r++)
        pf_values(1, chunks, pw + r * (PF_KEYS / 2), PF_KEYS / 2, vp, key_pairs, dim, o + r * dim);
}

/* One task: KV head h, query positions i0 .. i0 + qn, with the group's query heads as rows
 * (row r: position i0 + r / group, head h * group + r % group). Buffers: xt pairs x rows
 * words, s rows x PF_KEYS floats, pw rows x PF_KEYS / 2 words, o rows x dim floats, top and
 * total rows floats each. */
static inline __attribute__((always_inline)) void pf_task(
    const Prefill *job, int64_t h, int64_t i0, int64_t qn, const int chunks, uint32_t *xt,
    float *s, uint32_t *pw, float *o, float *top, float *total) {
    const int64_t dim = job->dim, pairs = dim / 2, group = job->heads / job->kv_heads;
    const int64_t rows = qn * group, offset = job->ctx - job->n;
    for (int64_t r = 0; r < rows; r++) {
        const uint32_t *qw = (const uint32_t *)(job->q + ((i0 + r / group) * job->heads
                                                          + h * group + r % group) * dim);
        for (int64_t p = 0; p < pairs; p++) xt[p * rows + r] = qw[p];
        top[r] = -INFINITY;
        total[r] = 0.0f;
    }
    memset(o, 0, sizeof(float) * (size_t)(rows * dim));
    /* Keys any row of the task may see: causal, up to its last query's position. */
    const int64_t keys = job->mask != NULL ? job->ctx : offset + i0 + qn;
    const uint32_t *kt_head = job->kt + h * job->tiles * pairs * 16;
    const uint32_t *vp_head = job->vp + h * job->tiles * 8 * dim;
    for (int64_t j0 = 0; j0 < keys; j0 += PF_KEYS) {
        const int64_t kb = keys - j0 < PF_KEYS ? keys - j0 : PF_KEYS;
        const int64_t kb_tiles = (kb + 15) / 16;
        for (int64_t t = 0; t < kb_tiles; t++) {
            const uint32_t *kt = kt_head + (j0 / 16 + t) * pairs * 16;
            int64_t r = 0;
            for (; r + 16 <= rows; r += 16)
                pf_scores(16, xt + r, rows, pairs, kt, s + r * PF_KEYS + t * 16, PF_KEYS, job->scale);
            switch (rows - r) {
                PF_SCORE_ROWS(1) PF_SCORE_ROWS(2) PF_SCORE_ROWS(3) PF_SCORE_ROWS(4)
                PF_SCORE_ROWS(5) PF_SCORE_ROWS(6) PF_SCORE_ROWS(7) PF_SCORE_ROWS(8)
                PF_SCORE_ROWS(9) PF_SCORE_ROWS(10) PF_SCORE_ROWS(11) PF_SCORE_ROWS(12)
                PF_SCORE_ROWS(13) PF_SCORE_ROWS(14) PF_SCORE_ROWS(15)
            }
        }
        const int64_t width = kb_tiles * 16;
        for (int64_t r = 0; r < rows; r++) {
            float *sr = s + r * PF_KEYS;
            const int64_t i = i0 + r / group;
            /* Keys this row may not see score -inf: past its position, or off the mask. */
            if (job->mask != NULL) {
                const uint8_t *allowed = job->mask + i * job->ctx + j0;
                for (int64_t j = 0; j < width; j++)
                    if (j >= kb || !allowed[j]) sr[j] = -INFINITY;
            } else {
                const int64_t seen = offset + i + 1 - j0; /* keys of this block it sees */
                for (int64_t j = seen < 0 ? 0 : seen; j < width; j++) sr[j] = -INFINITY;
            }
            vf most = (vf){0} - INFINITY;
            for (int64_t j = 0; j < width; j += 16) {
                vf x;
                memcpy(&x, sr + j, sizeof x);
                most = select_vec(x > most, x, most);
            }
            float m = top[r];
            for (int l = 0; l < 16; l++) m = most[l] > m ? most[l] : m;
            uint32_t *pr = pw + r * (PF_KEYS / 2);
            if (m == -INFINITY) { /* nothing seen yet: no weight */
                memset(pr, 0, sizeof(uint32_t) * (size_t)(width / 2));
                continue;
            }
            const float alpha = exp_nonpositive(top[r] - m);
            top[r] = m;
            vf sum = (vf){0};
            for (int64_t j = 0; j < width; j += 32) {
                vf lo, hi = (vf){0} - INFINITY;
                memcpy(&lo, sr + j, sizeof lo);
                if (j + 16 < width) memcpy(&hi, sr + j + 16, sizeof hi);
                lo = exp_nonpositive_vec(lo - m);
                hi = exp_nonpositive_vec(hi - m);
                sum += lo + hi;
                __m512 l512, h512;
                memcpy(&l512, &lo, sizeof l512);
                memcpy(&h512, &hi, sizeof h512);
                const __m512bh both = _mm512_cvtne2ps_pbh(h512, l512);
                memcpy(pr + j / 2, &both, j + 16 < width ? 64 : 32);
            }
            total[r] = total[r] * alpha + sum_lanes(sum);
            if (alpha != 1.0f) {
                float *orow = o + r * dim;
                for (int64_t d = 0; d < dim; d++) orow[d] *= alpha;
            }
        }
        pf_values_rows(chunks, rows, pw, vp_head + j0 / 2 * dim, width / 2, dim, o);
    }
    for (int64_t r = 0; r < rows; r++) {
        const float inv = total[r] > 0.0f ? 1.0f / total[r] : 0.0f;
        uint16_t *dst = job->out + ((i0 + r / group) * job->heads + h * group + r % group) * dim;
        for (int64_t c = 0; c < dim; c += 16)
            store_tile_row(dst + c, _mm512_mul_ps(_mm512_loadu_ps(o + r * dim + c),
                                                  _mm512_set1_ps(inv)), 1);
    }
}

/* out [n, heads, dim] = attention of q [n, heads, dim] over the keys and values at slots [ctx]
 * of the caches ([slots, kv_heads, dim]), all bfloat16: query i sits at position ctx - n + i and
 * sees the keys up to it (mask NULL), or the keys mask [n, ctx] (bytes, 1 = seen) allows. The
 * keys are first repacked per KV head as score tiles (kt: [tiles][dim / 2][16] words, key
 * 16t + e's dim pair p at [t][p][e]) and the values as key pairs (vp: [tiles * 8][dim] words,
 * keys 2j and 2j + 1's values at dim d in word [j][d]), zero past ctx. -1 for a head dim this
 * does not take (a multiple of 32 up to PF_MAX_DIM), a context whose repacked copy would pass
 * PF_REPACK_BYTES, or a failed allocation: the caller runs the torch path. */
int prefill_attention(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                      uint16_t *out, const int64_t *slots, const uint8_t *mask, int64_t n,
                      int64_t ctx, int64_t heads, int64_t kv_heads, int64_t dim, float scale,
                      int threads) {
    if (dim % 32 || dim > PF_MAX_DIM || heads % kv_heads || n < 1 || ctx < n) return -1;
    const int64_t tiles = (ctx + 15) / 16, pairs = dim / 2, group = heads / kv_heads;
    const int64_t words = kv_heads * tiles * 16 * pairs; /* each of kt and vp */
    if (words * 8 > PF_REPACK_BYTES) return -1;
    uint32_t *kt = malloc(sizeof(uint32_t) * (size_t)words);
    uint32_t *vp = malloc(sizeof(uint32_t) * (size_t)words);
    if (kt == NULL || vp == NULL) {
        free(kt);
        free(vp);
        return -1;
    }
    const Prefill job = {q, out, kt, vp, mask, n, ctx, tiles, heads, kv_heads, dim, scale};
    const int64_t blocks = (n + PF_QUERIES - 1) / PF_QUERIES, tasks = blocks * kv_heads;
    const int64_t most_rows = PF_QUERIES * group;
    int failed = 0;
    if (threads < 1) threads = 1;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
#pragma omp for schedule(static)
        for (int64_t ht = 0; ht < kv_heads * tiles; ht++) {
            const int64_t h = ht / tiles, t = ht % tiles;
            uint32_t *kdst = kt + ht * pairs * 16, *vdst = vp + ht * 8 * dim;
            for (int64_t e = 0; e < 16; e++) {
                const int64_t key = t * 16 + e;
                const uint32_t *krow = key < ctx
                    ? (const uint32_t *)(k_cache + (slots[key] * kv_heads + h) * dim) : NULL;
                for (int64_t p = 0; p < pairs; p++) kdst[p * 16 + e] = krow ? krow[p] : 0;
            }
            for (int64_t jp = 0; jp < 8; jp++) {
                const int64_t key = t * 16 + 2 * jp;
                const uint16_t *a = key < ctx ? v_cache + (slots[key] * kv_heads + h) * dim : NULL;
                const uint16_t *b = key + 1 < ctx ? v_cache + (slots[key + 1] * kv_heads + h) * dim
                                                  : NULL;
                for (int64_t d = 0; d < dim; d++)
                    vdst[jp * dim + d] = (a ? a[d] : 0) | (uint32_t)(b ? b[d] : 0) << 16;
            }
        }
        uint32_t *xt = malloc(sizeof(uint32_t) * (size_t)(pairs * most_rows));
        float *s = malloc(sizeof(float) * (size_t)(most_rows * PF_KEYS));
        uint32_t *pw = malloc(sizeof(uint32_t) * (size_t)(most_rows * PF_KEYS / 2));
        float *o = malloc(sizeof(float) * (size_t)(most_rows * dim));
        float *top = malloc(sizeof(float) * (size_t)most_rows);
        float *total = malloc(sizeof(float) * (size_t)most_rows);
        failed = !xt || !s || !pw || !o || !top || !total;
        /* Heaviest first (causal: the last positions see the most keys), handed out as threads
         * free up. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            if (failed) continue;
            const int64_t block = blocks - 1 - task / kv_heads, h = task % kv_heads;
            const int64_t i0 = block * PF_QUERIES, qn = n - i0 < PF_QUERIES ? n - i0 : PF_QUERIES;
            switch (dim / 16) {
            case 4: pf_task(&job, h, i0, qn, 4, xt, s, pw, o, top, total); break;
            case 8: pf_task(&job, h, i0, qn, 8, xt, s, pw, o, top, total); break;
            default: pf_task(&job, h, i0, qn, (int)(dim / 16), xt, s, pw, o, top, total); break;
            }
        }
        free(xt);
        free(s);
        free(pw);
        free(o);
        free(top);
        free(total);
    }
    free(kt);
    free(vp);
    return failed ? -1 : 0;
}
#else
int prefill_attention(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                      uint16_t *out, const int64_t *slots, const uint8_t *mask, int64_t n,
                      int64_t ctx, int64_t heads, int64_t kv_heads, int64_t dim, float scale,
                      int threads) {
    return -1;
}
#endif
