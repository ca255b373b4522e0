// In-place writes and autograd: every write through the tensor API raises
// the storage's version, and a backward rule refuses to run on a tensor it
// saved that was written since forward (PyTorch's "modified by an inplace
// operation"), while writes to tensors no rule reads pass.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "autograd/ops.h"
#include "models/sgd.h"
#include "tests/test_util.h"

namespace mpt {
namespace {

Tensor leaf_of(const std::vector<float>& values) {
  Tensor t = from_vector(values, {static_cast<int64_t>(values.size())});
  t.set_requires_grad(true);
  return t;
}

// Runs backward(loss) expecting the saved-tensor refusal; returns its message.
std::string refusal_of(const Tensor& loss) {
  try {
    backward(loss);
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "backward ran on a saved tensor written after forward";
  return {};
}

void expect_mentions(const std::string& message, const std::vector<std::string>& parts) {
  for (const std::string& part : parts) EXPECT_NE(message.find(part), std::string::npos) << part << " in: " << message;
}

TEST(Versions, EveryInPlaceWriteRaisesTheVersionThatViewsShare) {
  const Tensor t = zeros({2, 3});
  const Tensor row = prim::slice(t, 0, 1, 2);
  uint64_t expected = t.version();
  auto expect_one_more = [&](const char* what) {
    EXPECT_EQ(t.version(), ++expected) << what;
    EXPECT_EQ(row.version(), expected) << what << " (seen through a view)";
  };
  prim::fill_(row, 1.0);
  expect_one_more("fill_");
  prim::copy_(t, ones({3}));
  expect_one_more("copy_");
  prim::unary_(UnaryOp::neg, row, row);
  expect_one_more("unary_");
  prim::binary_(BinaryOp::add, t, t, t);
  expect_one_more("binary_");
  prim::scaled_copy_list_({row}, {ones({1, 3})}, 2.0);
  expect_one_more("scaled_copy_list_");
  prim::index_add_rows_(t, from_vector<int64_t>({1}, {1}, DType::i64), ones({1, 3}));
  expect_one_more("index_add_rows_");
  t.bump_version();
  expect_one_more("bump_version");
  // Reading, and making new tensors from it, writes nothing.
  [[maybe_unused]] const Tensor sum_of = prim::sum(t);
  const Tensor copy = prim::clone(t);
  EXPECT_EQ(t.version(), expected);
  EXPECT_NE(copy.storage(), t.storage());
}

TEST(SavedTensors, WritingASavedInputRefusesBackwardAndAccumulatesNothing) {
  Tensor w = leaf_of({1.f, 2.f, 3.f});
  const Tensor x = from_vector({4.f, 5.f, 6.f}, {3});
  const Tensor loss = sum(mul(w, x));  // mul saves x to give w its gradient
  prim::fill_(x, 0.0);
  expect_mentions(refusal_of(loss), {"'mul'", "input 1", "f32[3]", "version 0 then, 1 now"});
  EXPECT_FALSE(w.grad().defined());
}

TEST(SavedTensors, WritingASavedOutputRefusesBackward) {
  Tensor x = leaf_of({0.5f, 1.f});
  const Tensor y = exp(x);  // exp's gradient is its output
  const Tensor loss = sum(mul(y, 1.0));
  prim::copy_(y, zeros({2}));
  expect_mentions(refusal_of(loss), {"'exp'", "output 0"});
}

TEST(SavedTensors, WritingAViewOfASavedTensorRefusesBackward) {
  Tensor w = leaf_of({1.f, 2.f, 3.f, 4.f});
  const Tensor x = from_vector({1.f, 1.f, 1.f, 1.f}, {4});
  const Tensor loss = sum(mul(w, x));
  prim::fill_(prim::slice(x, 0, 2, 3), 7.0);  // one element, through a view
  expect_mentions(refusal_of(loss), {"'mul'", "input 1"});
}

TEST(SavedTensors, WritingATensorNoRuleReadsIsAllowed) {
  // add's gradient does not depend on its inputs' values, so writing them
  // after forward changes nothing backward computes (as in PyTorch).
  Tensor w = leaf_of({1.f, 2.f});
  const Tensor x = from_vector({3.f, 4.f}, {2});
  const Tensor loss = sum(mul(add(w, x), 2.0));
  prim::fill_(x, -1.0);
  backward(loss);
  EXPECT_EQ(w.grad().to_vector<float>(), (std::vector<float>{2.f, 2.f}));
}

TEST(SavedTensors, AnAbsentOptionalInputIsNoSavedTensor) {
  // layer_norm reads its weight when there is one; without one, nothing.
  Tensor x = leaf_of({1.f, 2.f, 4.f});
  const Tensor loss = sum(mul(layer_norm(x, Tensor(), Tensor()), from_vector({1.f, 0.f, 0.f}, {3})));
  backward(loss);
  EXPECT_TRUE(x.grad().defined());
}

TEST(SavedTensors, WritesAfterBackwardAreAllowedButNotBeforeASecondOne) {
  Tensor w = leaf_of({1.f, 2.f});
  const Tensor x = from_vector({3.f, 4.f}, {2});
  const Tensor loss = sum(mul(w, x));
  backward(loss, Tensor(), /*retain_graph=*/true);
  EXPECT_EQ(w.grad().to_vector<float>(), (std::vector<float>{3.f, 4.f}));
  prim::fill_(x, 0.0);
  expect_mentions(refusal_of(loss), {"'mul'", "version"});
  EXPECT_EQ(w.grad().to_vector<float>(), (std::vector<float>{3.f, 4.f}));  // the refused pass added nothing
}

TEST(SavedTensors, AnOptimizerStepBetweenForwardAndBackwardIsRefused) {
  // The step writes w, which the second layer saved to send a gradient to
  // its input: that gradient would use the stepped weight.
  Tensor w = leaf_of({1.f, 2.f});
  Tensor v = leaf_of({3.f, 4.f});
  optim::SGD sgd({w, v}, optim::SGDOptions{.lr = 0.1});
  backward(sum(mul(mul(v, 2.0), w)));
  const Tensor loss = sum(mul(mul(v, 2.0), w));
  sgd.step();
  expect_mentions(refusal_of(loss), {"'mul'", "input 1"});
}

TEST(SavedTensors, ReusingTheIndicesBufferBeforeBackwardIsRefused) {
  // A loader that writes the next batch into the buffer the last one came in.
  Tensor table = randn({5, 3});
  table.set_requires_grad(true);
  const Tensor indices = from_vector<int64_t>({0, 4, 4}, {3}, DType::i64);
  const Tensor loss = sum(embedding(table, indices));
  prim::copy_(indices, from_vector<int64_t>({1, 2, 3}, {3}, DType::i64));
  expect_mentions(refusal_of(loss), {"'embedding'", "i64[3]"});
}

TEST(SavedTensors, MovingASavedTensorsStorageIsRefused) {
  // What a module's to() does to its parameters: the tensor keeps its
  // handle and gets new memory.
  Tensor w = leaf_of({1.f, 2.f});
  const Tensor x = from_vector({3.f, 4.f}, {2});
  const Tensor loss = sum(mul(x, w));
  x.impl().storage = prim::clone(x).storage();
  expect_mentions(refusal_of(loss), {"'mul'", "moved to other memory"});
}

}  // namespace
}  // namespace mpt
