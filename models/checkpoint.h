#pragma once
// Training checkpoints: everything a run needs to continue exactly where it
// stopped, in one safetensors file (models/safetensors.h).
//
// Layout of the file:
//   <name>               the model's state dict under its own names, so
//                        PyTorch's safetensors.torch.load_file() gives
//                        weights that load_state_dict() accepts by name
//   optimizer/<key>      the optimizer's flat state dict (models/optimizer.h)
//   extra/<key>          free-form named tensors: the loss scaler's state, ...
//   metadata             format, step, data position (epoch, batch), RNG
//                        (seed, offset), and any caller entries ("run.*")
// A model name containing '/' is refused, so the parts cannot collide.
#include <map>
#include <string>

#include "models/data_loader.h"
#include "models/module.h"
#include "models/optimizer.h"
#include "models/safetensors.h"
#include "tensor/random.h"

namespace mpt::ckpt {

inline constexpr const char* kFormat = "mptrain-checkpoint-1";

struct Checkpoint {
  nn::StateDict model;
  optim::StateDict optimizer;
  OrderedDict<Tensor> extra;       // e.g. GradScaler::state_dict()
  int64_t step = 0;                // optimizer steps taken
  data::DataPosition position;     // next batch to train on
  uint64_t rng_seed = 0, rng_offset = 0;
  io::Metadata info;               // caller's own entries (model kind, options)
};

// Snapshot of live objects (tensors are copied to the host when written,
// so the objects may keep training afterwards).
Checkpoint capture(const nn::Module& model, const optim::Optimizer& optimizer, int64_t step,
                   const data::DataPosition& position, const Generator& rng);

// Atomic write (see io::save_safetensors); `hook` is for tests only.
void save_checkpoint(const std::string& path, const Checkpoint& checkpoint, const io::PartialWriteHook& hook = {});

// Reads and validates the file: structure, checksum (required here: a
// checkpoint without one is refused), format and every metadata field.
Checkpoint read_checkpoint(const std::string& path);

// Loads a checkpoint into live objects, all or nothing: if the model or the
// optimizer refuses its part (names, shapes, counts), both are left as
// they were and the error says which part and why. The RNG is set last.
void restore(const Checkpoint& checkpoint, nn::Module& model, optim::Optimizer& optimizer, Generator& rng,
             const std::string& source = "checkpoint");

}  // namespace mpt::ckpt
