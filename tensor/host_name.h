#pragma once
// This machine's name, the one place it is asked for: ranks tell hosts apart
// by it, and checkpoint temporaries carry it so that writers on hosts sharing
// a folder never take each other's.
#include <string>

namespace mpt {

// gethostname(), or "localhost" where the machine has no name.
std::string host_name();

}  // namespace mpt
