#include "format/storage.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <numeric>
#include <optional>
#include <string>

#include <fmt/ranges.h>

#include "common/error.h"

namespace scorch {
namespace {

// Level coordinates [level][nnz] of the input tuples, with range checks on the tensor coordinates.
std::vector<std::vector<int64_t>> level_coords(const Format& f, std::span<const int64_t> shape,
                                               std::span<const int64_t> coords, int64_t nnz) {
  const int nd = f.ndim();
  SCORCH_CHECK(static_cast<int64_t>(coords.size()) == nd * nnz,
               "coordinates must have shape ({}, nnz={}), got {} entries", nd, nnz, coords.size());
  for (int d = 0; d < nd; ++d) {
    const int64_t* c = coords.data() + d * nnz;
    for (int64_t k = 0; k < nnz; ++k) {
      SCORCH_CHECK(c[k] >= 0 && c[k] < shape[d],
                         "index out of range: nonzero {} has coordinate {} in dimension {} of size {}", k, c[k], d,
                         shape[d]);
    }
  }
  std::vector<std::vector<int64_t>> lc;
  for (const auto& l : f.levels()) {
    std::vector<int64_t> v(static_cast<size_t>(nnz));
    const int64_t* c = coords.data() + l.expr.dim * nnz;
    for (int64_t k = 0; k < nnz; ++k) v[k] = l.expr.apply(c[k]);
    lc.push_back(std::move(v));
  }
  return lc;
}

// The first number in a cgroup control file ("max", absent or unreadable: none).
std::optional<long double> cgroup_limit(const std::string& path) {
  std::ifstream in(path);
  std::string word;
  if (!(in >> word) || word.empty() || word == "max") return std::nullopt;
  try {
    return std::stold(word);
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

// The leading dense levels of a format have parent count x extent positions whatever the data, and the
// level below them builds an array of that many entries + 1 (a CSR's pos), in int64, which the torch layer
// copies once more. A dense extent of billions (a (2^31, 2^31) CSR) would need tens of GiB: refuse it up front
// with an error that says so, instead of letting the out-of-memory handler kill the process. Levels below the
// first sparse one follow the stored entries: check_level_memory checks each as it is packed.
void check_pack_memory(const Format& f, std::span<const int64_t> shape, std::span<const int64_t> sizes) {
  const auto& levels = f.levels();
  long double positions = 1;
  size_t l = 0;
  for (; l < levels.size() && levels[l].kind->walk() == LevelWalk::locate; ++l)
    positions *= static_cast<long double>(sizes[l]);
  // The last dense level's positions (int64), then the next level's parent array and what it builds for every
  // parent whatever the data (a bitmap's or n:m's mask, n:m's positions): int64, its copy, the index dtype.
  const long double fixed =
      l < levels.size() ? static_cast<long double>(levels[l].kind->fixed_entries_per_parent(sizes[l])) : 0;
  const long double need = positions * 8 + (l < levels.size() ? (positions * (1 + fixed) + 1) * 24 : 0);
  static const long double have = memory_limit_bytes();  // read once: a process's limit rarely moves
  if (have <= 0) return;
  constexpr long double GiB = 1024.0L * 1024.0L * 1024.0L;
  SCORCH_CHECK(need <= have,
               "packing a tensor of shape ({}) in format {} needs about {:.0f} GiB for the index arrays of its "
               "leading dense levels ({:.3g} positions{}), more than the {:.0f} GiB of memory this process may use; a format "
               "whose first levels are compressed (dcsr, coo) stores only the nonempty ones",
               fmt::join(shape, ", "), f.short_name(), static_cast<double>(need / GiB),
               static_cast<double>(positions),
               fixed > 0 ? fmt::format(" and the {:.0f} entries the next level stores under each", static_cast<double>(fixed)) : "",
               static_cast<double>(have / GiB));
}

// What level l stores under each of its `parents` (the stored prefixes above it) whatever the data: a bitmap's
// or n:m's words, a dense level's whole extent (its positions, and the values padded with zeros below it).
// Checked before the level is packed, from the real parent count (helper-45: `compressed(0),bitmap(1)` of two
// entries in 2^38 columns raised std::bad_alloc, where `dense(0),bitmap(1)` named the size; without a memory
// limit, the OOM killer).
void check_level_memory(const Format& f, std::span<const int64_t> shape, std::span<const int64_t> sizes, size_t l,
                        int64_t parents) {
  const LevelKind& kind = *f.levels()[l].kind;
  const long double n = static_cast<long double>(parents), size = static_cast<long double>(sizes[l]);
  const long double need = n * static_cast<long double>(kind.fixed_entries_per_parent(sizes[l])) * 24 +
                           (kind.walk() == LevelWalk::locate ? n * size * 16 : 0);
  static const long double have = memory_limit_bytes();
  if (have <= 0 || need <= have) return;
  constexpr long double GiB = 1024.0L * 1024.0L * 1024.0L;
  SCORCH_CHECK(false,
               "packing a tensor of shape ({}) in format {} needs about {:.0f} GiB for what {} stores under each of "
               "its {} parents whatever the data, more than the {:.0f} GiB of memory this process may use; a "
               "compressed level there stores only the nonempty entries",
               fmt::join(shape, ", "), f.short_name(), static_cast<double>(need / GiB), level_name(f, l), parents,
               static_cast<double>(have / GiB));
}

// Sort order of the tuples by level coordinates (lexicographic, storage order).
std::vector<int64_t> sort_order(const std::vector<std::vector<int64_t>>& lc, std::span<const int64_t> sizes,
                                int64_t nnz) {
  std::vector<int64_t> order(static_cast<size_t>(nnz));
  std::iota(order.begin(), order.end(), 0);
  // Fast path: a mixed-radix key when the level extents fit in 62 bits.
  bool fits = true;
  unsigned __int128 span = 1;
  for (auto s : sizes) {
    span *= static_cast<unsigned __int128>(std::max<int64_t>(s, 1));
    if (span > (static_cast<unsigned __int128>(1) << 62)) fits = false;
  }
  if (fits) {
    std::vector<int64_t> key(static_cast<size_t>(nnz), 0);
    for (size_t l = 0; l < lc.size(); ++l)
      for (int64_t k = 0; k < nnz; ++k) key[k] = key[k] * std::max<int64_t>(sizes[l], 1) + lc[l][k];
    bool sorted = true;
    for (int64_t k = 1; k < nnz && sorted; ++k) sorted = key[k - 1] <= key[k];
    if (!sorted) std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return key[a] < key[b]; });
    return order;
  }
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    for (const auto& v : lc)
      if (v[a] != v[b]) return v[a] < v[b];
    return false;
  });
  return order;
}

