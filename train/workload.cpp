#include "train/workload.h"

#include <filesystem>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "models/cnn.h"
#include "models/data_fingerprint.h"
#include "models/fashion_mnist.h"
#include "models/gpt.h"
#include "models/mlp.h"

namespace mpt::train {

std::string workload_data(const WorkloadOptions& o) {
  if (!o.data.empty()) return o.data;
  return o.model == "gpt" ? "fortunes" : "fashion-mnist";
}

Workload make_workload(const WorkloadOptions& o, Generator& gen) {
  Workload w;
  const std::string data = workload_data(o);
  if (o.model == "mlp" || o.model == "cnn") {
    // "fashion-mnist" is Debian's copy; a folder holds another one.
    const std::string dir = data == "fashion-mnist" ? data::kFashionMnistDir : data;
    check(data == "fashion-mnist" || std::filesystem::is_directory(dir),
          "--model {} trains on --data fashion-mnist or a folder holding Fashion-MNIST's four .gz files, not '{}'",
          o.model, data);
    std::vector<std::string> files = data::FashionMNIST::files(data::Split::train, dir);
    for (std::string& f : data::FashionMNIST::files(data::Split::test, dir)) files.push_back(std::move(f));
    w.data_identity = "Fashion-MNIST, " + data::content_fingerprint(files);
    w.train_set = std::make_shared<data::FashionMNIST>(data::Split::train, dir);
    w.eval_set = std::make_shared<data::FashionMNIST>(data::Split::test, dir);
    nn::MLPOptions mlp;
    mlp.hidden = o.mlp_hidden;
    w.model = o.model == "mlp" ? std::static_pointer_cast<nn::Module>(nn::make_mlp(mlp, &gen))
                               : std::static_pointer_cast<nn::Module>(nn::make_cnn({}, &gen));
    // The MLP sees images as flat vectors, as the reference feeds it.
    w.objective = classification(/*flatten_input=*/o.model == "mlp");
    const std::string name =
        o.model == "mlp" ? fmt::format("mlp {}-{}-{}", mlp.in_features, fmt::join(mlp.hidden, "-"), mlp.num_classes)
                         : o.model;
    w.description = fmt::format("{} on Fashion-MNIST ({} training, {} test images)", name, w.train_set->size(),
                                w.eval_set->size());
    return w;
  }
  check(o.model == "gpt", "unknown --model '{}' (mlp, cnn, gpt)", o.model);
  check(data != "fashion-mnist", "--model gpt trains on text: --data fortunes or a text file");
  const std::string path = data == "fortunes" ? data::kDefaultTextCorpus : data;
  const data::CharDataset text(path, o.context);
  w.data_identity = "text, " + data::content_fingerprint({path});
  // The last tenth of the text is held out for evaluation; no training
  // window reads any of its bytes.
  const int64_t held_out = std::max<int64_t>(1, text.size() / 10);
  check(text.size() - held_out - o.context >= 1,
        "--data '{}' is too short for --context {}: its {} windows leave none for training before the {} held out "
        "for evaluation",
        path, o.context, text.size(), held_out);
  auto [train, eval] = text.split_held_out(held_out);
  w.text = std::make_shared<data::CharDataset>(std::move(train));
  w.train_set = w.text;
  w.eval_set = std::make_shared<data::CharDataset>(std::move(eval));
  nn::GPTOptions g;
  g.vocab_size = text.vocab_size();
  g.context = std::max<int64_t>(o.context, 1);
  g.d_model = o.gpt_d_model;
  g.n_layers = o.gpt_layers;
  g.n_heads = o.gpt_heads;
  w.model = std::make_shared<nn::GPT>(g, &gen);
  w.objective = classification();
  w.sequences = true;
  w.eval_stride = o.context;
  w.description = fmt::format("gpt ({} layers, {} heads, d {}, context {}, vocab {}) on '{}' ({} windows)", g.n_layers,
                              g.n_heads, g.d_model, g.context, g.vocab_size, path, text.size());
  return w;
}

}  // namespace mpt::train
