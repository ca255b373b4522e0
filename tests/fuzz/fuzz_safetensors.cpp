// The checkpoint reader on arbitrary bytes: the safetensors layer returns a
// checked file or throws IOError, and the checkpoint layer above it reads
// its metadata or throws IOError / ValueError. Anything else (another
// exception, a crash, a sanitizer report, an allocation beyond the fuzzer's
// limit) is a finding.
#include "fuzz_file.h"
#include "models/checkpoint.h"
#include "models/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = mpt::fuzz::input_file(data, size, ".safetensors");
  try {
    const mpt::io::TensorFile file = mpt::io::load_safetensors(path);
    // What was accepted is whole: every tensor's bytes lie in the file.
    for (const auto& [name, t] : file.tensors) {
      if (t.nbytes() > size) __builtin_trap();
      if (t.nbytes() > 0) {
        volatile uint8_t last = static_cast<const uint8_t*>(t.data_ptr())[t.nbytes() - 1];
        (void)last;
      }
    }
    try {
      mpt::ckpt::read_checkpoint(path);
    } catch (const mpt::ValueError&) {
    }
  } catch (const mpt::IOError&) {
  }
  return 0;
}
