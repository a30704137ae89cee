#include "lower/pipeline.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <fstream>

#include <fmt/format.h>

#include "common/error.h"
#include "lower/native_forms.h"

namespace scorch {

namespace passes {

// Pass: native forms. A statement over level kinds with a lowering of their own (native_forms.h: BSR
// blocks, ...) is lowered whole by it; the general passes then leave the kernel as it is.
void native_forms(KernelIR& k) {
  if (auto n = lower_native_form(*k.spec, *k.sched, k.machine)) {
    k.native = true;
    k.body = std::move(n->body);
    k.facts = std::move(*n);
    k.facts.body.clear();
  }
}

std::string KernelIR::str() const {
  std::string s;
  auto region = [&](const char* name, const loops::Stmts& r) {
    if (r.empty()) return;
    s += fmt::format("## {}\n", name);
    s += loops::print(r, 0);
  };
  if (native) s += "## (a native form: the general passes leave it)\n";
  region("nest", nest);
  region("setup", setup);
  region("thread", thread);
  region("teardown", teardown);
  region("body", body);
  return s;
}

}  // namespace passes

const std::vector<PipelinePass>& pipeline_passes() {
  static const std::vector<PipelinePass> list = {
      {"native_forms", passes::native_forms}, {"iterate", passes::iterate},         {"vectorize", passes::vectorize},
      {"output_assembly", passes::output_assembly}, {"parallelize", passes::parallelize}, {"entry", passes::entry},
  };
  return list;
}

passes::KernelIR run_pipeline(const KernelSpec& spec, const Schedule& schedule, const VectorShape& machine,
                              const PassDump& dump, bool native_forms, int stop_after) {
  passes::KernelIR k;
  k.spec = &spec;
  k.sched = &schedule;
  k.machine = machine;
  const auto& list = pipeline_passes();
  for (size_t n = 0; n < list.size(); ++n) {
    if (stop_after > 0 && static_cast<int>(n) >= stop_after) return k;
    if (n > 0 || native_forms) list[n].run(k);
    if (dump) dump(static_cast<int>(n) + 1, list[n].name, k.str());
  }
  k.facts.body = k.body;
  return k;
}

namespace {

void make_dirs(const std::string& dir) {
  for (size_t at = 1; at <= dir.size(); ++at) {
    if (at != dir.size() && dir[at] != '/') continue;
    const std::string part = dir.substr(0, at);
    if (::mkdir(part.c_str(), 0755) != 0 && errno != EEXIST)
      SCORCH_CHECK(false, "cannot create the loop IR dump folder {}: {}", part, std::strerror(errno));
  }
}

}  // namespace

PassDump dump_to_folder(const std::string& dir, const std::string& kernel, const std::string& spec_text) {
  make_dirs(dir);
  return [dir, kernel, spec_text](int number, const std::string& pass, const std::string& ir) {
    const std::string path = fmt::format("{}/{}.{:02d}-{}.txt", dir, kernel, number, pass);
    std::ofstream f(path);
    SCORCH_CHECK(f.good(), "cannot write the loop IR dump {}", path);
    f << "// spec: " << spec_text << "\n// after pass " << number << ": " << pass << "\n" << ir;
  };
}

}  // namespace scorch
