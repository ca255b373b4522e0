#include "autograd/grad_mode.h"

namespace mpt {
namespace {
thread_local bool t_grad_enabled = true;
}

bool grad_enabled() { return t_grad_enabled; }
void set_grad_enabled(bool on) { t_grad_enabled = on; }

}  // namespace mpt