// Per-level buffers split out of a flat list.
std::vector<std::span<const IndexSpan>> split_buffers(const Format& f, std::span<const IndexSpan> buffers) {
  SCORCH_CHECK(static_cast<int>(buffers.size()) == f.buffer_count(),
               "format '{}' stores {} index buffers, got {}", f.str(), f.buffer_count(), buffers.size());
  std::vector<std::span<const IndexSpan>> per_level;
  size_t at = 0;
  for (const auto& l : f.levels()) {
    const size_t n = l.kind->buffer_names().size();
    per_level.push_back(buffers.subspan(at, n));
    at += n;
  }
  return per_level;
}

}  // namespace

long double memory_limit_bytes(const std::string& proc_cgroup, const std::string& root) {
  long double have = 0;
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0) have = static_cast<long double>(pages) * static_cast<long double>(page);
  // The process's own group, as /proc/self/cgroup names it (v2: "0::/path"; v1: "N:controllers:/path" with
  // memory among the comma-separated controllers), and every group above it (a limit set on a parent holds
  // for its children), up to the mount's root, which is also where a container sees its own group.
  std::vector<std::string> files;
  auto up_the_tree = [&](const std::string& base, std::string path, const char* file) {
    for (;;) {
      files.push_back(base + path + "/" + file);
      const auto slash = path.find_last_of('/');
      if (slash == std::string::npos || path.empty()) break;
      path.resize(slash);
    }
  };
  std::ifstream groups(proc_cgroup);
  for (std::string line; std::getline(groups, line);) {
    const auto a = line.find(':'), b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string controllers = "," + line.substr(a + 1, b - a - 1) + ",", path = line.substr(b + 1);
    if (controllers == ",," && line.rfind("0:", 0) == 0) up_the_tree(root, path, "memory.max");
    else if (controllers.find(",memory,") != std::string::npos) up_the_tree(root + "/memory", path, "memory.limit_in_bytes");
  }
  files.push_back(root + "/memory.max");
  files.push_back(root + "/memory/memory.limit_in_bytes");
  for (const auto& file : files)
    if (const auto limit = cgroup_limit(file); limit && *limit > 0 && (have <= 0 || *limit < have)) have = *limit;
  // The process's own limits (ulimit -v, ulimit -d; prlimit): under them an allocation fails long before the
  // machine's memory is used up (helper-60: 8 GiB of index arrays passed the check in a 4 GB process).
  for (const int resource : {RLIMIT_AS, RLIMIT_DATA}) {
    struct rlimit rl;
    if (::getrlimit(resource, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY) continue;
    const long double limit = static_cast<long double>(rl.rlim_cur);
    if (limit > 0 && (have <= 0 || limit < have)) have = limit;
  }
  return have;
}

