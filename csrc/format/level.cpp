#include "format/level.h"

#include <map>
#include <mutex>

#include "common/error.h"

namespace scorch {
namespace {

struct Registry {
  std::mutex mu;
  std::map<std::string, LevelFactory> factories{
      {"dense", make_dense_level},
      {"compressed", make_compressed_level},
      {"singleton", make_singleton_level},
  };
};

Registry& registry() {
  static Registry r;
  return r;
}

}  // namespace

void register_level_kind(const std::string& name, LevelFactory factory) {
  auto& r = registry();
  std::lock_guard lock(r.mu);
  SCORCH_CHECK(!r.factories.count(name), "level kind '{}' is already registered", name);
  r.factories.emplace(name, std::move(factory));
}

bool has_level_kind(const std::string& name) {
  auto& r = registry();
  std::lock_guard lock(r.mu);
  return r.factories.count(name) != 0;
}

LevelKindPtr make_level_kind(const std::string& name, LevelProperties props) {
  LevelFactory factory;
  {
    auto& r = registry();
    std::lock_guard lock(r.mu);
    auto it = r.factories.find(name);
    SCORCH_CHECK(it != r.factories.end(), "unknown level kind '{}'", name);
    factory = it->second;
  }
  return factory(props);
}

}  // namespace scorch
