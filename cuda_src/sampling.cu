// SAMPLE: the sampler chain of every output row on the device that holds the logits (backend
// sampling). Same packed inputs and outputs as the CPU kernel (graph/ops.py Op.SAMPLE,
// _fast/sampling.pyx), same chain and the same rules:
//
//   sanitize (NaN -> -inf, +inf -> FLT_MAX) -> penalties over the distinct tokens of the window ->
//   greedy (temperature <= 0: argmax, lowest id on ties; probabilities from the full softmax)
//   or top_k -> top_p -> min_p -> temperature -> draw.
//
// Candidates are ordered by logit descending, ties by ascending id. The CPU sorts small candidate
// sets; here one block per row finds every boundary of the chain (the k-th candidate, the first
// candidate whose running mass reaches top_p, the draw) by a radix select over a 32-bit sort key:
// four passes of 8-bit digit histograms (counts and masses) over the candidates that still match
// the chosen digits, then a walk in id order among candidates of equal logit. Positions therefore
// follow exactly the CPU's order; running masses are summed in double in another order than the
// CPU's, so a draw that falls within rounding of a boundary may pick the neighbouring candidate.
//
// Scratch per row (the backend allocates it): the sanitized logits (n_vocab floats), penalty
// counts (n_vocab ints, zeroed before the launch and left zeroed) and up to N gathered keys.
#include "common.cuh"

#include <float.h>
#include <limits.h>

#define ST 512            // threads per row
#define NW (ST / 32)

typedef unsigned long long u64;

// Sort key: ascending key = descending logit; -0 and +0 are the same logit.
__device__ __forceinline__ unsigned int key_of(float v) {
    unsigned int u = __float_as_uint(v);
    if (u == 0x80000000u) u = 0;
    const unsigned int ord = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ~ord;
}

// Kept candidates are a prefix of the order: (key, id) <= (bk, bi).
__device__ __forceinline__ bool kept(unsigned int k, int i, unsigned int bk, int bi) {
    return k < bk || (k == bk && i <= bi);
}

struct Shared {
    unsigned int cnt[256];
    double mass[256];
    double red_d[NW];
    long long red_l[NW];
    u64 red_u[NW];
    // results of the single-thread steps, broadcast through shared memory
    int chosen;
    int found;
    double before;
    long long cbefore;
    int sel_id;
    long long sel_pos;
    unsigned int gcount;
};

__device__ __forceinline__ double block_sum_d(double v, Shared& s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) s.red_d[warp] = v;
    __syncthreads();
    double t = 0.0;
    for (int w = 0; w < NW; w++) t += s.red_d[w];
    return t;
}

__device__ __forceinline__ long long block_sum_l(long long v, Shared& s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if (lane == 0) s.red_l[warp] = v;
    __syncthreads();
    long long t = 0;
    for (int w = 0; w < NW; w++) t += s.red_l[w];
    return t;
}

__device__ __forceinline__ u64 block_max_u(u64 v, Shared& s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const u64 x = __shfl_xor_sync(0xffffffffu, v, o);
        v = x > v ? x : v;
    }
    __syncthreads();
    if (lane == 0) s.red_u[warp] = v;
    __syncthreads();
    u64 t = 0;
    for (int w = 0; w < NW; w++) t = s.red_u[w] > t ? s.red_u[w] : t;
    return t;
}

__device__ __forceinline__ u64 block_min_u(u64 v, Shared& s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const u64 x = __shfl_xor_sync(0xffffffffu, v, o);
        v = x < v ? x : v;
    }
    __syncthreads();
    if (lane == 0) s.red_u[warp] = v;
    __syncthreads();
    u64 t = ~0ull;
    for (int w = 0; w < NW; w++) t = s.red_u[w] < t ? s.red_u[w] : t;
    return t;
}

// Inclusive prefix sums over the block in thread order (double and count together); *total gets
// the block's sums.
__device__ __forceinline__ void block_scan(double v, long long c, double* incl, long long* cincl, double* total,
                                           long long* ctotal, Shared& s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const double x = __shfl_up_sync(0xffffffffu, v, o);
        const long long y = __shfl_up_sync(0xffffffffu, c, o);
        if (lane >= o) {
            v += x;
            c += y;
        }
    }
    __syncthreads();
    if (lane == 31) {
        s.red_d[warp] = v;
        s.red_l[warp] = c;
    }
    __syncthreads();
    double off = 0.0, tot = 0.0;
    long long coff = 0, ctot = 0;
    for (int w = 0; w < NW; w++) {
        if (w < warp) {
            off += s.red_d[w];
            coff += s.red_l[w];
        }
        tot += s.red_d[w];
        ctot += s.red_l[w];
    }
    *incl = v + off;
    *cincl = c + coff;
    *total = tot;
    *ctotal = ctot;
}

