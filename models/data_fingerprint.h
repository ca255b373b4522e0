#pragma once
// What a data set is, as opposed to how its path was spelled: the size and
// a CRC-32 of the bytes of its files, read in order. Two copies of one data
// set agree wherever they lie and however they are named; another file
// under the same name does not. A resumed run compares it with the
// checkpoint's, and the ranks of a job compare theirs.
#include <string>
#include <vector>

namespace mpt::data {

// "47042560 bytes, crc32 9a1c5e0f" for the files' bytes one after another.
// IOError naming a file that cannot be read.
std::string content_fingerprint(const std::vector<std::string>& paths);

}  // namespace mpt::data
