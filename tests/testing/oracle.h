// The independent fp64 attention oracle of the test suite (docs/design.md section 6).
//
// Plain loops over dense, contiguous std::vector<double> tensors. It shares no code with src/:
// its own Philox4x32-10, its own dense masks, its own softmax. Every masking rule and score
// modifier is first turned into one dense bias [B, Hq, Lq, Lk] (0, -inf or the additive value),
// then forward and backward follow the plain formulas of docs/design.md section 1.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <vector>

namespace attncore::test {

// Sizes of one attention problem: q [B, Hq, Lq, D], k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv].
struct Dims {
  std::int64_t batch = 1;     // B
  std::int64_t heads_q = 1;   // Hq
  std::int64_t heads_kv = 1;  // Hkv
  std::int64_t len_q = 1;     // Lq
  std::int64_t len_k = 1;     // Lk
  std::int64_t dim = 1;       // D
  std::int64_t dim_v = 1;     // Dv

  std::array<std::int64_t, 4> q_shape() const { return {batch, heads_q, len_q, dim}; }
  std::array<std::int64_t, 4> k_shape() const { return {batch, heads_kv, len_k, dim}; }
  std::array<std::int64_t, 4> v_shape() const { return {batch, heads_kv, len_k, dim_v}; }
  std::array<std::int64_t, 4> out_shape() const { return {batch, heads_q, len_q, dim_v}; }
  std::array<std::int64_t, 3> lse_shape() const { return {batch, heads_q, len_q}; }
  std::array<std::int64_t, 4> score_shape() const { return {batch, heads_q, len_q, len_k}; }
};

// Number of elements of a shape.
template <std::size_t N>
std::int64_t numel_of(const std::array<std::int64_t, N>& shape) {
  std::int64_t n = 1;
  for (std::int64_t s : shape) n *= s;
  return n;
}

enum class CausalMode { none, upper_left, lower_right };

// A boolean or additive attention mask of rank-4 shape [B|1, Hq|1, Lq|1, Lk|1], broadcast on
// its size-1 dims. A rank-2 mask [Lq|1, Lk|1] is the rank-4 mask [1, 1, Lq|1, Lk|1].
struct DenseMask {
  bool is_bool = false;
  std::array<std::int64_t, 4> shape{1, 1, 1, 1};
  std::vector<double> values;  // contiguous over `shape`; bool: != 0 takes part
};

// What one call computes (the oracle's own copy of attncore::Options).
struct Spec {
  double scale = 1.0;
  CausalMode causal = CausalMode::none;
  std::int64_t window_left = -1;   // -1 = unbounded
  std::int64_t window_right = -1;  // -1 = unbounded
  double softcap = 0.0;            // 0 = off
  std::vector<double> alibi;       // empty, [Hq] or [B, Hq] (alibi_per_batch)
  bool alibi_per_batch = false;
  std::optional<DenseMask> mask;
  double dropout_p = 0.0;
  std::uint64_t seed = 0;
  std::uint64_t offset = 0;
};

// Rounds an intermediate value to a storage type; nullptr = exact. Used to build the "naive
// implementation in the same dtype" baseline of the tolerance rule.
using Rounder = double (*)(double);

struct OracleForward {
  std::vector<double> out;  // [B, Hq, Lq, Dv]
  std::vector<double> lse;  // [B, Hq, Lq]; -inf on rows with no visible key
};

struct OracleBackward {
  std::vector<double> dq;     // [B, Hq, Lq, D]
  std::vector<double> dk;     // [B, Hkv, Lk, D]
  std::vector<double> dv;     // [B, Hkv, Lk, Dv]
  std::vector<double> dbias;  // shape of spec.mask (additive masks only), else empty
};

// Philox4x32-10 of Salmon et al. (SC'11), written from the paper.
std::array<std::uint32_t, 4> oracle_philox4x32_10(std::array<std::uint32_t, 4> counter,
                                                  std::array<std::uint32_t, 2> key);
// Word `pos` of the stream keyed by `seed`: word pos % 4 of Philox(counter = pos / 4).
std::uint32_t oracle_philox_word(std::uint64_t seed, std::uint64_t pos);
// x * 2^-32 + 2^-33, rounded to fp32 (curand_uniform).
float oracle_uniform(std::uint32_t word);
// The keep decision of stream element `pos` for dropout probability p.
bool oracle_keep(std::uint64_t seed, std::uint64_t pos, double p);

// Dense bias [B, Hq, Lq, Lk]: ALiBi plus the additive mask, -inf where any mask hides the key.
std::vector<double> oracle_dense_bias(const Dims& dims, const Spec& spec);
// Dense keep mask [B, Hq, Lq, Lk] of dropout (all 1 when dropout_p == 0).
std::vector<std::uint8_t> oracle_dropout_mask(const Dims& dims, const Spec& spec);

// out and lse of q [B, Hq, Lq, D], k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv]. With `round`, the
// probabilities are rounded before P V and the output after it (a naive same-dtype run).
OracleForward oracle_forward(const Dims& dims, const Spec& spec, const std::vector<double>& q,
                             const std::vector<double>& k, const std::vector<double>& v,
                             Rounder round = nullptr);

// Gradients of sum(dout * out) for dout [B, Hq, Lq, Dv]. With `round`, P, O (for Delta), dP, dS
// and the results are rounded as a naive same-dtype autograd run would.
OracleBackward oracle_backward(const Dims& dims, const Spec& spec, const std::vector<double>& q,
                               const std::vector<double>& k, const std::vector<double>& v,
                               const std::vector<double>& dout, Rounder round = nullptr);

}  // namespace attncore::test
