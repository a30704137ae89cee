// scorch_deploy: runs a TorchScript model that calls torch.ops.scorch operators, in a process with no Python
// and no compiler. Kernels come from a bundle built ahead of time (scorch_backend.custom_ops.aot.build_bundle).
//
//   scorch_deploy <model.pt> <kernels bundle | @ | -> <inputs.pt> <outputs.pt> [--repeat N] [--no-freeze]
//
// The bundle is a file, or "@": the one stored inside model.pt as the extra file "scorch/kernels"
// (scorch_backend.custom_ops.aot.save_model), or "-": none (then kernels come from the JIT, if it may compile).
// inputs.pt holds a tensor, or a tuple or list of tensors (a dict for a sparse CSR matrix: see argument()),
// saved with torch.save (torch::jit::pickle_load reads it); they are the model's forward() arguments.
// outputs.pt receives forward()'s result, saved with torch::jit::pickle_save (torch.load reads it).
// --repeat N runs forward() N more times and prints the median latency. The model is frozen first
// (torch::jit::freeze) unless --no-freeze is given.
#include <torch/script.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

namespace {

std::vector<char> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  return std::vector<char>(std::istreambuf_iterator<char>(in), {});
}

void write_file(const std::string& path, const std::vector<char>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("cannot write " + path);
}

// scorch::load_kernels through the dispatcher, as any op registered by a library loaded into the process.
int64_t load_kernels(const std::string& bundle) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("scorch::load_kernels", "")
                       .typed<int64_t(c10::string_view)>();
  return op.call(bundle);
}

// scorch::load_kernel_bytes: a bundle held in memory, as a uint8 tensor.
int64_t load_kernel_bytes(std::string& bytes, const std::string& name) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("scorch::load_kernel_bytes", "")
                       .typed<int64_t(const at::Tensor&, c10::string_view)>();
  const at::Tensor data = torch::from_blob(bytes.data(), {static_cast<int64_t>(bytes.size())}, torch::kUInt8);
  return op.call(data, name);
}

constexpr const char* kBundleExtraFile = "scorch/kernels";  // scorch_backend.custom_ops.aot.EXTRA_FILE

// A sparse CSR matrix (a GCN's graph) as the inputs file carries it: the pickle format C++ reads has no sparse
// layouts, so a dict {"crow_indices", "col_indices", "values", "size"} stands for
// at::sparse_csr_tensor(crow_indices, col_indices, values, size), which is how a C++ caller builds one.
c10::IValue argument(const c10::IValue& v) {
  if (!v.isGenericDict()) return v;
  const c10::Dict<c10::IValue, c10::IValue> d = v.toGenericDict();
  for (const char* key : {"crow_indices", "col_indices", "values", "size"})
    if (!d.contains(key)) throw std::runtime_error(std::string("an input dict (a sparse CSR matrix) lacks '") + key + "'");
  std::vector<int64_t> size;
  const c10::IValue s = d.at("size");
  const std::vector<c10::IValue> items = s.isTuple() ? s.toTupleRef().elements().vec()
                                         : s.isList() ? s.toListRef().vec()
                                                      : std::vector<c10::IValue>{};
  for (const auto& n : items) {
    if (!n.isInt()) throw std::runtime_error("a sparse CSR input's 'size' must be a list of integers");
    size.push_back(n.toInt());
  }
  if (size.size() != 2) throw std::runtime_error("a sparse CSR input's 'size' must have 2 entries");
  return at::sparse_csr_tensor(d.at("crow_indices").toTensor(), d.at("col_indices").toTensor(),
                               d.at("values").toTensor(), size,
                               d.at("values").toTensor().options().layout(at::kSparseCsr));
}

std::vector<c10::IValue> forward_arguments(const c10::IValue& v) {
  std::vector<c10::IValue> args;
  if (v.isTuple()) args = v.toTupleRef().elements().vec();
  else if (v.isList()) args = v.toListRef().vec();
  else args = {v};
  for (auto& a : args) a = argument(a);
  return args;
}

}  // namespace

int main(int argc, char** argv) {
  int repeat = 0;
  bool freeze = true;
  bool ok = argc >= 5;
  for (int i = 5; ok && i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--repeat" && i + 1 < argc) {
      // A count of 1 to a million, digits only (atoi took "abc" and "-5" as 0 and wrapped 99999999999999).
      const std::string n = argv[++i];
      ok = !n.empty() && n.size() <= 7 && n.find_first_not_of("0123456789") == std::string::npos;
      repeat = ok ? std::stoi(n) : 0;
      ok = ok && repeat >= 1 && repeat <= 1000000;
      if (!ok) std::cerr << "--repeat takes a count from 1 to 1000000, got '" << n << "'\n";
    } else if (a == "--no-freeze") freeze = false;
    else ok = false;
  }
  if (!ok) {
    std::cerr << "usage: " << argv[0]
              << " <model.pt> <kernels bundle | @ | -> <inputs.pt> <outputs.pt> [--repeat N] [--no-freeze]\n";
    return 2;
  }
  const std::string model_path = argv[1], bundle = argv[2], inputs_path = argv[3], outputs_path = argv[4];
  try {
    torch::jit::ExtraFilesMap extra{{kBundleExtraFile, ""}};
    torch::jit::Module model = torch::jit::load(model_path, c10::nullopt, extra);
    if (bundle == "@") {
      std::string& bytes = extra[kBundleExtraFile];
      if (bytes.empty()) throw std::runtime_error(model_path + " holds no kernel bundle (extra file scorch/kernels)");
      const int64_t n = load_kernel_bytes(bytes, model_path + ":" + kBundleExtraFile);  // printed once loaded
      std::cout << "kernels loaded: " << n << "\n";
    } else if (bundle != "-") {
      const int64_t n = load_kernels(bundle);
      std::cout << "kernels loaded: " << n << "\n";
    }
    model.eval();
    // Freezing folds the attributes into the graph as constants and lets TorchScript's passes simplify it (an
    // inference deployment: 4-7% faster on the rewritten BERT, which then runs as fast as torch.compile does).
    if (freeze) model = torch::jit::freeze(model);
    const std::vector<c10::IValue> inputs = forward_arguments(torch::jit::pickle_load(read_file(inputs_path)));
    torch::NoGradGuard no_grad;
    const c10::IValue out = model.forward(inputs);
    write_file(outputs_path, torch::jit::pickle_save(out));
    if (repeat > 0) {
      std::vector<double> ms;
      for (int r = 0; r < repeat; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        model.forward(inputs);
        ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
      }
      std::nth_element(ms.begin(), ms.begin() + ms.size() / 2, ms.end());
      std::cout << "median latency: " << ms[ms.size() / 2] << " ms over " << repeat << " runs\n";
    }
  } catch (const c10::Error& e) {
    std::cerr << "scorch_deploy: " << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "scorch_deploy: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
