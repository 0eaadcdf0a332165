// kvpubd tier copy kernel: scattered whole-block copies between the GPU pool and the host tier.
//
// Compiled at run time by kvpubd/daemon/tier_copy.py through cupy.RawModule (NVRTC). The host
// tier is page-locked and mapped (cudaHostRegisterMapped), so one side of every copy is host
// memory read or written over the bus through its device pointer; the other side is the pool.
//
// Both pools are C-contiguous rows of `vecs_per_block` 16-byte vectors (the caller only uses
// this kernel when block_bytes is a multiple of 16 and both bases are 16-byte aligned). Block k
// of the list copies row src_ids[k] to row dst_ids[k]; the ids sit in one device array, the
// n destination ids first and the n source ids after them.
//
// Work decomposition: every block is cut into chunks of KV_COPY_THREADS * KV_COPY_UNROLL
// vectors (16 KiB with the defaults); the CTAs of the grid stride over the flat list of
// (block, chunk) pairs. A thread loads KV_COPY_UNROLL vectors before storing any, so that many
// bus transactions are in flight per SM: reads of host memory wait a bus round trip each.

#ifndef KV_COPY_UNROLL
#define KV_COPY_UNROLL 4
#endif
#define KV_COPY_THREADS 256

typedef unsigned long long u64;
typedef long long i64;

extern "C" __global__ void __launch_bounds__(KV_COPY_THREADS)
kv_copy_blocks(uint4* __restrict__ dst, const uint4* __restrict__ src, u64 vecs_per_block,
               const i64* __restrict__ ids, i64 n, u64 chunks_per_block) {
    const u64 chunk_vecs = (u64)KV_COPY_THREADS * KV_COPY_UNROLL;
    const i64 items = n * (i64)chunks_per_block;
    for (i64 item = blockIdx.x; item < items; item += gridDim.x) {
        const i64 k = item / (i64)chunks_per_block;
        const u64 first = (u64)(item - k * (i64)chunks_per_block) * chunk_vecs;
        const uint4* s = src + (u64)ids[n + k] * vecs_per_block + first;
        uint4* d = dst + (u64)ids[k] * vecs_per_block + first;
        const u64 left = vecs_per_block - first;
        if (left >= chunk_vecs) {
            uint4 r[KV_COPY_UNROLL];
#pragma unroll
            for (int u = 0; u < KV_COPY_UNROLL; ++u) r[u] = s[threadIdx.x + u * KV_COPY_THREADS];
#pragma unroll
            for (int u = 0; u < KV_COPY_UNROLL; ++u) d[threadIdx.x + u * KV_COPY_THREADS] = r[u];
        } else {
            for (u64 i = threadIdx.x; i < left; i += KV_COPY_THREADS) d[i] = s[i];
        }
    }
}
