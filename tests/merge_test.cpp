// merge_attention_states (attncore/merge.h): attention over two disjoint key sets, merged,
// equals attention over their union; -inf sides contribute nothing; dense, flash and varlen
// layouts; in place; bad inputs; the cancel flag.
#include "attncore/merge.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "attncore/attncore.h"
#include "testing/problem.h"
#include "testing/random.h"
#include "testing/tensors.h"

namespace attncore::test {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Keys [begin, end) of a [B, H, L, D] view (dim 2).
TensorView keys(const Tensor& t, std::int64_t begin, std::int64_t end) {
  TensorView v = t.view();
  v.data = static_cast<char*>(v.data) +
           begin * v.stride_of(2) * static_cast<std::int64_t>(size_of(v.dtype));
  v.shape[2] = end - begin;
  return v;
}

TEST(Merge, TwoKeySetsGiveTheirUnion) {
  for (DType dtype : {DType::f64, DType::f32}) {
    const Backend backend = dtype == DType::f64 ? Backend::reference : Backend::flash;
    const Tensor q = make_tensor(dtype, {2, 3, 5, 16}, random_vector(2 * 3 * 5 * 16, 1));
    const Tensor k = make_tensor(dtype, {2, 3, 40, 16}, random_vector(2 * 3 * 40 * 16, 2, -2, 2));
    const Tensor v = make_tensor(dtype, {2, 3, 40, 16}, random_vector(2 * 3 * 40 * 16, 3));
    const ForwardResult whole = forward(q, k, v, {}, backend);
    for (std::int64_t cut : {0, 1, 17, 40}) {
      const ForwardResult a = forward(q, keys(k, 0, cut), keys(v, 0, cut), {}, backend);
      const ForwardResult b = forward(q, keys(k, cut, 40), keys(v, cut, 40), {}, backend);
      const MergeResult m = merge_attention_states(a.out, a.lse, b.out, b.lse);
      const double tol = dtype == DType::f64 ? 1e-12 : 2e-6;
      EXPECT_TRUE(all_close(read_view(m.out.view()), read_view(whole.out.view()), tol,
                            "out, cut " + std::to_string(cut)));
      EXPECT_TRUE(all_close(read_view(m.lse.view()), read_view(whole.lse.view()), tol,
                            "lse, cut " + std::to_string(cut)));
    }
  }
}

TEST(Merge, InfiniteSidesContributeNothing) {
  // Row 0: side b is -inf (its output NaN); row 1: side a; row 2: both.
  const double nan = std::nan("");
  const Tensor out_a = make_tensor(DType::f32, {3, 2}, {1, 2, nan, nan, nan, 5});
  const Tensor out_b = make_tensor(DType::f32, {3, 2}, {nan, nan, 3, 4, 6, nan});
  const Tensor lse_a = make_tensor(DType::f32, {3}, {0.5, -kInf, -kInf});
  const Tensor lse_b = make_tensor(DType::f32, {3}, {-kInf, 0.25, -kInf});
  const MergeResult m = merge_attention_states(out_a, lse_a, out_b, lse_b);
  EXPECT_EQ(read_view(m.out.view()), (std::vector<double>{1, 2, 3, 4, 0, 0}));
  EXPECT_EQ(read_view(m.lse.view()), (std::vector<double>{0.5, 0.25, -kInf}));
}

TEST(Merge, FlashAndVarlenLayoutsAndInPlace) {
  // flash layout: out [B, L, H, Dv] as [B, H, L, Dv] views, LSE [B, H, L]: the merge of the
  // transposed views equals the merge of contiguous copies.
  const std::int64_t b = 2, l = 3, h = 4, dv = 8;
  const Tensor oa = make_tensor(DType::f32, {b, l, h, dv}, random_vector(b * l * h * dv, 4));
  const Tensor ob = make_tensor(DType::f32, {b, l, h, dv}, random_vector(b * l * h * dv, 5));
  const Tensor la = make_tensor(DType::f32, {b, h, l}, random_vector(b * h * l, 6, -3, 3));
  const Tensor lb = make_tensor(DType::f32, {b, h, l}, random_vector(b * h * l, 7, -3, 3));
  const MergeResult flash = merge_attention_states(oa.view().transposed(1, 2), la,
                                                   ob.view().transposed(1, 2), lb);
  const Tensor ca = make_tensor(DType::f32, {b, h, l, dv}, read_view(oa.view().transposed(1, 2)));
  const Tensor cb = make_tensor(DType::f32, {b, h, l, dv}, read_view(ob.view().transposed(1, 2)));
  const MergeResult dense = merge_attention_states(ca, la, cb, lb);
  EXPECT_EQ(read_view(flash.out.view()), read_view(dense.out.view()));
  EXPECT_EQ(read_view(flash.lse.view()), read_view(dense.lse.view()));
  // varlen: out [total, H, Dv], LSE [H, total] seen as [total, H]; merged in place into side a.
  const std::int64_t total = 5;
  const Tensor va = make_tensor(DType::f32, {total, h, dv}, random_vector(total * h * dv, 8));
  const Tensor vb = make_tensor(DType::f32, {total, h, dv}, random_vector(total * h * dv, 9));
  const Tensor wa = make_tensor(DType::f32, {h, total}, random_vector(h * total, 10, -3, 3));
  const Tensor wb = make_tensor(DType::f32, {h, total}, random_vector(h * total, 11, -3, 3));
  const MergeResult copy = merge_attention_states(va, wa.view().transposed(0, 1), vb,
                                                  wb.view().transposed(0, 1));
  merge_attention_states_into(va, wa.view().transposed(0, 1), vb, wb.view().transposed(0, 1), va,
                              wa.view().transposed(0, 1));
  EXPECT_EQ(read_view(va.view()), read_view(copy.out.view()));
  EXPECT_EQ(read_view(wa.view().transposed(0, 1)), read_view(copy.lse.view()));
}

// Any strides, the last dim's too: each input's every other element (a last stride of 2),
// merged into an output with a last stride of 3, equals the merge of contiguous copies.
TEST(Merge, AnyLastStride) {
  const std::int64_t rows = 6, dv = 5;
  const Tensor wide_a = make_tensor(DType::bf16, {rows, 2 * dv}, random_vector(rows * 2 * dv, 14));
  const Tensor wide_b = make_tensor(DType::bf16, {rows, 2 * dv}, random_vector(rows * 2 * dv, 15));
  const Tensor la = make_tensor(DType::f32, {rows}, random_vector(rows, 16, -3, 3));
  const Tensor lb = make_tensor(DType::f32, {rows}, random_vector(rows, 17, -3, 3));
  auto every_other = [&](const Tensor& t) {
    TensorView v = t.view();
    v.shape[1] = dv;
    v.stride[1] = 2;
    return v;
  };
  const TensorView sa = every_other(wide_a), sb = every_other(wide_b);
  const Tensor ca = make_tensor(DType::bf16, {rows, dv}, read_view(sa));
  const Tensor cb = make_tensor(DType::bf16, {rows, dv}, read_view(sb));
  const MergeResult dense = merge_attention_states(ca, la, cb, lb);
  const Tensor out_buf =
      make_tensor(DType::bf16, {rows, 3 * dv}, std::vector<double>(rows * 3 * dv, 0.0));
  TensorView out = out_buf.view();
  out.shape[1] = dv;
  out.stride[1] = 3;
  const Tensor lse = make_tensor(DType::f32, {rows}, std::vector<double>(rows, 0.0));
  merge_attention_states_into(sa, la, sb, lb, out, lse);
  EXPECT_EQ(read_view(out), read_view(dense.out.view()));
  EXPECT_EQ(read_view(lse.view()), read_view(dense.lse.view()));
  // The elements between the output's are not written.
  const std::vector<double> all = read_view(out_buf.view());
  for (std::size_t i = 0; i < all.size(); ++i) {
    if (i % 3 != 0) {
      ASSERT_EQ(all[i], 0.0) << i;
    }
  }
}

TEST(Merge, BadInputs) {
  const Tensor o = make_tensor(DType::f32, {2, 3, 4}, std::vector<double>(24, 0.0));
  const Tensor l = make_tensor(DType::f32, {2, 3}, std::vector<double>(6, 0.0));
  const Tensor o_short = make_tensor(DType::f32, {2, 2, 4}, std::vector<double>(16, 0.0));
  const Tensor l_f64 = make_tensor(DType::f64, {2, 3}, std::vector<double>(6, 0.0));
  const Tensor l_wrong = make_tensor(DType::f32, {3, 2}, std::vector<double>(6, 0.0));
  auto message = [](auto&& call) -> std::string {
    try {
      call();
    } catch (const InvalidArgument& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_EQ(message([&] { merge_attention_states(o, l, o_short, l); }),
            "merge_attention_states: out_b has shape [2, 2, 4], expected [2, 3, 4] (like out_a)");
  EXPECT_EQ(message([&] { merge_attention_states(o, l_f64, o, l); }),
            "merge_attention_states: lse_a has the wrong dtype (dtype=f64, expected f32 (f64 only "
            "for f64 outputs))");
  EXPECT_EQ(message([&] { merge_attention_states(o, l, o, l_wrong); }),
            "merge_attention_states: lse_b has shape [3, 2], expected [2, 3] (out_a's shape "
            "without its last dim)");
  EXPECT_NE(message([&] { merge_attention_states(o, o, o, l); }).find("lse_a has the wrong rank"),
            std::string::npos);
}

// Outputs into caller views: the very view of side a or b is fine (above); any other overlap
// with an input or between out and lse is refused before anything is written.
TEST(Merge, OverlappingOutputsAreRefused) {
  const Tensor buf = make_tensor(DType::f32, {5, 4}, random_vector(20, 12));
  const Tensor lse_buf = make_tensor(DType::f32, {5}, random_vector(5, 13, -3, 3));
  const std::vector<double> before = read_view(buf.view()), lse_before = read_view(lse_buf.view());
  auto rows = [](const Tensor& t, std::int64_t first) {  // rows [first, first + 4) of t
    TensorView v = t.view();
    v.data = static_cast<char*>(v.data) + first * v.stride_of(0) * std::int64_t{4};
    v.shape[0] = 4;
    return v;
  };
  const Tensor ob = make_tensor(DType::f32, {4, 4}, random_vector(16, 14));
  const Tensor lb = make_tensor(DType::f32, {4}, random_vector(4, 15, -3, 3));
  const Tensor lse_out(DType::f32, {4});
  // out = out_a shifted by one row: row 0's result would overwrite out_a's row 1 unread.
  EXPECT_NE(error_message([&] {
              merge_attention_states_into(rows(buf, 0), rows(lse_buf, 0), ob, lb, rows(buf, 1),
                                          lse_out);
            }).find("merge_attention_states: out overlaps out_a"),
            std::string::npos);
  EXPECT_NE(error_message([&] {
              merge_attention_states_into(rows(buf, 0), rows(lse_buf, 0), ob, lb, ob,
                                          rows(lse_buf, 1));
            }).find("merge_attention_states: lse overlaps lse_a"),
            std::string::npos);
  const Tensor out(DType::f32, {4, 4});
  TensorView lse_in_out = out.view();  // the LSE in out's first column
  lse_in_out.rank = 1;
  lse_in_out.shape = {4};
  lse_in_out.stride = {4};
  EXPECT_NE(error_message([&] {
              merge_attention_states_into(rows(buf, 0), rows(lse_buf, 0), ob, lb, out, lse_in_out);
            }).find("merge_attention_states: lse overlaps out"),
            std::string::npos);
  EXPECT_EQ(read_view(buf.view()), before);
  EXPECT_EQ(read_view(lse_buf.view()), lse_before);
}

// The allocating form refuses outputs the process may not hold before allocating them: a
// broadcast (stride 0) out_a of 2^40 rows.
TEST(Merge, AllocatingFormChecksMemory) {
  std::vector<float> row(64, 1.0f), lse_row(1, 0.0f);
  const std::int64_t rows = std::int64_t{1} << 40;
  const TensorView out = TensorView::strided(row.data(), DType::f32, {rows, 64}, {0, 1});
  const TensorView lse = TensorView::strided(lse_row.data(), DType::f32, {rows}, {0});
  try {
    merge_attention_states(out, lse, out, lse);
    ADD_FAILURE() << "no error";
  } catch (const OutOfMemory& e) {
    EXPECT_EQ(std::string(e.what()).rfind("merge_attention_states: the outputs exceed the memory "
                                          "this process may use (outputs=2.859e+14 bytes",
                                          0),
              0u)
        << e.what();
  }
}

// A cancel flag read true stops the merge with Cancelled, in either form; false changes nothing.
TEST(Merge, CancelFlagStopsTheCall) {
  const Tensor out_a = make_tensor(DType::f32, {2, 3, 4}, random_vector(24, 1));
  const Tensor out_b = make_tensor(DType::f32, {2, 3, 4}, random_vector(24, 2));
  const Tensor lse_a = make_tensor(DType::f32, {2, 3}, random_vector(6, 3));
  const Tensor lse_b = make_tensor(DType::f32, {2, 3}, random_vector(6, 4));
  const std::atomic<bool> go{false}, stop{true};
  const MergeResult plain = merge_attention_states(out_a, lse_a, out_b, lse_b);
  const MergeResult flagged = merge_attention_states(out_a, lse_a, out_b, lse_b, 1, &go);
  EXPECT_EQ(read_view(flagged.out.view()), read_view(plain.out.view()));
  EXPECT_EQ(read_view(flagged.lse.view()), read_view(plain.lse.view()));
  // (Set before the call: read once before anything is written, as the attention calls do.)
  const std::string message =
      "merge_attention_states: call is cancelled (cancel=true, expected false); the outputs are "
      "not written";
  try {
    merge_attention_states(out_a, lse_a, out_b, lse_b, 2, &stop);
    ADD_FAILURE() << "no error";
  } catch (const Cancelled& e) {
    EXPECT_EQ(std::string(e.what()), message);
  }
  Tensor out(DType::f32, {2, 3, 4}), lse(DType::f32, {2, 3});
  try {
    merge_attention_states_into(out_a, lse_a, out_b, lse_b, out, lse, 1, &stop);
    ADD_FAILURE() << "no error";
  } catch (const Cancelled& e) {
    EXPECT_EQ(std::string(e.what()), message);
  }
}

}  // namespace
}  // namespace attncore::test
