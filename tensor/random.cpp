#include "tensor/random.h"

namespace mpt {

Generator& default_generator() {
  thread_local Generator gen(0);
  return gen;
}

void manual_seed(uint64_t seed) { default_generator().manual_seed(seed); }

}  // namespace mpt
