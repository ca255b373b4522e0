#pragma once
#include "tensor/backend.h"

namespace mpt {

Backend& cpu_backend();

}  // namespace mpt
