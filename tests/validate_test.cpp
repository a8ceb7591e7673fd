// Input validation (docs/design.md section 4): every bad input is rejected before any kernel runs,
// with the right exception type and a message of the form
// `<op>: <what> <problem> (<name>=<value>, expected <constraint>)`, through forward,
// forward_into, backward and backward_into and every backend. Nothing is written on failure.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "attncore/attncore.h"

namespace attncore {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

// Sizes of the valid call the bad inputs are derived from: Hq = 4, Hkv = 2 (GQA), Lq = 8,
// Lk = 6, D = 16, Dv = 12, B = 2; all distinct so every mismatch is visible.
constexpr std::int64_t kB = 2, kHq = 4, kHkv = 2, kLq = 8, kLk = 6, kD = 16, kDv = 12;

// A valid call and the storage behind it; the cases below break one thing each.
struct Call {
  Tensor q_t{DType::f32, {kB, kHq, kLq, kD}};      // [B, Hq, Lq, D]
  Tensor k_t{DType::f32, {kB, kHkv, kLk, kD}};     // [B, Hkv, Lk, D]
  Tensor v_t{DType::f32, {kB, kHkv, kLk, kDv}};    // [B, Hkv, Lk, Dv]
  Tensor out_t{DType::f32, {kB, kHq, kLq, kDv}};   // [B, Hq, Lq, Dv]
  Tensor lse_t{DType::f32, {kB, kHq, kLq}};        // [B, Hq, Lq]
  Tensor dout_t{DType::f32, {kB, kHq, kLq, kDv}};  // [B, Hq, Lq, Dv]
  Tensor dq_t{DType::f32, {kB, kHq, kLq, kD}};     // [B, Hq, Lq, D]
  Tensor dk_t{DType::f32, {kB, kHkv, kLk, kD}};    // [B, Hkv, Lk, D]
  Tensor dv_t{DType::f32, {kB, kHkv, kLk, kDv}};   // [B, Hkv, Lk, Dv]
  Tensor spare{DType::f64, {4096}};                // backing for replacement views
  TensorView q = q_t, k = k_t, v = v_t, out = out_t, lse = lse_t, dout = dout_t;
  TensorView dq = dq_t, dk = dk_t, dv = dv_t;
  std::optional<TensorView> lse_into = lse_t.view();
  std::optional<TensorView> dbias;
  Options options;

