#pragma once
// What mpt-train does with checkpoint files: a run records its whole
// configuration, its shards and its data in the checkpoint, a resumed run
// reads that record back, and a run never replaces another run's
// checkpoint unasked.
#include <string>

#include <nlohmann/json.hpp>

#include "models/checkpoint.h"
#include "tools/mpt-train/train_config.h"

namespace mpt::tools {

// The checkpoint's metadata entries for this run: "run.config" (every
// saved option as the run resolved it, as JSON), "run.world_size" and
// "run.data_identity".
io::Metadata run_record(const TrainConfig& c, int64_t world_size, const std::string& data_identity);

// The run configuration a checkpoint recorded; null for one written before
// checkpoints recorded it. IOError for a record that is not readable.
nlohmann::json recorded_config(const ckpt::Checkpoint& saved, const std::string& source);

// A checkpoint written before the whole configuration was recorded names a
// few options of its run ("run.model", ...): those must agree (ValueError).
void check_older_record(const TrainConfig& c, const ckpt::Checkpoint& saved, const std::string& source);

// IOError when --checkpoint names an existing file that this run does not
// resume, unless --overwrite: naming what the file holds and the ways out.
void refuse_to_replace(const TrainConfig& c);

// Makes the checkpoint's folder before training, so that a path that cannot
// be written fails now rather than at the first save, after the work.
void prepare_checkpoint_path(const std::string& checkpoint);

// A path the run records: absolute, so that a resumed run finds it from
// any folder. The data sets' own names ("fashion-mnist", "fortunes") stay.
std::string recorded_path(const std::string& path);

}  // namespace mpt::tools
