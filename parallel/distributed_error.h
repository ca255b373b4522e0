#pragma once
// Errors of the distributed layer. Both are mpt::Error, so callers that
// catch the library's errors catch these too; the subtypes let a test (or a
// supervisor) tell "waited too long" from "the other side broke".
#include "tensor/error.h"

namespace mpt {

// A wait that ran past its timeout: a rendezvous key that never came, a
// master that never answered, a collective whose peers never joined.
class TimeoutError : public Error { using Error::Error; };
// A peer or the transport failed: connection refused or reset, a port in
// use, ranks that disagree about the world.
class DistributedError : public Error { using Error::Error; };

}  // namespace mpt
