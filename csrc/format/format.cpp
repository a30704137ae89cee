#include "format/format.h"

#include <cctype>

#include "common/error.h"
#include "common/text_cursor.h"

namespace scorch {

int64_t LevelExpr::extent(int64_t n) const {
  switch (part) {
    case Part::whole: return n;
    case Part::outer: return n / block;
    case Part::inner: return block;
  }
  return n;
}

int64_t LevelExpr::apply(int64_t c) const {
  switch (part) {
    case Part::whole: return c;
    case Part::outer: return c / block;
    case Part::inner: return c % block;
  }
  return c;
}

std::string LevelExpr::str() const {
  switch (part) {
    case Part::whole: return fmt::format("{}", dim);
    case Part::outer: return fmt::format("{}/{}", dim, block);
    case Part::inner: return fmt::format("{}%{}", dim, block);
  }
  return "";
}

Format::Format(int ndim, std::vector<Level> levels) : ndim_(ndim), levels_(std::move(levels)) {
  SCORCH_CHECK(ndim >= 0, "a format needs a non-negative number of dimensions, got {}", ndim);
  std::vector<int> whole(ndim, 0), outer(ndim, 0), inner(ndim, 0);
  std::vector<int64_t> block(ndim, 0);
  for (const auto& l : levels_) {
    SCORCH_ASSERT(l.kind != nullptr, "level without a kind");
    const auto& e = l.expr;
    SCORCH_CHECK(e.dim >= 0 && e.dim < ndim, "format level refers to dimension {} of a {}-dimensional tensor", e.dim,
                 ndim);
    SCORCH_CHECK(e.block >= 1, "block size must be positive, got {}", e.block);
    if (e.part == LevelExpr::Part::whole) {
      whole[e.dim]++;
    } else {
      SCORCH_CHECK(block[e.dim] == 0 || block[e.dim] == e.block, "dimension {} is blocked by both {} and {}", e.dim,
                   block[e.dim], e.block);
      block[e.dim] = e.block;
      (e.part == LevelExpr::Part::outer ? outer : inner)[e.dim]++;
    }
    SCORCH_CHECK(l.kind->supports(l.kind->properties()), "level kind '{}' does not support those properties",
                 l.kind->name());
  }
  for (int d = 0; d < ndim; ++d) {
    const bool ok = (whole[d] == 1 && outer[d] == 0 && inner[d] == 0) ||
                    (whole[d] == 0 && outer[d] == 1 && inner[d] == 1);
    SCORCH_CHECK(ok, "format '{}' must store dimension {} exactly once (as d, or as both d/b and d%b)", str(), d);
  }
}

std::string Format::str() const {
  std::string s;
  for (size_t k = 0; k < levels_.size(); ++k) {
    const auto& l = levels_[k];
    if (k) s += ",";
    s += l.kind->name();
    const auto& p = l.kind->properties();
    if (!p.unique || !p.ordered) {
      s += "[";
      if (!p.unique) s += "nonunique";
      if (!p.unique && !p.ordered) s += ",";
      if (!p.ordered) s += "unordered";
      s += "]";
    }
    s += "(" + l.expr.str() + ")";
  }
  return s;
}

std::string Format::short_name() const {
  const std::string me = str();
  for (const char* name : {"dense", "csr", "csc", "coo", "dcsr", "dcsc", "csf", "bitmap"}) {
    try {
      if (preset(name, ndim_).str() == me) return name;
    } catch (const Error&) {
    }
  }
  if (ndim_ == 2 && levels_.size() == 4 && levels_[0].expr.part == LevelExpr::Part::outer &&
      levels_[1].expr.part == LevelExpr::Part::outer) {
    const int64_t b[2] = {levels_[0].expr.block, levels_[1].expr.block};
    if (preset("bsr", 2, b).str() == me) return fmt::format("bsr({},{})", b[0], b[1]);
  }
  if (!levels_.empty()) {
    if (const auto [n, m] = levels_.back().kind->structured_groups(); m > 0) {
      const int64_t nm[2] = {n, m};
      try {
        if (preset("nm", ndim_, nm).str() == me) return fmt::format("nm({},{})", n, m);
      } catch (const Error&) {
      }
    }
  }
  return me;
}

std::vector<int64_t> Format::level_sizes(std::span<const int64_t> shape) const {
  SCORCH_CHECK(static_cast<int>(shape.size()) == ndim_, "format '{}' is for {}-dimensional tensors, got shape of {}",
               str(), ndim_, shape.size());
  std::vector<int64_t> sizes;
  for (auto n : shape) SCORCH_CHECK(n >= 0, "sizes must be non-negative, got {}", n);
  for (const auto& l : levels_) {
    const auto& e = l.expr;
    if (e.part != LevelExpr::Part::whole) {
      SCORCH_CHECK(shape[e.dim] % e.block == 0, "dimension {} of size {} is not divisible by its block size {}", e.dim,
                   shape[e.dim], e.block);
    }
    sizes.push_back(e.extent(shape[e.dim]));
  }
  return sizes;
}

std::vector<std::string> Format::buffer_names() const {
  std::vector<std::string> names;
  for (size_t k = 0; k < levels_.size(); ++k)
    for (const auto& n : levels_[k].kind->buffer_names()) names.push_back(fmt::format("{}{}", n, k));
  return names;
}

int Format::buffer_count() const { return static_cast<int>(buffer_names().size()); }

bool Format::all_dense() const {
  for (const auto& l : levels_)
    if (l.kind->name() != "dense") return false;
  return true;
}

bool Format::ordered() const {
  for (const auto& l : levels_)
    if (!l.kind->properties().ordered) return false;
  return true;
}

bool Format::unique() const { return levels_.empty() || levels_.back().kind->properties().unique; }

Format Format::preset(const std::string& name, int ndim, std::span<const int64_t> block) {
  auto level = [](const char* kind, int dim, LevelProperties props = {}) {
    return Level{make_level_kind(kind, props), LevelExpr{dim}};
  };
  auto need2 = [&] { SCORCH_CHECK(ndim == 2, "format '{}' is for 2-dimensional tensors, got {} dimensions", name, ndim); };
  std::vector<Level> ls;
  if (name == "dense") {
    for (int d = 0; d < ndim; ++d) ls.push_back(level("dense", d));
  } else if (name == "csr") {
    SCORCH_CHECK(ndim >= 2, "format 'csr' needs at least 2 dimensions, got {}", ndim);
    for (int d = 0; d + 1 < ndim; ++d) ls.push_back(level("dense", d));
    ls.push_back(level("compressed", ndim - 1));
  } else if (name == "csc") {
    need2();
    ls = {level("dense", 1), level("compressed", 0)};
  } else if (name == "dcsr") {
    need2();
    ls = {level("compressed", 0), level("compressed", 1)};
  } else if (name == "dcsc") {
    need2();
    ls = {level("compressed", 1), level("compressed", 0)};
  } else if (name == "csf") {
    for (int d = 0; d < ndim; ++d) ls.push_back(level("compressed", d));
  } else if (name == "coo") {
    for (int d = 0; d < ndim; ++d) {
      const bool last = d + 1 == ndim;
      if (d == 0) ls.push_back(level("compressed", 0, {true, last}));
      else ls.push_back(level("singleton", d, {true, last}));
    }
  } else if (name == "bsr") {
    need2();
    SCORCH_CHECK(block.size() == 2 && block[0] >= 1 && block[1] >= 1,
                 "format 'bsr' needs a block size of two positive integers, e.g. 'bsr(2,2)'");
    using P = LevelExpr::Part;
    ls = {Level{make_dense_level({}), {0, P::outer, block[0]}}, Level{make_compressed_level({}), {1, P::outer, block[1]}},
          Level{make_dense_level({}), {0, P::inner, block[0]}}, Level{make_dense_level({}), {1, P::inner, block[1]}}};
  } else if (name == "nm") {  // n of every m consecutive coordinates of the last dimension, rows dense
    SCORCH_CHECK(ndim >= 1 && block.size() == 2, "format 'nm' needs n and m, e.g. 'nm(2,4)'");
    for (int d = 0; d + 1 < ndim; ++d) ls.push_back(level("dense", d));
    ls.push_back(Level{make_level_kind("nm", {}, block), LevelExpr{ndim - 1}});
  } else if (name == "bitmap") {  // a bit per coordinate of the last dimension, rows dense
    SCORCH_CHECK(ndim >= 1, "format 'bitmap' needs at least 1 dimension");
    for (int d = 0; d + 1 < ndim; ++d) ls.push_back(level("dense", d));
    ls.push_back(level("bitmap", ndim - 1));
  } else {
    SCORCH_CHECK(false, "unknown format preset '{}'; known: dense, csr, csc, coo, dcsr, dcsc, csf, bsr(bh,bw), "
                 "nm(n,m), bitmap", name);
  }
  return Format(ndim, std::move(ls));
}

namespace {

// Recursive-descent parser of the canonical text form; errors point at the offending character.
class Parser : public TextCursor {
 public:
  using TextCursor::TextCursor;

