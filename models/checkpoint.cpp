#include "models/checkpoint.h"

#include <charconv>
#include <cstring>

#include "tensor/ops.h"

namespace mpt::ckpt {
namespace {

constexpr const char* kOptimizerPrefix = "optimizer/";
constexpr const char* kExtraPrefix = "extra/";

int64_t parse_count(const io::Metadata& meta, const std::string& key, const std::string& path) {
  auto it = meta.find(key);
  check<IOError>(it != meta.end(), "read_checkpoint: '{}' lacks metadata '{}'", path, key);
  int64_t v = 0;
  const std::string& s = it->second;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  check<IOError>(ec == std::errc() && end == s.data() + s.size() && v >= 0,
                 "read_checkpoint: '{}': metadata '{}' = '{}' is not a count", path, key, s);
  return v;
}

uint64_t parse_u64(const io::Metadata& meta, const std::string& key, const std::string& path) {
  auto it = meta.find(key);
  check<IOError>(it != meta.end(), "read_checkpoint: '{}' lacks metadata '{}'", path, key);
  uint64_t v = 0;
  const std::string& s = it->second;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  check<IOError>(ec == std::errc() && end == s.data() + s.size(),
                 "read_checkpoint: '{}': metadata '{}' = '{}' is not an unsigned integer", path, key, s);
  return v;
}

bool starts_with(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }

}  // namespace

Checkpoint capture(const nn::Module& model, const optim::Optimizer& optimizer, int64_t step,
                   const data::DataPosition& position, const Generator& rng) {
  Checkpoint c;
  for (const auto& [k, t] : model.state_dict()) c.model.insert(k, prim::clone(t));
  for (const auto& [k, t] : optimizer.state_dict()) c.optimizer.insert(k, prim::clone(t));
  c.step = step;
  c.position = position;
  c.rng_seed = rng.seed();
  c.rng_offset = rng.offset();
  return c;
}

void save_checkpoint(const std::string& path, const Checkpoint& c, const io::PartialWriteHook& hook) {
  OrderedDict<Tensor> tensors;
  for (const auto& [k, t] : c.model) {
    check(k.find('/') == std::string::npos, "save_checkpoint('{}'): model key '{}' must not contain '/'", path, k);
    tensors.insert(k, t);
  }
  for (const auto& [k, t] : c.optimizer) tensors.insert(kOptimizerPrefix + k, t);
  for (const auto& [k, t] : c.extra) tensors.insert(kExtraPrefix + k, t);
  io::Metadata meta;
  for (const auto& [k, v] : c.info) {
    check(starts_with(k, "run."), "save_checkpoint('{}'): caller metadata key '{}' must start with 'run.'", path, k);
    meta[k] = v;
  }
  meta["format"] = kFormat;
  meta["step"] = std::to_string(c.step);
  meta["data.epoch"] = std::to_string(c.position.epoch);
  meta["data.batch"] = std::to_string(c.position.batch);
  meta["rng.seed"] = std::to_string(c.rng_seed);
  meta["rng.offset"] = std::to_string(c.rng_offset);
  io::save_safetensors(path, tensors, meta, hook);
}

Checkpoint read_checkpoint(const std::string& path) {
  io::TensorFile file = io::load_safetensors(path);
  check<IOError>(file.had_checksum,
                 "read_checkpoint: '{}' has no '{}' checksum; it was not written by save_checkpoint", path,
                 io::kChecksumKey);
  auto format = file.metadata.find("format");
  check<IOError>(format != file.metadata.end() && format->second == kFormat,
                 "read_checkpoint: '{}' has format '{}', expected '{}'", path,
                 format == file.metadata.end() ? "(none)" : format->second, kFormat);
  Checkpoint c;
  c.step = parse_count(file.metadata, "step", path);
  c.position.epoch = parse_count(file.metadata, "data.epoch", path);
  c.position.batch = parse_count(file.metadata, "data.batch", path);
  c.rng_seed = parse_u64(file.metadata, "rng.seed", path);
  c.rng_offset = parse_u64(file.metadata, "rng.offset", path);
  for (const auto& [k, v] : file.metadata)
    if (starts_with(k, "run.")) c.info[k] = v;
  for (const auto& [k, t] : file.tensors) {
    if (starts_with(k, kOptimizerPrefix))
      c.optimizer.insert(k.substr(std::strlen(kOptimizerPrefix)), t);
    else if (starts_with(k, kExtraPrefix))
      c.extra.insert(k.substr(std::strlen(kExtraPrefix)), t);
    else
      c.model.insert(k, t);
  }
  return c;
}

void restore(const Checkpoint& c, nn::Module& model, optim::Optimizer& optimizer, Generator& rng,
             const std::string& source) {
  // The model load checks everything before it copies; so does the
  // optimizer's. Keep the model's values to put back if the optimizer refuses.
  nn::StateDict before;
  for (const auto& [k, t] : model.state_dict()) before.insert(k, prim::clone(t));
  try {
    model.load_state_dict(c.model, /*strict=*/true);
  } catch (const Error& e) {
    throw ValueError(fmt::format("{} does not fit this model ({}), nothing was loaded: {}", source,
                                 model.type_name(), e.what()));
  }
  try {
    optimizer.load_state_dict(c.optimizer);
  } catch (const Error& e) {
    model.load_state_dict(before, true);
    throw ValueError(fmt::format("{} does not fit this optimizer ({}), nothing was loaded: {}", source,
                                 optimizer.name(), e.what()));
  }
  rng.set_state(c.rng_seed, c.rng_offset);
}

}  // namespace mpt::ckpt
