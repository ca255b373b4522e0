// DataParallel over virtual CPU devices: the same training as one device on
// the whole batch (the gradient of the batch mean is the row-weighted sum
// of the per-device means), and clear errors for a misplaced module.
#include "amp/autocast.h"
#include "amp/grad_scaler.h"
#include "autograd/engine.h"
#include "autograd/grad_mode.h"
#include "autograd/ops.h"
#include "models/batch_norm.h"
#include "models/layers.h"
#include "models/sgd.h"
#include "parallel/data_parallel.h"
#include "parallel/device_threads.h"
#include "parallel/sharded_reference.h"
#include "parallel/tiny_models.h"
#include "test_util.h"

using namespace mpt;
using namespace mpt::dist;
using mpt::testing::flat_parameters;

namespace {

void train_and_compare(const std::vector<Device>& devices, int64_t batch) {
  const uint64_t seed = mpt::testing::fresh_seed();
  SCOPED_TRACE(seed);
  const int steps = 3;
  const mpt::testing::MlpBatches data(steps, batch, seed);
  auto loss = [](const Tensor& out, const Tensor& y) { return mse_loss(out, y); };

  auto model = mpt::testing::make_mlp(seed);
  model->to(devices[0]);
  DataParallel dp(model, [&] { return mpt::testing::make_mlp(seed + 1); }, devices);
  optim::SGD opt(model->parameters(), {.lr = 0.1, .momentum = 0.9});

  auto reference = mpt::testing::make_mlp(seed);
  optim::SGD ref_opt(reference->parameters(), {.lr = 0.1, .momentum = 0.9});

  for (int s = 0; s < steps; ++s) {
    const Tensor x = data.x(s), y = data.y(s);
    opt.zero_grad();
    const double l = dp.forward_backward(x, y, loss);
    opt.step();

    ref_opt.zero_grad();
    const Tensor ref_loss = mse_loss(reference->forward(x), y);
    backward(ref_loss);
    ref_opt.step();
    EXPECT_NEAR(l, ref_loss.item(), 1e-5 * std::abs(ref_loss.item()));
  }
  EXPECT_LE(mpt::testing::rel_error(flat_parameters(*model), flat_parameters(*reference)), 1e-6);
  for (auto& p : model->parameters()) EXPECT_EQ(p.device(), devices[0]);
}

}  // namespace

TEST(DataParallel, TwoVirtualCpuDevicesTrainLikeOne) { train_and_compare({Device("cpu:0"), Device("cpu:1")}, 8); }

// f16 autocast (carried into the device threads) and one loss scaler for
// all devices train as one device with its own scaler does, when it averages
// its halves' gradients as the devices do (sharded_reference.h says why).
TEST(DataParallel, AutocastAndOneScalerTrainLikeOneDevice) {
  const uint64_t seed = mpt::testing::fresh_seed();
  SCOPED_TRACE(seed);
  const int steps = 5;
  const mpt::testing::MlpBatches data(steps, 8, seed);
  auto loss = [](const Tensor& out, const Tensor& y) { return mse_loss(out, y); };
  amp::GradScalerOptions so;
  so.init_scale = 1024;
  so.growth_interval = 2;

  const std::vector<Device> devices{Device("cpu:0"), Device("cpu:1")};
  auto model = mpt::testing::make_mlp(seed);
  DataParallel dp(model, [&] { return mpt::testing::make_mlp(seed + 1); }, devices);
  optim::SGD opt(model->parameters(), {.lr = 0.1});
  amp::GradScaler scaler(so);

  auto reference = mpt::testing::make_mlp(seed);
  optim::SGD ref_opt(reference->parameters(), {.lr = 0.1});
  amp::GradScaler ref_scaler(so);

  for (int s = 0; s < steps; ++s) {
    const Tensor x = data.x(s), y = data.y(s);
    {
      amp::AutocastGuard autocast(DeviceType::cpu, DType::f16);
      opt.zero_grad();
      dp.forward_backward(x, y, loss, &scaler);
      mpt::testing::backward_averaged_over_shards(*reference, ref_scaler, x, y, devices.size());
    }
    // The gradients are those of the f16 forward, scaled.
    for (auto& p : model->parameters()) ASSERT_EQ(p.grad().dtype(), DType::f32);
    scaler.step(opt);
    scaler.update();
    ref_scaler.step(ref_opt);
    ref_scaler.update();
  }
  EXPECT_EQ(scaler.get_scale(), ref_scaler.get_scale());
  EXPECT_EQ(scaler.get_scale(), 1024.0 * 4);  // grew twice in 5 clean steps
  EXPECT_LE(mpt::testing::rel_error(flat_parameters(*model), flat_parameters(*reference)), 1e-6);
}

