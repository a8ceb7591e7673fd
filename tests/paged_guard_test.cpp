// Pages no sequence uses are never read, not even at their address: each call runs over page
// pools whose pages outside the block table's use are unreadable (PROT_NONE), so a read of
// one ends the process here. (A GQA group's scores read page 0 of the pool for the empty
// blocks past a tile's last key, found so; their values never reached a result.)
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <string>
#include <vector>

#include "attncore/attncore.h"
#include "attncore/kvcache.h"
#include "attncore/varlen.h"
#include "testing/problem.h"
#include "testing/random.h"
#include "testing/tensors.h"

namespace attncore::test {
namespace {

// A page pool [pages, page_size, heads, dim] of `dtype` on whole OS pages, random values in
// the pages `used` lists and every other page unreadable.
class GuardedPool {
 public:
  GuardedPool(DType dtype, std::int64_t pages, std::int64_t page_size, std::int64_t heads,
              std::int64_t dim, const std::vector<int>& used, std::uint64_t seed)
      : page_bytes_(page_size * heads * dim * static_cast<std::int64_t>(size_of(dtype))),
        bytes_(static_cast<std::size_t>(pages * page_bytes_)) {
    data_ = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (data_ == MAP_FAILED) data_ = nullptr;
    if (data_ == nullptr || page_bytes_ % sysconf(_SC_PAGESIZE) != 0) return;
    view_ = TensorView::contiguous(data_, dtype, {pages, page_size, heads, dim});
    write_view(view_, rounded(random_vector(view_.numel(), seed), dtype));
    for (std::int64_t p = 0; p < pages; ++p) {
      bool in_use = false;
      for (int u : used) in_use |= u == p;
      if (!in_use) mprotect(static_cast<char*>(data_) + p * page_bytes_, page_bytes_, PROT_NONE);
    }
  }
  GuardedPool(const GuardedPool&) = delete;
  GuardedPool& operator=(const GuardedPool&) = delete;
  ~GuardedPool() {
    if (data_ != nullptr) munmap(data_, bytes_);
  }
  bool ready() const { return view_.data != nullptr; }
  // [pages, page_size, heads, dim] (forward_varlen's pools), and as [pages, heads, page_size,
  // dim] (forward_kvcache's).
  TensorView pool() const { return view_; }
  TensorView view() const { return view_.transposed(1, 2); }

 private:
  std::int64_t page_bytes_;
  std::size_t bytes_;
  void* data_ = nullptr;
  TensorView view_;
};

Tensor i32(const std::vector<std::int64_t>& shape, const std::vector<double>& values) {
  return make_tensor(DType::i32, shape, values);
}

// Decode and a chunk of new rows, MHA and GQA (groups of 4 and 8 rows), over sequences whose
// last page is partly filled and pages far from 0, split and unsplit, on every SIMD target.
TEST(PagedGuard, PagesNoSequenceUsesAreNeverRead) {
  constexpr std::int64_t kPages = 12, kPageSize = 32, kHkv = 2, kDim = 64;
  // Sequence 0: 1 key (page 7); sequence 1: 150 keys (pages 9, 4, 11, 5, 10).
  const std::vector<int> used = {7, 9, 4, 11, 5, 10};
  const Tensor table = i32({2, 5}, {7, -1, -1, -1, -1, 9, 4, 11, 5, 10});
  const Tensor lens = i32({2}, {1, 150});
  KvCacheSeqs seqs;
  seqs.cache_seqlens = lens.view();
  seqs.block_table = table.view();
  for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
    const GuardedPool k(dtype, kPages, kPageSize, kHkv, kDim, used, 1);
    const GuardedPool v(dtype, kPages, kPageSize, kHkv, kDim, used, 2);
    ASSERT_TRUE(k.ready() && v.ready()) << "a page of this pool is not a whole OS page";
    for (std::int64_t group : {1, 4, 8}) {
      for (std::int64_t rows : {1, 3}) {
        const std::int64_t hq = kHkv * group;
        const Tensor q = make_tensor(dtype, {2, hq, rows, kDim},
                                     rounded(random_vector(2 * hq * rows * kDim, 3), dtype));
        for (const std::string& target : simd_targets_supported()) {
          const ScopedTarget scope(target);
          for (int splits : {1, 4}) {
            SCOPED_TRACE(std::string(name_of(dtype)) + " " + target +
                         " group=" + std::to_string(group) + " rows=" + std::to_string(rows) +
                         " splits=" + std::to_string(splits));
            Options o;
            o.num_splits = splits;
            o.causal = Causal::lower_right;
            const ForwardResult r = forward_kvcache(q, k.view(), v.view(), seqs, o, Backend::flash);
            EXPECT_EQ(r.out.size(1), hq);
          }
        }
      }
    }
  }
}

// The same pools as a packed varlen batch's keys (forward_varlen with a block table).
TEST(PagedGuard, VarlenOverPagesReadsOnlyItsPages) {
  constexpr std::int64_t kPages = 12, kPageSize = 32, kHkv = 2, kDim = 64;
  const std::vector<int> used = {7, 9, 4, 11, 5, 10};
  const Tensor table = i32({2, 5}, {7, -1, -1, -1, -1, 9, 4, 11, 5, 10});
  const Tensor cu_q = i32({3}, {0, 1, 4}), cu_k = i32({3}, {0, 1, 151});
  VarlenSeqs seqs{cu_q.view(), cu_k.view()};
  seqs.max_seqlen_q = 3;
  seqs.max_seqlen_k = 150;
  seqs.block_table = table.view();
  for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
    const GuardedPool k(dtype, kPages, kPageSize, kHkv, kDim, used, 4);
    const GuardedPool v(dtype, kPages, kPageSize, kHkv, kDim, used, 5);
    ASSERT_TRUE(k.ready() && v.ready()) << "a page of this pool is not a whole OS page";
    for (std::int64_t group : {1, 4}) {
      const std::int64_t hq = kHkv * group;
      const Tensor q =
          make_tensor(dtype, {4, hq, kDim}, rounded(random_vector(4 * hq * kDim, 6), dtype));
      for (const std::string& target : simd_targets_supported()) {
        const ScopedTarget scope(target);
        SCOPED_TRACE(std::string(name_of(dtype)) + " " + target +
                     " group=" + std::to_string(group));
        const ForwardResult r = forward_varlen(q, k.pool(), v.pool(), seqs, {}, Backend::flash);
        EXPECT_EQ(r.out.size(0), 4);
      }
    }
  }
}

}  // namespace
}  // namespace attncore::test
