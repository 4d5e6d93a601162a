// Developer probe: how fast a decode step's cache reads can go, apart from any attention. Two caches of
// BH x S rows of ROW bytes (a packed layer's keys and values) are read by blocks of one (b, head) split
// each, as the split kernel (ops/cuda/attention_tc.cu) reads them, or by a flat grid of blocks taking
// equal shares of all the rows; by bulk copies (cp.async.bulk, one per cache and tile, an mbarrier per
// buffer) or plain 16-byte loads; tiles of T rows, NS buffers per warp, W warps per block, a warp's
// tiles interleaved with the other warps'. Prints us and GB/s of cache bytes against a grid-stride
// read of the same buffers and cudaMemcpy's copy rate (CUDA events, launches back to back, median of
// 5 rounds of 20).
//   nvcc -std=c++17 -O3 -arch=sm_90 -Iops/include scripts/cuda_read_probe.cu -o /tmp/read_probe
//   /tmp/read_probe [BH S ROW SPLITS]   then a sweep of configurations (defaults 64 32768 68 2)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "../ops/cuda/ptx.cuh"
#include "cuda_check.h"

using namespace turboquant::cuda::detail;

struct Geometry {
  int64_t bh;
  int64_t rows;  // per (b, head)
  int row;       // bytes
  int64_t split_len;
  int tile;  // rows per tile
  bool flat;  // blocks take equal shares of all BH x S rows instead of one (b, head) split each
};

// the block's first byte and its tiles
struct Share {
  int64_t base, tiles;
};
__device__ __forceinline__ Share share_of(const Geometry& g) {
  if (g.flat) {
    const int64_t all = g.bh * g.rows / g.tile;
    const int64_t lo = all * blockIdx.x / gridDim.x, hi = all * (blockIdx.x + 1) / gridDim.x;
    return {lo * g.tile * g.row, hi - lo};
  }
  return {(blockIdx.x * g.rows + blockIdx.y * g.split_len) * g.row, g.split_len / g.tile};
}

__device__ __forceinline__ int span_of(int tile, int row) { return (15 + tile * row + 15) & ~15; }

// this warp's j-th tile, or -1
__device__ __forceinline__ int64_t tile_of(int64_t n, int warp, int warps, int64_t j) {
  const int64_t t = warp + warps * j;
  return t < n ? t : -1;
}

__device__ __forceinline__ uint32_t consume(uint32_t at, int span, int lane) {
  uint32_t acc = 0;
  for (int o = 4 * lane; o < span; o += 128) {
    uint32_t v;
    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(at + o));
    acc ^= v;
  }
  return acc;
}

template <int NS>
__global__ void bulk_read(const uint8_t* K, const uint8_t* V, Geometry g, uint32_t* sink) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int span = span_of(g.tile, g.row), tile_bytes = 2 * span;
  const uint32_t bars = smem_u32(smem) + 8 * NS * warp;
  const uint32_t stage = smem_u32(smem) + 1024 + (warp * NS) * tile_bytes;
  if (lane == 0) {
    for (int s = 0; s < NS; ++s) mbar_init(bars + 8 * s, 1);
    fence_mbarrier_init();
  }
  __syncwarp();
  const Share sh = share_of(g);
  const int64_t base = sh.base;
  auto issue = [&](int64_t j, int s) {
    const int64_t t = tile_of(sh.tiles, warp, warps, j);
    if (t < 0) return;
    const uint8_t* k = K + ((base + t * g.tile * g.row) & ~int64_t{15});
    const uint8_t* v = V + ((base + t * g.tile * g.row) & ~int64_t{15});
    const uint32_t bar = bars + 8 * s, dst = stage + s * tile_bytes;
    asm volatile(
        "{\n .reg .pred one;\n elect.sync _|one, 0xffffffff;\n"
        " @one mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %6;\n"
        " .reg .b64 pol;\n createpolicy.fractional.L2::evict_first.b64 pol, 1.0;\n"
        " @one cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%1], [%2], %5, [%0], pol;\n"
        " @one cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%3], [%4], %5, [%0], pol;\n}\n" ::"r"(bar),
        "r"(dst), "l"(k), "r"(dst + span), "l"(v), "r"(span), "r"(2 * span)
        : "memory");
  };
  for (int s = 0; s < NS; ++s) issue(s, s);
  uint32_t acc = 0;
  for (int64_t j = 0; tile_of(sh.tiles, warp, warps, j) >= 0; ++j) {
    const int s = static_cast<int>(j % NS);
    mbar_wait(bars + 8 * s, static_cast<uint32_t>((j / NS) & 1));
    acc ^= consume(stage + s * tile_bytes, tile_bytes, lane);
    __syncwarp();
    issue(j + NS, s);
  }
  if (acc == 0x12345678u) *sink = acc;
}

__global__ void load_read(const uint8_t* K, const uint8_t* V, Geometry g, uint32_t* sink) {
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int span = span_of(g.tile, g.row);
  const Share sh = share_of(g);
  const int64_t base = sh.base;
  uint4 acc = {0, 0, 0, 0};
  for (int64_t j = 0; tile_of(sh.tiles, warp, warps, j) >= 0; ++j) {
    const int64_t at = (base + tile_of(sh.tiles, warp, warps, j) * g.tile * g.row) & ~int64_t{15};
#pragma unroll 8
    for (int o = 16 * lane; o < span; o += 512) {
      const uint4 k = __ldg(reinterpret_cast<const uint4*>(K + at + o));
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(V + at + o));
      acc.x ^= k.x ^ v.x;
      acc.y ^= k.y ^ v.y;
      acc.z ^= k.z ^ v.z;
      acc.w ^= k.w ^ v.w;
    }
  }
  if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x12345678u) *sink = acc.x;
}