std::string level_name(const Format& f, size_t k) {
  return fmt::format("level {} ({} of dimension {})", k, f.levels()[k].kind->name(), f.levels()[k].expr.str());
}

Packed pack(const Format& f, std::span<const int64_t> shape, std::span<const int64_t> coords, int64_t nnz) {
  SCORCH_CHECK(nnz >= 0, "number of nonzeros must be non-negative, got {}", nnz);
  const auto sizes = f.level_sizes(shape);
  check_pack_memory(f, shape, sizes);
  const auto lc = level_coords(f, shape, coords, nnz);
  const auto order = sort_order(lc, sizes, nnz);

  // Unique tuples in sorted order; every input tuple maps to its unique tuple.
  std::vector<int64_t> input_tuple(static_cast<size_t>(nnz));
  std::vector<int64_t> first;  // input index of the first occurrence of each unique tuple
  for (int64_t r = 0; r < nnz; ++r) {
    const int64_t k = order[r];
    bool same = r > 0;
    if (same) {
      const int64_t prev = order[r - 1];
      for (const auto& v : lc) same = same && v[k] == v[prev];
    }
    if (!same) first.push_back(k);
    input_tuple[k] = static_cast<int64_t>(first.size()) - 1;
  }
  const int64_t nt = static_cast<int64_t>(first.size());

  Packed out;
  std::vector<int64_t> parts{0, nt};  // the root owns all tuples
  const size_t nl = f.levels().size();
  for (size_t l = 0; l < nl;) {
    // A non-unique level l stores one position per distinct prefix of coordinates through it and the levels
    // with one child per parent right below it, up to the first unique one of those: COO's rows
    // (compressed[nonunique], singletons, the last one unique) are whole tuples. When levels with more
    // children follow (compressed[nonunique](0),singleton(1),compressed(2): one (i, k), its l's under it;
    // compressed[nonunique](0),dense(1),...: one i, a dense row under it), several tuples share such a
    // prefix, so levels l..last are packed over those groups of tuples, not over the tuples: else the prefix
    // would be stored once per tuple, repeated under a level that promises it unique. Sorted tuples keep each
    // group contiguous, and every partition from above falls on group boundaries.
    size_t last = l;
    const bool nonunique = !f.levels()[l].kind->properties().unique;
    if (nonunique) {
      while (last + 1 < nl && f.levels()[last + 1].kind->one_child_per_parent()) {
        ++last;
        if (f.levels()[last].kind->properties().unique) break;
      }
    }
    const bool grouped = nonunique && last + 1 < nl;
    std::vector<int64_t> start;  // first tuple of each group; start[groups] = nt
    std::vector<int64_t> group_of(static_cast<size_t>(nt) + 1);
    for (int64_t t = 0; t < nt; ++t) {
      bool same = t > 0 && grouped;
      for (size_t m = 0; same && m <= last; ++m) same = lc[m][first[t]] == lc[m][first[t - 1]];
      if (!same) start.push_back(t);
      group_of[t] = static_cast<int64_t>(start.size()) - 1;
    }
    group_of[nt] = static_cast<int64_t>(start.size());
    start.push_back(nt);
    std::vector<int64_t> gparts(parts.size());
    for (size_t q = 0; q < parts.size(); ++q) gparts[q] = group_of[parts[q]];
    std::vector<int64_t> col(start.size() - 1);
    for (; l <= last; ++l) {
      const auto& kind = *f.levels()[l].kind;
      for (size_t g = 0; g + 1 < start.size(); ++g) col[g] = lc[l][first[start[g]]];
      std::vector<std::vector<int64_t>> bufs(kind.buffer_names().size());
      check_level_memory(f, shape, sizes, l, static_cast<int64_t>(gparts.size()) - 1);
      gparts = kind.pack(gparts, col, sizes[l], bufs);
      for (auto& b : bufs) out.buffers.push_back(std::move(b));
    }
    parts.resize(gparts.size());
    for (size_t q = 0; q < gparts.size(); ++q) parts[q] = start[gparts[q]];
  }
  out.value_count = static_cast<int64_t>(parts.size()) - 1;
  // Each leaf position owns at most one tuple; record where each tuple went.
  std::vector<int64_t> tuple_pos(static_cast<size_t>(nt), -1);
  for (int64_t q = 0; q < out.value_count; ++q) {
    SCORCH_ASSERT(parts[q + 1] - parts[q] <= 1, "leaf position {} holds {} tuples", q, parts[q + 1] - parts[q]);
    if (parts[q + 1] > parts[q]) tuple_pos[parts[q]] = q;
  }
  out.value_pos.resize(static_cast<size_t>(nnz));
  for (int64_t k = 0; k < nnz; ++k) out.value_pos[k] = tuple_pos[input_tuple[k]];
  return out;
}

