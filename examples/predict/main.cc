// Classifies IDX images on the CPU with a checkpoint written by fashion_mnist,
// printing the accuracy and per-class counts: the common pipeline of training
// on accelerators and serving on CPUs. Every strategy whose state is whole in
// one process writes the same single safetensors file, on GPUs or CPUs; a
// parameter-server checkpoint (an index plus one shard file per PS rank) is
// reassembled by load_checkpoint, so any strategy's checkpoint works here.
//
//   predict --checkpoint /ckpt            # a directory: its `latest` checkpoint
//   predict --checkpoint /ckpt/ckpt-1000.safetensors --split t10k --limit 1000
#include <sys/stat.h>

#include <CLI/CLI.hpp>
#include <charconv>
#include <optional>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include <diststrat/diststrat.h>

namespace ds = diststrat;

namespace {

const char* const kFashionClasses[10] = {"T-shirt/top", "Trouser",   "Pullover", "Dress",
                                         "Coat",        "Sandal",    "Shirt",    "Sneaker",
                                         "Bag",         "Ankle boot"};

// A directory means "its latest checkpoint" (the CheckpointManager layout):
// ds::latest_checkpoint reads `latest` safely (a FIFO there is an error, not
// a hang) and finds the newest checkpoint when `latest` was deleted.
std::string resolve(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0)
    throw ds::NotFoundError("checkpoint '" + path + "' does not exist");
  if (!S_ISDIR(st.st_mode)) return path;
  const std::optional<std::string> latest = ds::latest_checkpoint(path);
  if (!latest) throw ds::NotFoundError("checkpoint directory '" + path + "' holds no checkpoint");
  return *latest;
}

// "784,256,10": every size a whole number in [1, 2^20], nothing else. A
// list from the checkpoint's metadata that is not is kDataLoss (the file is
// damaged), one from --model kInvalidArgument.
std::vector<int64_t> parse_sizes(const std::string& text, const std::string& what,
                                 ds::ErrorCode code) {
  std::vector<int64_t> sizes;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    int64_t v = 0;
    const char* end = item.data() + item.size();
    const auto r = std::from_chars(item.data(), end, v);
    if (item.empty() || r.ec != std::errc() || r.ptr != end || v < 1 || v > (int64_t{1} << 20)) {
      ds::throw_error(code, what + ": '" + text.substr(0, 200) +
                                "' is not a comma-separated list of sizes in [1, 1048576]");
    }
    sizes.push_back(v);
  }
  if (sizes.size() < 2)
    ds::throw_error(code, what + ": '" + text.substr(0, 200) + "' needs at least two sizes");
  return sizes;
}

}  // namespace

int main(int argc, char** argv) {
  std::string checkpoint, data = ds::kFashionMnistDir, split = "t10k", model;
  int64_t limit = 0;
  bool unverified = false;
  CLI::App app{"Classify IDX images with a diststrat checkpoint (CPU)"};
  app.add_option("--checkpoint", checkpoint,
                 "a .safetensors file, or a checkpoint directory (uses 'latest')")
      ->required();
  app.add_option("--data", data, "directory with the IDX files")->capture_default_str();
  app.add_option("--split", split, "t10k or train")->capture_default_str();
  app.add_option("--limit", limit, "classify only the first N images (0 = all)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--model", model,
                 "layer sizes, e.g. 784,256,256,10 (default: the checkpoint's 'model' metadata)");
  app.add_flag(
      "--allow-unverified", unverified,
      "accept files without diststrat checksums (exported by PyTorch / Python safetensors)");
  CLI11_PARSE(app, argc, argv);

  try {
    const std::string path = resolve(checkpoint);
    ds::SafetensorsLoadOptions lo;
    lo.require_checksums = !unverified;
    const ds::SafetensorsFile file = ds::load_checkpoint(path, lo);
    std::vector<int64_t> sizes;
    if (model.empty()) {
      auto it = file.metadata.find("model");
      if (it == file.metadata.end() || it->second.rfind("mlp:", 0) != 0) {
        throw ds::InvalidArgumentError(
            "checkpoint '" + path +
            "' has no 'model' metadata (\"mlp:784,256,256,10\"): pass --model");
      }
      sizes = parse_sizes(it->second.substr(4), "checkpoint '" + path + "': metadata 'model'",
                          ds::ErrorCode::kDataLoss);
    } else {
      sizes = parse_sizes(model, "--model", ds::ErrorCode::kInvalidArgument);
    }
    const ds::nn::Mlp mlp(sizes);

    // Only the model's tensors are needed; optimizer state in the file is ignored.
    std::vector<ds::Tensor> params;
    for (size_t i = 0; i < mlp.num_params(); ++i) {
      const std::string name = mlp.param_name(i);
      const ds::Tensor* t = file.find(name);
      if (!t)
        throw ds::InvalidArgumentError("checkpoint '" + path + "' has no tensor '" + name + "'");
      if (t->dtype() != ds::DType::kFloat32 || t->shape() != mlp.param_shape(i)) {
        throw ds::InvalidArgumentError(
            "checkpoint '" + path + "': tensor '" + name + "' is " + ds::dtype_name(t->dtype()) +
            t->shape().to_string() + ", the model needs float32" + mlp.param_shape(i).to_string());
      }
      params.push_back(*t);
    }

    const ds::Dataset images = ds::load_mnist_split(data, split, limit);
    if (images.features().shape()[1] != mlp.sizes().front()) {
      throw ds::InvalidArgumentError("images have " + std::to_string(images.features().shape()[1]) +
                                     " pixels, the model takes " +
                                     std::to_string(mlp.sizes().front()));
    }
    const ds::Tensor logits = mlp.predict(params, images.features());
    const int64_t n = images.size(), k = mlp.sizes().back();
    std::vector<int64_t> truth(k, 0), predicted(k, 0), correct(k, 0);
    const float* l = logits.data<float>();
    const int32_t* y = images.labels().data<int32_t>();
    for (int64_t i = 0; i < n; ++i) {
      int64_t best = 0;
      for (int64_t j = 1; j < k; ++j) {
        if (l[i * k + j] > l[i * k + best]) best = j;
      }
      if (y[i] < 0 || y[i] >= k) {
        throw ds::InvalidArgumentError("label " + std::to_string(y[i]) + " of image " +
                                       std::to_string(i) + " is outside the model's " +
                                       std::to_string(k) + " classes");
      }
      ++truth[y[i]];
      ++predicted[best];
      if (best == y[i]) ++correct[best];
    }
    int64_t total_correct = 0;
    for (int64_t c : correct) total_correct += c;

    std::printf("checkpoint: %s (step %s)\n", path.c_str(),
                file.metadata.count("step") ? file.metadata.at("step").c_str() : "?");
    std::printf("%-3s %-12s %8s %10s %8s %9s\n", "id", "class", "images", "predicted", "correct",
                "recall");
    for (int64_t c = 0; c < k; ++c) {
      std::printf("%-3lld %-12s %8lld %10lld %8lld %9.4f\n", static_cast<long long>(c),
                  k == 10 ? kFashionClasses[c] : "-", static_cast<long long>(truth[c]),
                  static_cast<long long>(predicted[c]), static_cast<long long>(correct[c]),
                  truth[c] ? static_cast<double>(correct[c]) / truth[c] : 0.0);
    }
    std::printf("accuracy=%.4f (%lld of %lld)\n", n ? static_cast<double>(total_correct) / n : 0.0,
                static_cast<long long>(total_correct), static_cast<long long>(n));
    return 0;
  } catch (const ds::Error& e) {
    std::fprintf(stderr, "predict: %s\n", e.what());
    return 1;
  }
}