// Weight of a candidate: 0 -> 1 (counting), 1 -> exp(l - M) (temperature 1), 2 -> exp((l - M) / T).
__device__ __forceinline__ double weight(float v, int mode, float M, float inv_t) {
    if (mode == 0) return 1.0;
    if (mode == 1) return (double)expf(v - M);
    return (double)expf((v - M) * inv_t);
}

// Excluded from every count: NaN logits of the raw row (only the greedy path that reads the raw
// row in place, as the CPU does, passes `nan_src`).
__device__ __forceinline__ bool eligible(const float* nan_src, int i) {
    return nan_src == nullptr || !isnan(nan_src[i]);
}

struct Sel {
    bool found;
    unsigned int key;
    int id;
    long long pos;  // 1-based position in the order
};

// The first kept candidate (in order) at which the running sum of weights from the start of the
// order satisfies sum > target (strict) or sum >= target. Rounding may leave a digit pass short
// of the target its parent reached: the walk then takes the last candidate of the parent that
// could have crossed (weight > 0 when strict). found = false only when the whole kept set does
// not reach the target.
__device__ Sel select_cross(const float* buf, const float* nan_src, int V, unsigned int bk, int bi, int mode,
                            float M, float inv_t, double target, bool strict, Shared& s) {
    const int tid = threadIdx.x;
    unsigned int prefix = 0, pmask = 0;
    double before = 0.0;
    long long cbefore = 0;
    unsigned int tie_n = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int d = tid; d < 256; d += ST) {
            s.cnt[d] = 0;
            s.mass[d] = 0.0;
        }
        __syncthreads();
        for (int i = tid; i < V; i += ST) {
            const float v = buf[i];
            const unsigned int k = key_of(v);
            if (!kept(k, i, bk, bi) || (k & pmask) != prefix || !eligible(nan_src, i)) continue;
            const unsigned int d = (k >> shift) & 255u;
            atomicAdd(&s.cnt[d], 1u);
            const double w = weight(v, mode, M, inv_t);
            if (w != 0.0) atomicAdd(&s.mass[d], w);
        }
        __syncthreads();
        if (tid == 0) {
            // walk the bins in order; remember the last bin that could have crossed (weight > 0
            // when strict) and the last non-empty one, with the sums before each
            int chosen = -1, fb = -1, ne = -1;
            double c = before, c_fb = before, c_ne = before;
            long long cc = cbefore, cc_fb = cbefore, cc_ne = cbefore;
            for (int d = 0; d < 256; d++) {
                if (s.cnt[d] == 0) continue;
                const double nc = c + s.mass[d];
                if (strict ? nc > target : nc >= target) {
                    chosen = d;
                    break;
                }
                if (!strict || s.mass[d] > 0.0) {
                    fb = d;
                    c_fb = c;
                    cc_fb = cc;
                }
                ne = d;
                c_ne = c;
                cc_ne = cc;
                c = nc;
                cc += s.cnt[d];
            }
            s.found = 1;
            if (chosen < 0 && shift == 24) {
                s.found = 0;  // the whole kept set does not reach the target
            } else if (chosen < 0 && fb >= 0) {
                chosen = fb;  // a parent reached it, rounding left its bins short
                c = c_fb;
                cc = cc_fb;
            } else if (chosen < 0) {
                chosen = ne;
                c = c_ne;
                cc = cc_ne;
                if (ne < 0) s.found = 0;  // nothing matches (cannot happen below a chosen parent)
            }
            s.chosen = chosen;
            s.before = c;
            s.cbefore = cc;
        }
        __syncthreads();
        if (!s.found) {
            Sel r = {false, 0u, 0, 0};
            __syncthreads();
            return r;
        }
        const int chosen = s.chosen;
        before = s.before;
        cbefore = s.cbefore;
        tie_n = s.cnt[chosen];
        prefix |= (unsigned int)chosen << shift;
        pmask |= 255u << shift;
        __syncthreads();
    }
    // Candidates with the full key: in id order.
    const unsigned int K = prefix;
    Sel r;
    r.found = true;
    r.key = K;
    if (tie_n == 1) {
        for (int i = tid; i < V; i += ST)
            if (key_of(buf[i]) == K && kept(K, i, bk, bi) && eligible(nan_src, i)) s.sel_id = i;
        __syncthreads();
        r.id = s.sel_id;
        r.pos = cbefore + 1;
        __syncthreads();
        return r;
    }
    u64 fb = 0;  // (position << 32 | id) + 1 of the last candidate that could cross, 0 = none
    for (int base = 0; base < V; base += ST) {
        const int i = base + tid;
        bool in = false;
        double w = 0.0;
        if (i < V) {
            const float v = buf[i];
            in = key_of(v) == K && kept(K, i, bk, bi) && eligible(nan_src, i);
            if (in) w = weight(v, mode, M, inv_t);
        }
        double incl, tot;
        long long cincl, ctot;
        block_scan(w, in ? 1 : 0, &incl, &cincl, &tot, &ctot, s);
        const double c = before + incl;
        const bool hit = in && (strict ? c > target : c >= target);
        const u64 first = block_min_u(hit ? (u64)tid : ~0ull, s);
        if (first != ~0ull) {
            if ((u64)tid == first) {
                s.sel_id = i;
                s.sel_pos = cbefore + cincl;
            }
            __syncthreads();
            r.id = s.sel_id;
            r.pos = s.sel_pos;
            __syncthreads();
            return r;
        }
        const bool cand = in && (!strict || w > 0.0);
        const u64 last = block_max_u(cand ? (((u64)(cbefore + cincl) << 32) | (u64)i) + 1 : 0ull, s);
        if (last) fb = last;
        before += tot;
        cbefore += ctot;
    }
    if (fb == 0) {  // cannot happen when the parent bins reached the target; keep the group's end
        r.found = false;
        return r;
    }
    fb -= 1;
    r.id = (int)(fb & 0xffffffffull);
    r.pos = (long long)(fb >> 32);
    return r;
}

