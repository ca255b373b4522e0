#include "models/training_mode.h"

namespace mpt::nn {

EvalModeGuard::EvalModeGuard(Module& root) {
  for (const auto& [name, module] : root.named_modules()) modes_.emplace_back(module, module->is_training());
  root.eval();
}

EvalModeGuard::~EvalModeGuard() {
  // Parents first: a parent's train() reaches its children, whose own mode
  // is then set again.
  for (const auto& [module, training] : modes_)
    if (module->is_training() != training) module->train(training);
}

void copy_training_modes(const Module& from, Module& to) {
  if (to.is_training() != from.is_training()) to.train(from.is_training());
  const auto& from_children = from.named_children();
  const auto& to_children = to.named_children();
  for (size_t i = 0; i < from_children.size() && i < to_children.size(); ++i)
    copy_training_modes(*from_children[i].second, *to_children[i].second);
}

}  // namespace mpt::nn
