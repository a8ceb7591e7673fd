// Which keys a query row may read (docs/design.md section 1.11): keys outside the row's causal
// or window band, or false in a bool mask, never influence the row, even where K or V holds inf
// or NaN. Kernels that multiply whole tiles use this to keep such keys' values out of the rows
// that cannot see them.
#pragma once

#include <cstdint>

#include "core/convert.h"
#include "core/params.h"
#include "policy/mask.h"

namespace attncore::detail {

// Whether row i of (b, h) sees key j: inside its band and, with a bool mask, true there.
inline bool row_sees_key(const Params& p, const CausalWindowMask& band, std::int64_t b,
                         std::int64_t h, std::int64_t i, std::int64_t j) {
  if (!band.row(i).contains(j)) return false;
  if (p.mask_kind != MaskKind::boolean) return true;
  const auto* m = static_cast<const std::uint8_t*>(p.mask.data);
  return m[offset4(p.mask, b, h, i, j)] != 0;
}

// Whether some row of the call may not see some key: a causal or window band, or a bool mask.
inline bool keys_may_be_hidden(const Params& p) {
  return p.causal != Causal::none || p.window_left >= 0 || p.window_right >= 0 ||
         p.mask_kind == MaskKind::boolean;
}

}  // namespace attncore::detail
