// PTX wrappers for Hopper's warpgroup matrix products (wgmma, sm_90a only): shared-memory matrix
// descriptors of 128-byte-swizzled tiles, the fences and groups that order the asynchronous
// products, and the shapes prefill_sm90.cu uses. A warpgroup is 4 consecutive warps (128 threads)
// starting at a warp index divisible by 4; all of its threads issue each instruction together.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace turboquant::cuda::detail::wgmma {

// Operands are 128-byte-swizzled tiles of 16-bit elements in shared memory, as the tensor copy engine
// writes them: column blocks (atoms) of 64 elements, each `rows` rows of 128 bytes, 1024-byte
// aligned; the 16-byte chunk c of row r lies at chunk c ^ (r % 8) of its row (descriptor swizzle
// mode 1).
__device__ __forceinline__ uint64_t encode(uint32_t bytes) { return (bytes & 0x3FFFFu) >> 4; }

// A K-major operand (rows along M or N, 16 elements of K read from each row): 8-row groups 1024
// bytes apart; the leading offset is unused with swizzling. addr: row 0 of the product's K slice
// (an atom's base plus 32 bytes per 16 elements).
__device__ __forceinline__ uint64_t desc_k_major(uint32_t addr) {
  return encode(addr) | (encode(16) << 16) | (encode(1024) << 32) | (1ull << 62);
}
// An MN-major operand (B = V: rows along K, each holding 64 consecutive elements of N per atom): the
// next 64 elements of N `atom_bytes` further, the next 8 rows of K 1024 bytes further. addr: row 0
// of the product's 16 rows of K.
__device__ __forceinline__ uint64_t desc_mn_major(uint32_t addr, uint32_t atom_bytes) {
  return encode(addr) | (encode(atom_bytes) << 16) | (encode(1024) << 32) | (1ull << 62);
}

// Orders this thread's earlier register and shared-memory accesses before the products that follow.
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Keeps the compiler from moving accesses of an accumulator across the asynchronous products: the
// asm statements that issue them name the registers, but the products write them until wait().
template <int N>
__device__ __forceinline__ void fence_registers(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// d (64 x N, fp32 accumulators of the warpgroup) = A B + (scale_d ? d : 0), one instruction for each
// shape and operand form, TY the inputs' type ("f16" or "bf16"). SS: A and B from shared memory
// through descriptors, both K-major. RS_*_TB: A from registers (the accumulator layout of a product
// packed to 16-bit pairs), B MN-major (transposed).
#define TQ_WGMMA_SS_M64N128K16(TY)                                                                                  \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                                  \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, "  \
               "p, 1, 1, 0, 0;\n}\n"                                                                        \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),  \
                 "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),  \
                 "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),  \
                 "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),  \
                 "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),  \
                 "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),  \
                 "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),  \
                 "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])                                                                                 \
               : "l"(a), "l"(b), "r"(scale_d))

#define TQ_WGMMA_RS_M64N128K16_TB(TY)                                                                                  \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                                  \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "                    \
               "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"                                  \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),  \
                 "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),  \
                 "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),  \
                 "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),  \
                 "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),  \
                 "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),  \
                 "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),  \
                 "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])                                                                                 \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d))

#define TQ_WGMMA_RS_M64N64K16_TB(TY)                                                                                  \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                                  \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "                    \
               "{%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"                                  \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),  \
                 "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),  \
                 "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),  \
                 "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])                                                                                 \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d))

template <typename T>
struct Ops;
template <>
struct Ops<__half> {
  static __device__ __forceinline__ void ss_n128(float (&d)[64], uint64_t a, uint64_t b, int scale_d) {
    TQ_WGMMA_SS_M64N128K16("f16");
  }
  static __device__ __forceinline__ void rs_tb(float (&d)[64], const uint32_t (&a)[4], uint64_t b, int scale_d = 1) {
    TQ_WGMMA_RS_M64N128K16_TB("f16");
  }
  static __device__ __forceinline__ void rs_tb(float (&d)[32], const uint32_t (&a)[4], uint64_t b, int scale_d = 1) {
    TQ_WGMMA_RS_M64N64K16_TB("f16");
  }
};
template <>
struct Ops<__nv_bfloat16> {
  static __device__ __forceinline__ void ss_n128(float (&d)[64], uint64_t a, uint64_t b, int scale_d) {
    TQ_WGMMA_SS_M64N128K16("bf16");
  }
  static __device__ __forceinline__ void rs_tb(float (&d)[64], const uint32_t (&a)[4], uint64_t b, int scale_d = 1) {
    TQ_WGMMA_RS_M64N128K16_TB("bf16");
  }
  static __device__ __forceinline__ void rs_tb(float (&d)[32], const uint32_t (&a)[4], uint64_t b, int scale_d = 1) {
    TQ_WGMMA_RS_M64N64K16_TB("bf16");
  }
};

#undef TQ_WGMMA_SS_M64N128K16
#undef TQ_WGMMA_RS_M64N128K16_TB
#undef TQ_WGMMA_RS_M64N64K16_TB

}  // namespace turboquant::cuda::detail::wgmma
