// Keys a row cannot see have no influence (docs/design.md section 1.11): K and V positions each
// row cannot see (outside its causal band or window, false in a bool mask, past seqused_k) are
// poisoned with NaN and inf, and the rows that cannot see any of them must keep the clean run's
// bits: output, LSE and dQ, and dK / dV of every key that only such rows see. Reference and
// flash (every SIMD target) guarantee it for every kind of hidden key; math for keys outside the
// band only: with bool masks it multiplies whole blocks as PyTorch's math path does (0 * NaN is
// NaN), which docs/design.md section 1.11 allows.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "attncore/attncore.h"
#include "testing/problem.h"
#include "testing/random.h"

namespace attncore::test {
namespace {

enum class MaskShape { none, full, keys };  // bool [B, Hq, Lq, Lk] random, or [B, 1, 1, Lk]

struct Case {
  std::string name;
  std::int64_t batch, heads_q, heads_kv, lq, lk, d;
  Causal causal;
  std::int64_t window_left, window_right;
  MaskShape mask;
};

// Lk 300: three key tiles of 128 with a short last one; decode rows read K and V in place.
std::vector<Case> cases() {
  return {
      {"causal_lower_right", 2, 4, 2, 200, 300, 64, Causal::lower_right, -1, -1, MaskShape::none},
      {"causal_lower_right_long_q", 1, 2, 1, 300, 140, 64, Causal::lower_right, -1, -1,
       MaskShape::none},
      {"causal_upper_left", 2, 2, 1, 150, 300, 64, Causal::upper_left, -1, -1, MaskShape::none},
      {"window", 1, 4, 2, 260, 300, 64, Causal::none, 70, 20, MaskShape::none},
      {"window_causal", 1, 2, 2, 300, 300, 64, Causal::lower_right, 100, -1, MaskShape::none},
      {"bool_mask", 2, 2, 1, 140, 300, 64, Causal::none, -1, -1, MaskShape::full},
      {"key_padding", 2, 4, 2, 150, 300, 64, Causal::none, -1, -1, MaskShape::keys},
      {"key_padding_causal", 1, 2, 1, 200, 300, 64, Causal::lower_right, -1, -1, MaskShape::keys},
      {"decode_key_padding", 2, 4, 1, 1, 300, 128, Causal::none, -1, -1, MaskShape::keys},
      {"decode_bool_mask", 1, 8, 2, 1, 300, 128, Causal::lower_right, -1, -1, MaskShape::full},
  };
}

// A [shape] tensor of dtype, element n read and written as float.
struct Buffer {
  Tensor t;
  Buffer(DType dtype, std::initializer_list<std::int64_t> shape) : t(dtype, shape) {}
  void set(std::int64_t n, float x) {
    if (t.dtype() == DType::f32) {
      t.data_as<float>()[n] = x;
    } else {
      std::uint32_t bits;
      std::memcpy(&bits, &x, sizeof bits);
      t.data_as<std::uint16_t>()[n] = static_cast<std::uint16_t>(bits >> 16);  // bf16
    }
  }
};

Buffer random_buffer(DType dtype, std::initializer_list<std::int64_t> shape, Random& rng) {
  Buffer b(dtype, shape);
  for (std::int64_t n = 0; n < b.t.numel(); ++n) b.set(n, static_cast<float>(rng.uniform(-1, 1)));
  return b;
}

// The bytes of element n of a tensor.
bool same_bits(const Tensor& x, const Tensor& y, std::int64_t n) {
  const std::size_t size = size_of(x.dtype());
  return std::memcmp(static_cast<const char*>(x.data()) + n * size,
                     static_cast<const char*>(y.data()) + n * size, size) == 0;
}

struct Inputs {
  Buffer q, k, v, dout;
  std::vector<std::uint8_t> mask;  // the bool mask's values, laid out as `mask_tensor`
  Tensor mask_tensor;
};

struct Results {
  ForwardResult fwd;
  BackwardResult bwd;
};

class Checker {
 public:
  Checker(const Case& c, DType dtype, Backend backend) : c_(c), dtype_(dtype), backend_(backend) {}

