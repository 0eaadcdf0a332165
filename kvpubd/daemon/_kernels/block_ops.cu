// kvpubd block kernels: scrub and checksum over a KV block pool.
//
// Compiled at run time by kvpubd/daemon/kernels.py through cupy.RawModule (NVRTC); every
// kernel is extern "C" so it can be looked up by name. Each has a NumPy twin in
// kvpubd/daemon/kernels.py that gives bit-identical results; keep the two in step
// (tests/test_kernels.py checks both).
//
// The pool is rows of `block_bytes` bytes, `row_stride` bytes apart (row_stride >= block_bytes;
// it equals block_bytes for a C-contiguous [num_blocks, block_bytes] uint8 array). Neither needs
// to be a multiple of 16, so a block may start at any address: every kernel works out the
// alignment of each piece it touches and uses 16-byte vector accesses wherever it can.
//
// Work decomposition: block `ids[k]` is cut into tiles of TILE bytes (the last one shorter);
// a warp owns a whole tile, and the warps of the grid stride over the flat list of
// (k, tile) pairs, so small and large blocks alike keep the whole GPU busy, and one huge block
// is spread over many SMs. Inside a tile the 32 lanes walk the body with 16-byte accesses,
// coalesced (lane j touches bytes 16j..16j+15 of each 512-byte step), four steps unrolled so
// that several loads are in flight per lane; the unaligned head and the tail (< 16 bytes) are
// done byte by byte.
// Block ids are read from device memory by the kernels (no host round trip per block).
//
// Checksum (see kvpubd/daemon/kernels.py for the normative definition):
//   word_i  = little-endian uint64 at byte 8*i of the block, zero-padded past block_bytes
//   S       = sum_i mix64(word_i ^ (i * GOLDEN))                       (mod 2^64)
//   result  = mix64(S ^ (block_bytes * SIZE_SALT))                     (mod 2^64)
// A sum mod 2^64 does not depend on the order of its terms, so warps add their partial sums
// with 64-bit atomics and the result is exact and deterministic.

// Tuning knobs; kvpubd/daemon/kernels.py passes KV_TILE and KV_UNROLL with -D and must agree
// on them.
#ifndef KV_TILE
#define KV_TILE 8192            // bytes of a block handled by one warp; a multiple of 16
#endif
#ifndef KV_UNROLL
#define KV_UNROLL 4             // 16-byte accesses in flight per lane
#endif
#ifndef KV_STREAMING
#define KV_STREAMING 0          // 1: 16-byte accesses with the evict-first hints (ld/st .cs)
#endif
#define KV_WARPS_PER_CTA 8      // launch with 256 threads

typedef unsigned long long u64;
typedef long long i64;

#define KV_GOLDEN 0x9E3779B97F4A7C15ULL
#define KV_SIZE_SALT 0xD1B54A32D192ED03ULL

__device__ __forceinline__ u64 kv_mix64(u64 z) {
    z ^= z >> 30;
    z *= 0xBF58476D1CE4E5B9ULL;
    z ^= z >> 27;
    z *= 0x94D049BB133111EBULL;
    z ^= z >> 31;
    return z;
}

// One tile of the flat (k, tile) list: the k-th id, and [off, off + len) inside its block.
struct KvTile {
    i64 k;
    u64 off;
    u64 len;
};

__device__ __forceinline__ KvTile kv_tile(i64 t, u64 tiles_per_block, u64 block_bytes) {
    KvTile r;
    r.k = (i64)((u64)t / tiles_per_block);
    u64 chunk = (u64)t - (u64)r.k * tiles_per_block;
    r.off = chunk * KV_TILE;
    u64 rest = block_bytes - r.off;
    r.len = rest < KV_TILE ? rest : KV_TILE;
    return r;
}

// 16-byte accesses, with the streaming (evict-first) cache hints when KV_STREAMING is set;
// other widths are plain accesses.
template <typename V>
__device__ __forceinline__ V kv_ld(const V* p) { return *p; }
template <typename V>
__device__ __forceinline__ void kv_st(V* p, const V& v) { *p = v; }
#if KV_STREAMING
template <>
__device__ __forceinline__ ulonglong2 kv_ld<ulonglong2>(const ulonglong2* p) { return __ldcs(p); }
template <>
__device__ __forceinline__ void kv_st<uint4>(uint4* p, const uint4& v) { __stcs(p, v); }
#endif

