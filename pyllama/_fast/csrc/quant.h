/* The C/C++ half of _fast/quant.pyx. */
#ifndef PYLLAMA_QUANT_H
#define PYLLAMA_QUANT_H

#include <stdint.h>
#include <string.h>

static inline float pyl_bits_to_f32(uint32_t w) { float f; memcpy(&f, &w, 4); return f; }
static inline uint32_t pyl_f32_to_bits(float f) { uint32_t w; memcpy(&w, &f, 4); return w; }

/* IEEE half -> float, exact for every input (ggml's portable ggml_compute_fp16_to_fp32;
   branch-free so loops over it vectorize). */
static inline float pyl_f16_to_f32(uint16_t h) {
    const uint32_t w = (uint32_t) h << 16;
    const uint32_t sign = w & 0x80000000u;
    const uint32_t two_w = w + w;
    const uint32_t exp_offset = 0xE0u << 23;
    const float exp_scale = pyl_bits_to_f32(0x7800000u); /* 2^-112 */
    const float normalized = pyl_bits_to_f32((two_w >> 4) + exp_offset) * exp_scale;
    const uint32_t magic_mask = 126u << 23;
    const float denormalized = pyl_bits_to_f32((two_w >> 17) | magic_mask) - 0.5f;
    const uint32_t cutoff = 1u << 27;
    const uint32_t result = sign |
        (two_w < cutoff ? pyl_f32_to_bits(denormalized) : pyl_f32_to_bits(normalized));
    return pyl_bits_to_f32(result);
}

static inline float pyl_load_f16(const uint8_t *p) {
    uint16_t h; memcpy(&h, p, 2); return pyl_f16_to_f32(h);
}

static inline float pyl_bf16_to_f32(uint16_t h) { return pyl_bits_to_f32((uint32_t) h << 16); }

#endif /* PYLLAMA_QUANT_H */
