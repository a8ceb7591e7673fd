// The bias gradient reduced over the mask's broadcast dims: an fp64 accumulator shaped like
// the caller's mask, addressed with the [B, Hq, Lq, Lk] indices of the full problem.
#pragma once

#include <cstdint>
#include <vector>

#include "core/convert.h"
#include "core/params.h"

namespace attncore::detail {

class DbiasAccumulator {
 public:
  explicit DbiasAccumulator(const Params& p) {
    if (!p.compute_dbias) return;
    const TensorView& m = p.mask_original;
    const int lead = 4 - m.rank;
    std::int64_t running = 1;
    for (int d = 3; d >= 0; --d) {
      const std::int64_t size = d < lead ? 1 : m.size(d - lead);
      stride_[d] = size == 1 ? 0 : running;
      running *= size;
    }
    values_.assign(static_cast<std::size_t>(running), 0.0);
  }

  // The bytes one takes for p (0 without a bias gradient), which every backend's backward
  // makes: the memory check counts them with the backend's own workspace.
  static double bytes(const Params& p) {
    if (!p.compute_dbias) return 0;
    double n = 8;
    for (int d = 0; d < p.mask_original.rank; ++d) {
      n *= static_cast<double>(p.mask_original.size(d));
    }
    return n;
  }

  bool active() const { return !values_.empty(); }
  double* row(std::int64_t b, std::int64_t h, std::int64_t i) {
    return values_.data() + b * stride_[0] + h * stride_[1] + i * stride_[2];
  }
  std::int64_t column_stride() const { return stride_[3]; }

  // Whether two (b, h) tasks can add into the same element.
  bool shared_across(const Params& p) const {
    return active() && ((stride_[0] == 0 && p.batch > 1) || (stride_[1] == 0 && p.heads_q > 1));
  }

  // Converts the sums into the caller's dbias view (the mask's shape and dtype).
  void store(const TensorView& dbias) const {
    if (!active()) return;
    const int lead = 4 - dbias.rank;
    std::int64_t shape[4], dst_stride[4];
    for (int d = 0; d < 4; ++d) {
      shape[d] = d < lead ? 1 : dbias.size(d - lead);
      dst_stride[d] = d < lead ? 0 : dbias.stride_of(d - lead);
    }
    for (std::int64_t a = 0; a < shape[0]; ++a)
      for (std::int64_t b = 0; b < shape[1]; ++b)
        for (std::int64_t c = 0; c < shape[2]; ++c)
          for (std::int64_t e = 0; e < shape[3]; ++e) {
            const double value = values_[static_cast<std::size_t>(a * stride_[0] + b * stride_[1] +
                                                                  c * stride_[2] + e * stride_[3])];
            store_element(
                dbias.data, dbias.dtype,
                a * dst_stride[0] + b * dst_stride[1] + c * dst_stride[2] + e * dst_stride[3],
                value);
          }
  }

 private:
  std::int64_t stride_[4] = {0, 0, 0, 0};
  std::vector<double> values_;
};

}  // namespace attncore::detail
