#include "models/fashion_mnist.h"

#include "models/idx_file.h"
#include "tensor/ops.h"

namespace mpt::data {

std::vector<std::string> FashionMNIST::files(Split split, const std::string& dir) {
  const std::string prefix = dir + (split == Split::train ? "/train" : "/t10k");
  return {prefix + "-images-idx3-ubyte.gz", prefix + "-labels-idx1-ubyte.gz"};
}

FashionMNIST::FashionMNIST(Split split, const std::string& dir) {
  const std::vector<std::string> paths = files(split, dir);
  const std::string &images_path = paths[0], &labels_path = paths[1];
  IdxArray images = read_idx(images_path);
  IdxArray labels = read_idx(labels_path);
  check<IOError>(images.shape.size() == 3 && images.shape[1] == kRows && images.shape[2] == kCols,
                 "FashionMNIST: '{}' has shape [{}], expected [N, 28, 28]", images_path, fmt::join(images.shape, ", "));
  check<IOError>(labels.shape.size() == 1 && labels.shape[0] == images.shape[0],
                 "FashionMNIST: '{}' has shape [{}], expected [{}] (one label per image of '{}')", labels_path,
                 fmt::join(labels.shape, ", "), images.shape[0], images_path);
  for (size_t i = 0; i < labels.values.size(); ++i)
    check<IOError>(labels.values[i] < kClasses, "FashionMNIST: '{}' has label {} at index {}, expected 0..9",
                   labels_path, labels.values[i], i);
  count_ = images.shape[0];
  pixels_ = std::move(images.values);
  labels_ = std::move(labels.values);
}

Batch FashionMNIST::get_batch(const std::vector<int64_t>& indices) const {
  const int64_t n = static_cast<int64_t>(indices.size());
  constexpr int64_t pixels = kRows * kCols;
  Tensor input = Tensor::empty({n, 1, kRows, kCols}, DType::f32);
  Tensor target = Tensor::empty({n}, DType::i64);
  float* x = input.data<float>();
  int64_t* y = target.data<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t s = indices[i];
    check(s >= 0 && s < count_, "FashionMNIST::get_batch: index {} out of range [0, {})", s, count_);
    const uint8_t* src = pixels_.data() + s * pixels;
    for (int64_t p = 0; p < pixels; ++p) x[i * pixels + p] = (src[p] / 255.0f - kMean) / kStd;
    y[i] = labels_[s];
  }
  return {input, target};
}

}  // namespace mpt::data
