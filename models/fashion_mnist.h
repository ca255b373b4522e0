#pragma once
// Fashion-MNIST (Debian package dataset-fashion-mnist): 60000 training and
// 10000 test images of 28x28 grey levels, ten classes.
#include <string>
#include <vector>

#include "models/dataset.h"

namespace mpt::data {

inline constexpr const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";

enum class Split { train, test };

class FashionMNIST : public Dataset {
 public:
  // Reads <dir>/{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz.
  explicit FashionMNIST(Split split, const std::string& dir = kFashionMnistDir);
  // The files of one split: its images, then its labels.
  static std::vector<std::string> files(Split split, const std::string& dir = kFashionMnistDir);

  int64_t size() const override { return count_; }
  // input f32 [N, 1, 28, 28], normalised by the training set's mean and
  // standard deviation; target i64 [N] in 0..9.
  Batch get_batch(const std::vector<int64_t>& indices) const override;

  static constexpr int64_t kRows = 28, kCols = 28, kClasses = 10;
  static constexpr float kMean = 0.2860f, kStd = 0.3530f;

 private:
  int64_t count_ = 0;
  std::vector<uint8_t> pixels_, labels_;
};

}  // namespace mpt::data
