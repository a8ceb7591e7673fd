// PagedKvCache (attncore/paged.h): the pool, the page table, lengths, free list and reference
// counts. Every call checks all of its arguments (docs/design.md section 4's messages) before it
// changes anything.
#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "attncore/error.h"
#include "attncore/paged.h"
#include "core/convert.h"
#include "core/cpu_info.h"
#include "core/large_memory.h"
#include "core/validate_checks.h"

namespace attncore {

namespace {

// The pages of K or V: zeroed memory of their own (StreamedMemory: huge pages where the OS
// offers them, for decode's streaming) seen as [num_pages, page_size, Hkv, D].
class Pool {
 public:
  Pool() = default;
  Pool(DType dtype, std::int64_t num_pages, std::int64_t page_size, std::int64_t heads,
       std::int64_t dim)
      : memory_(static_cast<std::size_t>(num_pages * page_size * heads * dim) * size_of(dtype)),
        pages_(TensorView::contiguous(memory_.data(), dtype, {num_pages, page_size, heads, dim})) {}
  const TensorView& view() const { return pages_; }
  DType dtype() const { return pages_.dtype; }
  void* data() const { return pages_.data; }
  std::int64_t size(int d) const { return pages_.size(d); }

 private:
  detail::StreamedMemory memory_;
  TensorView pages_;
};

}  // namespace

struct PagedKvCache::State {
  std::int64_t num_pages, page_size, heads_kv, head_dim, head_dim_v, max_batch, per_seq;
  Pool k, v;       // [num_pages, page_size, Hkv, D], [num_pages, page_size, Hkv, Dv]
  Tensor table;    // i32 [max_batch, per_seq], -1 unmapped: the view callers read
  Tensor lengths;  // i32 [max_batch]
  // [max_batch * per_seq]: the page table as the cache keeps it, copied into `table` after each
  // change (publish), so that a caller writing the view (which it must not) misleads only its
  // own attention calls, never the reference counts and the free list.
  std::vector<std::int32_t> pages;
  std::vector<std::int32_t> free;  // free pages; taken from the back (torch's order)
  std::vector<std::int32_t> refs;  // [num_pages]: sequences mapping each page

