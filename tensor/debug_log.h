#pragma once
// Debug lines on stderr, one topic at a time: MPT_DEBUG names the topics
// to print (a comma-separated list, or "all"), e.g. MPT_DEBUG=attention says
// which attention kernel each shape runs on and why.
#include <string_view>

namespace mpt {

bool debug_enabled(std::string_view topic);
// Prints "mptrain[topic]: message" where the topic is enabled.
void debug_log(std::string_view topic, std::string_view message);

}  // namespace mpt
