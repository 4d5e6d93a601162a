// The one entry to the CPU kernels (turboquant::cpu, cpu_kernels.h). CMakeLists.txt compiles the kernel
// sources once per instruction set, each into a namespace of its own (cpu_x86_64: any x86-64 CPU;
// cpu_x86_64_v3: AVX2, FMA and F16C), so that one library runs on every x86-64 CPU; this file, compiled
// for the baseline, picks one at library load. TURBOQUANT_CPU_BASELINE=1 forces the baseline (its tests).
#include <cstdlib>
#include <cstring>

#include "turboquant/cpu_kernels.h"

#define TQ_CPU_KERNELS(X) X(serial_for) X(encode_vector) X(decode_vector) X(pack) X(unpack) X(attention) X(gqa_attention)
#define TQ_DECLARE(name) decltype(cpu::name) name;

namespace turboquant {
#if defined(TQ_CPU_X86_64_V3)
namespace cpu_x86_64 { TQ_CPU_KERNELS(TQ_DECLARE) }
namespace cpu_x86_64_v3 { TQ_CPU_KERNELS(TQ_DECLARE) }
#else
namespace cpu_generic { TQ_CPU_KERNELS(TQ_DECLARE) }
#endif

namespace cpu {
namespace {

struct Kernels {
  const char* instruction_set;
#define TQ_POINTER(name) decltype(&cpu::name) name;
  TQ_CPU_KERNELS(TQ_POINTER)
#undef TQ_POINTER
};

#define TQ_TABLE(ns, isa) Kernels { isa, &ns::serial_for, &ns::encode_vector, &ns::decode_vector, &ns::pack, &ns::unpack, &ns::attention, &ns::gqa_attention }

Kernels choose() {
#if defined(TQ_CPU_X86_64_V3)
  const char* force = std::getenv("TURBOQUANT_CPU_BASELINE");
  const bool baseline = force != nullptr && std::strcmp(force, "") != 0 && std::strcmp(force, "0") != 0;
  __builtin_cpu_init();  // a constructor of a shared library may run before libgcc's own
  if (!baseline && __builtin_cpu_supports("x86-64-v3")) return TQ_TABLE(cpu_x86_64_v3, "x86-64-v3");
  return TQ_TABLE(cpu_x86_64, "x86-64");
#else
  return TQ_TABLE(cpu_generic, "generic");
#endif
}

const Kernels kKernels = choose();

}  // namespace

const char* instruction_set() { return kKernels.instruction_set; }

void serial_for(size_t n, const std::function<void(size_t)>& fn) { kKernels.serial_for(n, fn); }

void encode_vector(Format fmt, int d, bool norm_correction, const float* x, uint8_t* out) {
  kKernels.encode_vector(fmt, d, norm_correction, x, out);
}

void decode_vector(Format fmt, int d, const uint8_t* in, float* out) { kKernels.decode_vector(fmt, d, in, out); }

void pack(Format fmt, int d, bool norm_correction, DType dt, const void* x, int64_t n, const Offset& offset,
          uint8_t* out, const ParallelFor& pfor) {
  kKernels.pack(fmt, d, norm_correction, dt, x, n, offset, out, pfor);
}

void unpack(Format fmt, int d, const uint8_t* in, int64_t n, const Offset& offset, DType dt, void* out,
            const ParallelFor& pfor) {
  kKernels.unpack(fmt, d, in, n, offset, dt, out, pfor);
}

void attention(const AttentionParams& p, const void* q, const void* k, const void* v, const void* mask,
               const uint8_t* past_key, const uint8_t* past_value, void* y, uint8_t* present_key,
               uint8_t* present_value, const ParallelFor& pfor) {
  kKernels.attention(p, q, k, v, mask, past_key, past_value, y, present_key, present_value, pfor);
}

void gqa_attention(const AttentionParams& p, const RotaryParams& rot, const void* q, const void* k, const void* v,
                   const uint8_t* past_key, const uint8_t* past_value, void* y, uint8_t* present_key,
                   uint8_t* present_value, const ParallelFor& pfor) {
  kKernels.gqa_attention(p, rot, q, k, v, past_key, past_value, y, present_key, present_value, pfor);
}

}  // namespace cpu
}  // namespace turboquant
