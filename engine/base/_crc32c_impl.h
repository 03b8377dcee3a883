/* CRC-32C (Castagnoli, the iSCSI/ext4 polynomial 0x1EDC6F41, reflected 0x82F63B78), with
 * the standard pre- and post-inversion: crc32c("123456789") == 0xE3069283.
 *
 * x86-64 with SSE4.2: the crc32 instruction on three interleaved streams (its latency is
 * three cycles and it issues one per cycle, so one stream runs at a third of what the unit
 * can do), the streams joined by multiplying by x^(8n) modulo the polynomial.  Elsewhere a
 * slicing-by-8 table.  The choice is made once at run time (engine_crc32c_init). */
#ifndef ENGINE_CRC32C_IMPL_H
#define ENGINE_CRC32C_IMPL_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define ENGINE_CRC32C_POLY 0x82F63B78u

static uint32_t engine_crc32c_table[8][256];
static uint32_t engine_crc32c_x2n[32];   /* x^(2^n) mod P */
static int engine_crc32c_hw = 0;
/* three streams of this many bytes each per round of the hardware loop: long enough that
 * joining them (two carry-less multiplications done bit by bit) costs nothing beside the
 * round, short enough that a tensor of a few KiB still uses the three streams */
#define ENGINE_CRC32C_LANE 4096
static uint32_t engine_crc32c_lane_shift;   /* x^(8*LANE) mod P */

/* a(x) * b(x) mod P, reflected (zlib's multmodp) */
static inline uint32_t engine_crc32c_mulmod(uint32_t a, uint32_t b) {
    uint32_t m = 1u << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0)
                break;
        }
        m >>= 1;
        b = b & 1 ? (b >> 1) ^ ENGINE_CRC32C_POLY : b >> 1;
    }
    return p;
}

/* x^(8 * n) mod P */
static inline uint32_t engine_crc32c_x8n(uint64_t n) {
    uint32_t p = 1u << 31; /* x^0 */
    int k = 3;
    while (n) {
        if (n & 1)
            p = engine_crc32c_mulmod(engine_crc32c_x2n[k & 31], p);
        n >>= 1;
        k++;
    }
    return p;
}

/* the CRC of A||B from crc(A), crc(B) and len(B); the inversions cancel */
static inline uint32_t engine_crc32c_combine(uint32_t crc1, uint32_t crc2, uint64_t len2) {
    if (len2 == 0)
        return crc1;
    return engine_crc32c_mulmod(engine_crc32c_x8n(len2), crc1) ^ crc2;
}

/* the register (no inversions) after bytes, table-driven */
static uint32_t engine_crc32c_sw(uint32_t c, const uint8_t* p, size_t n) {
    while (n && ((uintptr_t)p & 7)) {
        c = engine_crc32c_table[0][(c ^ *p++) & 0xff] ^ (c >> 8);
        n--;
    }
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= c;
        c = engine_crc32c_table[7][w & 0xff] ^ engine_crc32c_table[6][(w >> 8) & 0xff] ^
            engine_crc32c_table[5][(w >> 16) & 0xff] ^ engine_crc32c_table[4][(w >> 24) & 0xff] ^
            engine_crc32c_table[3][(w >> 32) & 0xff] ^ engine_crc32c_table[2][(w >> 40) & 0xff] ^
            engine_crc32c_table[1][(w >> 48) & 0xff] ^ engine_crc32c_table[0][w >> 56];
        p += 8;
        n -= 8;
    }
    while (n--)
        c = engine_crc32c_table[0][(c ^ *p++) & 0xff] ^ (c >> 8);
    return c;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define ENGINE_CRC32C_X86 1
__attribute__((target("sse4.2"))) static uint32_t engine_crc32c_hw_update(uint32_t c, const uint8_t* p, size_t n) {
    uint64_t c0 = c;
    while (n && ((uintptr_t)p & 7)) {
        c0 = __builtin_ia32_crc32qi((uint32_t)c0, *p++);
        n--;
    }
    while (n >= 3 * ENGINE_CRC32C_LANE) {
        uint64_t c1 = 0, c2 = 0, w0, w1, w2;
        const uint8_t* p1 = p + ENGINE_CRC32C_LANE;
        const uint8_t* p2 = p + 2 * ENGINE_CRC32C_LANE;
        for (size_t i = 0; i < ENGINE_CRC32C_LANE; i += 8) {
            memcpy(&w0, p + i, 8);
            memcpy(&w1, p1 + i, 8);
            memcpy(&w2, p2 + i, 8);
            c0 = __builtin_ia32_crc32di(c0, w0);
            c1 = __builtin_ia32_crc32di(c1, w1);
            c2 = __builtin_ia32_crc32di(c2, w2);
        }
        /* the registers of the three lanes joined: r0 * x^(16 L) + r1 * x^(8 L) + r2 */
        c0 = engine_crc32c_mulmod(engine_crc32c_lane_shift,
                                  engine_crc32c_mulmod(engine_crc32c_lane_shift, (uint32_t)c0) ^ (uint32_t)c1) ^
             (uint32_t)c2;
        p += 3 * ENGINE_CRC32C_LANE;
        n -= 3 * ENGINE_CRC32C_LANE;
    }
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c0 = __builtin_ia32_crc32di(c0, w);
        p += 8;
        n -= 8;
    }
    while (n--)
        c0 = __builtin_ia32_crc32qi((uint32_t)c0, *p++);
    return (uint32_t)c0;
}
#endif

static void engine_crc32c_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? (c >> 1) ^ ENGINE_CRC32C_POLY : c >> 1;
        engine_crc32c_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = engine_crc32c_table[0][i];
        for (int t = 1; t < 8; t++) {
            c = engine_crc32c_table[0][c & 0xff] ^ (c >> 8);
            engine_crc32c_table[t][i] = c;
        }
    }
    uint32_t p = 1u << 30; /* x^1 */
    engine_crc32c_x2n[0] = p;
    for (int n = 1; n < 32; n++)
        engine_crc32c_x2n[n] = p = engine_crc32c_mulmod(p, p);
    engine_crc32c_lane_shift = engine_crc32c_x8n(ENGINE_CRC32C_LANE);
#ifdef ENGINE_CRC32C_X86
    __builtin_cpu_init();
    engine_crc32c_hw = __builtin_cpu_supports("sse4.2") ? 1 : 0;
#endif
}

/* the CRC-32C of the bytes that follow those whose CRC-32C is crc (0 for none) */
static inline uint32_t engine_crc32c_update(uint32_t crc, const uint8_t* p, size_t n) {
#ifdef ENGINE_CRC32C_X86
    if (engine_crc32c_hw)
        return ~engine_crc32c_hw_update(~crc, p, n);
#endif
    return ~engine_crc32c_sw(~crc, p, n);
}

static inline uint32_t engine_crc32c_update_sw(uint32_t crc, const uint8_t* p, size_t n) {
    return ~engine_crc32c_sw(~crc, p, n);
}

#endif
