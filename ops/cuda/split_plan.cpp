// The split-KV planner (split_plan.h): which kernel takes a call, then its layout, shared memory
// and workspace, from the same geometry the kernels use (split_geometry.h).
#include "turboquant/split_plan.h"

#include <cstdlib>
#include <cstring>

#include "split_geometry.h"

namespace turboquant::cuda {
namespace {

using detail::mma_geometry::kStaticBytes;

using detail::tc_geometry::kWideWarps;

// Whether the sliding window hides some key from some query row: the call's longest sequence holds
// more tokens than the window.
bool window_cuts(const AttentionParams& p) { return p.window > 0 && p.window < p.past_len + p.new_len; }

// Whether the kernel's query rows need the window per row: a window that cuts, over several query
// positions (one position's rows share its first key, where the split kernels start).
bool window_per_row(const AttentionParams& p) { return window_cuts(p) && p.q_len > 1; }

// The past tokens the splits cover: the sliding window's (window - 1 past tokens for a query that
// is the last new token; more where the new tokens outnumber the queries), at least one where there is
// a past (its split then finds nothing to see), else every past token.
int64_t visible_past(const AttentionParams& p) {
  if (!window_cuts(p) || p.past_len == 0) return p.past_len;
  const int64_t span = p.window - 1 + p.q_len - p.new_len;
  return span < 1 ? 1 : (span < p.past_len ? span : p.past_len);
}

// The bulk kernel's key product length: the padded head size for MSE keys, the head size for fp8
// and raw16.
int tc_kd(const AttentionParams& p) {
  return p.key_format == Format::kFp8 || p.key_format == Format::kRaw16 ? p.head_dim : padded_dim(p.head_dim);
}
int tc_key_bits(const AttentionParams& p) {
  return p.key_format == Format::kRaw16 ? 16 : p.key_format == Format::kFp8 ? 8 : format_bits(p.key_format);
}

// Shared memory of a bulk block of `warps` warps: the dynamic part and, at most, the static one.
int tc_block_bytes(const AttentionParams& p, int warps) {
  return detail::tc_geometry::dynamic_bytes(tc_key_bits(p), tc_kd(p), static_cast<int>(p.key_row()),
                                            static_cast<int>(p.value_row()), warps) +
         detail::tc_geometry::kStaticBytesMax;
}

// One block per SM: 16 warps where their buffers fit, else 8 (head size 256, whose registers allow
// no more, and caches with rows much wider than the packed vectors); 0: neither fits this device.
int tc_warps(const AttentionParams& p, const DeviceProps& dev) {
  if (tc_kd(p) <= 128 && tc_block_bytes(p, kWideWarps) <= dev.smem_optin) return kWideWarps;
  return tc_block_bytes(p, 8) <= dev.smem_optin ? 8 : 0;
}

// raw16 rows (2 x head size bytes: onnxruntime-genai's uncompressed boundary layers) on the bulk
// kernel: head sizes 64 and 128, rows of whole 16-byte chunks in 16-byte aligned caches (copied in
// swizzled chunks, as fp8 keys are), with as many warps as their double buffers leave room for in
// 227 KiB: a warp's two 32-token tiles of K and V are 16 KiB at head size 64 (8 warps), 32 KiB at
// 128 (6 warps, the first two also taking the block's query rows 6 and 7; 4 in sm_80's 163 KiB).
int raw16_warps(const AttentionParams& p, bool aligned16, const DeviceProps& dev) {
  if (p.head_dim != 64 && p.head_dim != 128) return 0;
  if (p.key_row() % 16 != 0 || p.value_row() % 16 != 0 || !aligned16) return 0;
  const int warps = p.head_dim == 64 ? detail::tc_geometry::kRaw16Warps64 : detail::tc_geometry::kRaw16Warps128;
  if (tc_block_bytes(p, warps) <= dev.smem_optin) return warps;
  return p.head_dim == 128 && tc_block_bytes(p, 4) <= dev.smem_optin ? 4 : 0;
}

// The warps of the bulk kernel for this call, or 0 where it does not take it.
int tc_bulk_warps(const AttentionParams& p, bool aligned16, const DeviceProps& dev) {
  // the presets' pairs: MSE 4-bit, fp8 or MSE 3-bit keys with uint4 values, MSE 3-bit with uint3;
  // and raw16 with raw16
  const Format kf = p.key_format, vf = p.value_format;
  const bool raw16 = kf == Format::kRaw16 && vf == Format::kRaw16;
  const bool pair = vf == Format::kUint4 ? (kf == Format::kMse4 || kf == Format::kFp8 || kf == Format::kMse3)
                                         : (vf == Format::kUint3 && kf == Format::kMse3);
  if (!pair && !raw16) return 0;
  if (dev.cc_major < 8) return 0;  // mma.sync with bf16, cp.async
  // a pool of blocks: each warp's tiles of kTok rows inside one block, from splits that start at
  // multiples of kTok (no sliding window's first key)
  if (p.blocks.table && (p.blocks.block_size % detail::tc_geometry::kTok != 0 || p.window > 0)) return 0;
  if (p.is_causal && p.new_len < p.q_len) return 0;  // a query could then miss some past tokens
  if (window_per_row(p) || p.softcap > 0.0f) return 0;  // (a window over one query position starts its splits)
  // The weights p * value scale enter the value product in fp16 (relative 2^-11): within the
  // tolerance of fp16/bf16 outputs, not of float32 ones, which keep the CUDA-core kernel.
  if (p.dtype == DType::kFloat32) return 0;
  if (p.v_head_dim != p.head_dim && raw16) return 0;
  if (raw16) return raw16_warps(p, aligned16, dev);
  const int kd = tc_kd(p);
  // masks: the wide blocks of head sizes 64 and 128 have a masked variant (attention_tc.cu's kMasked)
  if (p.mask_type != MaskType::kNone && (kd > 128 || tc_warps(p, dev) != kWideWarps)) return 0;
  if (kd != 64 && kd != 128 && kd != 256) return 0;
  if (p.v_head_dim != kd) return 0;
  if (kf == Format::kFp8 && (p.key_row() != kd || !aligned16)) return 0;  // swizzled 16-byte chunks
  if (p.value_row() % 4 != 0) return 0;                                  // aligned value words
  if (p.key_row() % 2 != 0) return 0;                                    // 2-byte copies of unaligned rows
  // One block fills an SM's shared memory (the MSE 4-bit table alone is 64 KiB). Rows much wider
  // than the packed vectors, or devices with less shared memory than sm_90, keep the other kernels.
  return tc_warps(p, dev);
}

// Whether the mma kernel takes this call: MSE keys and uint values, within the default 48 KiB of
// shared memory per block (static + dynamic), which the presets' layouts up to head size 128 are.
// Wider rows (genai caches as wide as raw16, head size 256) would need the opt-in attribute, which no
// GPU run has yet verified for this kernel (its first condition failed to launch on the H200), so
// they keep the CUDA-core kernel.
int mma_dynamic_bytes(const AttentionParams& p) {
  return detail::mma_geometry::dynamic_bytes(static_cast<int>(p.key_row()), static_cast<int>(p.value_row()),
                                             p.v_head_dim, padded_dim(p.head_dim));
}
bool mma_takes(const AttentionParams& p, const DeviceProps& dev) {
  if (p.blocks.table) return false;  // (reads each (b, head)'s past as one run of rows)
  if (!is_mse(p.key_format) || !is_uint(p.value_format)) return false;
  if (dev.cc_major < 8) return false;
  if (p.mask_type != MaskType::kNone) return false;
  if (p.is_causal && p.new_len < p.q_len) return false;
  if (window_per_row(p) || p.softcap > 0.0f) return false;
  if (p.v_head_dim % 16 != 0) return false;
  if (mma_dynamic_bytes(p) + kStaticBytes > 48 * 1024) return false;
  return p.dtype != DType::kFloat32;  // as the bulk kernel: fp16 weights
}

// Whether the chunk kernel takes this call: a continuation chunk of at least one block of 64 rows per
// KV head, MSE keys with uint values, head size 64 or 128, fp16 or bf16, no mask, every past token
// visible to every row, rows of even size (2-byte scales), within the device's shared memory; and
// preallocated caches (TQGroupQueryAttention's buffers, TQPagedAttention's pools): over dense ones
// (TQAttention's past) it measured slower than the bulk kernel at B = 1 (docs/performance.md, CUDA prefill).
bool chunk_takes(const AttentionParams& p, const DeviceProps& dev) {
  if (!is_mse(p.key_format) || !is_uint(p.value_format)) return false;
  if (p.present_rows == 0 && !p.blocks.table) return false;
  if (dev.cc_major < 8 || p.mask_type != MaskType::kNone) return false;
  if (p.is_causal && p.new_len < p.q_len) return false;
  if (p.softcap > 0.0f) return false;  // (its scores are of the keys minus key_offset, which the tanh sees)
  if (p.dtype != DType::kFloat16 && p.dtype != DType::kBFloat16) return false;
  // (at head size 256 its 128 accumulators per thread beside the tiles' per-token scales spill,
  // whichever way the tile's bytes are fetched: those chunks keep the bulk or CUDA-core kernel, their
  // new tokens still on prefill.cu)
  if ((p.head_dim != 64 && p.head_dim != 128) || p.v_head_dim != p.head_dim) return false;
  if (p.key_row() % 2 != 0 || p.value_row() % 2 != 0) return false;
  const int64_t group = p.kv_heads > 0 ? p.q_heads / p.kv_heads : 1;
  if (p.q_len * group < detail::chunk_geometry::kRows) return false;
  return detail::chunk_geometry::smem_bytes(p.head_dim) <= dev.smem_optin;
}

// Whether the wgmma chunk kernel takes a call that the chunk kernel takes (MSE keys, uint values):
// its sm_90a code on this device, a positive scale (its softmax takes the raw scores'
// maximum), at least one block of 128 rows per KV head, and whole tiles of packed rows for bulk copies:
// rows of an odd number of 4-byte words (the producer's threads read a row each: a row of an even
// number of words, as uniform 2 D-byte rows, would have a warp's reads meet in a few banks) in caches
// at 16-byte boundaries whose (b, head) regions are multiples of 16 bytes; within the device's
// shared memory.
bool chunk_wgmma_takes(const AttentionParams& p, bool aligned16, const DeviceProps& dev) {
  namespace geo = detail::chunk_sm90_geometry;
  if (!chunk_wgmma_enabled() || !dev.sm90a || !aligned16) return false;
  if (p.blocks.table) return false;  // (bulk copies of each (b, head)'s past as one run of rows)
  if (window_cuts(p)) return false;  // every past token visible to every row
  if (!(p.scale > 0.0f)) return false;
  const int64_t kb = p.key_row(), vb = p.value_row(), rows = p.past_rows_or_len();
  if (kb % 4 != 0 || vb % 4 != 0 || kb / 4 % 2 == 0 || vb / 4 % 2 == 0) return false;
  if (rows * kb % 16 != 0 || rows * vb % 16 != 0 || p.kv_heads <= 0) return false;
  if (p.q_len * (p.q_heads / p.kv_heads) < geo::kRows) return false;
  return geo::smem_bytes(p.head_dim, static_cast<int>(kb), static_cast<int>(vb)) <= dev.smem_optin;
}

// The dense copy's bound: past beyond it keeps the split kernels (at the 3B shape, 8 KV heads of 128,
// 64K tokens), so that a long past's chunk does not hold a scratch buffer as large as its cache.
constexpr size_t kDensePastMaxBytes = size_t{256} << 20;

size_t dense_past_bytes(const AttentionParams& p) {
  return 2 * static_cast<size_t>(p.past_len * p.kv_heads * p.head_dim * dtype_size(p.dtype));
}

// Whether a chunk's rows (the Engine's prompt chunks after the first, a continuation chunk) run on the
// prefill kernel over the past decoded once into dense K and V, its tiles of 64 or more query rows
// reading each key once, where the split kernels' blocks each decode (tc_chunk: every 64 rows) or read
// (tc_bulk: every 8 rows) the whole past: one sequence, at least 64 rows per KV head, fp16 or bf16 at
// head size 64, 128 or 256 (the prefill kernel's), every past key visible to every row, no softcap,
// sink or mask (the merge then adds the new tokens' part and the value offsets as for any split); a past
// whose length the host knows: TQPagedAttention's (its calls of one sequence) and TQAttention's, not
// TQGroupQueryAttention's buffers, whose sequence's past is read on the device and may be shorter than
// past_len (the dense copy's key count).
bool dense_prefill_takes(const AttentionParams& p, const DeviceProps& dev) {
  if (!dense_prefill_enabled() || p.batch != 1 || p.present_rows > 0) return false;
  const Format kf = p.key_format, vf = p.value_format;
  if (!(is_mse(kf) || kf == Format::kFp8 || kf == Format::kRaw16)) return false;
  if (!(is_uint(vf) || vf == Format::kRaw16)) return false;
  if (!new_tokens_on_tensor_cores(p) || dev.cc_major < 8) return false;
  const int64_t group = p.kv_heads > 0 ? p.q_heads / p.kv_heads : 1;
  if (p.q_len * group < detail::chunk_geometry::kRows) return false;
  if (window_cuts(p) || p.softcap > 0.0f || p.head_sink) return false;
  if (p.mask_type != MaskType::kNone || (p.is_causal && p.new_len < p.q_len)) return false;
  return dense_past_bytes(p) <= kDensePastMaxBytes;
}

// Developer variant (TQ_FINISH_RESERVE=1): the SMs the bulk kernel leaves to the finish kernel, so that
// its blocks (a merge per query row, a packing block per 4 new vectors) start together as the split
// blocks end: at B = 1 with 32 query heads its 36 blocks found 4 free SMs beside 128 split blocks
// (docs/performance.md, the B = 1 step). TQ_FINISH_BLOCKS_PER_SM (finish.cu): its blocks per SM, 5
// at the registers ptxas gives it. Only where a few SMs cover them (larger batches fill the SMs the
// split blocks free).
#ifndef TQ_FINISH_RESERVE
#define TQ_FINISH_RESERVE 0
#endif
#ifndef TQ_FINISH_BLOCKS_PER_SM
#define TQ_FINISH_BLOCKS_PER_SM 5
#endif
int finish_reserve(const AttentionParams& p, const SplitLayout& l, int sms) {
  if (!TQ_FINISH_RESERVE) return 0;
  constexpr int kFinishBlocksPerSm = TQ_FINISH_BLOCKS_PER_SM, kVectorsPerPackBlock = 4;
  const int64_t vectors = p.batch * p.kv_heads * p.new_len;
  const int64_t blocks = p.batch * p.kv_heads * l.rows + 2 * ((vectors + kVectorsPerPackBlock - 1) / kVectorsPerPackBlock);
  const int64_t reserve = (blocks + kFinishBlocksPerSm - 1) / kFinishBlocksPerSm;
  return reserve <= sms / 16 ? static_cast<int>(reserve) : 0;
}

// The query rows' blocks, the same for every kernel (the finish kernel merges the rows by them).
SplitLayout row_layout(const AttentionParams& p) {
  SplitLayout l;
  l.group = static_cast<int>(p.kv_heads > 0 ? p.q_heads / p.kv_heads : 1);
  l.rows = p.q_len * l.group;
  l.rows_per_block = l.rows >= 8 ? 8 : l.rows >= 4 ? 4 : l.rows >= 2 ? 2 : 1;
  l.rows_per_block = l.rows > 4 && l.rows < 8 ? 8 : l.rows > 2 && l.rows < 4 ? 4 : l.rows_per_block;
  l.row_blocks = static_cast<int>((l.rows + l.rows_per_block - 1) / l.rows_per_block);
  return l;
}

// The splits: `target` blocks' worth of (b, head, row block) work, each split a multiple of `unit`
// tokens, at least one unit, and none empty.
// The past is the window's where there is one (visible_past: the kernels start each sequence's
// splits at its window's first key).
void split_past(const AttentionParams& p, int64_t target, int64_t unit, SplitLayout* l) {
  const int64_t past = visible_past(p);
  const int64_t base = p.batch * p.kv_heads * l->row_blocks;
  int64_t splits = base > 0 ? (target + base - 1) / base : 1;
  const int64_t max_splits = (past + unit - 1) / unit;
  splits = splits < 1 ? 1 : splits;
  splits = splits > max_splits ? max_splits : splits;
  l->splits = static_cast<int>(splits < 1 ? 1 : splits);
  l->split_len = (past + l->splits - 1) / l->splits;
  l->split_len = (l->split_len + unit - 1) / unit * unit;
  // rounded up to whole units, fewer splits may cover the past: no block is launched for none of it
  l->splits = static_cast<int>((past + l->split_len - 1) / l->split_len);
}

}  // namespace

bool dense_prefill_enabled() {
  const char* v = std::getenv("TURBOQUANT_DENSE_PREFILL");
  return v == nullptr || std::strcmp(v, "0") != 0;
}

bool chunk_wgmma_enabled() {
  const char* v = std::getenv("TURBOQUANT_CHUNK_WGMMA");
  return v != nullptr && std::strcmp(v, "1") == 0;
}

bool new_tokens_on_tensor_cores(const AttentionParams& p) {
  const bool half = p.dtype == DType::kFloat16 || p.dtype == DType::kBFloat16;
  const bool head = p.head_dim == 64 || p.head_dim == 128 || p.head_dim == 256;
  return half && head && p.v_head_dim == p.head_dim && p.q_len > 1 && p.new_len > 0;
}

PrefillKernel plan_prefill(const AttentionParams& p, const DeviceProps& dev) {
  if (!new_tokens_on_tensor_cores(p)) return PrefillKernel::kNone;
  const bool hopper = dev.sm90a && dev.cc_major == 9 && dev.cc_minor == 0;
  // the wgmma kernel has no sliding window, softcap or sink (prefill.cu has), nor head size 256
  // (prefill.cu's one m-tile per warp, its tiles in 160 KiB of shared memory, or 96 where the device
  // has less: every device of compute capability 8.0 or newer has 99 KiB)
  const bool features = window_cuts(p) || p.softcap > 0.0f || p.head_sink != nullptr;
  const bool wgmma = hopper && p.mask_type == MaskType::kNone && !features && p.head_dim <= 128;
  return wgmma ? PrefillKernel::kWgmma : PrefillKernel::kMma;
}

const char* prefill_kernel_name(PrefillKernel k) {
  switch (k) {
    case PrefillKernel::kMma: return "mma";
    case PrefillKernel::kWgmma: return "wgmma";
    default: return "none";
  }
}

const char* split_kernel_name(SplitKernel k) {
  switch (k) {
    case SplitKernel::kTensorCoreBulk: return "tc_bulk";
    case SplitKernel::kTensorCoreMma: return "tc_mma";
    case SplitKernel::kCudaCore: return "cuda_core";
    case SplitKernel::kTensorCoreChunk: return "tc_chunk";
    case SplitKernel::kTensorCoreChunkWgmma: return "tc_chunk_wgmma";
    case SplitKernel::kDensePrefill: return "dense_prefill";
    default: return "none";
  }
}

SplitPlan plan_split(const AttentionParams& p, bool caches_aligned16, const DeviceProps& dev) {
  SplitPlan plan;
  SplitLayout& l = plan.layout;
  l = row_layout(p);
  if (p.q_len == 0 || p.past_len == 0 || p.batch == 0) return plan;  // the finish kernel alone
  const int64_t base = p.batch * p.kv_heads * l.row_blocks;
  const int sms = dev.sms > 0 ? dev.sms : 1;
  size_t past_copy = 0;
  if (dense_prefill_takes(p, dev)) {
    // one split: the whole past, as the prefill kernel's keys
    plan.kernel = SplitKernel::kDensePrefill;
    l.splits = 1;
    l.split_len = p.past_len;
    past_copy = dense_past_bytes(p);
  } else if (chunk_takes(p, dev) && chunk_wgmma_takes(p, caches_aligned16, dev)) {
    // 128-row blocks, one per SM (their shared memory), the past split while whole waves allow
    namespace geo = detail::chunk_sm90_geometry;
    plan.kernel = SplitKernel::kTensorCoreChunkWgmma;
    l.rows_per_block = geo::kRows;
    l.row_blocks = static_cast<int>((l.rows + l.rows_per_block - 1) / l.rows_per_block);
    plan.smem = geo::smem_bytes(p.head_dim, static_cast<int>(p.key_row()), static_cast<int>(p.value_row()));
    const int64_t blocks = p.batch * p.kv_heads * l.row_blocks;
    split_past(p, blocks > 0 ? sms / blocks * blocks : 1, geo::kKeys, &l);
  } else if (chunk_takes(p, dev)) {
    // 64-row tiles of the chunk's rows, and the past split until about four blocks per SM
    plan.kernel = SplitKernel::kTensorCoreChunk;
    l.rows_per_block = detail::chunk_geometry::kRows;
    l.row_blocks = static_cast<int>((l.rows + l.rows_per_block - 1) / l.rows_per_block);
    plan.smem = detail::chunk_geometry::smem_bytes(p.head_dim);
    split_past(p, 4LL * sms, detail::chunk_geometry::kKeys, &l);
  } else if (const int warps = tc_bulk_warps(p, caches_aligned16, dev); warps > 0) {
    // 16 (or 8) warps of 32-token tiles per block and one wave of blocks, one per SM, each walking a
    // long slice of at least a tile per warp (at B=1, S=4096, 256-token splits left half of the
    // warps idle and twice the partial results to merge)
    plan.kernel = SplitKernel::kTensorCoreBulk;
    plan.warps = warps;
    plan.smem = tc_block_bytes(p, warps) - detail::tc_geometry::kStaticBytesMax;
    const int free = sms - finish_reserve(p, l, sms);
    split_past(p, base > 0 ? free / base * base : 1, static_cast<int64_t>(warps) * detail::tc_geometry::kTok, &l);
  } else {
    plan.kernel = mma_takes(p, dev) ? SplitKernel::kTensorCoreMma : SplitKernel::kCudaCore;
    split_past(p, 8LL * sms, kCudaCoreTile, &l);  // 8 blocks' worth per SM
    const int64_t stage = static_cast<int64_t>(kCudaCoreTile) * (p.key_row() + p.value_row());
    l.stage_bytes = stage <= kCudaCoreStageMax ? static_cast<int>((stage + 15) / 16 * 16) : 0;
    l.buffers = l.stage_bytes > 0 && l.split_len > kCudaCoreTile ? 2 : 1;  // double-buffer when a block takes several tiles
    plan.smem = plan.kernel == SplitKernel::kTensorCoreMma ? mma_dynamic_bytes(p) : l.buffers * l.stage_bytes;
  }
  const size_t row_bytes = static_cast<size_t>(2 + p.v_head_dim) * sizeof(float), rows = static_cast<size_t>(p.batch * p.kv_heads * l.rows);
  plan.workspace = rows * l.splits * row_bytes;
  plan.new_part = new_tokens_on_tensor_cores(p);
  if (plan.new_part) {
    plan.new_part_offset = (plan.workspace + 255) / 256 * 256;
    plan.workspace = plan.new_part_offset + rows * row_bytes;
  }
  if (past_copy > 0) {
    plan.past_copy_offset = (plan.workspace + 255) / 256 * 256;
    plan.workspace = plan.past_copy_offset + past_copy;
  }
  return plan;
}

}  // namespace turboquant::cuda
