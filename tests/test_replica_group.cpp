// ReplicaGroup over virtual CPU devices (each thread a Gloo rank): replicas
// trained on their shares of each batch, each with its own optimizer and
// scaler, follow one device trained on the whole batch and stay equal to
// each other; a failing replica's error is the one reported, in bounded
// time; a misplaced module is a clear error.
#include <chrono>

#include "amp/autocast.h"
#include "amp/grad_scaler.h"
#include "autograd/engine.h"
#include "autograd/ops.h"
#include "models/adamw.h"
#include "models/layers.h"
#include "models/sgd.h"
#include "parallel/replica_group.h"
#include "parallel/sharded_reference.h"
#include "parallel/tiny_models.h"
#include "test_util.h"

using namespace mpt;
using namespace mpt::dist;
using mpt::testing::flat_parameters;

namespace {

// Replica r's rows of x, [r * rows, (r + 1) * rows), on its device.
Tensor share_of(const Tensor& x, const Replica& r, int64_t rows) {
  const auto begin = static_cast<int64_t>(r.rank) * rows;
  return prim::to(prim::slice(x, 0, begin, begin + rows), r.device);
}

// A failing test ends in a minute, not the default five.
ReplicaGroupOptions test_options() {
  ReplicaGroupOptions options;
  options.timeout = std::chrono::milliseconds(60000);
  return options;
}

}  // namespace

TEST(ReplicaGroup, ReplicasOnVirtualCpuDevicesTrainLikeOneDevice) {
  const uint64_t seed = mpt::testing::fresh_seed();
  SCOPED_TRACE(seed);
  const int steps = 4;
  const int64_t batch = 12;
  const std::vector<Device> devices{Device("cpu:0"), Device("cpu:1"), Device("cpu:2")};
  const int64_t rows = batch / static_cast<int64_t>(devices.size());
  const mpt::testing::MlpBatches data(steps, batch, seed);

  // The replicas start from different values: DDP gives them replica 0's.
  ReplicaGroup group(mpt::testing::make_mlp(seed), [&] { return mpt::testing::make_mlp(seed + 1); }, devices,
                     test_options());
  std::vector<std::unique_ptr<optim::AdamW>> opts(devices.size());
  group.run([&](Replica& r) {
    opts[r.rank] = std::make_unique<optim::AdamW>(r.module->parameters(), optim::AdamWOptions{.lr = 1e-2});
  });
  auto reference = mpt::testing::make_mlp(seed);
  optim::AdamW ref_opt(reference->parameters(), optim::AdamWOptions{.lr = 1e-2});

  for (int s = 0; s < steps; ++s) {
    const Tensor x = data.x(s), y = data.y(s);
    group.run([&](Replica& r) {
      opts[r.rank]->zero_grad();
      backward(mse_loss(r.ddp->forward(share_of(x, r, rows)), share_of(y, r, rows)));
      opts[r.rank]->step();
    });
    ref_opt.zero_grad();
    backward(mse_loss(reference->forward(x), y));
    ref_opt.step();
  }
  const std::vector<double> expected = flat_parameters(*reference);
  for (size_t r = 0; r < group.size(); ++r) {
    EXPECT_LE(mpt::testing::rel_error(flat_parameters(*group.replica(r).module), expected), 1e-5) << "replica " << r;
    // Same averaged gradients, same update: bit-identical replicas.
    EXPECT_EQ(flat_parameters(*group.replica(r).module), flat_parameters(group.module())) << "replica " << r;
    for (auto& p : group.replica(r).module->parameters()) EXPECT_EQ(p.device(), devices[r]);
  }
}

