#pragma once
// Settings read from environment variables (MPT_CPU_THREADS, MPT_CPU_CACHE_MB).
#include <optional>

namespace mpt {

// The variable `name` as a whole number from min to max; nullopt where it
// is unset or empty. Any other text is an error naming the variable, the
// range and the text.
std::optional<long long> whole_number_from_environment(const char* name, long long min, long long max);

}  // namespace mpt
