#include "tools/mpt-scaler/sweep_mlp.h"

#include <algorithm>

#include "amp/autocast.h"
#include "autograd/ops.h"
#include "models/adamw.h"
#include "models/layers.h"
#include "models/sequential.h"

namespace mpt::tools {

double train_synthetic_mlp(const SyntheticMlpConfig& c, amp::GradScaler& scaler,
                           const std::function<void(int64_t)>& on_step) {
  Generator init(c.seed);
  nn::Sequential net;
  net.push_back(std::make_shared<nn::Linear>(c.in_features, c.hidden, true, &init));
  net.push_back(std::make_shared<nn::GELU>());
  net.push_back(std::make_shared<nn::Linear>(c.hidden, c.hidden, true, &init));
  net.push_back(std::make_shared<nn::GELU>());
  net.push_back(std::make_shared<nn::Linear>(c.hidden, c.classes, true, &init));
  net.to(c.device);
  net.named_parameters();  // names for the scaler's messages
  optim::AdamW opt(net.parameters(), {.lr = c.lr, .weight_decay = 0.0});
  const Tensor teacher = randn({c.in_features, c.classes}, DType::f32, c.device, &init);

  Generator data(c.seed + 1);
  const int64_t tail = std::max<int64_t>(1, c.steps / 10);
  double tail_loss = 0;
  for (int64_t step = 0; step < c.steps; ++step) {
    const Tensor x = randn({c.batch, c.in_features}, DType::f32, c.device, &data);
    const Tensor y = prim::argmax(prim::matmul(x, teacher), 1);
    opt.zero_grad();
    Tensor loss;
    {
      amp::AutocastGuard autocast(c.device.type, c.autocast_dtype);
      loss = cross_entropy(net.forward(x), y);
    }
    backward(scaler.scale(loss, c.batch));
    scaler.step(opt);
    scaler.update();
    if (step >= c.steps - tail) tail_loss += loss.item();
    if (on_step) on_step(step + 1);
  }
  return tail_loss / static_cast<double>(tail);
}

}  // namespace mpt::tools