  // Row i of (b, h) sees key j (the test's own reading of docs/design.md section 1.3).
  bool sees(const Inputs& in, std::int64_t b, std::int64_t h, std::int64_t i,
            std::int64_t j) const {
    const std::int64_t diag = i + c_.lk - c_.lq;
    if (c_.causal == Causal::upper_left && j > i) return false;
    if (c_.causal == Causal::lower_right && j > diag) return false;
    if (c_.window_left >= 0 && j < diag - c_.window_left) return false;
    if (c_.window_right >= 0 && j > diag + c_.window_right) return false;
    if (c_.mask == MaskShape::full) return in.mask[((b * c_.heads_q + h) * c_.lq + i) * c_.lk + j];
    if (c_.mask == MaskShape::keys) return in.mask[b * c_.lk + j];
    return true;
  }

  Inputs make_inputs() const {
    Random rng(11);
    Inputs in{random_buffer(dtype_, {c_.batch, c_.heads_q, c_.lq, c_.d}, rng),
              random_buffer(dtype_, {c_.batch, c_.heads_kv, c_.lk, c_.d}, rng),
              random_buffer(dtype_, {c_.batch, c_.heads_kv, c_.lk, c_.d}, rng),
              random_buffer(dtype_, {c_.batch, c_.heads_q, c_.lq, c_.d}, rng),
              {},
              {}};
    if (c_.mask == MaskShape::full) {
      in.mask_tensor = Tensor(DType::b8, {c_.batch, c_.heads_q, c_.lq, c_.lk});
    } else if (c_.mask == MaskShape::keys) {
      in.mask_tensor = Tensor(DType::b8, {c_.batch, 1, 1, c_.lk});
    }
    if (c_.mask != MaskShape::none) {
      auto* m = in.mask_tensor.data_as<std::uint8_t>();
      for (std::int64_t n = 0; n < in.mask_tensor.numel(); ++n) {
        // Key padding: each batch's last keys (a different count per batch) are padding.
        const std::int64_t j = n % c_.lk, b = n / c_.lk;
        m[n] = c_.mask == MaskShape::keys ? j < c_.lk - 37 - 50 * b : rng.uniform(0, 1) < 0.8;
      }
      in.mask.assign(m, m + in.mask_tensor.numel());
    }
    return in;
  }

  Results run(const Inputs& in) const {
    Options o;
    o.causal = c_.causal;
    o.window_left = c_.window_left;
    o.window_right = c_.window_right;
    if (c_.mask != MaskShape::none) o.mask = in.mask_tensor.view();
    o.num_threads = 2;
    Results r;
    r.fwd = forward(in.q.t, in.k.t, in.v.t, o, backend_);
    r.bwd = backward(in.dout.t, in.q.t, in.k.t, in.v.t, r.fwd.out, r.fwd.lse, o, backend_);
    return r;
  }

