#pragma once
// Training modes of a whole module tree. Module::train(on) sets every module
// below to one mode, so `eval() ... train()` around an evaluation leaves a
// model whose parts were in different modes (a dropout switched off for
// good, say) uniformly in training mode. These keep each module's own mode.
#include <utility>
#include <vector>

#include "models/module.h"

namespace mpt::nn {

// Every module of the tree in eval mode while the guard lives; each gets
// its own mode back when it ends, whatever the modes were.
class EvalModeGuard {
 public:
  explicit EvalModeGuard(Module& root);
  ~EvalModeGuard();
  EvalModeGuard(const EvalModeGuard&) = delete;
  EvalModeGuard& operator=(const EvalModeGuard&) = delete;

 private:
  std::vector<std::pair<Module*, bool>> modes_;  // depth first, parents before children
};

// Each module of `to` in the mode of its twin in `from` (the same
// architecture: twins are matched by position in the tree).
void copy_training_modes(const Module& from, Module& to);

}  // namespace mpt::nn