__global__ void stream_read(const uint4* K, const uint4* V, int64_t n, uint32_t* sink) {
  uint4 acc = {0, 0, 0, 0};
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const uint4 k = __ldg(K + i), v = __ldg(V + i);
    acc.x ^= k.x ^ v.x;
    acc.y ^= k.y ^ v.y;
    acc.z ^= k.z ^ v.z;
    acc.w ^= k.w ^ v.w;
  }
  if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x12345678u) *sink = acc.x;
}

template <typename F>
static float median_us(F launch, int iters, int rounds) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  launch();
  CHECK(cudaDeviceSynchronize());
  std::vector<float> t;
  for (int r = 0; r < rounds; ++r) {
    CHECK(cudaEventRecord(a));
    for (int i = 0; i < iters; ++i) launch();
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(1000.0f * ms / iters);
  }
  CHECK(cudaGetLastError());
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

int main(int argc, char** argv) {
  const int64_t bh = argc > 1 ? std::atoll(argv[1]) : 64;
  const int64_t S = argc > 2 ? std::atoll(argv[2]) : 32768;
  const int row = argc > 3 ? std::atoi(argv[3]) : 68;
  const int splits = argc > 4 ? std::atoi(argv[4]) : 2;
  const int64_t bytes = bh * S * row;  // per cache
  uint8_t *K, *V;
  uint32_t* sink;
  CHECK(cudaMalloc(&K, bytes + 4096));
  CHECK(cudaMalloc(&V, bytes + 4096));
  CHECK(cudaMalloc(&sink, 4));
  CHECK(cudaMemset(K, 1, bytes + 4096));
  CHECK(cudaMemset(V, 2, bytes + 4096));
  uint8_t *k0 = K + 16, *v0 = V + 16;  // rows from byte 16: the aligned-down spans stay inside
  int sms;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const double gb = 2.0 * bytes / 1e9;
  std::printf("BH %lld S %lld row %d splits %d: %.1f MB of cache, %d SMs\n", (long long)bh, (long long)S, row, splits,
              1000 * gb, sms);
  const int iters = 20, rounds = 5;
  float us = median_us([&] { CHECK(cudaMemcpyAsync(V, K, bytes, cudaMemcpyDeviceToDevice)); }, iters, rounds);
  std::printf("cudaMemcpy copy: %.1f us, %.0f GB/s (read + write)\n", us, 2e-3 * bytes / us);  // (bytes / us: MB/s)
  for (int per_sm : {4, 8, 16}) {
    us = median_us([&] { stream_read<<<sms * per_sm, 256>>>(reinterpret_cast<uint4*>(K), reinterpret_cast<uint4*>(V), bytes / 16, sink); },
                   iters, rounds);
    std::printf("stream read, %d blocks of 256 per SM: %.1f us, %.0f GB/s\n", per_sm, us, 1e3 * gb / us * 1e3);
  }
  CHECK(cudaFuncSetAttribute(bulk_read<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024));
  CHECK(cudaFuncSetAttribute(bulk_read<3>, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024));
  struct Config {
    const char* method;
    int warps, tile, stages, blocks;  // blocks: 0, one per (b, head) split (SPLITS of them); else a flat grid
  };
  std::vector<Config> configs;
  for (const char* m : {"bulk", "load"}) {
    for (int w : {8, 12, 16}) {
      for (int t : {32, 64}) {
        for (int ns : {2, 3}) {
          for (int blocks : {0, 128, 132, 264, 396, 528}) configs.push_back({m, w, t, ns, blocks});
        }
      }
    }
  }
  std::printf("method warps tile stages grid: us GB/s\n");
  for (const Config& c : configs) {
    const bool load = c.method[0] == 'l';
    if (load && c.stages != 2) continue;
    const int span = (15 + c.tile * row + 15) & ~15;
    const size_t smem = load ? 0 : 1024 + size_t{2} * span * c.stages * c.warps;
    if (smem > 227 * 1024) continue;
    Geometry g{bh, S, row, S / splits, c.tile, c.blocks > 0};
    if (g.split_len % c.tile != 0) continue;
    const dim3 grid = c.blocks > 0 ? dim3(c.blocks) : dim3(static_cast<unsigned>(bh), static_cast<unsigned>(splits));
    auto launch = [&] {
      if (load) {
        load_read<<<grid, 32 * c.warps>>>(k0, v0, g, sink);
      } else if (c.stages == 2) {
        bulk_read<2><<<grid, 32 * c.warps, smem>>>(k0, v0, g, sink);
      } else {
        bulk_read<3><<<grid, 32 * c.warps, smem>>>(k0, v0, g, sink);
      }
    };
    us = median_us(launch, iters, rounds);
    std::printf("%s %d %d %d %s%d: %.1f %.0f\n", c.method, c.warps, c.tile, c.stages, c.blocks ? "flat " : "splits ",
                c.blocks ? c.blocks : splits, us, 1e-3 * 2.0 * bytes / us);
  }
  return 0;
}