  std::int32_t* row(std::int64_t b) { return pages.data() + b * per_seq; }
  const std::int32_t* row(std::int64_t b) const { return pages.data() + b * per_seq; }
  void publish(std::int64_t b) const {
    std::copy_n(row(b), per_seq, table.data_as<std::int32_t>() + b * per_seq);
  }
  std::int32_t& length(std::int64_t b) const { return lengths.data_as<std::int32_t>()[b]; }
  // Logical pages of b: the leading mapped entries of its row.
  std::int64_t mapped(std::int64_t b) const {
    const std::int32_t* r = row(b);
    std::int64_t i = 0;
    while (i < per_seq && r[i] >= 0) ++i;
    return i;
  }
  // The bytes of one page of K or V.
  std::size_t page_bytes(const Pool& t) const {
    return static_cast<std::size_t>(page_size * heads_kv * t.size(3)) * size_of(t.dtype());
  }
  char* page(const Pool& t, std::int64_t p) const {
    return static_cast<char*>(t.data()) + static_cast<std::size_t>(p) * page_bytes(t);
  }
};

namespace {

using detail::Checker;

void check_size(const Checker& check, const char* name, std::int64_t value, std::int64_t least) {
  if (value < least) {
    check.fail(std::string(name) + " is out of range (" + name + "=" + std::to_string(value) +
               ", expected >= " + std::to_string(least) + ")");
  }
}

void check_batch_idx(const Checker& check, const char* name, std::int64_t b,
                     std::int64_t max_batch) {
  if (b < 0 || b >= max_batch) {
    check.fail(std::string(name) + " is out of range (" + name + "=" + std::to_string(b) +
               ", expected 0 <= " + name + " < max_batch=" + std::to_string(max_batch) + ")");
  }
}

[[noreturn]] void out_of_pages(const char* op, std::int64_t requested, std::int64_t free,
                               const std::string& why) {
  throw OutOfMemory(std::string(op) + ": requested " + std::to_string(requested) +
                    " pages but only " + std::to_string(free) + " are free (" + why +
                    ", expected at most free_pages()=" + std::to_string(free) +
                    " pages); erase sequences first");
}

}  // namespace

PagedKvCache::PagedKvCache(std::int64_t num_pages, std::int64_t page_size, std::int64_t heads_kv,
                           std::int64_t head_dim, std::int64_t head_dim_v, DType dtype,
                           std::int64_t max_batch, std::int64_t max_pages_per_seq) {
  const Checker check("PagedKvCache");
  check_size(check, "num_pages", num_pages, 1);
  check_size(check, "page_size", page_size, 1);
  check_size(check, "heads_kv", heads_kv, 1);
  check_size(check, "head_dim", head_dim, 1);
  check_size(check, "head_dim_v", head_dim_v, 1);
  check_size(check, "max_batch", max_batch, 1);
  if (num_pages > INT32_MAX) {
    check.fail("num_pages is out of range (num_pages=" + std::to_string(num_pages) +
               ", expected <= 2147483647: pages are int32 in the page table)");
  }
  if (max_pages_per_seq == 0) max_pages_per_seq = num_pages;
  if (max_pages_per_seq < 1 || max_pages_per_seq > num_pages) {
    check.fail("max_pages_per_seq is out of range (max_pages_per_seq=" +
               std::to_string(max_pages_per_seq) +
               ", expected 1 <= max_pages_per_seq <= "
               "num_pages=" +
               std::to_string(num_pages) + "; 0 = num_pages)");
  }
  if (max_pages_per_seq > INT32_MAX / page_size) {
    check.fail("the capacity per sequence is too large (max_pages_per_seq * page_size=" +
               std::to_string(max_pages_per_seq) + " * " + std::to_string(page_size) +
               ", expected <= 2147483647: lengths are int32)");
  }
  if (dtype != DType::f32 && dtype != DType::bf16 && dtype != DType::f16 && dtype != DType::f64) {
    const std::string value =
        size_of(dtype) != 0 ? std::string(name_of(dtype)) : std::to_string(static_cast<int>(dtype));
    check.fail("dtype is not a cache dtype (dtype=" + value + ", expected f32, bf16, f16 or f64)");
  }
  if (head_dim > INT64_MAX - head_dim_v) {  // (both >= 1)
    check.fail("the pages have too many elements (D + Dv=" +
               detail::fmt_double(static_cast<double>(head_dim) + static_cast<double>(head_dim_v)) +
               ", expected < 2^63)");
  }
  check.count("the pages have too many elements", "num_pages * page_size * Hkv * (D + Dv)",
              {num_pages, page_size, heads_kv, head_dim + head_dim_v});
  check.count("the page table has too many entries", "max_batch * max_pages_per_seq",
              {max_batch, max_pages_per_seq});
  const double bytes =
      static_cast<double>(num_pages) * static_cast<double>(page_size) *
          static_cast<double>(heads_kv) * static_cast<double>(head_dim + head_dim_v) *
          static_cast<double>(size_of(dtype)) +
      // the page table twice (the view and the copy the cache keeps), the lengths
      4.0 * static_cast<double>(max_batch) * static_cast<double>(2 * max_pages_per_seq + 1) +
      4.0 * static_cast<double>(num_pages) * 2;
  detail::refuse_past_memory_limit(bytes, "PagedKvCache: the cache", "use fewer or smaller pages");
  s_ = std::make_unique<State>();
  State& s = *s_;
  s.num_pages = num_pages;
  s.page_size = page_size;
  s.heads_kv = heads_kv;
  s.head_dim = head_dim;
  s.head_dim_v = head_dim_v;
  s.max_batch = max_batch;
  s.per_seq = max_pages_per_seq;
  try {
    s.k = Pool(dtype, num_pages, page_size, heads_kv, head_dim);
    s.v = Pool(dtype, num_pages, page_size, heads_kv, head_dim_v);
    s.table = Tensor(DType::i32, {max_batch, max_pages_per_seq});
    s.lengths = Tensor(DType::i32, {max_batch});
    s.pages.assign(static_cast<std::size_t>(max_batch * max_pages_per_seq), -1);
    s.refs.assign(static_cast<std::size_t>(num_pages), 0);
    s.free.resize(static_cast<std::size_t>(num_pages));
  } catch (const std::bad_alloc&) {
    throw OutOfMemory("PagedKvCache: allocating the pages failed (bytes=" +
                      std::to_string(static_cast<long long>(bytes)) +
                      ", expected memory the system can give)");
  }
  std::fill_n(s.table.data_as<std::int32_t>(), max_batch * max_pages_per_seq, -1);
  // Free pages taken from the back: page 0 first, as torch's list(range(n - 1, -1, -1)).
  for (std::int64_t p = 0; p < num_pages; ++p) {
    s.free[static_cast<std::size_t>(p)] = static_cast<std::int32_t>(num_pages - 1 - p);
  }
}

PagedKvCache::~PagedKvCache() = default;

PagedKvCache::PagedKvCache(PagedKvCache&&) noexcept = default;
PagedKvCache& PagedKvCache::operator=(PagedKvCache&&) noexcept = default;

PagedKvCache::State& PagedKvCache::live(const char* method) const {
  if (s_ == nullptr) {
    throw InvalidArgument(std::string("PagedKvCache::") + method +
                          ": this cache was moved from (expected a PagedKvCache that holds its "
                          "pages; assign one to it first)");
  }
  return *s_;
}

std::int64_t PagedKvCache::num_pages() const { return live("num_pages").num_pages; }
std::int64_t PagedKvCache::page_size() const { return live("page_size").page_size; }
std::int64_t PagedKvCache::heads_kv() const { return live("heads_kv").heads_kv; }
std::int64_t PagedKvCache::head_dim() const { return live("head_dim").head_dim; }
std::int64_t PagedKvCache::head_dim_v() const { return live("head_dim_v").head_dim_v; }
DType PagedKvCache::dtype() const { return live("dtype").k.dtype(); }
std::int64_t PagedKvCache::max_batch() const { return live("max_batch").max_batch; }
std::int64_t PagedKvCache::max_pages_per_seq() const {
  return live("max_pages_per_seq").per_seq;
}
const TensorView& PagedKvCache::k_pages() const { return live("k_pages").k.view(); }
const TensorView& PagedKvCache::v_pages() const { return live("v_pages").v.view(); }
const TensorView& PagedKvCache::page_table() const {
  return live("page_table").table.view();
}
const TensorView& PagedKvCache::seqlens() const { return live("seqlens").lengths.view(); }
std::int64_t PagedKvCache::free_pages() const {
  return static_cast<std::int64_t>(live("free_pages").free.size());
}

std::int64_t PagedKvCache::capacity(std::int64_t batch_idx) const {
  const State& s = live("capacity");
  check_batch_idx(Checker("PagedKvCache::capacity"), "batch_idx", batch_idx, s.max_batch);
  return s.mapped(batch_idx) * s.page_size;
}

std::int64_t PagedKvCache::references(std::int64_t page) const {
  const State& s = live("references");
  if (page < 0 || page >= s.num_pages) {
    Checker("PagedKvCache::references")
        .fail("page is out of range (page=" + std::to_string(page) +
              ", expected 0 <= page < num_pages=" + std::to_string(s.num_pages) + ")");
  }
  return s.refs[static_cast<std::size_t>(page)];
}

void PagedKvCache::reserve(std::int64_t batch_idx, std::int64_t seq_len) {
  constexpr const char* op = "PagedKvCache::reserve";
  const Checker check(op);
  State& s = live("reserve");
  check_batch_idx(check, "batch_idx", batch_idx, s.max_batch);
  if (seq_len < 0 || seq_len > s.per_seq * s.page_size) {
    check.fail("seq_len is out of range (seq_len=" + std::to_string(seq_len) +
               ", expected 0 <= seq_len <= max_pages_per_seq * page_size=" +
               std::to_string(s.per_seq * s.page_size) + ")");
  }
  const std::int64_t have = s.mapped(batch_idx);
  if (seq_len <= have * s.page_size) return;
  const std::int64_t want = (seq_len - have * s.page_size + s.page_size - 1) / s.page_size;
  if (want > free_pages()) {
    out_of_pages(op, want, free_pages(),
                 "batch_idx=" + std::to_string(batch_idx) + ", seq_len=" + std::to_string(seq_len) +
                     ", capacity=" + std::to_string(have * s.page_size));
  }
  // The last `want` free pages, in their order, become logical pages have, have + 1, ...
  std::int32_t* row = s.row(batch_idx);
  const auto first = s.free.end() - want;
  for (std::int64_t i = 0; i < want; ++i) {
    const std::int32_t page = first[i];
    row[have + i] = page;
    s.refs[static_cast<std::size_t>(page)] = 1;
  }
  s.free.erase(first, s.free.end());
  s.publish(batch_idx);
}

void PagedKvCache::erase(std::int64_t batch_idx) {
  State& s = live("erase");
  check_batch_idx(Checker("PagedKvCache::erase"), "batch_idx", batch_idx, s.max_batch);
  std::int32_t* row = s.row(batch_idx);
  const std::int64_t pages = s.mapped(batch_idx);
  for (std::int64_t i = 0; i < pages; ++i) {
    if (--s.refs[static_cast<std::size_t>(row[i])] == 0) s.free.push_back(row[i]);
  }
  std::fill_n(row, s.per_seq, -1);
  s.publish(batch_idx);
  s.length(batch_idx) = 0;
}

void PagedKvCache::assign(std::int64_t batch_idx, const TensorView& positions, const TensorView& k,
                          const TensorView& v) {
  constexpr const char* op = "PagedKvCache::assign";
  const Checker check(op);
  State& s = live("assign");
  check_batch_idx(check, "batch_idx", batch_idx, s.max_batch);
  check.view(positions, "positions", 1, "[S]");
  check.dtype(positions, "positions", DType::i32, "");
  const std::int64_t n = positions.size(0);
  check.view(k, "k", 3, "[S, Hkv, D]");
  check.view(v, "v", 3, "[S, Hkv, Dv]");
  for (const TensorView* t : {&k, &v}) {
    if (t->dtype == DType::i32 || t->dtype == DType::b8) {
      check.fail(std::string(t == &k ? "k" : "v") + " has the wrong dtype (dtype=" +
                 std::string(name_of(t->dtype)) + ", expected f32, f64, bf16 or f16)");
    }
  }
  const std::int64_t k_shape[3] = {n, s.heads_kv, s.head_dim};
  const std::int64_t v_shape[3] = {n, s.heads_kv, s.head_dim_v};
  check.shape(k, "k", k_shape, "[S, Hkv, D] with S = len(positions)");
  check.shape(v, "v", v_shape, "[S, Hkv, Dv] with S = len(positions)");
  // The rows are read while pages are written: k and v may not lie in the cache's memory.
  check.separate({{&s.k.view(), "k_pages"}, {&s.v.view(), "v_pages"},
                  {&s.table.view(), "page_table"}, {&s.lengths.view(), "seqlens"}},
                 {{&k, "k"}, {&v, "v"}});
  const std::int64_t capacity = s.mapped(batch_idx) * s.page_size;
  // (Before the positions are copied: S is bounded by what was reserved. The Python package
  // makes the same check before it converts them: python/attncore/_paged.py, _positions.)
  if (n > capacity) {
    check.fail("positions has more entries than batch_idx=" + std::to_string(batch_idx) +
               " reserved (len(positions)=" + std::to_string(n) +
               ", expected <= capacity=" + std::to_string(capacity) + "); reserve first");
  }
  std::vector<std::int32_t> pos(static_cast<std::size_t>(n));  // [S]
  for (std::int64_t i = 0; i < n; ++i) {
    pos[static_cast<std::size_t>(i)] =
        detail::load_element<std::int32_t>(positions.data, DType::i32, i * positions.stride_of(0));
    const std::int64_t p = pos[static_cast<std::size_t>(i)];
    if (p < 0 || p >= capacity) {
      check.fail("positions is out of what batch_idx=" + std::to_string(batch_idx) +
                 " reserved (positions[" + std::to_string(i) + "]=" + std::to_string(p) +
                 ", expected 0 <= position < capacity=" + std::to_string(capacity) +
                 "); reserve first");
    }
  }
  std::vector<std::int32_t> sorted = pos;
  std::sort(sorted.begin(), sorted.end());
  const auto repeat = std::adjacent_find(sorted.begin(), sorted.end());
  if (repeat != sorted.end()) {
    check.fail("positions repeats a position (position=" + std::to_string(*repeat) +
               ", expected distinct positions)");
  }
  // Copy-on-write: each shared page written gets a copy of its own first.
  std::int32_t* row = s.row(batch_idx);
  std::vector<std::int64_t> shared;  // logical pages
  for (std::int32_t p : sorted) {
    const std::int64_t logical = p / s.page_size;
    if (s.refs[static_cast<std::size_t>(row[logical])] > 1 &&
        (shared.empty() || shared.back() != logical)) {
      shared.push_back(logical);
    }
  }
  const auto copies = static_cast<std::int64_t>(shared.size());
  if (copies > free_pages()) {
    out_of_pages(op, copies, free_pages(),
                 "copies of shared pages before writing, batch_idx=" + std::to_string(batch_idx));
  }
  for (std::int64_t logical : shared) {
    const std::int32_t old = row[logical], fresh = s.free.back();
    s.free.pop_back();
    std::memcpy(s.page(s.k, fresh), s.page(s.k, old), s.page_bytes(s.k));
    std::memcpy(s.page(s.v, fresh), s.page(s.v, old), s.page_bytes(s.v));
    --s.refs[static_cast<std::size_t>(old)];
    s.refs[static_cast<std::size_t>(fresh)] = 1;
    row[logical] = fresh;
  }
  s.publish(batch_idx);
  // The rows: K[page, slot, h, :] = k[i, h, :] (f32, or f64 for f64 caches).
  const DType dtype = s.k.dtype();
  std::vector<double> x(static_cast<std::size_t>(std::max(s.head_dim, s.head_dim_v)));  // [D]
  std::int64_t end = s.length(batch_idx);
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t p = pos[static_cast<std::size_t>(i)];
    const std::int64_t page = row[p / s.page_size], slot = p % s.page_size;
    end = std::max(end, p + 1);
    for (std::int64_t h = 0; h < s.heads_kv; ++h) {
      const std::int64_t at = (page * s.page_size + slot) * s.heads_kv + h;
      detail::load_row(k.data, k.dtype, i * k.stride_of(0) + h * k.stride_of(1), s.head_dim,
                       x.data(), k.stride_of(2));
      detail::store_row(x.data(), s.head_dim, s.k.data(), dtype, at * s.head_dim);
      detail::load_row(v.data, v.dtype, i * v.stride_of(0) + h * v.stride_of(1), s.head_dim_v,
                       x.data(), v.stride_of(2));
      detail::store_row(x.data(), s.head_dim_v, s.v.data(), dtype, at * s.head_dim_v);
    }
  }
  s.length(batch_idx) = static_cast<std::int32_t>(end);
}

