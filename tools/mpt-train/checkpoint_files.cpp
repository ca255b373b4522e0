#include "tools/mpt-train/checkpoint_files.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "tools/mpt-train/run_settings.h"

namespace mpt::tools {
namespace {

// Whether two paths name one file (both exist).
bool same_file(const std::string& a, const std::string& b) {
  std::error_code error;
  return std::filesystem::equivalent(a, b, error);
}

}  // namespace

// Makes the checkpoint's folder before training, so that a path that cannot
// be written fails now rather than at the first save, after the work.
void prepare_checkpoint_path(const std::string& checkpoint) {
  namespace fs = std::filesystem;
  std::error_code ignored;
  check<IOError>(!fs::is_directory(checkpoint, ignored), "mpt-train: --checkpoint '{}' is a folder; name a file in it",
                 checkpoint);
  const fs::path dir = fs::path(checkpoint).parent_path();
  if (!dir.empty()) {
    std::error_code error;
    fs::create_directories(dir, error);
    check<IOError>(!error, "mpt-train: --checkpoint '{}': cannot make its folder '{}': {}", checkpoint, dir.string(),
                   error.message());
  }
  const std::string folder = dir.empty() ? "." : dir.string();
  check<IOError>(::access(folder.c_str(), W_OK | X_OK) == 0, "mpt-train: --checkpoint '{}': cannot write into '{}': {}",
                 checkpoint, folder, std::strerror(errno));
}

// What a checkpoint records about its run: the whole configuration (the
// options as this run resolved them), how many shards its data position
// counts in, and what the data was.
io::Metadata run_record(const TrainConfig& c, int64_t world_size, const std::string& data_identity) {
  return {{"run.config", saved_options(c).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)},
          {"run.world_size", std::to_string(world_size)},
          {"run.data_identity", data_identity}};
}

// The run configuration a checkpoint recorded; null for one written before
// checkpoints recorded it.
nlohmann::json recorded_config(const ckpt::Checkpoint& saved, const std::string& source) {
  const auto it = saved.info.find("run.config");
  if (it == saved.info.end()) return nullptr;
  try {
    nlohmann::json config = nlohmann::json::parse(it->second);
    check(config.is_object(), "not an object");
    return config;
  } catch (const std::exception& e) {
    throw IOError(fmt::format("mpt-train: --resume '{}': the checkpoint's run configuration is not readable: {}", source,
                              e.what()));
  }
}

// A checkpoint written before the whole configuration was recorded names a
// few options of its run ("run.model", ...): those must agree.
void check_older_record(const TrainConfig& c, const ckpt::Checkpoint& saved, const std::string& source) {
  const io::Metadata expected{{"run.model", c.model},
                              {"run.batch_size", std::to_string(c.batch_size)},
                              {"run.accumulation", std::to_string(c.accumulation)},
                              {"run.seed", std::to_string(c.seed)},
                              {"run.optimizer", c.optimizer},
                              {"run.precision", c.precision},
                              {"run.scaler", c.scaler}};
  for (const auto& [key, value] : expected) {
    const auto it = saved.info.find(key);
    check(it == saved.info.end() || it->second == value,
          "mpt-train: --resume '{}' was written for {} '{}', but this run has '{}'", source, key,
          it == saved.info.end() ? "" : it->second, value);
  }
}

// A run writes --checkpoint over an existing file only when it continues
// that file's run, or when told to: another run's checkpoint (an MLP's
// under the name of a CNN's) is not replaced by mistake.
void refuse_to_replace(const TrainConfig& c) {
  namespace fs = std::filesystem;
  std::error_code error;
  if (c.checkpoint.empty() || c.overwrite || !fs::exists(c.checkpoint, error)) return;
  if (!c.resume.empty() && same_file(c.resume, c.checkpoint)) return;
  std::string what;
  try {
    const ckpt::Checkpoint existing = ckpt::read_checkpoint(c.checkpoint);
    const nlohmann::json config = recorded_config(existing, c.checkpoint);
    const std::string model = config.is_object() && config.contains("model") ? config["model"].get<std::string>()
                                                                             : "a model";
    what = fmt::format("it holds a run of {} at step {}", model, existing.step);
  } catch (const std::exception&) {
    what = "it is not a checkpoint this run can read";
  }
  throw IOError(fmt::format("mpt-train: --checkpoint '{}' already exists ({}), and this run would replace it. Continue "
                            "that run with --resume '{}' (or --auto-resume), or replace it with --overwrite",
                            c.checkpoint, what, c.checkpoint));
}

// A path the run records: absolute, so that a resumed run finds it from
// any folder. The data sets' own names stay names.
std::string recorded_path(const std::string& path) {
  if (path.empty() || path == "fashion-mnist" || path == "fortunes") return path;
  return std::filesystem::absolute(path).lexically_normal().string();
}

}  // namespace mpt::tools
