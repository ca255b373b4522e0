#include "tensor/matmul_sm_reserve.h"

namespace mpt {
namespace {
thread_local MatmulSmReserve t_reserve;
}

void set_matmul_sm_reserve(MatmulSmReserve reserve) { t_reserve = reserve; }

MatmulSmReserve matmul_sm_reserve() { return t_reserve; }

int take_matmul_sm_reserve() {
  if (t_reserve.sms <= 0 || t_reserve.matmuls == 0) return 0;
  if (t_reserve.matmuls > 0) --t_reserve.matmuls;
  return t_reserve.sms;
}

}  // namespace mpt