// The grid-stride loop over tiles shared by the kernels: each warp takes tiles warp,
// warp + nwarps, ... load_ids(k) reads the ids of the k-th entry; body(tile, ids) does one tile.
// With Prefetch, a warp reads the id(s) of its next tile before working on the current one, so
// that the id loads' latency hides behind the data traffic: that helps scrub on small blocks
// (short tiles); it costs registers, which slowed the checksum, so the checksum goes without.
template <bool Prefetch, typename IdsT, typename LoadIds, typename Body>
__device__ __forceinline__ void kv_for_each_tile(i64 n_ids, u64 tiles_per_block, u64 block_bytes,
                                                 LoadIds load_ids, Body body) {
    const i64 nwarps = ((i64)gridDim.x * blockDim.x) >> 5;
    const i64 ntiles = n_ids * (i64)tiles_per_block;
    i64 t = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (!Prefetch) {
        for (; t < ntiles; t += nwarps) {
            KvTile tl = kv_tile(t, tiles_per_block, block_bytes);
            body(tl, load_ids(tl.k));
        }
        return;
    }
    if (t >= ntiles) return;
    KvTile tl = kv_tile(t, tiles_per_block, block_bytes);
    IdsT cur = load_ids(tl.k);
    for (;;) {
        const i64 tn = t + nwarps;
        const bool more = tn < ntiles;
        KvTile tl_next = tl;
        IdsT next = cur;
        if (more) {
            tl_next = kv_tile(tn, tiles_per_block, block_bytes);
            next = load_ids(tl_next.k);
        }
        body(tl, cur);
        if (!more) break;
        t = tn;
        tl = tl_next;
        cur = next;
    }
}

// ---------------------------------------------------------------------------------------------
// scrub

__device__ __forceinline__ void kv_zero_range(unsigned char* p, u64 len, unsigned lane) {
    u64 head = (16 - ((unsigned long long)p & 15)) & 15;
    if (head > len) head = len;
    if (lane < head) p[lane] = 0;
    p += head;
    len -= head;
    u64 nv = len >> 4;
    uint4* v = reinterpret_cast<uint4*>(p);
    const uint4 z = make_uint4(0u, 0u, 0u, 0u);
    u64 i = lane;
    for (; i + 32 * (KV_UNROLL - 1) < nv; i += 32 * KV_UNROLL) {
#pragma unroll
        for (int u = 0; u < KV_UNROLL; ++u) kv_st(v + i + 32 * u, z);
    }
    for (; i < nv; i += 32) kv_st(v + i, z);
    u64 tail = len & 15;
    if (lane < tail) p[nv * 16 + lane] = 0;
}

extern "C" __global__ void __launch_bounds__(32 * KV_WARPS_PER_CTA)
kv_scrub(unsigned char* __restrict__ pool, u64 row_stride, u64 block_bytes,
         const i64* __restrict__ ids, i64 n_ids, u64 tiles_per_block) {
    const unsigned lane = threadIdx.x & 31;
    kv_for_each_tile<true, i64>(
        n_ids, tiles_per_block, block_bytes, [=](i64 k) { return ids[k]; },
        [=](const KvTile& tl, i64 id) {
            kv_zero_range(pool + (u64)id * row_stride + tl.off, tl.len, lane);
        });
}

// ---------------------------------------------------------------------------------------------
// checksum

// A little-endian uint64 at p, read with accesses of type T (p is aligned to sizeof(T)).
template <typename T>
__device__ __forceinline__ u64 kv_load_word(const unsigned char* p) {
    const T* q = reinterpret_cast<const T*>(p);
    u64 w = 0;
#pragma unroll
    for (int j = 0; j < (int)(8 / sizeof(T)); ++j) {
        w |= (u64)q[j] << (8 * sizeof(T) * j);
    }
    return w;
}

// Sum of mix64(word_i ^ i*GOLDEN) over nw whole words at p (word index w0 first), words read
// with accesses of type T; strided over the lanes.
template <typename T>
__device__ __forceinline__ u64 kv_sum_words_scalar(const unsigned char* p, u64 w0, u64 nw,
                                                   unsigned lane) {
    u64 acc = 0;
    for (u64 j = lane; j < nw; j += 32) {
        u64 w = kv_load_word<T>(p + 8 * j);
        acc += kv_mix64(w ^ ((w0 + j) * KV_GOLDEN));
    }
    return acc;
}