namespace {

// Walk the levels breadth-first. For each level, coordinate and parent of each position.
struct Walk {
  std::vector<std::vector<int64_t>> coord, parent;
};

Walk walk(const Format& f, const std::vector<int64_t>& sizes, const std::vector<std::span<const IndexSpan>>& per_level,
          const std::vector<int64_t>& counts) {
  Walk w;
  int64_t parents = 1;
  for (size_t l = 0; l < f.levels().size(); ++l) {
    std::vector<int64_t> c(static_cast<size_t>(counts[l])), par(static_cast<size_t>(counts[l]));
    for (int64_t p = 0; p < parents; ++p) {
      f.levels()[l].kind->for_each_child(per_level[l], sizes[l], p, [&](int64_t coord, int64_t pos) {
        SCORCH_ASSERT(pos >= 0 && pos < counts[l], "child position {} out of range", pos);
        c[pos] = coord;
        par[pos] = p;
      });
    }
    parents = counts[l];
    w.coord.push_back(std::move(c));
    w.parent.push_back(std::move(par));
  }
  return w;
}

// Level coordinates of leaf q, written into `out` (one per level).
void leaf_coords(const Walk& w, int64_t q, std::vector<int64_t>& out) {
  for (size_t l = w.coord.size(); l-- > 0;) {
    out[l] = w.coord[l][q];
    q = w.parent[l][q];
  }
}

std::vector<int64_t> check_levels(const Format& f, const std::vector<int64_t>& sizes,
                                  const std::vector<std::span<const IndexSpan>>& per_level) {
  std::vector<int64_t> counts;
  int64_t parents = 1;
  for (size_t l = 0; l < f.levels().size(); ++l) {
    parents = f.levels()[l].kind->validate(per_level[l], parents, sizes[l], level_name(f, l));
    counts.push_back(parents);
  }
  return counts;
}

}  // namespace

