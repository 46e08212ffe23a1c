/* The C/C++ half of _fast/sampling.pyx. */
#ifndef PYLLAMA_SAMPLING_H
#define PYLLAMA_SAMPLING_H

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <cfloat>
#include <new>

// Python's build flags add -fwrapv, which makes this kernel about 2x slower (GCC must assume
// that int index arithmetic wraps); nothing here relies on signed overflow wrapping.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("no-wrapv")
#endif

namespace pyllama_sampling {

// Local helpers instead of std:: ones: those are defined before the optimize pragma above
// and GCC will not inline them into functions compiled with other options.
template <typename T> static inline T imin(T a, T b) { return a < b ? a : b; }

// Buckets by distance to the max logit. 1024 keeps a boundary bucket small for realistic
// logit ranges (a few hundredths of a logit wide).
static const int NB = 1024;
// Logits further than this below the max share the last bucket. Only speed depends on it
// (a walk that reaches the last bucket sorts it): at temperature 1 such a token weighs under
// e^-24 of the max, and the per-bucket passes skip the last bucket cheaply.
static const float MAX_RANGE = 24.0f;

struct Scratch {
    void* block;      // the one allocation that holds every array below
    float* buf;       // penalized, sanitized logits of the row             [n_vocab]
    float* e;         // exp(l - max) at temperature 1, by id               [n_vocab]
    float* fe;        // exp((l - max) / T) of kept candidates, by id       [n_vocab]
    uint16_t* bkt;    // histogram bucket of each token                     [n_vocab]
    uint64_t* keys;   // gathered sort keys                                 [n_vocab]
    uint64_t* tmp;    // radix sort ping-pong buffer                        [n_vocab]
    int* counts;      // penalty counts, all zero between rows              [n_vocab]
    int* touched;     // distinct penalized tokens of the row               [L]
    int hcount[NB];   // tokens per bucket
    double hmass[NB]; // temperature-1 mass per bucket (never the last bucket)
    double tmass[NB]; // tempered mass of each bucket kept whole
    int counted_to;   // hcount is valid for buckets [0, counted_to)
    int massed_to;    // hmass is valid for buckets [0, massed_to)
    int tmassed_to;   // tmass is valid for buckets [0, min(tmassed_to, bfull))
    int bfull;        // buckets [0, bfull) are kept whole (have fe[] weights)
    // The sorted list of one bucket range, cached because the chain often asks for the
    // same boundary bucket twice.
    uint64_t* list;
    int n_list, list_lo, list_hi;
    // The general chain's candidate arrays (sample_row_ext), allocated on first use: rows of
    // the default chain never need them.
    int nv;
    void* xblock;
    int* cid;         // candidate ids                                     [n_vocab]
    float* cl;        // candidate logits                                  [n_vocab]
    float* cp;        // candidate probabilities                           [n_vocab]
    int* tid;         // reordering buffers                                [n_vocab]
    float* tl;        //                                                   [n_vocab]
    int* dry;         // DRY repeat counts                                 [dry_cap]
    int dry_cap;
};

// exp(x) for x <= 0, Cephes-style (about 1 ulp), written with plain arithmetic so that the
// loops calling it vectorize (libm expf does not without -ffast-math). Exactly 0 below -87
// (also for -inf and NaN) and exactly 1 at 0.
static inline float fexp(float x) {
    const bool under = !(x >= -87.0f);
    float xc = under ? -87.0f : x;
    float z = xc * 1.44269504088896341f;
    float n = __builtin_floorf(z + 0.5f);
    float r = xc - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500E-4f;
    p = p * r + 1.3981999507E-3f;
    p = p * r + 8.3334519073E-3f;
    p = p * r + 4.1665795894E-2f;
    p = p * r + 1.6666665459E-1f;
    p = p * r + 5.0000001201E-1f;
    float y = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    __builtin_memcpy(&scale, &bits, sizeof(scale));
    y *= scale;
    return under ? 0.0f : y;
}

// Sort key: ascending order of the key is descending logit, ties by ascending id.
static inline uint64_t make_key(float v, int id) {
    uint32_t u;
    __builtin_memcpy(&u, &v, sizeof(u));
    if (u == 0x80000000u) u = 0;                      // -0 and +0 are the same logit
    uint32_t ord = (u & 0x80000000u) ? ~u : (u | 0x80000000u);  // ascending with v
    return ((uint64_t)(~ord) << 32) | (uint32_t)id;
}
static inline int key_id(uint64_t k) { return (int)(uint32_t)k; }

// Stable LSD radix sort on the upper 32 bits. The keys are gathered in ascending id order and
// the low 32 bits are the id, so stability alone orders ties by id. Returns the sorted array
// (either a or b).
static uint64_t* radix_sort_hi32(uint64_t* a, uint64_t* b, int n) {
    int hist[4][256];
    __builtin_memset(hist, 0, sizeof(hist));
    for (int i = 0; i < n; i++) {
        uint32_t h = (uint32_t)(a[i] >> 32);
        hist[0][h & 255]++;
        hist[1][(h >> 8) & 255]++;
        hist[2][(h >> 16) & 255]++;
        hist[3][h >> 24]++;
    }
    uint64_t* src = a;
    uint64_t* dst = b;
    for (int pass = 0; pass < 4; pass++) {
        int* hp = hist[pass];
        const int shift = 32 + 8 * pass;
        // A digit shared by every key does not reorder anything: skip the pass.
        if (hp[(uint32_t)(src[0] >> shift) & 255] == n) continue;
        int sum = 0;
        for (int d = 0; d < 256; d++) { int c = hp[d]; hp[d] = sum; sum += c; }
        for (int i = 0; i < n; i++) {
            uint64_t k = src[i];
            dst[hp[(k >> shift) & 255]++] = k;
        }
        { uint64_t* t = src; src = dst; dst = t; }
    }
    return src;
}

static const int BLK = 32;

// The tokens of buckets [lo, hi], sorted (descending logit, ties by id) into s.list. Hits
// are found a block at a time with a vectorized test, so listing a small bucket costs a
// fraction of a pass over the vocabulary.
static void list_buckets(Scratch& s, int n_vocab, int lo, int hi) {
    if (s.list && s.list_lo == lo && s.list_hi == hi) return;
    const float* buf = s.buf;
    const uint16_t* bkt = s.bkt;
    uint64_t* keys = s.keys;
    const unsigned width = (unsigned)(hi - lo);
    int g = 0;
    int i0 = 0;
    for (; i0 + BLK <= n_vocab; i0 += BLK) {
        // a bit mask of the block's hits (vectorized compare), then its set bits
        uint32_t mask = 0;
        for (int l = 0; l < BLK; l++)
            mask |= (uint32_t)((unsigned)(bkt[i0 + l] - lo) <= width) << l;
        while (mask) {
            int i = i0 + __builtin_ctz(mask);
            mask &= mask - 1;
            keys[g++] = make_key(buf[i], i);
        }
    }
    for (int i = i0; i < n_vocab; i++)
        if ((unsigned)(bkt[i] - lo) <= width) keys[g++] = make_key(buf[i], i);
    if (g <= 256) {
        std::sort(keys, keys + g);
        s.list = keys;
    } else {
        s.list = radix_sort_hi32(keys, s.tmp, g);
    }
    s.n_list = g;
    s.list_lo = lo;
    s.list_hi = hi;
}

static inline void list_bucket(Scratch& s, int n_vocab, int b) {
    list_buckets(s, n_vocab, b, b);
}

// Sum of exp(buf[i] - M) over [0, n), in float blocks (vectorized) added up in double.
static double exp_sum(const float* buf, int n, float M) {
    double Z = 0.0;
    for (int i0 = 0; i0 < n; i0 += 512) {
        int i1 = imin(n, i0 + 512);
        float z = 0.0f;
        for (int i = i0; i < i1; i++) z += fexp(buf[i] - M);
        Z += z;
    }
    return Z;
}

static inline float bucket_scale(float M, float lo) {
    float range = M - lo;
    return range > 0.0f ? (float)(NB - 1) / range * 0.999999f : 0.0f;
}

// The bucket of a logit: floor((M - v) * scale), clamped to the last bucket. Monotone
// (non-increasing) in v, so buckets in increasing order hold logits in decreasing order.
static inline int bucket_of(float v, float M, float scale) {
    float d = (M - v) * scale;
    const float top = (float)(NB - 1);
    d = d < top ? d : top;              // also maps NaN (inf * 0) and -inf to the last bucket
    d = d > 0.0f ? d : 0.0f;
    return (int)d;
}

// Buckets every token by its distance to the max, fills e[] = exp(l - max) and returns the
// total mass. Vectorized; per-bucket counts and masses come later, and only as far as needed.
static double histogram(Scratch& s, int n_vocab, float M, float scale) {
    const float* buf = s.buf;
    float* e = s.e;
    uint16_t* bkt = s.bkt;
    double Z = 0.0;
    for (int i0 = 0; i0 < n_vocab; i0 += 512) {
        int i1 = imin(n_vocab, i0 + 512);
        float z = 0.0f;
        for (int i = i0; i < i1; i++) {
            float v = buf[i];
            float ev = fexp(v - M);
            e[i] = ev;
            z += ev;
            bkt[i] = (uint16_t)bucket_of(v, M, scale);
        }
        Z += z;
    }
    s.counted_to = 0;
    s.massed_to = 0;
    s.tmassed_to = 0;
    return Z;
}

// Per-bucket sums are a scalar scatter (about a nanosecond per token), so they are built in
// two stages, each only when first needed: the top NB_FIRST buckets (the top quarter of the
// range: usually all that top_k, top_p, the draw and n_probs look at on a peaked row), with
// blocks that hold none of them skipped by a vectorized test, then the rest.
static const int NB_FIRST = 256;

// For every token i in buckets [lo, hi): cnt[bucket]++ (COUNT) and mass[bucket] += w[i] (MASS).
template <bool COUNT, bool MASS, bool SKIP>
static void scatter(const uint16_t* bkt, int n_vocab, int lo, int hi, int* cnt,
                    const float* w, double* mass) {
    if (hi <= lo) return;
    const unsigned width = (unsigned)(hi - lo);
    if (COUNT) __builtin_memset(cnt + lo, 0, sizeof(int) * (hi - lo));
    if (MASS) __builtin_memset(mass + lo, 0, sizeof(double) * (hi - lo));
    for (int i0 = 0; i0 < n_vocab; i0 += BLK) {
        int i1 = imin(n_vocab, i0 + BLK);
        if (SKIP) {
            int any = 0;
            for (int i = i0; i < i1; i++) any |= ((unsigned)(bkt[i] - lo) < width);
            if (!any) continue;
        }
        for (int i = i0; i < i1; i++) {
            int bi = bkt[i];
            if ((unsigned)(bi - lo) < width) {
                if (COUNT) cnt[bi]++;
                if (MASS) mass[bi] += w[i];
            }
        }
    }
}

// hcount valid for buckets [0, b] (and then some). The last bucket's count is what remains.
static void ensure_counts(Scratch& s, int n_vocab, int b) {
    if (b < s.counted_to) return;
    if (s.counted_to == 0 && b < NB_FIRST) {
        scatter<true, false, true>(s.bkt, n_vocab, 0, NB_FIRST, s.hcount, nullptr, nullptr);
        s.counted_to = NB_FIRST;
        return;
    }
    scatter<true, false, false>(s.bkt, n_vocab, s.counted_to, NB - 1, s.hcount, nullptr,
                                nullptr);
    long c = 0;
    for (int k = 0; k < NB - 1; k++) c += s.hcount[k];
    s.hcount[NB - 1] = (int)(n_vocab - c);
    s.counted_to = NB;
}

// hmass (temperature-1 mass) valid for buckets [0, b], b < NB - 1: the last bucket is never
// weighed this way (a walk that reaches it lists it).
static void ensure_hmass(Scratch& s, int n_vocab, int b) {
    if (b < s.massed_to) return;
    const bool first = s.massed_to == 0 && b < NB_FIRST;
    const int hi = first ? NB_FIRST : NB - 1;
    if (first) scatter<false, true, true>(s.bkt, n_vocab, 0, hi, nullptr, s.e, s.hmass);
    else scatter<false, true, false>(s.bkt, n_vocab, s.massed_to, hi, nullptr, s.e, s.hmass);
    s.massed_to = hi;
}

// tmass (tempered mass) valid for buckets [0, b], b < s.bfull (the buckets kept whole, whose
// tokens all have their fe[] weight).
static void ensure_tmass(Scratch& s, int n_vocab, int b) {
    if (b < s.tmassed_to) return;
    const bool first = s.tmassed_to == 0 && b < NB_FIRST;
    const int hi = imin(first ? NB_FIRST : NB, s.bfull);
    if (first) scatter<false, true, true>(s.bkt, n_vocab, 0, hi, nullptr, s.fe, s.tmass);
    else scatter<false, true, false>(s.bkt, n_vocab, s.tmassed_to, hi, nullptr, s.fe, s.tmass);
    s.tmassed_to = first ? NB_FIRST : NB;
}

// Sum of e[i] over the tokens of buckets [0, b) (vectorized masked sum).
static double mass_below(const Scratch& s, int n_vocab, int b) {
    const uint16_t* __restrict bkt = s.bkt;
    const float* __restrict e = s.e;
    double Z = 0.0;
    for (int i0 = 0; i0 < n_vocab; i0 += 512) {
        int i1 = imin(n_vocab, i0 + 512);
        float z = 0.0f;
        for (int i = i0; i < i1; i++) {
            float ev = e[i];                // loaded unconditionally: the loop vectorizes
            z += bkt[i] < b ? ev : 0.0f;
        }
        Z += z;
    }
    return Z;
}

// The first bucket at which the cumulative count reaches n (counting as needed), and the
// number of tokens in the buckets before it.
static int count_bucket(Scratch& s, int n_vocab, long n, long* before) {
    long c = 0;
    for (int b = 0; b < NB; b++) {
        ensure_counts(s, n_vocab, b);
        if (c + s.hcount[b] >= n) { *before = c; return b; }
        c += s.hcount[b];
    }
    *before = c - s.hcount[NB - 1];
    return NB - 1;
}

// The top n entries of the final distribution (ids, weight * inv), padded with -1 / 0 up to
// n_probs. Needs the buckets that hold the first n tokens, listed together.
static void fill_top(Scratch& s, int n_vocab, int n, int n_probs, const float* w, double inv,
                     int* top_ids, float* top_probs) {
    int j = 0;
    if (n > 0) {
        long before;
        int bn = count_bucket(s, n_vocab, n, &before);
        list_buckets(s, n_vocab, 0, bn);
        for (; j < n; j++) {
            int id = key_id(s.list[j]);
            top_ids[j] = id;
            top_probs[j] = (float)((double)w[id] * inv);
        }
    }
    for (; j < n_probs; j++) { top_ids[j] = -1; top_probs[j] = 0.0f; }
}

// Top-k for a small k without any per-bucket pass: a threshold from a strided sample of the
// row, a vectorized gather of everything at or above it, then nth_element + sort of that
// handful. Writes the sorted keys of the k best tokens of buf to s.keys[0..k) and returns k
// (fewer when the row has fewer than k tokens that are not NaN).
static int select_top(Scratch& s, const float* buf, int n_vocab, int k) {
    uint64_t* keys = s.keys;
    if (k > n_vocab) k = n_vocab;
    float tau = -INFINITY;
    const int m = imin(n_vocab, 1024);
    if ((long)k * 16 < n_vocab && m == 1024) {
        // Sample rank r such that about 2k + 4 * stride tokens lie above the threshold, so
        // at least k do with overwhelming probability (else the fallback below gathers all).
        const int stride = n_vocab / m;
        const int r = imin(m - 1, (int)((2.0 * k * m) / n_vocab) + 4);
        if (r < 64) {
            // the r+1 largest samples, kept sorted descending by insertion
            float top[64];
            int cnt = 0;
            for (int j = 0; j < m; j++) {
                float v = buf[j * stride];
                if (cnt > r && !(v > top[r])) continue;
                int pos = cnt > r ? r : cnt++;
                while (pos > 0 && top[pos - 1] < v) { top[pos] = top[pos - 1]; pos--; }
                top[pos] = v;
            }
            tau = top[r];
        } else {
            // (negated so that std::nth_element's default, inlinable comparison applies)
            float* smp = s.fe;
            for (int j = 0; j < m; j++) smp[j] = -buf[j * stride];
            std::nth_element(smp, smp + r, smp + m);
            tau = -smp[r];
        }
    }
    int g = 0;
    for (int pass = 0; pass < 2; pass++) {
        g = 0;
        int i0 = 0;
        for (; i0 + BLK <= n_vocab; i0 += BLK) {
            // a bit mask of the block's hits (vectorized compare), then its set bits
            uint32_t mask = 0;
            for (int l = 0; l < BLK; l++) mask |= (uint32_t)(buf[i0 + l] >= tau) << l;
            while (mask) {
                int i = i0 + __builtin_ctz(mask);
                mask &= mask - 1;
                keys[g++] = make_key(buf[i], i);
            }
        }
        for (int i = i0; i < n_vocab; i++)
            if (buf[i] >= tau) keys[g++] = make_key(buf[i], i);
        if (g >= k) break;
        tau = -INFINITY;                    // unlucky sample: take everything
    }
    if (g < k) k = g;                       // only NaN left out
    // Every token left out is below tau, every gathered one at or above: the k best by
    // (logit desc, id asc) are the k smallest keys gathered.
    if (g > k) std::nth_element(keys, keys + k, keys + g);
    std::sort(keys, keys + k);
    return k;
}

// The chain for top_k <= KSMALL: everything after top_k runs on the sorted k candidates
// (above that, the bucket path below is faster: sorting k candidates dominates).
static const int KSMALL = 512;

static void sample_small_k(Scratch& s, int n_vocab, int top_k, float temp, float top_p,
                           float min_p, float draw, int n_probs, int* out_id,
                           float* out_prob, int* top_ids, float* top_probs) {
    const float* buf = s.buf;
    const int k = select_top(s, buf, n_vocab, top_k);
    const uint64_t* keys = s.keys;
    float* w = s.e;                         // per-position weights
    const float M = buf[key_id(keys[0])];
    int n = k;
    if (top_p < 1.0f) {
        double Zc = 0.0;
        for (int j = 0; j < n; j++) { w[j] = fexp(buf[key_id(keys[j])] - M); Zc += w[j]; }
        const double target = (double)top_p * Zc;
        double c = 0.0;
        for (int j = 0; j < n; j++) {
            c += w[j];
            if (c >= target) { n = j + 1; break; }
        }
    }
    if (min_p > 0.0f) {
        const float thr = M + __builtin_logf(min_p);
        int j = 1;
        while (j < n && buf[key_id(keys[j])] >= thr) j++;
        n = j;
    }
    // (capped: a denormal temperature would make 0 * inf = NaN of the max's weight)
    const float inv_t = imin(1.0f / temp, FLT_MAX);
    double S = 0.0;
    for (int j = 0; j < n; j++) { w[j] = fexp((buf[key_id(keys[j])] - M) * inv_t); S += w[j]; }
    if (!(draw >= 0.0f)) draw = 0.0f;
    const double target = (double)draw * S;
    double c = 0.0;
    int pick = -1, last_pos = 0;
    for (int j = 0; j < n; j++) {
        if (w[j] > 0.0f) last_pos = j;
        c += w[j];
        if (c > target) { pick = j; break; }
    }
    if (pick < 0) pick = last_pos;
    *out_id = key_id(keys[pick]);
    *out_prob = (float)((double)w[pick] / S);
    int j = 0;
    for (; j < n_probs && j < n; j++) {
        top_ids[j] = key_id(keys[j]);
        top_probs[j] = (float)((double)w[j] / S);
    }
    for (; j < n_probs; j++) { top_ids[j] = -1; top_probs[j] = 0.0f; }
}

// The max of a row with the lowest id reaching it, and its lowest finite value (the bucket
// range), in 16 independent lanes so that the loop vectorizes. With COPY it also writes the
// sanitized row to dst: NaN never wins (-inf), +inf becomes the largest finite float so that
// differences to the max stay defined.
template <bool COPY>
static void scan_max(const float* src, float* dst, int n_vocab, float* pM, int* pbest,
                     float* plo) {
    float mx[16], mn[16];
    int ax[16];
    for (int l = 0; l < 16; l++) { mx[l] = -INFINITY; mn[l] = INFINITY; ax[l] = l; }
    int i0 = 0;
    for (; i0 + 16 <= n_vocab; i0 += 16) {
        for (int l = 0; l < 16; l++) {
            float v = src[i0 + l];
            if (COPY) {
                v = (v == v) ? v : -INFINITY;
                v = v < FLT_MAX ? v : FLT_MAX;
                dst[i0 + l] = v;
            }
            bool gt = v > mx[l];
            mx[l] = gt ? v : mx[l];
            ax[l] = gt ? i0 + l : ax[l];
            float w = v > -INFINITY ? v : INFINITY;
            mn[l] = w < mn[l] ? w : mn[l];
        }
    }
    float M = -INFINITY, lo = INFINITY;
    int best = 0;
    for (int l = 0; l < 16; l++) {
        if (mx[l] > M || (mx[l] == M && ax[l] < best)) { M = mx[l]; best = ax[l]; }
        lo = mn[l] < lo ? mn[l] : lo;
    }
    for (; i0 < n_vocab; i0++) {
        float v = src[i0];
        if (COPY) {
            v = (v == v) ? v : -INFINITY;
            v = v < FLT_MAX ? v : FLT_MAX;
            dst[i0] = v;
        }
        if (v > M) { M = v; best = i0; }
        float w = v > -INFINITY ? v : INFINITY;
        lo = w < lo ? w : lo;
    }
    *pM = M;
    *pbest = best;
    *plo = lo;
}

// Greedy: the argmax is known; out_prob and the top n_probs come from the softmax of the
// whole row. A caller that reads out_prob only with n_probs (flags & 1) is spared the
// normalizer, an exp per token and two thirds of a greedy row's cost: out_prob is then NaN.
static void greedy_finish(Scratch& s, const float* row, int n_vocab, float M, int best,
                          int n_probs, int flags, int* out_id, float* out_prob, int* top_ids,
                          float* top_probs) {
    *out_id = best;
    if (n_probs <= 0 && (flags & 1)) {
        *out_prob = NAN;
        return;
    }
    const double Z = exp_sum(row, n_vocab, M);
    *out_prob = (float)(1.0 / Z);
    if (n_probs <= 0) return;
    const int n = select_top(s, row, n_vocab, n_probs);
    int j = 0;
    for (; j < n; j++) {
        int id = key_id(s.keys[j]);
        top_ids[j] = id;
        top_probs[j] = (float)((double)fexp(row[id] - M) / Z);
    }
    for (; j < n_probs; j++) { top_ids[j] = -1; top_probs[j] = 0.0f; }
}

// ---- The general chain: any order, and the samplers the bucketed path above lacks ----------
//
// llama.cpp's definitions, sampler by sampler, on an explicit candidate list (id, logit, p)
// with a `sorted` flag (descending logit, ties by lower id). Rows take this path only when
// they use typical-p, XTC, DRY, top-n-sigma, dynamic temperature, mirostat, min_keep or a
// chain order other than the default; the others keep the faster path above.

// Chain codes (pyllama/batching/sampling.py SAMPLER_CODES).
enum { C_PENALTIES = 0, C_DRY = 1, C_TOP_N_SIGMA = 2, C_TOP_K = 3, C_TYPICAL = 4, C_TOP_P = 5,
       C_MIN_P = 6, C_XTC = 7, C_TEMPERATURE = 8 };
// Extended float parameters (xparams columns) and int parameters (xiparams columns).
enum { XF_TYPICAL = 0, XF_NSIGMA = 1, XF_XTC_P = 2, XF_XTC_T = 3, XF_XTC_DRAW = 4, XF_DRY_MULT = 5,
       XF_DRY_BASE = 6, XF_TAU = 7, XF_ETA = 8, XF_MU = 9, XF_DYN_RANGE = 10, XF_DYN_EXP = 11 };
enum { XI_EXT = 0, XI_MIN_KEEP = 1, XI_MIROSTAT = 2, XI_DRY_ALLOWED = 3, XI_CHAIN_LEN = 4, XI_CHAIN = 5 };
static const int MAX_CHAIN = 16;

struct Cands {
    int* id;
    float* logit;
    float* p;
    int size;
    bool sorted;
    bool identity;   // id[i] == i for every i < size == n_vocab (nothing removed or moved)
};

static bool ensure_ext(Scratch& s) {
    if (s.xblock) return true;
    size_t nv = (size_t)s.nv;
    size_t sz = (nv * 4 + 63) & ~(size_t)63;
    char* p = (char*)std::malloc(5 * sz + 64);
    if (!p) return false;
    s.xblock = p;
    p = (char*)(((uintptr_t)p + 63) & ~(uintptr_t)63);
    s.cid = (int*)p; p += sz;
    s.cl = (float*)p; p += sz;
    s.cp = (float*)p; p += sz;
    s.tid = (int*)p; p += sz;
    s.tl = (float*)p;
    return true;
}

static inline float key_logit(uint64_t k) {
    uint32_t ord = ~(uint32_t)(k >> 32);
    uint32_t u = (ord & 0x80000000u) ? (ord & 0x7fffffffu) : ~ord;
    float v;
    __builtin_memcpy(&v, &u, sizeof(v));
    return v;
}

// Sorts keys[0, n) by the whole 64-bit key (logit descending, then id ascending): a radix
// sort on the logit half, then the rare runs of equal logits by id.
static uint64_t* sort_keys(Scratch& s, int n) {
    uint64_t* k = s.keys;
    if (n <= 256) { std::sort(k, k + n); return k; }
    k = radix_sort_hi32(k, s.tmp, n);
    for (int i = 0; i < n;) {
        int j = i + 1;
        uint32_t h = (uint32_t)(k[i] >> 32);
        while (j < n && (uint32_t)(k[j] >> 32) == h) j++;
        if (j - i > 1) std::sort(k + i, k + j);
        i = j;
    }
    return k;
}

static void cands_from_keys(Cands& c, const uint64_t* k, int n) {
    for (int j = 0; j < n; j++) { c.id[j] = key_id(k[j]); c.logit[j] = key_logit(k[j]); }
    c.size = n;
    c.sorted = true;
    c.identity = false;
}

static void sort_cands(Scratch& s, Cands& c) {
    if (c.sorted) return;
    for (int i = 0; i < c.size; i++) s.keys[i] = make_key(c.logit[i], c.id[i]);
    cands_from_keys(c, sort_keys(s, c.size), c.size);
}

// llama.cpp's softmax: p = exp(l - max) / sum over the current candidates.
static void softmax(Cands& c) {
    float mx = c.logit[0];
    if (!c.sorted) for (int i = 1; i < c.size; i++) mx = c.logit[i] > mx ? c.logit[i] : mx;
    double sum = 0.0;
    for (int i = 0; i < c.size; i++) { float p = std::exp(c.logit[i] - mx); c.p[i] = p; sum += p; }
    for (int i = 0; i < c.size; i++) c.p[i] = (float)(c.p[i] / sum);
}

static void keep_prefix(Cands& c, int n) {
    if (n < c.size) { c.size = n; c.identity = false; }
}

static void op_penalties(Scratch& s, Cands& c, const int* pen, int n_pen, float rp, float freq,
                         float pres) {
    if (n_pen <= 0 || (rp == 1.0f && freq == 0.0f && pres == 0.0f)) return;
    const int nv = s.nv;
    for (int j = 0; j < n_pen; j++) { int t = pen[j]; if (t >= 0 && t < nv) s.counts[t]++; }
    for (int i = 0; i < c.size; i++) {
        int cnt = s.counts[c.id[i]];
        if (!cnt) continue;
        float v = c.logit[i];
        v = v <= 0.0f ? v * rp : v / rp;
        v -= (float)cnt * freq + pres;
        v = (v == v) ? v : -INFINITY;
        c.logit[i] = v < FLT_MAX ? v : FLT_MAX;
    }
    for (int j = 0; j < n_pen; j++) { int t = pen[j]; if (t >= 0 && t < nv) s.counts[t] = 0; }
    c.sorted = false;
}

// The breaker table (pyllama/batching/sampling.py dry_breaker_table): [n, (head, offset) x n, tails]
// with heads ascending; a tail at `offset` is [length, tokens...].
static void breaker_range(const int* brk, int token, int* lo, int* hi) {
    if (!brk) { *lo = *hi = 0; return; }
    int n = brk[0];
    int a = 0, b = n;
    while (a < b) { int m = (a + b) / 2; if (brk[1 + 2 * m] < token) a = m + 1; else b = m; }
    int e = a;
    while (e < n && brk[1 + 2 * e] == token) e++;
    *lo = a;
    *hi = e;
}

static void op_dry(Scratch& s, Cands& c, const int* hist, int n_hist, float mult, float base,
                   int allowed, const int* brk) {
    if (mult == 0.0f || base < 1.0f || n_hist <= 0) return;
    const int N = n_hist;
    if (N <= allowed) return;
    auto rat = [&](int i) -> int { return hist[N - 1 - i]; };
    // 1. The most recent sequence breaker limits how far back a repeat may reach.
    int rep_limit = N;
    for (int i = 0; i < N; i++) {
        int lo, hi;
        breaker_range(brk, rat(i), &lo, &hi);
        if (lo == hi) continue;
        int longest = -1;
        for (int e = lo; e < hi; e++) {
            const int* tail = brk + brk[2 + 2 * e];
            int len = tail[0];
            if (len > longest && len <= i) {
                bool match = true;
                for (int o = 0; o < len; o++)
                    if (tail[1 + o] != rat(i - o - 1)) { match = false; break; }
                if (match) longest = len;
            }
        }
        if (longest >= 0) { rep_limit = i - longest; break; }
    }
    if (rep_limit < allowed) return;
    // 2. Z-algorithm over the reversed history: cnt[N - 1 - k] = length of the longest
    // suffix of the history that also ends k tokens earlier (capped at rep_limit).
    if (s.dry_cap < N) {
        int* d = (int*)std::realloc(s.dry, sizeof(int) * (size_t)N);
        if (!d) return;     // out of memory: no DRY penalty this step
        s.dry = d;
        s.dry_cap = N;
    }
    int* cnt = s.dry;
    for (int i = 0; i < N; i++) cnt[i] = 0;
    {
        const int last = N - 1;
        int rt = 0, lt = 0;
        for (int k = 1; k < N; k++) {
            if (k > rt) {
                int n = 0;
                while (n + k < N && rat(n) == rat(n + k)) n++;
                cnt[last - k] = imin(n, rep_limit);
                if (n > 0) { lt = k; rt = k + n - 1; }
            } else {
                int p = k - lt;
                int right = rt - k + 1;
                if (cnt[last - p] < right) {
                    cnt[last - k] = imin(cnt[last - p], rep_limit);
                } else {
                    int i = rt + 1;
                    while (i < N && rat(i) == rat(i - k)) i++;
                    cnt[last - k] = imin(i - k, rep_limit);
                    lt = k;
                    rt = i - 1;
                }
            }
        }
    }
    // 3. The token after each repeat would extend it: the longest such repeat per token
    // (stored + 1 in counts[], which is zero outside this function).
    const int nv = s.nv;
    bool any = false;
    for (int i = 0; i < N - 1; i++) {
        int len = cnt[i];
        if (len >= allowed) {
            int t = rat(N - 2 - i);
            if (t < 0 || t >= nv) continue;
            if (s.counts[t] < len + 1) s.counts[t] = len + 1;
            any = true;
        }
    }
    if (any) {
        // 4. Penalize, except single-token sequence breakers.
        int max_exp = 0;
        if (base > 1.000001f) max_exp = (int)(88.7228391f / std::log(base));
        for (int i = 0; i < c.size; i++) {
            int m = s.counts[c.id[i]];
            if (!m) continue;
            int lo, hi;
            breaker_range(brk, c.id[i], &lo, &hi);
            bool single = false;
            for (int e = lo; e < hi; e++) if (brk[brk[2 + 2 * e]] == 0) { single = true; break; }
            if (single) continue;
            int rexp = m - 1 - allowed;
            if (max_exp > 0 && rexp > max_exp) rexp = max_exp;
            float pen = mult * (float)std::pow((double)base, (double)rexp);
            c.logit[i] -= pen;
        }
        for (int i = 0; i < N; i++) { int t = hist[i]; if (t >= 0 && t < nv) s.counts[t] = 0; }
    }
    c.sorted = false;
}

static void op_top_n_sigma(Scratch& s, Cands& c, float n) {
    if (n <= 0.0f || c.size <= 1) return;
    float mx = c.logit[0], sum = 0.0f;
    int valid = 0;
    for (int i = 0; i < c.size; i++) {
        float v = c.logit[i];
        if (v != -INFINITY) { if (v > mx) mx = v; sum += v; valid++; }
    }
    float mean = valid > 0 ? sum / valid : 0.0f;
    float acc = 0.0f;
    for (int i = 0; i < c.size; i++)
        if (c.logit[i] != -INFINITY) acc += (float)std::pow((double)(c.logit[i] - mean), 2.0);
    float sd = valid > 0 ? std::sqrt(acc / valid) : 0.0f;
    for (int i = 0; i < c.size; i++)
        if (c.logit[i] < mx - n * sd) c.logit[i] = -INFINITY;
    sort_cands(s, c);
    softmax(c);
}

static void op_top_k(Scratch& s, Cands& c, int k) {
    if (k <= 0) return;
    if (k > c.size) k = c.size;
    if (c.sorted) { keep_prefix(c, k); return; }
    if (c.identity && k <= KSMALL) {
        int got = select_top(s, c.logit, c.size, k);   // (no NaN here: got == k)
        cands_from_keys(c, s.keys, got);
        return;
    }
    for (int i = 0; i < c.size; i++) s.keys[i] = make_key(c.logit[i], c.id[i]);
    if (k < c.size) std::nth_element(s.keys, s.keys + k, s.keys + c.size);
    std::sort(s.keys, s.keys + k);
    cands_from_keys(c, s.keys, k);
}

static void op_typical(Scratch& s, Cands& c, float p, int min_keep) {
    if (p >= 1.0f) return;
    sort_cands(s, c);
    softmax(c);
    // (a zero probability adds nothing to the entropy; llama.cpp's 0 * log 0 would be NaN)
    float ent = 0.0f;
    for (int i = 0; i < c.size; i++) if (c.p[i] > 0.0f) ent += -c.p[i] * std::log(c.p[i]);
    // order by |-log p - entropy|, ties by position (keys: score bits, then position)
    uint64_t* k = s.keys;
    for (int i = 0; i < c.size; i++) {
        float sc = std::fabs(-std::log(c.p[i]) - ent);
        if (!(sc == sc)) sc = INFINITY;
        uint32_t u;
        __builtin_memcpy(&u, &sc, sizeof(u));
        k[i] = ((uint64_t)u << 32) | (uint32_t)i;
    }
    std::sort(k, k + c.size);
    float cum = 0.0f;
    int last = c.size;
    for (int i = 0; i < c.size; i++) {
        cum += c.p[(uint32_t)k[i]];
        if (cum > p && (min_keep == 0 || i >= min_keep - 1)) { last = i + 1; break; }
    }
    for (int i = 0; i < last; i++) {
        int j = (int)(uint32_t)k[i];
        s.tid[i] = c.id[j];
        s.tl[i] = c.logit[j];
    }
    // (the probabilities are not carried: every later step that reads them recomputes them)
    for (int i = 0; i < last; i++) { c.id[i] = s.tid[i]; c.logit[i] = s.tl[i]; }
    c.size = last;
    c.sorted = false;
    c.identity = false;
}

static void op_top_p(Scratch& s, Cands& c, float p, int min_keep) {
    if (p >= 1.0f) return;
    sort_cands(s, c);
    softmax(c);
    float cum = 0.0f;
    int last = c.size;
    for (int i = 0; i < c.size; i++) {
        cum += c.p[i];
        if (cum >= p && i + 1 >= min_keep) { last = i + 1; break; }
    }
    keep_prefix(c, last);
}

static void op_min_p(Scratch& s, Cands& c, float p, int min_keep) {
    if (p <= 0.0f || c.size == 0) return;
    if (!c.sorted) {
        float mx = -FLT_MAX;
        for (int i = 0; i < c.size; i++) mx = c.logit[i] > mx ? c.logit[i] : mx;
        const float thr = mx + std::log(p);
        int n = 0;
        for (int i = 0; i < c.size; i++)
            if (c.logit[i] >= thr) { s.tid[n] = c.id[i]; s.tl[n] = c.logit[i]; n++; }
        if (n > 0 && n >= min_keep) {
            if (n < c.size) {
                for (int i = 0; i < n; i++) { c.id[i] = s.tid[i]; c.logit[i] = s.tl[i]; }
                c.size = n;
                c.identity = false;
            }
            return;
        }
    }
    sort_cands(s, c);
    const float thr = c.logit[0] + std::log(p);
    int i = 1;
    for (; i < c.size; i++) if (c.logit[i] < thr && i >= min_keep) break;
    keep_prefix(c, i);
}

static void op_xtc(Scratch& s, Cands& c, float prob, float thr, float chance, int min_keep) {
    if (prob <= 0.0f || thr > 0.5f || c.size < 2) return;
    if (chance > prob) return;
    sort_cands(s, c);
    softmax(c);
    int pos_last = 0;
    for (int i = 0; i < c.size; i++) { if (c.p[i] >= thr) pos_last = i; else break; }
    if (c.size - pos_last >= min_keep && pos_last > 0) {
        std::memmove(c.id, c.id + pos_last, sizeof(int) * (size_t)(c.size - pos_last));
        std::memmove(c.logit, c.logit + pos_last, sizeof(float) * (size_t)(c.size - pos_last));
        std::memmove(c.p, c.p + pos_last, sizeof(float) * (size_t)(c.size - pos_last));
        c.size -= pos_last;
        c.identity = false;
    }
}

// Temperature; <= 0 keeps only the first maximum (every other logit becomes -inf).
static void temp_impl(Cands& c, float t) {
    if (t <= 0.0f) {
        int mi = 0;
        float ml = c.logit[0];
        for (int i = 1; i < c.size; i++) {
            if (c.logit[i] > ml) { c.logit[mi] = -INFINITY; mi = i; ml = c.logit[i]; }
            else c.logit[i] = -INFINITY;
        }
        return;
    }
    for (int i = 0; i < c.size; i++) c.logit[i] /= t;
}

// llama.cpp's temp-ext: with a range, the temperature follows the normalized entropy.
static void op_temperature(Scratch& s, Cands& c, float t, float delta, float exponent) {
    if (delta > 0.0f) {
        const float tmin = t - delta > 0.0f ? t - delta : 0.0f, tmax = t + delta;
        if (c.size <= 1) return;
        const float max_ent = -std::log(1.0f / c.size);
        sort_cands(s, c);
        softmax(c);
        float ent = 0.0f;
        for (int i = 0; i < c.size; i++) if (c.p[i] > 0.0f) ent -= c.p[i] * std::log(c.p[i]);
        const float norm = ent / max_ent;
        const float dyn = tmin + (tmax - tmin) * std::pow(norm, exponent);
        temp_impl(c, dyn);
        return;
    }
    temp_impl(c, t);
}

// Sorts, normalizes and picks: the first candidate whose cumulative probability exceeds the
// draw (a walk that rounding leaves short picks the last candidate with weight).
static int dist_pick(Scratch& s, Cands& c, float draw) {
    sort_cands(s, c);
    softmax(c);
    if (!(draw >= 0.0f)) draw = 0.0f;
    double cum = 0.0;
    int last = 0;
    for (int i = 0; i < c.size; i++) {
        if (c.p[i] > 0.0f) last = i;
        cum += c.p[i];
        if (cum > draw) return i;
    }
    return last;
}

static int mirostat_v1(Scratch& s, Cands& c, int n_vocab, float tau, float eta, float* mu,
                       float draw) {
    const int m = 100;
    sort_cands(s, c);
    softmax(c);
    float sum_tb = 0.0f, sum_tt = 0.0f;
    for (int i = 0; i < m - 1 && i < c.size - 1; i++) {
        float ti = std::log((float)(i + 2) / (float)(i + 1));
        float bi = std::log(c.p[i] / c.p[i + 1]);
        sum_tb += ti * bi;
        sum_tt += ti * ti;
    }
    const float s_hat = sum_tb / sum_tt;
    const float eps = s_hat - 1;
    float k = std::pow((eps * std::pow(2.0f, *mu)) / (1 - std::pow((float)n_vocab, -eps)), 1 / s_hat);
    int ki = !(k >= 1.0f) ? 1 : (k >= (float)c.size ? c.size : (int)k);
    keep_prefix(c, ki);
    int idx = dist_pick(s, c, draw);
    float e = -std::log2(c.p[idx]) - tau;
    *mu = *mu - eta * e;
    return idx;
}

static int mirostat_v2(Scratch& s, Cands& c, float tau, float eta, float* mu, float draw) {
    sort_cands(s, c);
    softmax(c);
    int n = 0;
    while (n < c.size && !(-std::log2(c.p[n]) > *mu)) n++;
    keep_prefix(c, n > 0 ? n : 1);
    int idx = dist_pick(s, c, draw);
    float e = -std::log2(c.p[idx]) - tau;
    *mu = *mu - eta * e;
    return idx;
}

static void sample_row_ext(const float* logits, int n_vocab, const float* fp, const int* ip,
                           const int* pen, float* xf, const int* xi, const int* hist,
                           int n_hist, const int* brk, Scratch& s, int* out_id,
                           float* out_prob, int* top_ids, float* top_probs, int n_top_cols) {
    const float temp = fp[0], top_p = fp[1], min_p = fp[2];
    const float rp = fp[3], freq = fp[4], pres = fp[5], draw = fp[6];
    const int top_k = ip[0], n_probs = ip[1], n_pen = ip[2];
    const int min_keep = xi[XI_MIN_KEEP], mirostat = xi[XI_MIROSTAT];
    for (int j = 0; j < n_top_cols; j++) { top_ids[j] = -1; top_probs[j] = 0.0f; }
    Cands c;
    c.id = s.cid; c.logit = s.cl; c.p = s.cp;
    c.size = n_vocab; c.sorted = false; c.identity = true;
    for (int i = 0; i < n_vocab; i++) {
        float v = logits[i];
        v = (v == v) ? v : -INFINITY;
        c.logit[i] = v < FLT_MAX ? v : FLT_MAX;
        c.id[i] = i;
    }
    s.list = nullptr;
    int pick;
    if (mirostat == 1 || mirostat == 2) {
        // llama.cpp's common sampler: with mirostat the chain is temperature then mirostat.
        temp_impl(c, temp);
        pick = mirostat == 1
            ? mirostat_v1(s, c, n_vocab, xf[XF_TAU], xf[XF_ETA], &xf[XF_MU], draw)
            : mirostat_v2(s, c, xf[XF_TAU], xf[XF_ETA], &xf[XF_MU], draw);
    } else {
        const int n_chain = imin(xi[XI_CHAIN_LEN], MAX_CHAIN);
        for (int q = 0; q < n_chain; q++) {
            switch (xi[XI_CHAIN + q]) {
                case C_PENALTIES: op_penalties(s, c, pen, n_pen, rp, freq, pres); break;
                case C_DRY: op_dry(s, c, hist, n_hist, xf[XF_DRY_MULT], xf[XF_DRY_BASE],
                                   xi[XI_DRY_ALLOWED], brk); break;
                case C_TOP_N_SIGMA: op_top_n_sigma(s, c, xf[XF_NSIGMA]); break;
                case C_TOP_K: op_top_k(s, c, top_k); break;
                case C_TYPICAL: op_typical(s, c, xf[XF_TYPICAL], min_keep); break;
                case C_TOP_P: op_top_p(s, c, top_p, min_keep); break;
                case C_MIN_P: op_min_p(s, c, min_p, min_keep); break;
                case C_XTC: op_xtc(s, c, xf[XF_XTC_P], xf[XF_XTC_T], xf[XF_XTC_DRAW], min_keep); break;
                case C_TEMPERATURE: op_temperature(s, c, temp, xf[XF_DYN_RANGE], xf[XF_DYN_EXP]); break;
                default: break;
            }
        }
        pick = dist_pick(s, c, draw);
    }
    *out_id = c.id[pick];
    *out_prob = c.p[pick];
    const int n = imin(n_probs, c.size);
    for (int j = 0; j < n; j++) { top_ids[j] = c.id[j]; top_probs[j] = c.p[j]; }
}

// Samples one row. fp: temperature, top_p, min_p, repeat_penalty, frequency_penalty,
// presence_penalty, draw. ip: top_k, n_probs, n_penalty_tokens. top_ids/top_probs have room
// for n_top_cols entries; the first n_probs are the row's, the rest padded with -1 / 0.
// xi (NULL: none) marks a row of the general chain (sample_row_ext), with xf its extended
// parameters (the mirostat mu is updated in place), hist its DRY history (oldest first) and
// brk its DRY breaker table.
//
// The kept candidates are always a prefix of the sorted vocabulary, held as "every token of
// buckets [0, bK) plus the first mK tokens (in sorted order) of bucket bK". Each step of the
// chain moves that boundary using whole-bucket counts and masses, and sorts only the bucket
// the boundary falls in; the draw likewise sorts only the bucket where the cumulative mass
// crosses it.
static void sample_row(const float* logits, int n_vocab, const float* fp, const int* ip,
                       const int* pen, float* xf, const int* xi, const int* hist, int n_hist,
                       const int* brk, Scratch& s, int* out_id, float* out_prob,
                       int* top_ids, float* top_probs, int n_top_cols) {
    if (xi && xi[XI_EXT]) {
        if (!ensure_ext(s)) { *out_id = -1; return; }   // (reported as a MemoryError)
        sample_row_ext(logits, n_vocab, fp, ip, pen, xf, xi, hist, n_hist, brk, s, out_id,
                       out_prob, top_ids, top_probs, n_top_cols);
        return;
    }
    const float temp = fp[0], top_p = fp[1], min_p = fp[2];
    const float rp = fp[3], freq = fp[4], pres = fp[5];
    float draw = fp[6];
    const int top_k = ip[0], n_probs = ip[1], n_pen = ip[2];
    float* buf = s.buf;
    s.list = nullptr;

    for (int j = n_probs; j < n_top_cols; j++) { top_ids[j] = -1; top_probs[j] = 0.0f; }

    const bool pen_on = n_pen > 0 && (rp != 1.0f || freq != 0.0f || pres != 0.0f);
    float M, lo;
    int best;

    // Greedy without penalties reads the logits in place: a finite max is all the copy
    // below would have fixed (NaN never wins the max and weighs 0 in exp_sum).
    if (!(temp > 0.0f) && !pen_on) {
        scan_max<false>(logits, nullptr, n_vocab, &M, &best, &lo);
        if (M > -INFINITY && M < INFINITY) {
            greedy_finish(s, logits, n_vocab, M, best, n_probs, ip[3], out_id, out_prob, top_ids,
                          top_probs);
            return;
        }
    }

    // Copy, sanitize and find the max in one pass (see scan_max).
    scan_max<true>(logits, buf, n_vocab, &M, &best, &lo);

    // 1. Penalties over the distinct tokens of the window. counts[] is zero on entry and
    // reset only at the touched entries, so a row costs O(window), not O(n_vocab).
    if (pen_on) {
        int nt = 0;
        for (int j = 0; j < n_pen; j++) {
            int t = pen[j];
            if (t < 0 || t >= n_vocab) continue;    // padding / foreign ids: ignored
            if (s.counts[t]++ == 0) s.touched[nt++] = t;
        }
        bool rescan = false;
        for (int j = 0; j < nt; j++) {
            int t = s.touched[j];
            int c = s.counts[t];
            s.counts[t] = 0;
            float v = buf[t];
            if (rp != 1.0f) v = v > 0.0f ? v / rp : v * rp;
            v -= (float)c * freq + pres;
            v = (v == v) ? v : -INFINITY;
            v = v < FLT_MAX ? v : FLT_MAX;
            buf[t] = v;
            // The max moves only if it was penalized or something reached it.
            rescan |= t == best || v >= M;
            if (v > -INFINITY && v < lo) lo = v;
        }
        if (rescan) {
            float lo2;
            scan_max<false>(buf, buf, n_vocab, &M, &best, &lo2);
            lo = lo2 < lo ? lo2 : lo;
        }
    }
    if (M == -INFINITY) {
        // Every logit is -inf (or NaN): nothing is preferred, so sample uniformly.
        for (int i = 0; i < n_vocab; i++) buf[i] = 0.0f;
        M = 0.0f;
        lo = 0.0f;
        best = 0;
    }
    if (lo < M - MAX_RANGE) lo = M - MAX_RANGE;
    const float scale = bucket_scale(M, lo);

    // 2. Greedy: argmax (lowest id on ties); probabilities from the full softmax.
    if (!(temp > 0.0f)) {
        greedy_finish(s, buf, n_vocab, M, best, n_probs, ip[3], out_id, out_prob, top_ids,
                      top_probs);
        return;
    }

    // 3. Sampling chain on the kept prefix: every token of buckets [0, bK), plus the first
    // mK tokens (in sorted order) of bucket bK, or all of it when mK < 0. It starts as the
    // whole vocabulary.
    const bool k_on = top_k > 0 && top_k < n_vocab;
    if (k_on && top_k <= KSMALL) {
        sample_small_k(s, n_vocab, top_k, temp, top_p, min_p, draw, n_probs, out_id, out_prob,
                       top_ids, top_probs);
        return;
    }
    const bool p_on = top_p < 1.0f;
    const bool m_on = min_p > 0.0f;
    const float* e = s.e;
    const double Zfull = histogram(s, n_vocab, M, scale);
    int bK = NB - 1, mK = -1;

    // top_k: the bucket where the cumulative count reaches k
    if (k_on) {
        long c;
        bK = count_bucket(s, n_vocab, top_k, &c);
        mK = (int)(top_k - c);
    }

    // top_p: shortest prefix whose temperature-1 mass over the current candidates >= p
    if (p_on) {
        // Mass of the kept part of bucket b: whole buckets from the per-bucket sums, the
        // boundary bucket and the (never weighed) last bucket from their sorted lists.
        auto kept_mass = [&](int b) -> double {
            if (b != NB - 1 && (b < bK || mK < 0)) {
                ensure_hmass(s, n_vocab, b);
                return s.hmass[b];
            }
            list_bucket(s, n_vocab, b);
            int lim = (b == bK && mK >= 0) ? imin(mK, s.n_list) : s.n_list;
            double m = 0.0;
            for (int j = 0; j < lim; j++) m += e[key_id(s.list[j])];
            return m;
        };
        const double Zc = k_on ? mass_below(s, n_vocab, bK) + kept_mass(bK) : Zfull;
        const double target = (double)top_p * Zc;
        double c = 0.0;
        for (int b = 0; b <= bK; b++) {
            double mb = kept_mass(b);
            if (c + mb < target) { c += mb; continue; }
            list_bucket(s, n_vocab, b);
            int lim = (b == bK && mK >= 0) ? imin(mK, s.n_list) : s.n_list;
            int j = 0;
            for (; j < lim; j++) {
                c += e[key_id(s.list[j])];
                if (c >= target) break;
            }
            if (j < lim) { bK = b; mK = j + 1; break; }
            // rounding left the walk short inside b: go on with the next bucket
        }
    }

    // min_p: keep l >= max + log(min_p), i.e. prob >= min_p * max prob (at least one)
    if (m_on) {
        const float thr = M + __builtin_logf(min_p);
        if (!(thr <= M)) {                  // min_p > 1: only the top token
            bK = 0; mK = 1;
        } else {
            int bm = bucket_of(thr, M, scale);
            if (bm <= bK) {
                // Tokens of bm at or above thr come first in its sorted order: count them.
                int cnt = 0, tot = 0;
                const uint16_t* bkt = s.bkt;
                for (int i = 0; i < n_vocab; i++) {
                    int in = bkt[i] == bm;
                    tot += in;
                    cnt += in & (buf[i] >= thr);
                }
                if (bm == bK && mK >= 0) mK = imin(mK, cnt);
                else mK = cnt == tot ? -1 : cnt;
                bK = bm;    // buckets before bm hold the max, so the prefix is never empty
            }
        }
    }

    // temperature: tempered weights fe[] of the kept tokens and their total S
    // (capped: a denormal temperature would make 0 * inf = NaN of the max's weight)
    const float inv_t = imin(1.0f / temp, FLT_MAX);
    float* fe = s.fe;
    double S = 0.0, tpartial = 0.0;
    s.bfull = mK < 0 ? bK + 1 : bK;         // buckets [0, bfull) are kept whole
    {
        const uint16_t* bkt = s.bkt;
        const int bfull = s.bfull;
        for (int i0 = 0; i0 < n_vocab; i0 += BLK) {
            int i1 = imin(n_vocab, i0 + BLK);
            int any = 0;
            for (int i = i0; i < i1; i++) any |= bkt[i] < bfull;
            if (!any) continue;
            float z = 0.0f;
            for (int i = i0; i < i1; i++) {
                float w = fexp((buf[i] - M) * inv_t);
                fe[i] = w;
                z += bkt[i] < bfull ? w : 0.0f;
            }
            S += z;
        }
        // The boundary bucket's kept part: its first mK tokens in sorted order.
        if (mK > 0) {
            list_bucket(s, n_vocab, bK);
            mK = imin(mK, s.n_list);
            for (int j = 0; j < mK; j++) {
                int id = key_id(s.list[j]);
                fe[id] = fexp((buf[id] - M) * inv_t);
                tpartial += fe[id];
            }
            S += tpartial;
        }
    }

    // draw: the first candidate whose cumulative mass exceeds draw * S; only the bucket
    // where that happens is sorted. A zero-weight candidate can never be that first one; a
    // walk that rounding leaves short picks the last candidate with weight.
    if (!(draw >= 0.0f)) draw = 0.0f;
    const double target = (double)draw * S;
    int pick = -1, last_b = 0;
    {
        double c = 0.0;
        for (int b = 0; b <= bK && pick < 0; b++) {
            double mb;
            if (b < s.bfull) {
                ensure_tmass(s, n_vocab, b);
                mb = s.tmass[b];
            } else {
                mb = tpartial;
            }
            if (mb > 0.0) last_b = b;
            if (c + mb <= target) { c += mb; continue; }
            list_bucket(s, n_vocab, b);
            int lim = (b == bK && mK >= 0) ? mK : s.n_list;
            for (int j = 0; j < lim; j++) {
                c += fe[key_id(s.list[j])];
                if (c > target) { pick = key_id(s.list[j]); break; }
            }
        }
        if (pick < 0) {
            list_bucket(s, n_vocab, last_b);
            int lim = (last_b == bK && mK >= 0) ? mK : s.n_list;
            pick = key_id(s.list[0]);
            for (int j = 0; j < lim; j++)
                if (fe[key_id(s.list[j])] > 0.0f) pick = key_id(s.list[j]);
        }
    }
    *out_id = pick;
    *out_prob = (float)((double)fe[pick] / S);
    if (n_probs > 0) {
        long n_kept = n_vocab;
        if (!(bK == NB - 1 && mK < 0)) {
            ensure_counts(s, n_vocab, bK);
            n_kept = mK < 0 ? s.hcount[bK] : mK;
            for (int b = 0; b < bK; b++) n_kept += s.hcount[b];
        }
        fill_top(s, n_vocab, (int)imin<long>(n_probs, n_kept), n_probs, fe, 1.0 / S,
                 top_ids, top_probs);
    }
}

static void free_scratch(Scratch* s) {
    if (!s) return;
    std::free(s->block);
    std::free(s->xblock);
    std::free(s->dry);
    delete s;
}

static inline size_t align64(size_t n) { return (n + 63) & ~(size_t)63; }

// One thread's scratch (about 30 bytes per vocabulary entry); NULL when out of memory.
// One block rather than one allocation per array: after the first call glibc's dynamic
// mmap threshold serves a block this size from the heap and keeps it mapped, where separate
// large arrays would be mmapped, page-faulted and unmapped again on every call.
static Scratch* new_scratch(int n_vocab, int L) {
    Scratch* s = new (std::nothrow) Scratch;
    if (!s) return nullptr;
    size_t nv = (size_t)n_vocab;
    size_t sz_f = align64(nv * sizeof(float));
    size_t sz_b = align64(nv * sizeof(uint16_t));
    size_t sz_k = align64(nv * sizeof(uint64_t));
    size_t sz_c = align64(nv * sizeof(int));
    size_t sz_t = align64((size_t)(L > 0 ? L : 1) * sizeof(int));
    char* p = (char*)std::malloc(3 * sz_f + sz_b + 2 * sz_k + sz_c + sz_t + 64);
    if (!p) { delete s; return nullptr; }
    s->block = p;
    p = (char*)(((uintptr_t)p + 63) & ~(uintptr_t)63);
    s->keys = (uint64_t*)p; p += sz_k;
    s->tmp = (uint64_t*)p; p += sz_k;
    s->buf = (float*)p; p += sz_f;
    s->e = (float*)p; p += sz_f;
    s->fe = (float*)p; p += sz_f;
    s->counts = (int*)p; p += sz_c;
    s->bkt = (uint16_t*)p; p += sz_b;
    s->touched = (int*)p;
    // counts[] starts zeroed and sample_row leaves it zeroed.
    __builtin_memset(s->counts, 0, nv * sizeof(int));
    s->list = nullptr;
    s->nv = n_vocab;
    s->xblock = nullptr;
    s->dry = nullptr;
    s->dry_cap = 0;
    return s;
}

}  // namespace pyllama_sampling

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

#endif /* PYLLAMA_SAMPLING_H */
