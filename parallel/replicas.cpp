#include "parallel/replicas.h"

#include "models/training_mode.h"
#include "tensor/device_guard.h"

namespace mpt::dist {

void check_replica_devices(const nn::Module& module, const std::vector<Device>& devices, const char* who) {
  check<ValueError>(!devices.empty(), "{}: no devices given", who);
  for (size_t i = 0; i < devices.size(); ++i) {
    check<DeviceError>(devices[i].type == devices[0].type, "{}: devices mix {} and {}", who, devices[0].str(),
                       devices[i].str());
    for (size_t j = 0; j < i; ++j)
      check<DeviceError>(devices[i] != devices[j], "{}: device {} is listed twice", who, devices[i].str());
    check_device_available(devices[i]);
  }
  for (const auto& [name, p] : module.named_parameters())
    check<DeviceError>(p.device() == devices[0],
                       "{}: parameter '{}' of the {} is on {}, but the module must live on devices[0] = {}; call "
                       "module->to(\"{}\") (before creating the optimizer) and wrap it again",
                       who, name, module.type_name(), p.device().str(), devices[0].str(), devices[0].str());
}

std::shared_ptr<nn::Module> make_replica(const ModuleFactory& make, const nn::Module& source, const Device& device,
                                         const char* who) {
  auto replica = make();
  check<ValueError>(replica != nullptr, "{}: the replica factory returned null for {}", who, device.str());
  replica->to(device);
  replica->load_state_dict(source.state_dict());  // checks that the architectures agree
  nn::copy_training_modes(source, *replica);
  return replica;
}

}  // namespace mpt::dist