  [[noreturn]] void fail(const std::string& msg) const {
    throw_error(ErrorKind::value, fmt::format("bad format string: {}\n  {}\n  {}^", msg, s_, std::string(i_, ' ')));
  }
  void expect(char c) {
    if (!eat(c)) fail(fmt::format("expected '{}'", c));
  }
  std::string ident() {
    std::string n = name();
    if (n.empty()) fail("expected a name");
    return n;
  }
  int64_t integer() {
    skip();
    size_t b = i_;
    while (i_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[i_]))) ++i_;
    if (b == i_) fail("expected a non-negative integer");
    if (i_ - b > 12) {
      i_ = b;
      fail("integer too large");
    }
    return std::stoll(s_.substr(b, i_ - b));
  }
};

}  // namespace

Format Format::parse(const std::string& text, int ndim) {
  Parser p(text);
  if (p.done()) {  // the canonical text of a 0-dimensional tensor's format has no levels
    SCORCH_CHECK(ndim == 0, "empty format string (only a 0-dimensional tensor has no levels)");
    return preset("dense", 0);
  }
  // A preset name, optionally with arguments: "csr", "bsr(2,3)".
  {
    const std::string name = p.ident();
    static const char* presets[] = {"dense", "csr", "csc", "coo", "dcsr", "dcsc", "csf", "bsr", "bitmap"};
    bool is_preset = false;
    for (auto* q : presets) is_preset |= name == q;
    if (is_preset && p.done()) return preset(name, ndim);
    if (!is_preset && p.done()) {
      p.rewind(0);
      p.skip();
      p.fail(fmt::format("unknown format '{}'; presets are dense, csr, csc, coo, dcsr, dcsc, csf, bsr(bh,bw), "
                         "nm(n,m), bitmap, or "
                         "give levels such as 'dense(0),compressed(1)'",
                         name));
    }
    if (name == "nm" && p.eat('(')) {  // the preset nm(n,m); nm[n:m](d) is the level kind
      std::vector<int64_t> b{p.integer()};
      p.expect(',');
      b.push_back(p.integer());
      p.expect(')');
      if (!p.done()) {
        p.rewind(0);
        p.fail("the preset nm(n,m) stands alone; for levels write e.g. 'dense(0),nm[2:4](1)'");
      }
      return preset(name, ndim, b);
    }
    if (name == "bsr") {
      p.expect('(');
      std::vector<int64_t> b{p.integer()};
      p.expect(',');
      b.push_back(p.integer());
      p.expect(')');
      if (!p.done()) p.fail("unexpected text after the preset");
      return preset(name, ndim, b);
    }
    p.rewind(0);
  }
  std::vector<Level> levels;
  do {
    const size_t start = p.at();
    const std::string kind = p.ident();
    if (!has_level_kind(kind)) {
      p.rewind(start);
      p.fail(fmt::format("unknown level kind '{}'", kind));
    }
    LevelProperties props;
    std::vector<int64_t> params;
    if (const int np = level_kind_parameter_count(kind); np > 0) {  // kind[a:b], e.g. nm[2:4]
      p.expect('[');
      for (int i = 0; i < np; ++i) {
        if (i) p.expect(':');
        params.push_back(p.integer());
      }
      p.expect(']');
    } else if (p.eat('[')) {
      do {
        const size_t at = p.at();
        const std::string prop = p.ident();
        if (prop == "nonunique") props.unique = false;
        else if (prop == "unordered") props.ordered = false;
        else {
          p.rewind(at);
          p.fail(fmt::format("unknown level property '{}' (known: nonunique, unordered)", prop));
        }
      } while (p.eat(','));
      p.expect(']');
    }
    p.expect('(');
    const size_t dim_at = p.at();
    LevelExpr e;
    e.dim = static_cast<int>(p.integer());
    if (e.dim >= ndim) {
      p.rewind(dim_at);
      p.skip();
      p.fail(fmt::format("dimension {} does not exist in a {}-dimensional tensor", e.dim, ndim));
    }
    if (p.eat('/')) {
      e.part = LevelExpr::Part::outer;
      e.block = p.integer();
    } else if (p.eat('%')) {
      e.part = LevelExpr::Part::inner;
      e.block = p.integer();
    }
    if (e.part != LevelExpr::Part::whole && e.block < 1) p.fail("block size must be positive");
    p.expect(')');
    LevelKindPtr k;
    try {
      k = make_level_kind(kind, props, params);
    } catch (const Error& e) {
      p.rewind(start);
      p.fail(e.what());
    }
    if (!k->supports(props)) {
      p.rewind(start);
      p.fail(fmt::format("level kind '{}' cannot be non-unique or unordered", kind));
    }
    levels.push_back(Level{std::move(k), e});
  } while (p.eat(','));
  if (!p.done()) p.fail("expected ',' or the end");
  return Format(ndim, std::move(levels));
}

}  // namespace scorch