int64_t stored_positions(const Format& f, std::span<const int64_t> shape, std::span<const IndexSpan> buffers) {
  const auto sizes = f.level_sizes(shape);
  const auto per_level = split_buffers(f, buffers);
  int64_t parents = 1;
  for (size_t l = 0; l < f.levels().size(); ++l) {
    // Runs on every kernel call: the level's name is formatted only when a check fails (the check then runs
    // again to raise with the name in its message).
    const LevelKind& kind = *f.levels()[l].kind;
    try {
      parents = kind.check_lengths(per_level[l], parents, sizes[l], std::string());
    } catch (const Error&) {
      parents = kind.check_lengths(per_level[l], parents, sizes[l], level_name(f, l));
    }
  }
  return parents;
}

void check_lengths(const Format& f, std::span<const int64_t> shape, std::span<const IndexSpan> buffers,
                   int64_t value_count) {
  const int64_t parents = stored_positions(f, shape, buffers);
  SCORCH_CHECK(value_count == parents, "values has {} entries but the index buffers describe {} stored positions",
               value_count, parents);
}

void validate(const Format& f, std::span<const int64_t> shape, std::span<const IndexSpan> buffers,
              int64_t value_count) {
  const auto sizes = f.level_sizes(shape);
  const auto per_level = split_buffers(f, buffers);
  const auto counts = check_levels(f, sizes, per_level);
  const int64_t expect = counts.empty() ? 1 : counts.back();
  SCORCH_CHECK(value_count == expect, "values has {} entries but the index buffers describe {} stored positions",
               value_count, expect);
  if (!f.ordered() || f.levels().empty()) return;
  // Whole tuples must be in lexicographic order, and strictly so when the format is unique.
  const Walk w = walk(f, sizes, per_level, counts);
  const size_t nl = f.levels().size();
  // And each unique level's prefixes (its positions' coordinates through it) strictly increasing: a unique
  // level under non-unique ones (a COO's last row level above more levels) must not repeat a prefix, nor
  // store one after a greater one (between them, a position with an empty segment below hides either from
  // the whole tuples' order).
  // (Under unique levels only, each parent position is a distinct prefix already, and the level's own
  // validate checks its coordinates unique within a parent.)
  bool under_nonunique = false;
  for (size_t l = 0; l + 1 < nl; ++l) {
    const bool unique_level = f.levels()[l].kind->properties().unique;
    const bool check = unique_level && under_nonunique;
    under_nonunique = under_nonunique || !unique_level;
    if (!check) continue;
    std::vector<int64_t> a(l + 1), b(l + 1);
    for (int64_t q = 1; q < counts[l]; ++q) {
      for (int64_t m = static_cast<int64_t>(l), x = q, y = q - 1; m >= 0; --m) {
        a[m] = w.coord[m][x];
        b[m] = w.coord[m][y];
        x = w.parent[m][x];
        y = w.parent[m][y];
      }
      SCORCH_CHECK(std::lexicographical_compare(b.begin(), b.end(), a.begin(), a.end()),
                   "{} stores the coordinates ({}) {} ({}) at positions {} and {}, but promises them unique and sorted",
                   level_name(f, l), fmt::join(b, ", "), b == a ? "twice:" : "before", fmt::join(a, ", "), q - 1, q);
    }
  }
  std::vector<int64_t> prev(nl), cur(nl);
  const bool unique = f.unique();
  for (int64_t q = 0; q < value_count; ++q) {
    leaf_coords(w, q, cur);
    if (q > 0) {
      const bool less = std::lexicographical_compare(prev.begin(), prev.end(), cur.begin(), cur.end());
      SCORCH_CHECK(less || (!unique && prev == cur), "stored coordinates are {} at positions {} and {}",
                   prev == cur ? "duplicated" : "not sorted", q - 1, q);
    }
    std::swap(prev, cur);
  }
}