TEST(DataParallel, UnevenSplitOverThreeDevicesTrainsLikeOne) {
  train_and_compare({Device("cpu:0"), Device("cpu:1"), Device("cpu:2")}, 7);
}

// With fewer rows than devices the last devices sit out, and the step is
// still the one device's.
TEST(DataParallel, ABatchSmallerThanTheDevicesTrainsLikeOne) {
  train_and_compare({Device("cpu:0"), Device("cpu:1"), Device("cpu:2")}, 2);
}

// eval() on the wrapped module after the replicas were made reaches them:
// a dropout left on in a replica would change the loss.
TEST(DataParallel, TheReplicasFollowTheModulesTrainingMode) {
  const uint64_t seed = mpt::testing::fresh_seed();
  SCOPED_TRACE(seed);
  auto make = [seed] {
    auto m = mpt::testing::make_mlp(seed);
    m->push_back(std::make_shared<nn::Dropout>(0.5));
    return m;
  };
  auto model = make();
  DataParallel dp(model, make, {Device("cpu:0"), Device("cpu:1")});
  model->eval();
  const mpt::testing::MlpBatches data(1, 8, seed);
  auto loss = [](const Tensor& out, const Tensor& y) { return mse_loss(out, y); };
  const double got = dp.forward_backward(data.x(0), data.y(0), loss);
  const double want = mse_loss(model->forward(data.x(0)), data.y(0)).item();
  EXPECT_NEAR(got, want, 1e-6 * std::abs(want));
}

// A batch norm's running statistics: the module (replica 0) keeps those of
// its own share of each batch, as in PyTorch's DataParallel, and the other
// replicas start each call from them, so an evaluation over the devices
// normalises as the module does on the whole batch.
TEST(DataParallel, BatchNormStatisticsAreTheModulesOnEveryReplica) {
  const uint64_t seed = mpt::testing::fresh_seed();
  SCOPED_TRACE(seed);
  auto make = [seed] {
    auto m = mpt::testing::make_mlp(seed);
    m->push_back(std::make_shared<nn::BatchNorm1d>(3));
    return m;
  };
  auto model = make();
  auto& bn = dynamic_cast<nn::BatchNorm1d&>(*(*model)[model->size() - 1]);
  DataParallel dp(model, make, {Device("cpu:0"), Device("cpu:1")});
  const mpt::testing::MlpBatches data(2, 8, seed);
  auto loss = [](const Tensor& out, const Tensor& y) { return mse_loss(out, y); };
  // What the module's norm saw: the features of rows 0-3 of each batch.
  std::vector<double> expected(3, 0.0);
  for (int step = 0; step < 2; ++step) {
    std::vector<double> features;
    {
      NoGradGuard no_grad;
      nn::Sequential& body = *model;
      Tensor h = prim::slice(data.x(step), 0, 0, 4);
      for (size_t i = 0; i + 1 < body.size(); ++i) h = body[i]->forward(h);
      features = mpt::testing::host_f64(prim::mean(h, {0}));
    }
    dp.forward_backward(data.x(step), data.y(step), loss);
    for (int c = 0; c < 3; ++c) expected[c] = 0.9 * expected[c] + 0.1 * features[c];
  }
  const std::vector<double> running = mpt::testing::host_f64(bn.running_mean);
  for (int c = 0; c < 3; ++c) EXPECT_NEAR(running[c], expected[c], 1e-6) << "channel " << c;
  EXPECT_EQ(bn.num_batches_tracked.item(), 2);

  model->eval();
  const double got = dp.forward_backward(data.x(0), data.y(0), loss);
  const double want = mse_loss(model->forward(data.x(0)), data.y(0)).item();
  EXPECT_NEAR(got, want, 1e-6 * std::abs(want)) << "a replica normalised by statistics other than the module's";
}