// Autocast carries into the threads; each replica's scaler sees the same
// averaged gradients, so all follow one device's scale trajectory, whole
// steps or with the last bucket overlapped. The reference averages its
// halves' gradients as the replicas do (see sharded_reference.h for why not
// one backward over the whole batch).
TEST(ReplicaGroup, AutocastAndAScalerPerReplicaFollowOneDevice) {
  const uint64_t seed = mpt::testing::fresh_seed();
  SCOPED_TRACE(seed);
  const int steps = 5;
  const int64_t batch = 8;
  const mpt::testing::MlpBatches data(steps, batch, seed);
  amp::GradScalerOptions so;
  so.init_scale = 1024;
  so.growth_interval = 2;

  // Also with the last bucket's all-reduce beside each replica's step
  // (small buckets, so that there is a last one and others).
  for (const bool overlap : {false, true}) {
    SCOPED_TRACE(overlap ? "overlap_step_with" : "whole steps");
    ReplicaGroupOptions options = test_options();
    options.ddp.first_bucket_bytes = 200;
    options.ddp.bucket_bytes = 600;
    ReplicaGroup group(mpt::testing::make_mlp(seed), [&] { return mpt::testing::make_mlp(seed); },
                       {Device("cpu:0"), Device("cpu:1")}, options);
    struct Trainer {
      std::unique_ptr<optim::SGD> opt;
      amp::GradScaler scaler;
    };
    std::vector<Trainer> trainers;
    for (size_t r = 0; r < group.size(); ++r)
      trainers.push_back(
          {std::make_unique<optim::SGD>(group.replica(r).module->parameters(), optim::SGDOptions{.lr = 0.1}),
           amp::GradScaler(so)});
    if (overlap)
      for (size_t r = 0; r < group.size(); ++r) group.replica(r).ddp->overlap_step_with(trainers[r].scaler);
    auto reference = mpt::testing::make_mlp(seed);
    optim::SGD ref_opt(reference->parameters(), {.lr = 0.1});
    amp::GradScaler ref_scaler(so);

    for (int s = 0; s < steps; ++s) {
      const Tensor x = data.x(s), y = data.y(s);
      amp::AutocastGuard autocast(DeviceType::cpu, DType::f16);
      group.run([&](Replica& r) {
        Trainer& t = trainers[r.rank];
        t.opt->zero_grad();
        backward(t.scaler.scale(mse_loss(r.ddp->forward(share_of(x, r, batch / 2)), share_of(y, r, batch / 2))));
        t.scaler.step(*t.opt);
        t.scaler.update();
      });
      mpt::testing::backward_averaged_over_shards(*reference, ref_scaler, x, y, 2);
      ref_scaler.step(ref_opt);
      ref_scaler.update();
    }
    EXPECT_EQ(ref_scaler.get_scale(), 1024.0 * 4);  // grew twice in 5 clean steps
    for (size_t r = 0; r < group.size(); ++r) {
      EXPECT_EQ(trainers[r].scaler.get_scale(), ref_scaler.get_scale()) << "replica " << r;
      EXPECT_LE(mpt::testing::rel_error(flat_parameters(*group.replica(r).module), flat_parameters(*reference)), 1e-6)
          << "replica " << r;
    }
  }
}

// Replica 1 fails before its forward; replica 0 waits in its gradient
// all-reduce until the group's timeout. run() reports replica 1's error,
// the cause, and returns in bounded time.
TEST(ReplicaGroup, TheFailingReplicasErrorIsReportedInBoundedTime) {
  ReplicaGroupOptions options;
  options.timeout = std::chrono::milliseconds(2000);
  ReplicaGroup group(mpt::testing::make_mlp(3), [] { return mpt::testing::make_mlp(3); },
                     {Device("cpu:0"), Device("cpu:1")}, options);
  const auto start = std::chrono::steady_clock::now();
  try {
    group.run([&](Replica& r) {
      if (r.rank == 1) throw ValueError("replica 1 lost its data");
      backward(mse_loss(r.ddp->forward(ones({4, 6}, DType::f32, r.device)), zeros({4, 3}, DType::f32, r.device)));
    });
    FAIL() << "expected replica 1's error";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("replica 1 lost its data"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
}

TEST(ReplicaGroup, AModuleOnTheWrongDeviceIsAClearError) {
  auto model = mpt::testing::make_mlp(2);
  try {
    ReplicaGroup group(model, [] { return mpt::testing::make_mlp(2); }, {Device("cpu:1"), Device("cpu:2")});
    FAIL() << "expected a DeviceError";
  } catch (const DeviceError& e) {
    EXPECT_NE(std::string(e.what()).find("ReplicaGroup: parameter"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("must live on devices[0] = cpu:1"), std::string::npos) << e.what();
  }
}

// A replica starts in its module's modes, module by module: a dropout
// switched off in the module is off in every replica.
TEST(ReplicaGroup, ReplicasStartInTheModulesTrainingModes) {
  auto make = [] {
    auto m = mpt::testing::make_mlp(3);
    m->push_back(std::make_shared<nn::Dropout>(0.5));
    return m;
  };
  auto model = make();
  (*model)[model->size() - 1]->eval();
  ReplicaGroup group(model, make, {Device("cpu:0"), Device("cpu:1")}, test_options());
  for (size_t r = 0; r < group.size(); ++r) {
    auto& replica = dynamic_cast<nn::Sequential&>(*group.replica(r).module);
    EXPECT_TRUE(replica.is_training()) << "replica " << r;
    EXPECT_FALSE(replica[replica.size() - 1]->is_training()) << "replica " << r << "'s dropout";
  }
}