// Sum over one tile (p: its first byte, at byte offset `off` of its block, off % 16 == 0) of
// mix64(word_i ^ i*GOLDEN), for this lane's share of the words; the lanes' sums add up to the
// tile's.
__device__ __forceinline__ u64 kv_checksum_tile(const unsigned char* p, u64 off, u64 len,
                                                unsigned lane) {
    u64 w0 = off >> 3;           // index of the tile's first word (off % 16 == 0)
    u64 nw = len >> 3;           // whole words in the tile
    u64 acc = 0;
    unsigned long long a = (unsigned long long)p;
    if ((a & 7) == 0) {
        u64 skip = 0;
        if ((a & 15) == 8 && nw > 0) {  // one word to reach 16-byte alignment
            if (lane == 0) acc += kv_mix64(*reinterpret_cast<const u64*>(p) ^ (w0 * KV_GOLDEN));
            skip = 1;
        }
        const unsigned char* q = p + 8 * skip;
        u64 wq = w0 + skip;
        u64 npairs = (nw - skip) >> 1;
        const ulonglong2* v = reinterpret_cast<const ulonglong2*>(q);
        u64 i = lane;
        for (; i + 32 * (KV_UNROLL - 1) < npairs; i += 32 * KV_UNROLL) {
            ulonglong2 r[KV_UNROLL];
#pragma unroll
            for (int u = 0; u < KV_UNROLL; ++u) r[u] = kv_ld(v + i + 32 * u);
#pragma unroll
            for (int u = 0; u < KV_UNROLL; ++u) {
                u64 wi = wq + 2 * (i + 32 * u);
                u64 salt = wi * KV_GOLDEN;
                acc += kv_mix64(r[u].x ^ salt);
                acc += kv_mix64(r[u].y ^ (salt + KV_GOLDEN));
            }
        }
        for (; i < npairs; i += 32) {
            ulonglong2 r = kv_ld(v + i);
            u64 salt = (wq + 2 * i) * KV_GOLDEN;
            acc += kv_mix64(r.x ^ salt);
            acc += kv_mix64(r.y ^ (salt + KV_GOLDEN));
        }
        u64 done = skip + 2 * npairs;
        if (done < nw && lane == 0) {  // one word left over after the pairs
            acc += kv_mix64(*reinterpret_cast<const u64*>(p + 8 * done) ^
                            ((w0 + done) * KV_GOLDEN));
        }
    } else if ((a & 3) == 0) {
        acc = kv_sum_words_scalar<unsigned int>(p, w0, nw, lane);
    } else if ((a & 1) == 0) {
        acc = kv_sum_words_scalar<unsigned short>(p, w0, nw, lane);
    } else {
        acc = kv_sum_words_scalar<unsigned char>(p, w0, nw, lane);
    }
    u64 rem = len & 7;  // a partial last word, zero-padded (only in a block's last tile)
    if (rem != 0 && lane == 0) {
        const unsigned char* r = p + 8 * nw;
        u64 w = 0;
        for (u64 j = 0; j < rem; ++j) w |= (u64)r[j] << (8 * j);
        acc += kv_mix64(w ^ ((w0 + nw) * KV_GOLDEN));
    }
    return acc;
}

extern "C" __global__ void __launch_bounds__(32 * KV_WARPS_PER_CTA)
kv_checksum_partial(const unsigned char* __restrict__ pool, u64 row_stride, u64 block_bytes,
                    const i64* __restrict__ ids, i64 n_ids, u64 tiles_per_block,
                    u64* __restrict__ sums) {
    const unsigned lane = threadIdx.x & 31;
    kv_for_each_tile<false, i64>(
        n_ids, tiles_per_block, block_bytes, [=](i64 k) { return ids[k]; },
        [=](const KvTile& tl, i64 id) {
            u64 acc = kv_checksum_tile(pool + (u64)id * row_stride + tl.off, tl.off, tl.len, lane);
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
            if (lane == 0) {
                if (tiles_per_block == 1) {
                    sums[tl.k] = acc;  // the whole block in one tile: no other writer
                } else {
                    atomicAdd(&sums[tl.k], acc);  // sums[] zeroed by the caller
                }
            }
        });
}

extern "C" __global__ void kv_checksum_final(u64* __restrict__ sums, i64 n_ids,
                                             u64 block_bytes) {
    const u64 salt = block_bytes * KV_SIZE_SALT;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n_ids;
         i += (i64)gridDim.x * blockDim.x) {
        sums[i] = kv_mix64(sums[i] ^ salt);
    }
}
