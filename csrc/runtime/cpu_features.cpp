#include "runtime/cpu_features.h"

#include <cstring>

#if defined(__aarch64__)
#include <sys/auxv.h>
#if __has_include(<asm/hwcap.h>)
#include <asm/hwcap.h>
#endif
#endif

namespace scorch {
namespace {

struct Row {
  const char* arch;
  const char* macro;
  const char* name;
  bool (*has)();  // null: cannot be checked by this build
};

#if defined(__x86_64__)
// __builtin_cpu_supports takes string literals only, hence one function per feature. libgcc's detection
// also requires the OS to save the AVX / AVX-512 register state (XGETBV) before reporting those features.
#define SCORCH_X86(feature) [] { __builtin_cpu_init(); return __builtin_cpu_supports(feature) != 0; }
#else
#define SCORCH_X86(feature) nullptr
#endif

#if defined(__aarch64__)
#define SCORCH_HWCAP(word, bit) [] { return (getauxval(word) & (bit)) != 0; }
#define SCORCH_ARM_ROW(macro, name, word, bit) {"aarch64", macro, name, SCORCH_HWCAP(word, bit)}
#else
#define SCORCH_ARM_ROW(macro, name, word, bit) {"aarch64", macro, name, nullptr}
#endif

// Bits the system headers do not define (older kernels, other architectures) read as absent features.
#ifndef HWCAP_ASIMD
#define HWCAP_ASIMD 0
#endif
#ifndef HWCAP_FP
#define HWCAP_FP 0
#endif
#ifndef HWCAP_ASIMDHP
#define HWCAP_ASIMDHP 0
#endif
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP 0
#endif
#ifndef HWCAP_ATOMICS
#define HWCAP_ATOMICS 0
#endif
#ifndef HWCAP_CRC32
#define HWCAP_CRC32 0
#endif
#ifndef HWCAP_SVE
#define HWCAP_SVE 0
#endif
#ifndef HWCAP2_SVE2
#define HWCAP2_SVE2 0
#endif
#ifndef HWCAP2_BF16
#define HWCAP2_BF16 0
#endif
#ifndef HWCAP2_I8MM
#define HWCAP2_I8MM 0
#endif
#ifndef AT_HWCAP
#define AT_HWCAP 16
#endif
#ifndef AT_HWCAP2
#define AT_HWCAP2 26
#endif

// Features compiled code may use (instruction-set extensions the compiler's code generation emits; not
// system-level ones such as XSAVE's or FSGSBASE's).
const std::vector<Row>& table() {
  static const std::vector<Row> rows = {
      {"x86_64", "__SSE__", "sse", SCORCH_X86("sse")},
      {"x86_64", "__SSE2__", "sse2", SCORCH_X86("sse2")},
      {"x86_64", "__SSE3__", "sse3", SCORCH_X86("sse3")},
      {"x86_64", "__SSSE3__", "ssse3", SCORCH_X86("ssse3")},
      {"x86_64", "__SSE4_1__", "sse4.1", SCORCH_X86("sse4.1")},
      {"x86_64", "__SSE4_2__", "sse4.2", SCORCH_X86("sse4.2")},
      {"x86_64", "__SSE4A__", "sse4a", SCORCH_X86("sse4a")},
      {"x86_64", "__POPCNT__", "popcnt", SCORCH_X86("popcnt")},
      {"x86_64", "__LZCNT__", "lzcnt", SCORCH_X86("lzcnt")},
      {"x86_64", "__MOVBE__", "movbe", SCORCH_X86("movbe")},
      {"x86_64", "__BMI__", "bmi", SCORCH_X86("bmi")},
      {"x86_64", "__BMI2__", "bmi2", SCORCH_X86("bmi2")},
      {"x86_64", "__ADX__", "adx", SCORCH_X86("adx")},
      {"x86_64", "__AES__", "aes", SCORCH_X86("aes")},
      {"x86_64", "__PCLMUL__", "pclmul", SCORCH_X86("pclmul")},
      {"x86_64", "__SHA__", "sha", SCORCH_X86("sha")},
      {"x86_64", "__F16C__", "f16c", SCORCH_X86("f16c")},
      {"x86_64", "__AVX__", "avx", SCORCH_X86("avx")},
      {"x86_64", "__AVX2__", "avx2", SCORCH_X86("avx2")},
      {"x86_64", "__FMA__", "fma", SCORCH_X86("fma")},
      {"x86_64", "__FMA4__", "fma4", SCORCH_X86("fma4")},
      {"x86_64", "__XOP__", "xop", SCORCH_X86("xop")},
      {"x86_64", "__AVXVNNI__", "avxvnni", SCORCH_X86("avxvnni")},
      {"x86_64", "__GFNI__", "gfni", SCORCH_X86("gfni")},
      {"x86_64", "__VAES__", "vaes", SCORCH_X86("vaes")},
      {"x86_64", "__VPCLMULQDQ__", "vpclmulqdq", SCORCH_X86("vpclmulqdq")},
      {"x86_64", "__AVX512F__", "avx512f", SCORCH_X86("avx512f")},
      {"x86_64", "__AVX512CD__", "avx512cd", SCORCH_X86("avx512cd")},
      {"x86_64", "__AVX512VL__", "avx512vl", SCORCH_X86("avx512vl")},
      {"x86_64", "__AVX512BW__", "avx512bw", SCORCH_X86("avx512bw")},
      {"x86_64", "__AVX512DQ__", "avx512dq", SCORCH_X86("avx512dq")},
      {"x86_64", "__AVX512IFMA__", "avx512ifma", SCORCH_X86("avx512ifma")},
      {"x86_64", "__AVX512VBMI__", "avx512vbmi", SCORCH_X86("avx512vbmi")},
      {"x86_64", "__AVX512VBMI2__", "avx512vbmi2", SCORCH_X86("avx512vbmi2")},
      {"x86_64", "__AVX512VNNI__", "avx512vnni", SCORCH_X86("avx512vnni")},
      {"x86_64", "__AVX512BITALG__", "avx512bitalg", SCORCH_X86("avx512bitalg")},
      {"x86_64", "__AVX512VPOPCNTDQ__", "avx512vpopcntdq", SCORCH_X86("avx512vpopcntdq")},
      {"x86_64", "__AVX512BF16__", "avx512bf16", SCORCH_X86("avx512bf16")},
      {"x86_64", "__AVX512FP16__", "avx512fp16", SCORCH_X86("avx512fp16")},
      {"x86_64", "__AVX512VP2INTERSECT__", "avx512vp2intersect", SCORCH_X86("avx512vp2intersect")},
      SCORCH_ARM_ROW("__ARM_NEON", "neon", AT_HWCAP, HWCAP_ASIMD),
      SCORCH_ARM_ROW("__ARM_FEATURE_FMA", "fma", AT_HWCAP, HWCAP_FP),
      SCORCH_ARM_ROW("__ARM_FEATURE_FP16_VECTOR_ARITHMETIC", "fp16", AT_HWCAP, HWCAP_ASIMDHP),
      SCORCH_ARM_ROW("__ARM_FEATURE_DOTPROD", "dotprod", AT_HWCAP, HWCAP_ASIMDDP),
      SCORCH_ARM_ROW("__ARM_FEATURE_ATOMICS", "atomics", AT_HWCAP, HWCAP_ATOMICS),
      SCORCH_ARM_ROW("__ARM_FEATURE_CRC32", "crc32", AT_HWCAP, HWCAP_CRC32),
      SCORCH_ARM_ROW("__ARM_FEATURE_SVE", "sve", AT_HWCAP, HWCAP_SVE),
      SCORCH_ARM_ROW("__ARM_FEATURE_SVE2", "sve2", AT_HWCAP2, HWCAP2_SVE2),
      SCORCH_ARM_ROW("__ARM_FEATURE_BF16_VECTOR_ARITHMETIC", "bf16", AT_HWCAP2, HWCAP2_BF16),
      SCORCH_ARM_ROW("__ARM_FEATURE_MATMUL_INT8", "i8mm", AT_HWCAP2, HWCAP2_I8MM),
  };
  return rows;
}

}  // namespace

const char* host_arch() {
#if defined(__x86_64__)
  return "x86_64";
#elif defined(__aarch64__)
  return "aarch64";
#elif defined(__arm__)
  return "arm";
#elif defined(__riscv)
  return "riscv";
#elif defined(__powerpc64__)
  return "ppc64";
#else
  return "unknown";
#endif
}

std::vector<std::string> isa_features_from_macros(const std::set<std::string>& defined) {
  std::vector<std::string> out;
  for (const Row& r : table())
    if (defined.count(r.macro)) out.push_back(r.name);
  return out;
}

IsaCheck check_cpu_features(const std::vector<std::string>& features) {
  IsaCheck c;
  for (const auto& f : features) {
    const Row* row = nullptr;
    for (const Row& r : table())
      if (std::strcmp(r.arch, host_arch()) == 0 && f == r.name) row = &r;
    if (!row || !row->has) c.unknown.push_back(f);
    else if (!row->has()) c.missing.push_back(f);
  }
  return c;
}

}  // namespace scorch
