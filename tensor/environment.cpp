#include "tensor/environment.h"

#include <cstdlib>

#include "tensor/error.h"

namespace mpt {

std::optional<long long> whole_number_from_environment(const char* name, long long min, long long max) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return std::nullopt;
  char* end = nullptr;
  const long long n = std::strtoll(text, &end, 10);
  check(*end == '\0' && n >= min && n <= max, "{} must be a whole number from {} to {}, got '{}'", name, min, max,
        text);
  return n;
}

}  // namespace mpt
