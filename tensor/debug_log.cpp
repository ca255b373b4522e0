#include "tensor/debug_log.h"

#include <cstdio>
#include <cstdlib>
#include <string>

namespace mpt {

bool debug_enabled(std::string_view topic) {
  static const std::string topics = [] {
    const char* set = std::getenv("MPT_DEBUG");
    std::string list = ",";
    list.append(set ? set : "").append(",");
    return list;
  }();
  std::string wanted = ",";
  wanted.append(topic).append(",");
  return topics.find(",all,") != std::string::npos || topics.find(wanted) != std::string::npos;
}

void debug_log(std::string_view topic, std::string_view message) {
  if (!debug_enabled(topic)) return;
  std::fprintf(stderr, "mptrain[%.*s]: %.*s\n", static_cast<int>(topic.size()), topic.data(),
               static_cast<int>(message.size()), message.data());
}

}  // namespace mpt