  // Poisons K and V of keys (b, kv_head, j) in `hidden` with `value` (two elements of each row)
  // and checks what must not change.
  void check(const Inputs& clean_in, const Results& clean, const std::vector<std::int64_t>& hidden,
             float value, const std::string& what) const {
    Inputs in = make_inputs();
    for (std::int64_t key : hidden) {  // key = (b * Hkv + kv_head) * Lk + j
      for (std::int64_t e : {(key * 7) % c_.d, c_.d - 1}) {
        in.k.set(key * c_.d + e, value);
        in.v.set(key * c_.d + e, -value);
      }
    }
    const Results got = run(in);
    std::vector<bool> poisoned(static_cast<std::size_t>(c_.batch * c_.heads_kv * c_.lk), false);
    for (std::int64_t key : hidden) poisoned[static_cast<std::size_t>(key)] = true;
    // Rows that see no poisoned key, and keys seen only by such rows.
    std::vector<bool> key_clean(poisoned.size(), true);
    std::int64_t rows_checked = 0;
    const std::int64_t group = c_.heads_q / c_.heads_kv;
    for (std::int64_t b = 0; b < c_.batch; ++b) {
      for (std::int64_t h = 0; h < c_.heads_q; ++h) {
        const std::int64_t kv = (b * c_.heads_kv + h / group) * c_.lk;
        for (std::int64_t i = 0; i < c_.lq; ++i) {
          bool affected = false;
          for (std::int64_t j = 0; j < c_.lk && !affected; ++j) {
            affected = poisoned[static_cast<std::size_t>(kv + j)] && sees(clean_in, b, h, i, j);
          }
          if (affected) {
            for (std::int64_t j = 0; j < c_.lk; ++j) {
              if (sees(clean_in, b, h, i, j)) key_clean[static_cast<std::size_t>(kv + j)] = false;
            }
            continue;
          }
          ++rows_checked;
          const std::int64_t row = (b * c_.heads_q + h) * c_.lq + i;
          ASSERT_TRUE(same_bits(got.fwd.lse, clean.fwd.lse, row)) << what << " lse row " << row;
          for (std::int64_t e = 0; e < c_.d; ++e) {
            ASSERT_TRUE(same_bits(got.fwd.out, clean.fwd.out, row * c_.d + e))
                << what << " out row " << row << " col " << e;
            ASSERT_TRUE(same_bits(got.bwd.dq, clean.bwd.dq, row * c_.d + e))
                << what << " dq row " << row << " col " << e;
          }
        }
      }
    }
    EXPECT_GT(rows_checked, 0) << what;
    for (std::size_t key = 0; key < key_clean.size(); ++key) {
      if (!key_clean[key]) continue;
      for (std::int64_t e = 0; e < c_.d; ++e) {
        const auto n = static_cast<std::int64_t>(key) * c_.d + e;
        ASSERT_TRUE(same_bits(got.bwd.dk, clean.bwd.dk, n)) << what << " dk key " << key;
        ASSERT_TRUE(same_bits(got.bwd.dv, clean.bwd.dv, n)) << what << " dv key " << key;
      }
    }
  }