// The first n candidates of the kept set (n <= N) in order, with prob = weight * inv, into the
// packed output; slots n..n_probs-1 are padded with -1 / 0.
__device__ void write_top(const float* buf, const float* nan_src, int V, unsigned int bk, int bi, int n, int n_probs,
                          int mode, float M, float inv_t, double inv, int* top_ids, int* top_probs, u64* gath,
                          Shared& s) {
    const int tid = threadIdx.x;
    if (n > 0) {
        const Sel b = select_cross(buf, nan_src, V, bk, bi, 0, M, inv_t, (double)n, false, s);
        if (tid == 0) s.gcount = 0;
        __syncthreads();
        for (int i = tid; i < V; i += ST) {
            const unsigned int k = key_of(buf[i]);
            if (kept(k, i, b.key, b.id) && kept(k, i, bk, bi) && eligible(nan_src, i)) {
                const unsigned int slot = atomicAdd(&s.gcount, 1u);
                if (slot < (unsigned int)n) gath[slot] = ((u64)k << 32) | (u64)(unsigned int)i;
            }
        }
        __syncthreads();
        // keys are unique (the id is in the low bits): the rank of each is its output slot
        for (int e = tid; e < n; e += ST) {
            const u64 ke = gath[e];
            int rank = 0;
            for (int j = 0; j < n; j++) rank += gath[j] < ke;
            const int id = (int)(ke & 0xffffffffull);
            top_ids[rank] = id;
            top_probs[rank] = __float_as_int((float)(weight(buf[id], mode, M, inv_t) * inv));
        }
    }
    for (int j = n + tid; j < n_probs; j += ST) {
        top_ids[j] = -1;
        top_probs[j] = 0;
    }
    __syncthreads();
}

