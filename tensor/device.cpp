#include "tensor/device.h"

#include <fmt/format.h>

#include "tensor/error.h"

namespace mpt {

Device::Device(const std::string& spec) {
  const auto colon = spec.find(':');
  const std::string kind = spec.substr(0, colon);
  if (kind == "cpu") {
    type = DeviceType::cpu;
  } else if (kind == "cuda" || kind == "gpu") {
    type = DeviceType::cuda;
  } else {
    throw DeviceError(fmt::format("unknown device '{}' (expected cpu, cpu:N, cuda or cuda:N)", spec));
  }
  index = 0;
  if (colon != std::string::npos) {
    const std::string num = spec.substr(colon + 1);
    size_t used = 0;
    int parsed = -1;
    try {
      parsed = std::stoi(num, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (num.empty() || used != num.size() || parsed < 0)
      throw DeviceError(fmt::format("bad device index in '{}' (expected a number >= 0 after ':')", spec));
    index = parsed;
  }
}

std::string Device::str() const {
  if (type == DeviceType::cpu) return index == 0 ? "cpu" : fmt::format("cpu:{}", index);
  return fmt::format("cuda:{}", index);
}

}  // namespace mpt