// A scaler that counts samples counts the whole batch's rows once.
TEST(DataParallel, AScalerCountingSamplesCountsTheBatchsRows) {
  const std::vector<Device> devices{Device("cpu:0"), Device("cpu:1")};
  auto model = mpt::testing::make_mlp(3);
  DataParallel dp(model, [] { return mpt::testing::make_mlp(4); }, devices);
  optim::SGD opt(model->parameters(), {.lr = 0.1});
  amp::GradScaler scaler({.growth_interval = 100, .growth_unit = amp::GrowthUnit::samples});
  const mpt::testing::MlpBatches data(1, 8, 3);
  dp.forward_backward(data.x(0), data.y(0), [](const Tensor& out, const Tensor& y) { return mse_loss(out, y); },
                      &scaler);
  scaler.step(opt);
  scaler.update();
  EXPECT_EQ(scaler.growth_tracker(), 8);
}

// Each device's thread draws from its own fork of the caller's default
// generator: the devices' numbers differ, and manual_seed() repeats them.
TEST(DeviceThreads, EachDeviceDrawsItsOwnNumbersFromTheCallersSeed) {
  const std::vector<Device> devices{Device("cpu:0"), Device("cpu:1")};
  DeviceThreads threads(devices);
  auto draw = [&] {
    std::vector<std::vector<double>> drawn(devices.size());
    threads.run([&](size_t i) { drawn[i] = rand({8}, DType::f32, devices[i]).to_vector<double>(); });
    return drawn;
  };
  manual_seed(5);
  const auto first = draw();
  manual_seed(5);
  const auto again = draw();
  const auto next = draw();
  EXPECT_NE(first[0], first[1]);
  EXPECT_EQ(first, again);
  EXPECT_NE(again, next);
}

TEST(DataParallel, AModuleOnTheWrongDeviceIsAClearError) {
  auto model = mpt::testing::make_mlp(1);  // still on cpu:0
  try {
    DataParallel dp(model, [] { return mpt::testing::make_mlp(2); }, {Device("cpu:1"), Device("cpu:2")});
    FAIL() << "expected a DeviceError";
  } catch (const DeviceError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("is on cpu"), std::string::npos) << msg;
    EXPECT_NE(msg.find("devices[0] = cpu:1"), std::string::npos) << msg;
  }
}

// The replica's load of the module's state names the keys that differ.
TEST(DataParallel, ReplicasMustMatchTheModule) {
  auto model = mpt::testing::make_mlp(1);
  const std::string msg = mpt::testing::error_of<ValueError>([&] {
    DataParallel dp(model, [] { return std::make_shared<mpt::testing::WithSpareHead>(1); },
                    {Device("cpu:0"), Device("cpu:1")});
  });
  mpt::testing::expect_contains(msg, {"WithSpareHead.load_state_dict", "nothing was loaded",
                                      "missing key 'used.weight'", "unexpected key '0.weight'"});
}

// Without a CUDA build or without a device, the error names the device
// asked for (and, either way, why there is none).
TEST(DataParallel, CudaDevicesWithoutCudaSaySo) {
  if (mpt::testing::has_cuda()) GTEST_SKIP() << "this machine has CUDA";
  auto model = mpt::testing::make_mlp(1);
  const std::string msg = mpt::testing::error_of<DeviceError>([&] {
    DataParallel dp(model, [] { return mpt::testing::make_mlp(1); }, {Device("cuda:0"), Device("cuda:1")});
  });
  mpt::testing::expect_contains(msg, {"cuda:0 requested, but", "CUDA"});
}
