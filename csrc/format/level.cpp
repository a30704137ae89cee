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
      {"bitmap", make_bitmap_level},
  };
  std::map<std::string, std::pair<int, ParamLevelFactory>> param_factories{{"nm", {2, make_nm_level}}};
};

Registry& registry() {
  static Registry r;
  return r;
}

}  // namespace

LevelKind::IndexReport LevelKind::find_bad_index(std::span<const IndexSpan> buffers, std::span<const std::string>,
                                                 int64_t parent_count, int64_t size, const std::string& where) const {
  try {
    return {"", validate(buffers, parent_count, size, where)};
  } catch (const Error& e) {
    return {e.what(), 0};
  }
}

void register_level_kind(const std::string& name, LevelFactory factory) {
  auto& r = registry();
  std::lock_guard lock(r.mu);
  SCORCH_CHECK(!r.factories.count(name) && !r.param_factories.count(name), "level kind '{}' is already registered", name);
  r.factories.emplace(name, std::move(factory));
}

bool has_level_kind(const std::string& name) {
  auto& r = registry();
  std::lock_guard lock(r.mu);
  return r.factories.count(name) != 0 || r.param_factories.count(name) != 0;
}

int level_kind_parameter_count(const std::string& name) {
  auto& r = registry();
  std::lock_guard lock(r.mu);
  auto it = r.param_factories.find(name);
  return it == r.param_factories.end() ? 0 : it->second.first;
}

LevelKindPtr make_level_kind(const std::string& name, LevelProperties props, std::span<const int64_t> params) {
  if (params.empty()) return make_level_kind(name, props);
  ParamLevelFactory factory;
  {
    auto& r = registry();
    std::lock_guard lock(r.mu);
    auto it = r.param_factories.find(name);
    SCORCH_CHECK(it != r.param_factories.end(), "level kind '{}' takes no parameters", name);
    SCORCH_CHECK(static_cast<int>(params.size()) == it->second.first, "level kind '{}' takes {} parameters, got {}",
                 name, it->second.first, params.size());
    factory = it->second.second;
  }
  return factory(props, params);
}

LevelKindPtr make_level_kind(const std::string& name, LevelProperties props) {
  LevelFactory factory;
  {
    auto& r = registry();
    std::lock_guard lock(r.mu);
    auto it = r.factories.find(name);
    if (it == r.factories.end() && r.param_factories.count(name))
      SCORCH_CHECK(false, "level kind '{}' needs {} parameters, e.g. '{}[2:4]'", name,
                   r.param_factories.at(name).first, name);
    SCORCH_CHECK(it != r.factories.end(), "unknown level kind '{}'", name);
    factory = it->second;
  }
  return factory(props);
}

}  // namespace scorch
