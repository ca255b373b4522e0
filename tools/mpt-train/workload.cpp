#include "tools/mpt-train/workload.h"

#include <filesystem>

#include "autograd/ops.h"
#include "models/char_dataset.h"
#include "models/cnn.h"
#include "models/data_fingerprint.h"
#include "models/fashion_mnist.h"
#include "models/gpt.h"
#include "models/mlp.h"

namespace mpt::train {

Tensor Workload::forward(const Tensor& input) const {
  return model->forward(flatten_input ? flatten(input, 1) : input);
}

Tensor Workload::loss(const Tensor& output, const Tensor& target) const {
  if (!sequences) return cross_entropy(output, target);
  const int64_t vocab = output.size(2);
  return cross_entropy(reshape(output, {-1, vocab}), reshape(target, {-1}));
}

int64_t Workload::correct(const Tensor& output, const Tensor& target) const {
  const std::vector<int64_t> predicted = prim::argmax(output, output.dim() - 1).to_vector<int64_t>();
  const std::vector<int64_t> truth = target.to_vector<int64_t>();
  int64_t n = 0;
  for (size_t i = 0; i < truth.size(); ++i) n += predicted[i] == truth[i];
  return n;
}

int64_t Workload::predictions(const data::Batch& batch) const { return batch.target.numel(); }

Workload make_workload(const TrainConfig& c, Generator& gen) {
  Workload w;
  if (c.model == "mlp" || c.model == "cnn") {
    // "fashion-mnist" is Debian's copy; a folder holds another one.
    const std::string dir = c.data == "fashion-mnist" ? data::kFashionMnistDir : c.data;
    check(c.data == "fashion-mnist" || std::filesystem::is_directory(dir),
          "mpt-train: --model {} trains on --data fashion-mnist or a folder holding Fashion-MNIST's four .gz files, "
          "not '{}'",
          c.model, c.data);
    std::vector<std::string> files = data::FashionMNIST::files(data::Split::train, dir);
    for (std::string& f : data::FashionMNIST::files(data::Split::test, dir)) files.push_back(std::move(f));
    w.data_identity = "Fashion-MNIST, " + data::content_fingerprint(files);
    w.train_set = std::make_shared<data::FashionMNIST>(data::Split::train, dir);
    w.eval_set = std::make_shared<data::FashionMNIST>(data::Split::test, dir);
    w.model = c.model == "mlp" ? std::static_pointer_cast<nn::Module>(nn::make_mlp({}, &gen))
                               : std::static_pointer_cast<nn::Module>(nn::make_cnn({}, &gen));
    w.flatten_input = c.model == "mlp";  // the MLP sees images as flat vectors, as the reference feeds it
    w.description = fmt::format("{} on Fashion-MNIST ({} training, {} test images)", c.model, w.train_set->size(),
                                w.eval_set->size());
    return w;
  }
  check(c.model == "gpt", "mpt-train: unknown --model '{}' (mlp, cnn, gpt)", c.model);
  check(c.data != "fashion-mnist", "mpt-train: --model gpt trains on text: --data fortunes or a text file");
  const std::string path = c.data == "fortunes" ? data::kDefaultTextCorpus : c.data;
  const data::CharDataset text(path, c.context);
  w.data_identity = "text, " + data::content_fingerprint({path});
  // The last tenth of the text is held out for evaluation; no training
  // window reads any of its bytes.
  const int64_t held_out = std::max<int64_t>(1, text.size() / 10);
  check(text.size() - held_out - c.context >= 1,
        "mpt-train: --data '{}' is too short for --context {}: its {} windows leave none for training before the "
        "{} held out for evaluation",
        path, c.context, text.size(), held_out);
  auto [train, eval] = text.split_held_out(held_out);
  w.text = std::make_shared<data::CharDataset>(std::move(train));
  w.train_set = w.text;
  w.eval_set = std::make_shared<data::CharDataset>(std::move(eval));
  nn::GPTOptions o;
  o.vocab_size = text.vocab_size();
  o.context = std::max<int64_t>(c.context, 1);
  o.d_model = c.gpt_d_model;
  o.n_layers = c.gpt_layers;
  o.n_heads = c.gpt_heads;
  w.model = std::make_shared<nn::GPT>(o, &gen);
  w.sequences = true;
  w.eval_stride = c.context;
  w.description = fmt::format("gpt ({} layers, {} heads, d {}, context {}, vocab {}) on '{}' ({} windows)",
                              o.n_layers, o.n_heads, o.d_model, o.context, o.vocab_size, path, text.size());
  return w;
}

}  // namespace mpt::train
