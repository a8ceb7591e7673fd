// RunConfig: resolving its defaults, and the library Options and tensor views it describes.
#include "run_config.h"

#include <sstream>

#include "json.h"

namespace attncore_tools {

using attncore::DType;
using attncore::TensorView;

std::string_view name_of(MaskKind m) {
  switch (m) {
    case MaskKind::none:
      return "none";
    case MaskKind::boolean:
      return "bool";
    case MaskKind::additive:
      return "additive";
  }
  return "?";
}

void RunConfig::finish() {
  if (heads_kv < 0) heads_kv = heads_q;
  if (seqlen_k < 0) seqlen_k = seqlen_q;
  if (head_dim_v < 0) head_dim_v = head_dim;
}

int RunConfig::resolved_threads() const {
  return threads > 0 ? threads : attncore::default_num_threads();
}

attncore::Options RunConfig::options(const TensorView& alibi_slopes,
                                     const TensorView& mask_view) const {
  attncore::Options o;
  o.causal = causal;
  o.window_left = window.left;
  o.window_right = window.right;
  o.softcap = softcap;
  o.dropout_p = dropout;
  o.seed = seed;
  o.num_threads = threads;
  if (alibi) o.alibi_slopes = alibi_slopes;
  if (mask != MaskKind::none) o.mask = mask_view;
  return o;
}

CallViews RunConfig::views(void* data) const {
  CallViews w;
  w.q = TensorView::contiguous(data, dtype, {batch, heads_q, seqlen_q, head_dim});
  w.k = TensorView::contiguous(data, dtype, {batch, heads_kv, seqlen_k, head_dim});
  w.v = TensorView::contiguous(data, dtype, {batch, heads_kv, seqlen_k, head_dim_v});
  w.out = TensorView::contiguous(data, dtype, {batch, heads_q, seqlen_q, head_dim_v});
  w.lse = TensorView::contiguous(data, DType::f32, {batch, heads_q, seqlen_q});
  if (alibi) w.alibi = TensorView::contiguous(data, DType::f32, {heads_q});
  if (mask != MaskKind::none) {
    w.mask = TensorView::contiguous(data, mask == MaskKind::boolean ? DType::b8 : DType::f32,
                                    {seqlen_q, seqlen_k});
  }
  return w;
}

std::string RunConfig::shape_text() const {
  std::ostringstream s;
  s << "B=" << batch << " Hq=" << heads_q << " Hkv=" << heads_kv << " Lq=" << seqlen_q
    << " Lk=" << seqlen_k << " D=" << head_dim << " Dv=" << head_dim_v;
  return s.str();
}

void RunConfig::add_shape(JsonObject& j) const {
  j.add("dtype", name_of(dtype));
  j.add("batch", batch);
  j.add("heads_q", heads_q);
  j.add("heads_kv", heads_kv);
  j.add("seqlen_q", seqlen_q);
  j.add("seqlen_k", seqlen_k);
  j.add("head_dim", head_dim);
  j.add("head_dim_v", head_dim_v);
  j.add("causal", name_of(causal));
}

}  // namespace attncore_tools
