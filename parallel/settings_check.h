#pragma once
// Settings every rank of a job must share (the model and its sizes, the
// precision, the loss scaler's rule, the batch, the data, the library's
// version), compared through the rendezvous store before any collective.
// Ranks started with different settings would otherwise hang in their first
// collective (different models or precisions all-reduce different buckets)
// or, worse, train on silently (a different batch size or seed); compared
// here, every rank ends within seconds with one message naming each setting
// that differs and each rank's value.
//
//   dist::Distributed world = dist::init_process_group();
//   dist::check_same_settings(*world.store, world.config.rank, world.config.world_size,
//                             {{"model", "mlp"}, {"batch size", std::to_string(batch)}});
#include <string>
#include <utility>
#include <vector>

#include "parallel/store.h"

namespace mpt::dist {

// Names and values, in the order a message should list them.
using Settings = std::vector<std::pair<std::string, std::string>>;

// Collective: every rank calls it with its own settings, in the same order
// of calls. Returns when all ranks' settings are equal; otherwise throws
// DistributedError on every rank, naming each differing setting with the
// value of each rank ("precision: 'fp16' on rank 0, 'bf16' on rank 1"). A
// setting that some rank lacks counts as differing. Waits for the other
// ranks at most the store's timeout (TimeoutError naming the missing ones).
void check_same_settings(Store& store, int rank, int world_size, const Settings& mine);

// The message check_same_settings gives for these ranks' settings (one
// entry per rank, rank order); empty when they agree. For tests and for
// callers who gather settings some other way.
std::string describe_differences(const std::vector<Settings>& per_rank);

}  // namespace mpt::dist
