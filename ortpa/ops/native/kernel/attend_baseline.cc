// The attention tile at the ISA the library is compiled for (x86-64 baseline: SSE2).
#include "internal.h"

namespace ortpa_native {
#define ORTPA_ATTEND_FN attend_tile_baseline
#include "attend_impl.inc"
#undef ORTPA_ATTEND_FN
}  // namespace ortpa_native