std::vector<int64_t> unpack(const Format& f, std::span<const int64_t> shape, std::span<const IndexSpan> buffers,
                            int64_t value_count) {
  std::vector<int64_t> out(static_cast<size_t>(f.ndim() * std::max<int64_t>(value_count, 0)), 0);
  unpack_into(f, shape, buffers, value_count, out);
  return out;
}

void unpack_into(const Format& f, std::span<const int64_t> shape, std::span<const IndexSpan> buffers,
                 int64_t value_count, std::span<int64_t> out) {
  const auto sizes = f.level_sizes(shape);
  const auto per_level = split_buffers(f, buffers);
  const auto counts = check_levels(f, sizes, per_level);
  SCORCH_CHECK(value_count == (counts.empty() ? 1 : counts.back()), "values has {} entries, buffers describe {}",
               value_count, counts.empty() ? 1 : counts.back());
  const int nd = f.ndim();
  SCORCH_ASSERT(out.size() == static_cast<size_t>(nd * value_count), "unpack_into: {} slots for {} coordinates",
                out.size(), nd * value_count);
  std::fill(out.begin(), out.end(), 0);
  const Walk w = walk(f, sizes, per_level, counts);
  std::vector<int64_t> lc(f.levels().size());
  for (int64_t q = 0; q < value_count; ++q) {
    leaf_coords(w, q, lc);
    for (size_t l = 0; l < lc.size(); ++l) {
      const auto& e = f.levels()[l].expr;
      int64_t& slot = out[e.dim * value_count + q];
      slot += e.part == LevelExpr::Part::outer ? lc[l] * e.block : lc[l];
    }
  }
}

std::vector<int64_t> dense_offsets(const Format& f, std::span<const int64_t> shape, std::span<const IndexSpan> buffers,
                                   int64_t value_count) {
  const auto sizes = f.level_sizes(shape);
  const auto per_level = split_buffers(f, buffers);
  const auto counts = check_levels(f, sizes, per_level);
  SCORCH_CHECK(value_count == (counts.empty() ? 1 : counts.back()), "values has {} entries, buffers describe {}",
               value_count, counts.empty() ? 1 : counts.back());
  std::vector<int64_t> stride(shape.size(), 1);
  for (size_t d = shape.size(); d-- > 1;) stride[d - 1] = stride[d] * shape[d];
  std::vector<int64_t> above{0}, here;  // the offsets of the positions of the level above, and of this one
  for (size_t l = 0; l < f.levels().size(); ++l) {
    const LevelExpr& e = f.levels()[l].expr;
    const int64_t step = (e.part == LevelExpr::Part::outer ? e.block : 1) * stride[static_cast<size_t>(e.dim)];
    here.assign(static_cast<size_t>(counts[l]), 0);
    for (int64_t p = 0; p < static_cast<int64_t>(above.size()); ++p) {
      const int64_t base = above[static_cast<size_t>(p)];
      f.levels()[l].kind->for_each_child(per_level[l], sizes[l], p, [&](int64_t coord, int64_t pos) {
        SCORCH_ASSERT(pos >= 0 && pos < counts[l], "child position {} out of range", pos);
        here[static_cast<size_t>(pos)] = base + coord * step;
      });
    }
    std::swap(above, here);
  }
  return above;
}

}  // namespace scorch
