#include "tensor/cpu/cpu_threads.h"

#include <sched.h>

#include <algorithm>
#include <cstdlib>
#include <exception>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "tensor/error.h"

namespace mpt::cpu {
namespace {

int threads_from_environment() {
  if (const char* text = std::getenv("MPT_CPU_THREADS"); text != nullptr && *text != '\0') {
    char* end = nullptr;
    const long n = std::strtol(text, &end, 10);
    check(*end == '\0' && n >= 1 && n <= 1024, "MPT_CPU_THREADS must be a whole number from 1 to 1024, got '{}'",
          text);
    return static_cast<int>(n);
  }
  // The CPUs this process may run on: a container or `taskset` narrows
  // them, which hardware_concurrency() does not see.
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

}  // namespace

int cpu_threads() {
  static const int count = threads_from_environment();
  return count;
}

void parallel_for(int64_t count, int64_t grain, int64_t min_grains_per_piece,
                  const std::function<void(int64_t begin, int64_t end)>& f) {
  if (count <= 0) return;
  const int64_t grains = (count + grain - 1) / grain;
  const int64_t pieces = std::clamp<int64_t>(grains / std::max<int64_t>(min_grains_per_piece, 1), 1, cpu_threads());
  if (pieces == 1) {
    f(0, count);
    return;
  }
  const int64_t per_piece = (grains + pieces - 1) / pieces * grain;
  std::vector<std::exception_ptr> errors(static_cast<size_t>(pieces));
  auto run = [&](int64_t piece) {
    const int64_t begin = piece * per_piece, end = std::min(count, begin + per_piece);
    if (begin >= end) return;
    try {
      f(begin, end);
    } catch (...) {
      errors[static_cast<size_t>(piece)] = std::current_exception();
    }
  };
  std::vector<std::jthread> others;
  for (int64_t piece = 1; piece < pieces; ++piece) {
    try {
      others.emplace_back(run, piece);
    } catch (const std::system_error&) {
      run(piece);  // no thread to be had: this one does the piece
    }
  }
  run(0);
  others.clear();  // joins
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace mpt::cpu
