// The shared-memory geometry of the tensor-core split kernels (attention_tc.cu, attention_mma.cu,
// past_chunk.cu, past_chunk_sm90.cu), in plain C++ (TQ_HD): the planner (split_plan.cpp, host-only,
// also in CPU builds) sizes a launch with the same functions the kernels lay out their shared memory
// with.
#pragma once

#include "turboquant/numerics.h"  // TQ_HD

namespace turboquant::cuda::detail {

// ---- attention_tc.cu ----------------------------------------------------------------------------
namespace tc_geometry {

constexpr int kTok = 32;      // tokens per warp tile (two m16 row tiles)
constexpr int kRowsMax = 8;   // query rows per block: the N of the products
constexpr int kWindow = 65536;
constexpr int kDynStartMax = 4096;  // where the dynamic part starts in the window at most: 1 KiB reserved + static arrays
constexpr int kStaticBytesMax = 1024;  // the kernel's static shared memory, at most
// The wide blocks' warps: 16 measured best for a step alone (docs/performance.md, kept choices).
#ifndef TQ_TC_WARPS
#define TQ_TC_WARPS 16  // (developer A/B builds set others: scripts/build_probe.sh)
#endif
constexpr int kWideWarps = TQ_TC_WARPS;
// raw16 blocks' warps at head sizes 64 and 128: as many double buffers as fit (6 measured best at
// 128: docs/performance.md, kept choices; developer A/B builds set others)
#ifndef TQ_RAW16_WARPS_64
#define TQ_RAW16_WARPS_64 8
#endif
#ifndef TQ_RAW16_WARPS_128
#define TQ_RAW16_WARPS_128 6
#endif
constexpr int kRaw16Warps64 = TQ_RAW16_WARPS_64, kRaw16Warps128 = TQ_RAW16_WARPS_128;

TQ_HD constexpr int round16(int n) { return (n + 15) / 16 * 16; }
// A tile's rows land at its buffer's byte (source address mod 16), plus 4 bytes that a funnel shift
// may read past the last row.
TQ_HD int key_tile_bytes(int kb) { return round16(kTok * kb + 16 + 4); }
TQ_HD int value_tile_bytes(int vb) { return round16(kTok * vb + 16 + 4); }
TQ_HD int warp_stage_bytes(int kb, int vb) { return 2 * (key_tile_bytes(kb) + value_tile_bytes(vb)); }

// key_bits: 3 or 4 (MSE keys, which have a byte table of centroid pairs), 8 (fp8) or 16 (raw16).
// The byte table: one copy per lane of a row per pair value (256 pairs of MSE 4-bit codes, 64 of
// 3-bit ones). Up to head size 128, MSE 4-bit rows are 256 bytes (the first 128 used) and the table
// starts at a 64 KiB boundary of the block's shared-memory window, so that a lookup's address is one
// byte permute of (table | lane * 4) and the code byte, taken by the load as it is; otherwise rows
// are 128 bytes and the address a shift and a masked or.
TQ_HD constexpr bool permuted_table(int key_bits, int kd) { return key_bits == 4 && kd <= 128; }
TQ_HD constexpr int table_row_bytes(int key_bits, int kd) { return permuted_table(key_bits, kd) ? 256 : 128; }
TQ_HD constexpr int table_bytes(int key_bits, int kd) {
  return key_bits >= 8 ? 0 : (key_bits == 4 ? 256 : 64) * table_row_bytes(key_bits, kd);
}
TQ_HD constexpr int fragment_bytes(int kd) { return kd / 16 * 32 * 16; }
TQ_HD constexpr int query_bytes(int kd) { return kRowsMax * kd * 4; }

// Byte offsets within the block's dynamic shared memory, which starts `start` bytes into a 64 KiB
// window: the query fragments and rows, the warps' double buffers (the first low_warps below a
// permuted table, the others above it), the warps' states at the end (over the buffers), the table.
struct SmemLayout {
  int table, fragments, queries, low_warps, low_stages, high_stages, states, bytes;
};
TQ_HD SmemLayout smem_layout(int key_bits, int kd, int kb, int vb, int warps, int start) {
  SmemLayout s{};
  const int stage = warp_stage_bytes(kb, vb);
  const int states = warps * kRowsMax * (3 + kd) * 4;
  if (permuted_table(key_bits, kd)) {
    s.fragments = 0;
    s.queries = fragment_bytes(kd);
    s.low_stages = s.queries + query_bytes(kd);
    s.table = kWindow - start;
    const int room = kWindow - kDynStartMax - s.low_stages;  // below the table, wherever it starts
    s.low_warps = room / stage < warps ? room / stage : warps;
    s.high_stages = s.table + table_bytes(key_bits, kd);
    s.states = s.high_stages;
    const int high = (warps - s.low_warps) * stage;
    s.bytes = s.high_stages + (high > states ? high : states);
  } else {
    s.table = 0;
    s.fragments = table_bytes(key_bits, kd);
    s.queries = s.fragments + fragment_bytes(kd);
    s.low_stages = s.high_stages = s.states = s.queries + query_bytes(kd);
    s.low_warps = warps;
    s.bytes = s.low_stages + (warps * stage > states ? warps * stage : states);
  }
  return s;
}
// What the launch asks for: the layout of the earliest start (its table lies highest).
TQ_HD int dynamic_bytes(int key_bits, int kd, int kb, int vb, int warps) {
  return smem_layout(key_bits, kd, kb, vb, warps, 0).bytes;
}

}  // namespace tc_geometry

// ---- attention_mma.cu ---------------------------------------------------------------------------
namespace mma_geometry {

constexpr int kWarps = 4;
constexpr int kTok = 16;        // tokens per warp tile
constexpr int kMaxRows = 8;     // query rows per block (the A operand's real rows)
constexpr int kStaticBytes = 10400;  // sizeof(Smem) in attention_mma.cu (checked there)

// Per warp, the tile's packed keys and values and the dequantized value codes [kTok][dv + 8]
// (padded rows: ldmatrix reads 8 rows without bank conflicts); after the loop the same space holds
// the warps' states for the final merge.
TQ_HD int packed_tile_bytes(int kb, int vb) { return (kTok * (kb + vb) + 15) / 16 * 16; }
TQ_HD int warp_stage_bytes(int kb, int vb, int dv) {
  return 2 * packed_tile_bytes(kb, vb) + kTok * (dv + 8) * 2;  // two packed tiles: the next one is in flight
}
TQ_HD int merge_bytes(int dv) { return kWarps * kMaxRows * (3 + dv) * 4; }
// Dynamic shared memory of a launch (dp: the padded key length).
TQ_HD int dynamic_bytes(int kb, int vb, int dv, int dp) {
  int smem = kWarps * warp_stage_bytes(kb, vb, dv);
  smem = smem > merge_bytes(dv) ? smem : merge_bytes(dv);
  return smem > kMaxRows * dp * 4 ? smem : kMaxRows * dp * 4;
}

}  // namespace mma_geometry

// ---- past_chunk.cu ------------------------------------------------------------------------------
namespace chunk_geometry {

constexpr int kRows = 64;  // query rows per block: 4 warps of one m-tile
constexpr int kKeys = 64;  // past tokens per tile
// Q, K and V tiles of d-element 16-bit rows, then per token the key scale, value scale and zero, and
// the 16 centroids.
TQ_HD constexpr int smem_bytes(int d) { return kRows * d * 2 + 2 * kKeys * d * 2 + 3 * kKeys * 4 + 16 * 4; }

}  // namespace chunk_geometry

// ---- past_chunk_sm90.cu -------------------------------------------------------------------------
namespace chunk_sm90_geometry {

constexpr int kRows = 128;     // query rows per block: two consumer warpgroups of 64
constexpr int kKeys = 128;     // past tokens per tile
constexpr int kStages = 2;     // decoded tiles of keys, and of values
constexpr int kRawStages = 3;  // the tiles' packed rows, copied ahead
// The packed rows of one tile: 128 rows of K and of V as the cache holds them (kb, vb bytes each).
TQ_HD constexpr int raw_stage_bytes(int kb, int vb) { return kKeys * (kb + vb); }
// 1024 bytes of alignment slack (the swizzle's period), Q, the decoded tiles, the packed rows and the
// mbarriers (full and empty per decoded buffer of K and of V, one per packed buffer).
TQ_HD constexpr int smem_bytes(int d, int kb, int vb) {
  return 1024 + kRows * d * 2 + 2 * kStages * kKeys * d * 2 + kRawStages * raw_stage_bytes(kb, vb) +
         8 * (4 * kStages + kRawStages);
}

}  // namespace chunk_sm90_geometry

}  // namespace turboquant::cuda::detail