  // Poison sets: the keys no row sees, then the keys each of a few rows cannot see.
  void check_all(const std::string& label) const {
    const Inputs in = make_inputs();
    const Results clean = run(in);
    const std::int64_t group = c_.heads_q / c_.heads_kv;
    std::vector<std::vector<std::int64_t>> sets;
    std::vector<std::int64_t> unseen;
    for (std::int64_t b = 0; b < c_.batch; ++b) {
      for (std::int64_t kvh = 0; kvh < c_.heads_kv; ++kvh) {
        for (std::int64_t j = 0; j < c_.lk; ++j) {
          bool seen = false;
          for (std::int64_t h = kvh * group; h < (kvh + 1) * group && !seen; ++h) {
            for (std::int64_t i = 0; i < c_.lq && !seen; ++i) seen = sees(in, b, h, i, j);
          }
          if (!seen) unseen.push_back((b * c_.heads_kv + kvh) * c_.lk + j);
        }
      }
    }
    if (!unseen.empty()) sets.push_back(unseen);
    for (std::int64_t i : {std::int64_t{0}, c_.lq / 2, c_.lq - 1}) {
      std::vector<std::int64_t> hidden;  // from row i of batch 0, head 0
      for (std::int64_t j = 0; j < c_.lk; ++j) {
        if (!sees(in, 0, 0, i, j)) hidden.push_back(j);
      }
      if (!hidden.empty()) sets.push_back(hidden);
    }
    ASSERT_FALSE(sets.empty());
    for (std::size_t n = 0; n < sets.size(); ++n) {
      for (float value :
           {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
        check(in, clean, sets[n], value,
              label + " " + c_.name + " set " + std::to_string(n) + " " +
                  (std::isnan(value) ? "NaN" : "inf"));
        if (::testing::Test::HasFatalFailure()) return;
      }
    }
  }

 private:
  Case c_;
  DType dtype_;
  Backend backend_;
};

TEST(InvisibleKeys, Reference) {
  for (const Case& c : cases()) {
    Checker(c, DType::f32, Backend::reference).check_all("reference f32");
    if (HasFatalFailure()) return;
  }
}

TEST(InvisibleKeys, FlashEverySimdTarget) {
  for (const std::string& target : simd_targets_supported()) {
    ScopedTarget scoped(target);
    for (DType dtype : {DType::f32, DType::bf16}) {
      for (const Case& c : cases()) {
        Checker(c, dtype, Backend::flash)
            .check_all("flash " + target + (dtype == DType::f32 ? " f32" : " bf16"));
        if (HasFatalFailure()) return;
      }
    }
  }
}

// Math: keys outside the band (bool masks excepted, see the top of this file).
TEST(InvisibleKeys, MathBand) {
  for (DType dtype : {DType::f32, DType::bf16}) {
    for (const Case& c : cases()) {
      if (c.mask != MaskShape::none) continue;
      Checker(c, dtype, Backend::math).check_all(dtype == DType::f32 ? "math f32" : "math bf16");
      if (HasFatalFailure()) return;
    }
  }
}

// Keys past seqused_k in a packed batch are never read: poisoned, nothing changes.
TEST(InvisibleKeys, VarlenPastSequsedK) {
  const std::vector<std::int32_t> cu_q = {0, 130, 131, 331}, cu_k = {0, 300, 440, 700};
  const std::vector<std::int32_t> used = {170, 1, 256};
  const std::int64_t hq = 4, hkv = 2, d = 64, total_q = cu_q.back(), total_k = cu_k.back();
  Tensor cu_q_t(DType::i32, {4}), cu_k_t(DType::i32, {4}), used_t(DType::i32, {3});
  std::memcpy(cu_q_t.data(), cu_q.data(), 16);
  std::memcpy(cu_k_t.data(), cu_k.data(), 16);
  std::memcpy(used_t.data(), used.data(), 12);
  VarlenSeqs seqs{cu_q_t, cu_k_t, used_t.view(), 200, 300, std::nullopt};
  std::vector<std::string> targets = simd_targets_supported();
  for (Backend backend : {Backend::reference, Backend::math, Backend::flash}) {
    for (const std::string& target :
         backend == Backend::flash ? targets : std::vector<std::string>{""}) {
      ScopedTarget scoped(target);
      for (DType dtype : {DType::f32, DType::bf16}) {
        for (Causal causal : {Causal::none, Causal::lower_right}) {
          const std::string what = std::string(name_of(backend)) + " " + target + " " +
                                   (dtype == DType::f32 ? "f32 " : "bf16 ") +
                                   std::string(name_of(causal));
          auto make = [&](float poison) {
            Random rng(5);
            Inputs in{random_buffer(dtype, {total_q, hq, d}, rng),
                      random_buffer(dtype, {total_k, hkv, d}, rng),
                      random_buffer(dtype, {total_k, hkv, d}, rng),
                      random_buffer(dtype, {total_q, hq, d}, rng),
                      {},
                      {}};
            if (poison != 0.0f) {
              for (std::size_t b = 0; b < used.size(); ++b) {
                for (std::int64_t j = cu_k[b] + used[b]; j < cu_k[b + 1]; ++j) {
                  for (std::int64_t n = j * hkv * d; n < (j + 1) * hkv * d; n += 5) {
                    in.k.set(n, poison);
                    in.v.set(n, poison);
                  }
                }
              }
            }
            return in;
          };
          Options o;
          o.causal = causal;
          o.num_threads = 2;
          auto run = [&](const Inputs& in) {
            Results r;
            r.fwd = forward_varlen(in.q.t, in.k.t, in.v.t, seqs, o, backend);
            r.bwd = backward_varlen(in.dout.t, in.q.t, in.k.t, in.v.t, r.fwd.out, r.fwd.lse, seqs,
                                    o, backend);
            return r;
          };
          const Results clean = run(make(0.0f));
          for (float poison :
               {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
            const Results got = run(make(poison));
            for (std::int64_t n = 0; n < clean.fwd.out.numel(); ++n) {
              ASSERT_TRUE(same_bits(got.fwd.out, clean.fwd.out, n)) << what << " out " << n;
              ASSERT_TRUE(same_bits(got.bwd.dq, clean.bwd.dq, n)) << what << " dq " << n;
            }
            for (std::int64_t n = 0; n < clean.fwd.lse.numel(); ++n) {
              ASSERT_TRUE(same_bits(got.fwd.lse, clean.fwd.lse, n)) << what << " lse " << n;
            }
            for (std::int64_t n = 0; n < clean.bwd.dk.numel(); ++n) {
              ASSERT_TRUE(same_bits(got.bwd.dk, clean.bwd.dk, n)) << what << " dk " << n;
              ASSERT_TRUE(same_bits(got.bwd.dv, clean.bwd.dv, n)) << what << " dv " << n;
            }
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace attncore::test