void PagedKvCache::fork(std::int64_t src, std::int64_t dst, std::int64_t prefix_len) {
  const Checker check("PagedKvCache::fork");
  State& s = live("fork");
  check_batch_idx(check, "src", src, s.max_batch);
  check_batch_idx(check, "dst", dst, s.max_batch);
  if (src == dst) {
    check.fail("src and dst are the same sequence (src=dst=" + std::to_string(src) +
               ", expected two sequences)");
  }
  if (s.mapped(dst) != 0 || s.length(dst) != 0) {
    check.fail("dst is not empty (capacity=" + std::to_string(s.mapped(dst) * s.page_size) +
               ", length=" + std::to_string(s.length(dst)) + ", expected 0 and 0); erase it first");
  }
  // (The live lengths are the caller's to write: src's is checked before prefix_len is
  // measured by it.)
  const std::int64_t length = s.length(src);
  const std::int64_t capacity = s.mapped(src) * s.page_size;
  if (length < 0 || length > capacity) {
    check.fail("src's length is out of range (length=" + std::to_string(length) +
               ", expected 0 <= length <= its capacity=" + std::to_string(capacity) + ")");
  }
  if (prefix_len < 0 || prefix_len > length) {
    check.fail("prefix_len is out of range (prefix_len=" + std::to_string(prefix_len) +
               ", expected 0 <= prefix_len <= the length of src=" + std::to_string(length) + ")");
  }
  const std::int64_t pages = (prefix_len + s.page_size - 1) / s.page_size;
  const std::int32_t* from = s.row(src);
  std::int32_t* to = s.row(dst);
  for (std::int64_t i = 0; i < pages; ++i) {
    to[i] = from[i];
    ++s.refs[static_cast<std::size_t>(from[i])];
  }
  s.publish(dst);
  s.length(dst) = static_cast<std::int32_t>(prefix_len);
}

}  // namespace attncore