  // A contiguous view of `shape` and `dtype` on the spare storage (large enough for the cases).
  TensorView view(DType dtype, std::initializer_list<std::int64_t> shape) const {
    return TensorView::contiguous(spare.data(), dtype, shape);
  }
};

enum class Op { forward, forward_into, backward, backward_into };

const char* name_of_op(Op op) {
  switch (op) {
    case Op::forward:
      return "forward";
    case Op::forward_into:
      return "forward_into";
    case Op::backward:
      return "backward";
    case Op::backward_into:
      return "backward_into";
  }
  return "?";
}

enum class Kind { invalid_argument, unsupported };

struct BadInput {
  std::string name;
  Op op;
  std::function<void(Call&)> breaks;  // turns the valid call into the bad one
  Kind kind;
  std::vector<std::string> keywords;  // the message must contain each (besides op and "expected")
};

void run(Op op, Call& c, Backend backend) {
  switch (op) {
    case Op::forward:
      (void)forward(c.q, c.k, c.v, c.options, backend);
      return;
    case Op::forward_into:
      forward_into(c.q, c.k, c.v, c.out, c.lse_into, c.options, backend);
      return;
    case Op::backward:
      (void)backward(c.dout, c.q, c.k, c.v, c.out, c.lse, c.options, backend);
      return;
    case Op::backward_into:
      backward_into(c.dout, c.q, c.k, c.v, c.out, c.lse, c.dq, c.dk, c.dv, c.dbias, c.options,
                    backend);
      return;
  }
}

// Fills the output tensors of a call with a sentinel so that writes can be detected.
constexpr float kSentinel = 7.25f;
void fill_outputs(Call& c) {
  for (Tensor* t : {&c.out_t, &c.lse_t, &c.dq_t, &c.dk_t, &c.dv_t}) {
    for (std::int64_t i = 0; i < t->numel(); ++i) t->data_as<float>()[i] = kSentinel;
  }
}
bool outputs_untouched(const Call& c) {
  for (const Tensor* t : {&c.out_t, &c.lse_t, &c.dq_t, &c.dk_t, &c.dv_t}) {
    for (std::int64_t i = 0; i < t->numel(); ++i) {
      if (t->data_as<float>()[i] != kSentinel) return false;
    }
  }
  return true;
}

std::vector<BadInput> bad_inputs() {
  std::vector<BadInput> cases;
  // Each case: name, the op it calls, key words of the message, how it breaks the valid call.
  auto add = [&cases](std::string name, Op op, std::vector<std::string> keywords,
                      std::function<void(Call&)> breaks) {
    cases.push_back(
        {std::move(name), op, std::move(breaks), Kind::invalid_argument, std::move(keywords)});
  };
  // Ranks.
  add("query_rank3", Op::forward, {"query", "rank=3"}, [](Call& c) {
    c.q = c.view(DType::f32, {kB, kHq, kLq});
  });
  add("key_rank2", Op::forward, {"key", "rank=2"}, [](Call& c) {
    c.k = c.view(DType::f32, {kLk, kD});
  });
  add("value_rank1", Op::forward, {"value", "rank=1"},
      [](Call& c) { c.v = c.view(DType::f32, {kDv}); });
  add("query_rank0", Op::forward, {"query", "rank=0"}, [](Call& c) { c.q = TensorView{}; });
  // Shapes that do not agree.
  add("key_batch", Op::forward, {"key", "[3, 2, 6, 16]"}, [](Call& c) {
    c.k = c.view(DType::f32, {3, kHkv, kLk, kD});
  });
  add("key_head_dim", Op::forward, {"key", "[2, 2, 6, 15]"}, [](Call& c) {
    c.k = c.view(DType::f32, {kB, kHkv, kLk, kD - 1});
  });
  add("value_len", Op::forward, {"value", "[2, 2, 5, 12]"}, [](Call& c) {
    c.v = c.view(DType::f32, {kB, kHkv, kLk - 1, kDv});
  });
  add("value_batch", Op::forward, {"value", "shape"}, [](Call& c) {
    c.v = c.view(DType::f32, {1, kHkv, kLk, kDv});
  });
  add("value_heads", Op::forward, {"value", "shape"}, [](Call& c) {
    c.v = c.view(DType::f32, {kB, 1, kLk, kDv});
  });
  add("heads_not_dividing", Op::forward, {"key", "Hq % Hkv == 0", "Hkv=3"}, [](Call& c) {
    c.k = c.view(DType::f32, {kB, 3, kLk, kD});
    c.v = c.view(DType::f32, {kB, 3, kLk, kDv});
  });
  add("gqa_disabled", Op::forward, {"enable_gqa", "Hkv=2"},
      [](Call& c) { c.options.enable_gqa = false; });
  add("head_dim_zero", Op::forward, {"query", "head dim", "D=0"}, [](Call& c) {
    c.q = c.view(DType::f32, {kB, kHq, kLq, 0});
    c.k = c.view(DType::f32, {kB, kHkv, kLk, 0});
  });
  add("value_dim_zero", Op::forward, {"value", "Dv=0"}, [](Call& c) {
    c.v = c.view(DType::f32, {kB, kHkv, kLk, 0});
  });
  add("negative_size", Op::forward, {"query", "negative size"}, [](Call& c) {
    c.q = c.view(DType::f32, {kB, kHq, -1, kD});
  });
  // Dtypes.
  add("key_dtype", Op::forward, {"key", "dtype=bf16"}, [](Call& c) {
    c.k = c.view(DType::bf16, {kB, kHkv, kLk, kD});
  });
  add("value_dtype", Op::forward, {"value", "dtype=f64"}, [](Call& c) {
    c.v = c.view(DType::f64, {kB, kHkv, kLk, kDv});
  });
  add("query_bool", Op::forward, {"query", "dtype=bool"}, [](Call& c) {
    c.q = c.view(DType::b8, {kB, kHq, kLq, kD});
    c.k = c.view(DType::b8, {kB, kHkv, kLk, kD});
    c.v = c.view(DType::b8, {kB, kHkv, kLk, kDv});
  });
  // Strides and data.
  add("query_last_stride", Op::forward, {"query", "stride[3]=2"}, [](Call& c) {
    c.q = TensorView::strided(c.spare.data(), DType::f32, {kB, kHq, kLq, kD / 2},
                              {kHq * kLq * kD, kLq * kD, kD, 2});
    c.k = TensorView::strided(c.spare.data(), DType::f32, {kB, kHkv, kLk, kD / 2},
                              {kHkv * kLk * kD, kLk * kD, kD, 1});
  });
  add("key_negative_stride", Op::forward, {"key", "negative stride"}, [](Call& c) {
    c.k.stride[2] = -kD;
    c.k.data = c.k_t.data_as<float>() + (kLk - 1) * kD;
  });
  add("value_null_data", Op::forward, {"value", "null"}, [](Call& c) { c.v.data = nullptr; });
  add("numel_overflow", Op::forward, {"query", "int64"}, [](Call& c) {
    const std::int64_t big = std::int64_t{1} << 21;  // B * H * L = 2^63 elements
    c.q = c.view(DType::f32, {big, big, big, kD});
    c.k = c.view(DType::f32, {big, big, big, kD});
    c.v = c.view(DType::f32, {big, big, big, kDv});
  });
  add("stride_extent_overflow", Op::forward, {"key", "extent"}, [](Call& c) {
    c.k = TensorView::strided(c.k_t.data(), DType::f32, {kB, kHkv, kLk, kD},
                              {std::numeric_limits<std::int64_t>::max() / 2, kLk * kD, kD, 1});
  });
  add("query_null_data", Op::backward, {"query", "null"}, [](Call& c) { c.q.data = nullptr; });
  // Scalar options.
  add("scale_negative", Op::forward, {"scale=-0.5"}, [](Call& c) { c.options.scale = -0.5; });
  add("scale_nan", Op::forward, {"scale=nan"}, [](Call& c) { c.options.scale = kNaN; });
  add("scale_inf", Op::forward, {"scale=inf"}, [](Call& c) { c.options.scale = kInf; });
  add("scale_zero", Op::forward, {"scale=0"}, [](Call& c) { c.options.scale = 0.0; });
  add("dropout_negative", Op::forward, {"dropout_p=-0.1"},
      [](Call& c) { c.options.dropout_p = -0.1; });
  add("dropout_one", Op::forward, {"dropout_p=1"}, [](Call& c) { c.options.dropout_p = 1.0; });
  add("dropout_nan", Op::forward, {"dropout_p=nan"}, [](Call& c) { c.options.dropout_p = kNaN; });
  // 1 in f32, as dropout compares it: it would keep nothing (1 - 2^-24 is taken).
  add("dropout_one_in_f32", Op::forward, {"dropout_p is too close to 1", "1 - 2^-25"},
      [](Call& c) { c.options.dropout_p = 1.0 - 0x1p-25; });
  add("window_left", Op::forward, {"window_left=-2"}, [](Call& c) { c.options.window_left = -2; });
  add("window_right", Op::forward, {"window_right=-5"},
      [](Call& c) { c.options.window_right = -5; });
  add("softcap_negative", Op::forward, {"softcap=-1"}, [](Call& c) { c.options.softcap = -1.0; });
  add("softcap_nan", Op::forward, {"softcap=nan"}, [](Call& c) { c.options.softcap = kNaN; });
  add("softcap_inf", Op::forward, {"softcap=inf"}, [](Call& c) { c.options.softcap = kInf; });
  // f32 calls compute in f32: a cap below its normal range, a scale past it.
  add("softcap_below_f32", Op::forward,
      {"softcap is too small for f32 arithmetic", "softcap=1e-40"},
      [](Call& c) { c.options.softcap = 1e-40; });
  add("backward_softcap_below_f32", Op::backward, {"softcap=1e-50"},
      [](Call& c) { c.options.softcap = 1e-50; });
  add("scale_past_f32", Op::forward, {"scale is too large for f32 arithmetic", "|scale|=1e+39"},
      [](Call& c) { c.options.scale = 1e39; });
  add("num_threads", Op::forward, {"num_threads=-1"}, [](Call& c) { c.options.num_threads = -1; });
  add("num_threads_too_large", Op::forward, {"num_threads=1025", "<= 1024"},
      [](Call& c) { c.options.num_threads = kMaxThreads + 1; });
  add("causal_value", Op::forward, {"causal"},
      [](Call& c) { c.options.causal = static_cast<Causal>(9); });
  // ALiBi slopes.
  add("alibi_dtype", Op::forward, {"alibi_slopes", "dtype=f16"},
      [](Call& c) { c.options.alibi_slopes = c.view(DType::f16, {kHq}); });
  add("alibi_heads", Op::forward, {"alibi_slopes", "[3]"},
      [](Call& c) { c.options.alibi_slopes = c.view(DType::f32, {kHq - 1}); });
  add("alibi_batch", Op::forward, {"alibi_slopes", "[3, 4]"}, [](Call& c) {
    c.options.alibi_slopes = c.view(DType::f32, {kB + 1, kHq});
  });
  add("alibi_nan", Op::forward, {"alibi_slopes[1]=nan", "expected finite slopes"}, [](Call& c) {
    c.options.alibi_slopes = c.view(DType::f32, {kHq});
    static_cast<float*>(c.spare.data())[1] = std::numeric_limits<float>::quiet_NaN();
  });
  add("alibi_inf", Op::forward, {"alibi_slopes[1][2]=-inf", "expected finite slopes"}, [](Call& c) {
    c.options.alibi_slopes = c.view(DType::f32, {kB, kHq});
    static_cast<float*>(c.spare.data())[kHq + 2] = -std::numeric_limits<float>::infinity();
  });
  add("alibi_rank3", Op::forward, {"alibi_slopes", "[2, 4, 1]"}, [](Call& c) {
    c.options.alibi_slopes = c.view(DType::f32, {kB, kHq, 1});
  });
  // Masks.
  add("mask_rank3", Op::forward, {"mask", "rank=3"}, [](Call& c) {
    c.options.mask = c.view(DType::b8, {kHq, kLq, kLk});
  });
  add("mask_int32", Op::forward, {"mask has the wrong dtype (dtype=i32"},
      [](Call& c) { c.options.mask = c.view(DType::i32, {kLq, kLk}); });
  add("mask_rank1", Op::forward, {"mask", "rank=1"},
      [](Call& c) { c.options.mask = c.view(DType::f32, {kLk}); });
  add("mask_len_k", Op::forward, {"mask", "broadcast", "[2, 4, 8, 7]"}, [](Call& c) {
    c.options.mask = c.view(DType::b8, {kB, kHq, kLq, kLk + 1});
  });
  add("mask_len_q", Op::forward, {"mask", "broadcast", "[1, 1, 7, 6]"}, [](Call& c) {
    c.options.mask = c.view(DType::f32, {1, 1, kLq - 1, kLk});
  });
  add("mask_batch", Op::forward, {"mask", "broadcast", "[3, 1, 8, 6]"}, [](Call& c) {
    c.options.mask = c.view(DType::f32, {kB + 1, 1, kLq, kLk});
  });
  add("mask_heads", Op::forward, {"mask", "broadcast", "[1, 2, 8, 6]"}, [](Call& c) {
    c.options.mask = c.view(DType::b8, {1, kHkv, kLq, kLk});
  });
  add("mask_rank2_shape", Op::forward, {"mask", "broadcast", "[8, 5]"}, [](Call& c) {
    c.options.mask = c.view(DType::f32, {kLq, kLk - 1});
  });
  add("mask_null_data", Op::forward, {"mask", "null"}, [](Call& c) {
    c.options.mask = TensorView::contiguous(nullptr, DType::b8, {kLq, kLk});
  });
  add("mask_negative_stride", Op::forward, {"mask", "negative stride"}, [](Call& c) {
    c.options.mask =
        TensorView::strided(c.spare.data_as<float>() + 100, DType::f32, {kLq, kLk}, {-kLk, 1});
  });
  // Caller-provided outputs.
  add("out_shape", Op::forward_into, {"out", "[2, 4, 8, 16]"}, [](Call& c) {
    c.out = c.view(DType::f32, {kB, kHq, kLq, kD});
  });
  add("out_dtype", Op::forward_into, {"out", "dtype=f64"}, [](Call& c) {
    c.out = c.view(DType::f64, {kB, kHq, kLq, kDv});
  });
  add("out_last_stride", Op::forward_into, {"out", "stride[3]=2"}, [](Call& c) {
    c.out = TensorView::strided(c.spare.data(), DType::f32, {kB, kHq, kLq, kDv},
                                {kHq * kLq * kDv * 2, kLq * kDv * 2, kDv * 2, 2});
  });
  add("out_null_data", Op::forward_into, {"out", "null"}, [](Call& c) { c.out.data = nullptr; });
  add("out_zero_stride", Op::forward_into, {"out", "stride"}, [](Call& c) {
    c.out = TensorView::strided(c.spare.data(), DType::f32, {kB, kHq, kLq, kDv},
                                {0, kLq * kDv, kDv, 1});
  });
  add("lse_shape", Op::forward_into, {"lse", "[2, 4, 7]"}, [](Call& c) {
    c.lse_into = c.view(DType::f32, {kB, kHq, kLq - 1});
  });
  add("lse_dtype", Op::forward_into, {"lse", "dtype=bf16"}, [](Call& c) {
    c.lse_into = c.view(DType::bf16, {kB, kHq, kLq});
  });
  add("lse_rank", Op::forward_into, {"lse", "rank=4"}, [](Call& c) {
    c.lse_into = c.view(DType::f32, {kB, kHq, kLq, 1});
  });
  // Backward.
  add("backward_query_rank", Op::backward, {"query", "rank=3"}, [](Call& c) {
    c.q = c.view(DType::f32, {kHq, kLq, kD});
  });
  add("backward_dout_shape", Op::backward, {"dout", "[2, 4, 8, 13]"}, [](Call& c) {
    c.dout = c.view(DType::f32, {kB, kHq, kLq, kDv + 1});
  });
  add("backward_dout_dtype", Op::backward, {"dout", "dtype=f16"}, [](Call& c) {
    c.dout = c.view(DType::f16, {kB, kHq, kLq, kDv});
  });
  add("backward_out_shape", Op::backward, {"out", "[2, 4, 9, 12]"}, [](Call& c) {
    c.out = c.view(DType::f32, {kB, kHq, kLq + 1, kDv});
  });
  add("backward_lse_shape", Op::backward, {"lse", "[2, 4, 10]"}, [](Call& c) {
    c.lse = c.view(DType::f32, {kB, kHq, kLq + 2});
  });
  add("backward_lse_dtype", Op::backward, {"lse", "dtype=f64"}, [](Call& c) {
    c.lse = c.view(DType::f64, {kB, kHq, kLq});
  });
  add("backward_dropout", Op::backward, {"dropout_p=1.5"},
      [](Call& c) { c.options.dropout_p = 1.5; });
  add("backward_mask_shape", Op::backward, {"mask", "broadcast"}, [](Call& c) {
    c.options.mask = c.view(DType::f32, {1, 1, kLq, 2});
  });
  add("dbias_bool_mask", Op::backward, {"compute_dbias", "mask=bool"}, [](Call& c) {
    c.options.mask = c.view(DType::b8, {kLq, kLk});
    c.options.compute_dbias = true;
  });
  add("dbias_without_mask", Op::backward, {"compute_dbias", "mask=none"},
      [](Call& c) { c.options.compute_dbias = true; });
  add("backward_num_threads", Op::backward, {"num_threads=-3"},
      [](Call& c) { c.options.num_threads = -3; });
  add("backward_num_threads_too_large", Op::backward, {"num_threads=100000"},
      [](Call& c) { c.options.num_threads = 100000; });
  add("backward_into_dq_shape", Op::backward_into, {"dq", "[2, 4, 8, 17]"}, [](Call& c) {
    c.dq = c.view(DType::f32, {kB, kHq, kLq, kD + 1});
  });
  add("backward_into_dk_dtype", Op::backward_into, {"dk", "dtype=f64"}, [](Call& c) {
    c.dk = c.view(DType::f64, {kB, kHkv, kLk, kD});
  });
  add("backward_into_dv_shape", Op::backward_into, {"dv", "[2, 4, 6, 12]"}, [](Call& c) {
    c.dv = c.view(DType::f32, {kB, kHq, kLk, kDv});
  });
  add("backward_into_dbias_missing", Op::backward_into, {"dbias"}, [](Call& c) {
    c.options.mask = c.view(DType::f32, {kLq, kLk});
    c.options.compute_dbias = true;
  });
  add("backward_into_dbias_shape", Op::backward_into, {"dbias", "[8, 7]"}, [](Call& c) {
    c.options.mask = c.view(DType::f32, {kLq, kLk});
    c.options.compute_dbias = true;
    c.dbias = TensorView::contiguous(c.spare.data_as<double>() + 2048, DType::f32, {kLq, kLk + 1});
  });
  return cases;
}

void PrintTo(const BadInput& bad, std::ostream* os) { *os << bad.name; }

using Param = std::tuple<BadInput, Backend>;

class Validate : public ::testing::TestWithParam<Param> {};

TEST_P(Validate, RejectsWithTypeAndMessage) {
  const BadInput& bad = std::get<0>(GetParam());
  const Backend backend = std::get<1>(GetParam());
  Call call;
  bad.breaks(call);
  fill_outputs(call);
  std::string message;
  std::optional<Kind> kind;
  try {
    run(bad.op, call, backend);
  } catch (const Unsupported& e) {
    kind = Kind::unsupported;
    message = e.what();
  } catch (const InvalidArgument& e) {
    kind = Kind::invalid_argument;
    message = e.what();
  } catch (const std::exception& e) {
    FAIL() << "threw something other than attncore::InvalidArgument / Unsupported: " << e.what();
  }
  ASSERT_TRUE(kind.has_value()) << "no exception";
  RecordProperty("message", message);
  EXPECT_EQ(*kind, bad.kind) << message;
  // <op>: ... ; forward_into and backward_into may name themselves or their base op.
  const std::string op = name_of_op(bad.op);
  const std::string base = bad.op == Op::forward_into    ? "forward"
                           : bad.op == Op::backward_into ? "backward"
                                                         : op;
  EXPECT_TRUE(message.rfind(op + ":", 0) == 0 || message.rfind(base + ":", 0) == 0)
      << "message does not start with \"" << base << ":\": " << message;
  EXPECT_NE(message.find("expected"), std::string::npos) << message;
  for (const std::string& word : bad.keywords) {
    EXPECT_NE(message.find(word), std::string::npos) << "missing \"" << word << "\": " << message;
  }
  EXPECT_TRUE(outputs_untouched(call)) << "an output was written before the error: " << message;
}

std::string param_name(const ::testing::TestParamInfo<Param>& info) {
  return std::get<0>(info.param).name + "_" + std::string(name_of(std::get<1>(info.param)));
}

INSTANTIATE_TEST_SUITE_P(AllBackends, Validate,
                         ::testing::Combine(::testing::ValuesIn(bad_inputs()),
                                            ::testing::Values(Backend::automatic,
                                                              Backend::reference, Backend::math,
                                                              Backend::flash)),
                         param_name);

// The valid call the cases derive from really is valid, through every op and backend.
TEST(ValidateBaseline, ValidCallSucceeds) {
  for (Backend backend : {Backend::automatic, Backend::reference, Backend::math, Backend::flash}) {
    for (Op op : {Op::forward, Op::forward_into, Op::backward, Op::backward_into}) {
      Call call;
      EXPECT_NO_THROW(run(op, call, backend)) << name_of_op(op) << " " << name_of(backend);
    }
    Call with_mask;  // additive mask with dbias, bool mask, ALiBi [B, Hq]
    with_mask.options.mask = with_mask.view(DType::f32, {kLq, kLk});
    with_mask.options.compute_dbias = true;
    EXPECT_NO_THROW(run(Op::backward, with_mask, backend));
    Call with_bool;
    with_bool.options.mask = with_bool.view(DType::b8, {kB, 1, 1, kLk});
    with_bool.options.alibi_slopes = with_bool.view(DType::f32, {kB, kHq});
    EXPECT_NO_THROW(run(Op::forward, with_bool, backend));
  }
}

// f64 calls compute in f64: a softcap or scale outside f32's range is theirs to take, and the
// backends agree on it.
TEST(ValidateBaseline, F64TakesScalarsPastF32sRange) {
  const Tensor q(DType::f64, {1, 2, 3, 8});  // [B, Hq, Lq, D]
  for (const auto& [scale, softcap] : {std::pair{1e-3, 1e-40}, std::pair{1e39, 0.0}}) {
    Options o;
    o.scale = scale;
    o.softcap = softcap;
    const ForwardResult want = forward(q, q, q, o, Backend::reference);
    for (Backend backend : {Backend::math, Backend::automatic}) {
      ForwardResult got;
      ASSERT_NO_THROW(got = forward(q, q, q, o, backend)) << name_of(backend);
      EXPECT_EQ(got.out.numel(), want.out.numel());
    }
  }
}

// Empty views may have any strides (numpy gives an empty array all-zero strides): Lq = 0 and
// Lk = 0 calls with such inputs and outputs succeed on every backend.
TEST(ValidateBaseline, EmptyViewsWithZeroStrides) {
  float unused[1];
  const auto zero_strided = [&](std::initializer_list<std::int64_t> shape) {
    return TensorView::strided(unused, DType::f32, shape, {0, 0, 0, 0});
  };
  for (Backend backend : {Backend::automatic, Backend::reference, Backend::math, Backend::flash}) {
    // Lq = 0: q [1, 2, 0, 8], out [1, 2, 0, 8], lse [1, 2, 0] are empty.
    const Tensor k(DType::f32, {1, 2, 5, 8});  // [B, Hkv, Lk, D]
    const TensorView q = zero_strided({1, 2, 0, 8});
    const TensorView out = zero_strided({1, 2, 0, 8});
    EXPECT_NO_THROW(forward_into(q, k, k, out, std::nullopt, {}, backend)) << name_of(backend);
    // Lk = 0: k, v [1, 2, 0, 8] are empty; the output rows are 0.
    const Tensor q2(DType::f32, {1, 2, 3, 8});  // [B, Hq, Lq, D]
    const TensorView empty_kv = zero_strided({1, 2, 0, 8});
    ForwardResult r;
    EXPECT_NO_THROW(r = forward(q2, empty_kv, empty_kv, {}, backend)) << name_of(backend);
    for (std::int64_t i = 0; i < r.out.numel(); ++i) EXPECT_EQ(r.out.data_as<float>()[i], 0.0f);
  }
}

// ALiBi slopes are checked once per slope in memory: a [B, Hq] view broadcast along B (stride
// 0) holding a NaN is refused naming batch 0; an empty one with null data reads nothing.
TEST(ValidateBaseline, BroadcastAndEmptySlopes) {
  const Tensor q(DType::f32, {2, 4, 3, 8});  // [B, Hq, Lq, D]
  float slopes[4] = {0.5f, std::numeric_limits<float>::quiet_NaN(), 0.25f, 0.125f};
  Options o;
  o.alibi_slopes = TensorView::strided(slopes, DType::f32, {2, 4}, {0, 1});
  try {
    (void)forward(q, q, q, o);
    ADD_FAILURE() << "accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("alibi_slopes[0][1]=nan"), std::string::npos) << e.what();
  }
  slopes[1] = 1.0f;
  EXPECT_NO_THROW((void)forward(q, q, q, o));
  const Tensor empty_q(DType::f32, {0, 4, 3, 8});
  o.alibi_slopes = TensorView::strided(nullptr, DType::f32, {0, 4}, {0, 0});
  EXPECT_NO_THROW((void)forward(empty_q, empty_q, empty_q, o));
}

// Checks an Unsupported error: type, op prefix, "expected" and the key words.
void expect_unsupported(const std::function<void()>& call, const std::string& op,
                        const std::vector<std::string>& keywords) {
  try {
    call();
    ADD_FAILURE() << "no exception";
  } catch (const Unsupported& e) {
    const std::string message = e.what();
    EXPECT_EQ(message.rfind(op + ":", 0), 0u) << message;
    EXPECT_NE(message.find("expected"), std::string::npos) << message;
    for (const std::string& word : keywords) {
      EXPECT_NE(message.find(word), std::string::npos) << "missing \"" << word << "\": " << message;
    }
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected attncore::Unsupported, got: " << e.what();
  }
}

// A backend value outside the enum is not available, never dispatched on.
TEST(ValidateUnsupported, UnknownBackendValue) {
  Call call;
  expect_unsupported([&] { run(Op::forward, call, static_cast<Backend>(57)); }, "forward",
                     {"backend"});
  expect_unsupported([&] { run(Op::backward, call, static_cast<Backend>(99)); }, "backward",
                     {"backend"});
}

// The flash backend runs f32, bf16 and f16; f64 is a valid call it cannot run.
TEST(ValidateUnsupported, FlashBackendLimits) {
  const Tensor q(DType::f64, {1, 2, 3, 8});  // [B, Hq, Lq, D]
  const Tensor k(DType::f64, {1, 2, 4, 8});  // [B, Hkv, Lk, D]
  const Tensor v(DType::f64, {1, 2, 4, 8});  // [B, Hkv, Lk, Dv]
  expect_unsupported([&] { (void)forward(q, k, v, {}, Backend::flash); }, "forward",
                     {"flash", "dtype=f64"});
  EXPECT_NO_THROW((void)forward(q, k, v, {}, Backend::automatic));  // auto runs math
}

// Forcing a SIMD target: only compiled and supported names; "" restores the automatic choice.
TEST(ValidateUnsupported, SimdTargetNames) {
  EXPECT_THROW(set_simd_target("avx9000"), InvalidArgument);
  for (const std::string& t : simd_targets_supported()) {
    const std::string previous = set_simd_target(t);
    EXPECT_EQ(simd_target(), t);
    set_simd_target(previous);
  }
  EXPECT_EQ(set_simd_target(""), "");
  EXPECT_EQ(simd_target(), simd_targets_supported().front());
}

// The supported targets, best first for this CPU: avx512bf16 before avx512 on AMD's cores,
// after it on Intel's (README, "SIMD targets"); the compiled ones in their fixed order.
TEST(ValidateUnsupported, SimdTargetsRankedForTheVendor) {
  const std::vector<std::string> compiled = simd_targets_compiled();
  ASSERT_FALSE(compiled.empty());
  EXPECT_EQ(compiled.back(), "generic");
  const std::vector<std::string> supported = simd_targets_supported();
  const auto at = [&](const std::string& name) {
    return std::find(supported.begin(), supported.end(), name) - supported.begin();
  };
  const auto bf16 = at("avx512bf16"), plain = at("avx512");
  if (bf16 == static_cast<std::ptrdiff_t>(supported.size()) ||
      plain == static_cast<std::ptrdiff_t>(supported.size())) {
    GTEST_SKIP() << "this CPU does not run both avx512bf16 and avx512";
  }
  if (cpu_info().vendor == "GenuineIntel") {
    EXPECT_LT(plain, bf16);
  } else {
    EXPECT_LT(bf16, plain);
  }
}

// The math backend hands sizes to BLAS as 32-bit ints: Lq * Lk >= 2^31 is valid input that it
// cannot run.
TEST(ValidateUnsupported, MathBackendSizeLimit) {
  const std::int64_t len = std::int64_t{1} << 16;  // Lq * Lk = 2^32
  const Tensor q(DType::f32, {1, 1, len, 1});      // [B, Hq, Lq, D]
  const Tensor k(DType::f32, {1, 1, len, 1});      // [B, Hkv, Lk, D]
  const Tensor v(DType::f32, {1, 1, len, 1});      // [B, Hkv, Lk, Dv]
  expect_unsupported([&] { (void)forward(q, k, v, {}, Backend::math); }, "forward",
                     {"math", "Lq=65536"});
}

}  // namespace
}  // namespace attncore
