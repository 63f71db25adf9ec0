#include "lora_trainer/kernels/vector_math.hpp"

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace lt::vec {

namespace {

Isa widest_supported() {
#if LT_VECTOR_ISAS
  __builtin_cpu_init();
  if (__builtin_cpu_supports("x86-64-v4")) return Isa::Avx512;
  if (__builtin_cpu_supports("x86-64-v3")) return Isa::Avx2;
#endif
  return Isa::Baseline;
}

Isa choose() {
  const Isa best = widest_supported();
  const char* env = std::getenv("LT_CPU_KERNELS");
  if (!env || !*env || std::strcmp(env, "auto") == 0) return best;
  for (const Isa want : {Isa::Baseline, Isa::Avx2, Isa::Avx512}) {
    if (std::strcmp(env, isa_name(want)) != 0) continue;
    if (want <= best) return want;
    std::fprintf(stderr, "note: LT_CPU_KERNELS=%s: this CPU (or build) runs at most %s; using %s\n", env,
                 isa_name(best), isa_name(best));
    return best;
  }
  std::fprintf(stderr, "note: LT_CPU_KERNELS=%s is none of auto, baseline, avx2, avx512; using %s\n", env,
               isa_name(best));
  return best;
}

}  // namespace

Isa isa() {
  static const Isa chosen = choose();
  return chosen;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::Avx512: return "avx512";
    case Isa::Avx2: return "avx2";
    default: return "baseline";
  }
}

}  // namespace lt::vec