// logits [rows, V]; inp [rows, 12 + L] (8 float bit patterns: temperature, top_p, min_p,
// repeat_penalty, frequency_penalty, presence_penalty, draw, unused; then top_k, n_probs,
// n_penalty_tokens, unused; then L penalty tokens); out [rows, 2 + 2N]: id, prob bits, N ids, N
// prob bits. Scratch: sbuf [rows, V] floats, scounts [rows, V] ints (zero), sgath [rows, max(N, 1)].
extern "C" __global__ void __launch_bounds__(ST)
sample_rows(const float* logits, const int* inp, int* out, float* sbuf, int* scounts, u64* sgath, int V, int L,
            int N, unsigned int* err) {
    __shared__ Shared s;
    __shared__ int s_flag;
    const int tid = threadIdx.x;
    const long long r = blockIdx.x;
    const float* lg = logits + r * V;
    const int* row = inp + r * (12 + L);
    int* o = out + r * (2 + 2 * (long long)N);
    float* buf = sbuf + r * V;
    int* counts = scounts + r * V;
    u64* gath = sgath + r * (N > 0 ? N : 1);
    int* top_ids = o + 2;
    int* top_probs = o + 2 + N;

    const float temp = __int_as_float(row[0]), top_p = __int_as_float(row[1]), min_p = __int_as_float(row[2]);
    const float rp = __int_as_float(row[3]), freq = __int_as_float(row[4]), pres = __int_as_float(row[5]);
    float draw = __int_as_float(row[6]);
    const int top_k = row[8], n_probs = row[9], n_pen = row[10];
    const int* pen = row + 12;

    if (n_probs < 0 || n_probs > N || n_pen < 0 || n_pen > L) {  // the CPU raises
        if (tid == 0) {
            pyl_flag(err, PYL_ERR_SAMPLE_PARAMS);
            o[0] = -1;
            o[1] = 0;
        }
        for (int j = tid; j < N; j += ST) {
            top_ids[j] = -1;
            top_probs[j] = 0;
        }
        return;
    }
    for (int j = n_probs + tid; j < N; j += ST) {
        top_ids[j] = -1;
        top_probs[j] = 0;
    }
    const bool pen_on = n_pen > 0 && (rp != 1.0f || freq != 0.0f || pres != 0.0f);
    const bool greedy = !(temp > 0.0f);

    // 1. sanitized copy; note a +inf (the CPU's in-place greedy path then falls back to the copy)
    if (tid == 0) s_flag = 0;
    __syncthreads();
    int pinf = 0;
    for (int i = tid; i < V; i += ST) {
        float v = lg[i];
        pinf |= v == INFINITY;
        v = (v == v) ? v : -INFINITY;
        v = v < FLT_MAX ? v : FLT_MAX;
        buf[i] = v;
    }
    if (pinf) s_flag = 1;
    __syncthreads();
    const bool has_pinf = s_flag != 0;

    // 2. penalties over the distinct tokens of the window: counts first, then the one thread that
    // takes a token's count back to zero applies its penalty
    if (pen_on) {
        for (int j = tid; j < n_pen; j += ST) {
            const int t = pen[j];
            if (t >= 0 && t < V) atomicAdd(&counts[t], 1);
        }
        __syncthreads();
        for (int j = tid; j < n_pen; j += ST) {
            const int t = pen[j];
            if (t < 0 || t >= V) continue;
            const int c = atomicExch(&counts[t], 0);
            if (c <= 0) continue;
            float v = buf[t];
            if (rp != 1.0f) v = v > 0.0f ? v / rp : v * rp;
            v -= (float)c * freq + pres;
            v = (v == v) ? v : -INFINITY;
            v = v < FLT_MAX ? v : FLT_MAX;
            buf[t] = v;
        }
        __syncthreads();
    }

    // 3. the max, lowest id on ties: the smallest (key, id)
    u64 mine = ~0ull;
    for (int i = tid; i < V; i += ST) {
        const u64 kv = ((u64)key_of(buf[i]) << 32) | (u64)(unsigned int)i;
        mine = kv < mine ? kv : mine;
    }
    const u64 top = block_min_u(mine, s);
    int best = (int)(top & 0xffffffffull);
    float M = buf[best];
    const bool all_neg_inf = M == -INFINITY;
    if (all_neg_inf) {
        // every logit is -inf (or NaN): nothing is preferred, sample uniformly
        __syncthreads();
        for (int i = tid; i < V; i += ST) buf[i] = 0.0f;
        __syncthreads();
        M = 0.0f;
        best = 0;
    }

    if (greedy) {
        // the CPU reads a row with a finite max and no penalties in place, where NaN never enters
        // the top list; other rows it reads sanitized (NaN as -inf), as here
        const float* nan_src = (!pen_on && !has_pinf && !all_neg_inf) ? lg : nullptr;
        double z = 0.0;
        for (int i = tid; i < V; i += ST) z += (double)expf(buf[i] - M);
        const double Z = block_sum_d(z, s);
        if (tid == 0) {
            o[0] = best;
            o[1] = __float_as_int((float)(1.0 / Z));
        }
        if (n_probs > 0) {
            long long n_ok = V;
            if (nan_src != nullptr) {
                long long c = 0;
                for (int i = tid; i < V; i += ST) c += !isnan(lg[i]);
                n_ok = block_sum_l(c, s);
            }
            const int n = (int)(n_ok < n_probs ? n_ok : n_probs);
            write_top(buf, nan_src, V, 0xffffffffu, INT_MAX, n, n_probs, 1, M, 1.0f, 1.0 / Z, top_ids, top_probs,
                      gath, s);
        }
        return;
    }

    // 4. the chain on the kept prefix (key, id) <= (bk, bi) of n_kept candidates
    unsigned int bk = 0xffffffffu;
    int bi = INT_MAX;
    long long n_kept = V;
    if (top_k > 0 && top_k < V) {
        const Sel b = select_cross(buf, nullptr, V, bk, bi, 0, M, 1.0f, (double)top_k, false, s);
        bk = b.key;
        bi = b.id;
        n_kept = top_k;
    }
    if (top_p < 1.0f) {
        double z = 0.0;
        for (int i = tid; i < V; i += ST) {
            const float v = buf[i];
            if (kept(key_of(v), i, bk, bi)) z += (double)expf(v - M);
        }
        const double Zc = block_sum_d(z, s);
        const Sel b = select_cross(buf, nullptr, V, bk, bi, 1, M, 1.0f, (double)top_p * Zc, false, s);
        if (b.found) {
            bk = b.key;
            bi = b.id;
            n_kept = b.pos;
        }
    }
    if (min_p > 0.0f) {
        const float thr = M + logf(min_p);
        if (!(thr <= M)) {  // min_p > 1: only the top token
            bk = key_of(M);
            bi = best;
            n_kept = 1;
        } else {
            long long c = 0;
            for (int i = tid; i < V; i += ST) {
                const float v = buf[i];
                c += kept(key_of(v), i, bk, bi) && v >= thr;
            }
            c = block_sum_l(c, s);
            if (c < n_kept) {
                n_kept = c > 1 ? c : 1;  // the max always stays
                const Sel b = select_cross(buf, nullptr, V, bk, bi, 0, M, 1.0f, (double)n_kept, false, s);
                bk = b.key;
                bi = b.id;
            }
        }
    }
    // temperature (capped: a denormal temperature would make 0 * inf = NaN of the max's weight)
    const float inv_t = fminf(1.0f / temp, FLT_MAX);
    double sw = 0.0;
    for (int i = tid; i < V; i += ST) {
        const float v = buf[i];
        if (kept(key_of(v), i, bk, bi)) sw += weight(v, 2, M, inv_t);
    }
    const double S = block_sum_d(sw, s);
    if (!(draw >= 0.0f)) draw = 0.0f;
    const Sel d = select_cross(buf, nullptr, V, bk, bi, 2, M, inv_t, (double)draw * S, true, s);
    int pick = d.id;
    if (!d.found) {
        // rounding left the walk short: the last candidate with weight
        u64 last = 0;
        for (int i = tid; i < V; i += ST) {
            const float v = buf[i];
            const unsigned int k = key_of(v);
            if (kept(k, i, bk, bi) && weight(v, 2, M, inv_t) > 0.0) {
                const u64 kv = (((u64)k << 32) | (u64)(unsigned int)i) + 1;
                last = kv > last ? kv : last;
            }
        }
        last = block_max_u(last, s);
        pick = last ? (int)((last - 1) & 0xffffffffull) : best;
    }
    if (tid == 0) {
        o[0] = pick;
        o[1] = __float_as_int((float)(weight(buf[pick], 2, M, inv_t) / S));
    }
    if (n_probs > 0) {
        const int n = (int)(n_kept < n_probs ? n_kept : n_probs);
        write_top(buf, nullptr, V, bk, bi, n, n_probs, 2, M, inv_t, 1.0 / S, top_ids, top_probs, gath, s);
    }
}
