#pragma once
// Scaler research without training: overflow patterns (generated or read
// from a file) replayed through a policy's rule, giving the trajectory the
// scaler would follow. The rule is amp/scale_rule.h, the one the scaler runs.
#include <cstdint>
#include <string>
#include <vector>

#include "amp/grad_scaler.h"
#include "amp/scaler_trace.h"

namespace mpt::amp {

// Each step overflows with probability p (seeded: the same pattern from
// every build; step i overflows when the i-th number of mt19937_64(seed),
// its top 53 bits as a fraction of 2^53, is below p).
std::vector<bool> bernoulli_overflows(int64_t steps, double p, uint64_t seed);
// `length` consecutive overflows starting every `every` steps (from step `every - 1`).
std::vector<bool> burst_overflows(int64_t steps, int64_t every, int64_t length);
// One overflow every `period` steps (steps period-1, 2*period-1, ...).
std::vector<bool> periodic_overflows(int64_t steps, int64_t period);
// A text file with one 0/1 (or false/true) per line; '#' starts a comment.
// A scaler trace (.jsonl/.csv) is read too: its found_inf column.
std::vector<bool> read_overflow_pattern(const std::string& path);
// "bernoulli:0.01", "bursts:500:3", "periodic:1000", "file:PATH" (ValueError otherwise).
std::vector<bool> overflow_pattern_from_spec(const std::string& spec, int64_t steps, uint64_t seed);

// The trajectory under `options` (growth counted in optimizer steps, one
// unit per step); each row names options.policy, first_nonfinite is empty
// and grad_norm -1 (no gradients were measured).
std::vector<ScalerTraceRow> replay_overflows(const GradScalerOptions& options, const std::vector<bool>& overflows);

}  // namespace mpt::amp
