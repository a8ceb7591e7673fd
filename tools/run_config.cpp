// RunConfig: resolving its defaults, and the library Options and tensor views it describes.
#include "run_config.h"

#include <algorithm>
#include <numeric>
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

namespace {

std::int64_t longest(const std::vector<std::int64_t>& lengths) {
  return lengths.empty() ? 0 : *std::max_element(lengths.begin(), lengths.end());
}

std::string join(const std::vector<std::int64_t>& values) {
  std::string s;
  for (const std::int64_t x : values) {
    if (!s.empty()) s += ',';
    s += std::to_string(x);
  }
  return s;
}

std::string json_list(const std::vector<std::int64_t>& values) {
  std::vector<std::string> items;
  for (const std::int64_t x : values) items.push_back(std::to_string(x));
  return json_array(items);
}

}  // namespace

void RunConfig::finish() {
  if (heads_kv < 0) heads_kv = heads_q;
  if (head_dim_v < 0) head_dim_v = head_dim;
  if (is_varlen()) {
    if (varlen_k.empty()) varlen_k = varlen;
    batch = static_cast<std::int64_t>(varlen.size());
    seqlen_q = longest(varlen);
    seqlen_k = longest(varlen_k);
  }
  if (is_cache()) {
    seqlen_q = new_tokens;
    seqlen_k = cache_len + new_tokens;
  }
  if (seqlen_k < 0) seqlen_k = seqlen_q;
}

std::int64_t RunConfig::total_q() const {
  return std::accumulate(varlen.begin(), varlen.end(), std::int64_t{0});
}

std::int64_t RunConfig::total_k() const {
  return std::accumulate(varlen_k.begin(), varlen_k.end(), std::int64_t{0});
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
  o.num_splits = num_splits;
  if (alibi) o.alibi_slopes = alibi_slopes;
  if (mask != MaskKind::none) o.mask = mask_view;
  return o;
}

CallViews RunConfig::views(void* data) const {
  CallViews w;
  const DType lse_dtype = dtype == DType::f64 ? DType::f64 : DType::f32;
  if (is_varlen()) {
    w.q = TensorView::contiguous(data, dtype, {total_q(), heads_q, head_dim});
    w.k = TensorView::contiguous(data, dtype, {total_k(), heads_kv, head_dim});
    w.v = TensorView::contiguous(data, dtype, {total_k(), heads_kv, head_dim_v});
    w.out = TensorView::contiguous(data, dtype, {total_q(), heads_q, head_dim_v});
    w.lse = TensorView::contiguous(data, lse_dtype, {heads_q, total_q()});
  } else {
    w.q = TensorView::contiguous(data, dtype, {batch, heads_q, seqlen_q, head_dim});
    w.k = TensorView::contiguous(data, dtype, {batch, heads_kv, seqlen_k, head_dim});
    w.v = TensorView::contiguous(data, dtype, {batch, heads_kv, seqlen_k, head_dim_v});
    w.out = TensorView::contiguous(data, dtype, {batch, heads_q, seqlen_q, head_dim_v});
    w.lse = TensorView::contiguous(data, lse_dtype, {batch, heads_q, seqlen_q});
  }
  if (alibi) w.alibi = TensorView::contiguous(data, DType::f32, {heads_q});
  if (mask != MaskKind::none) {
    w.mask = TensorView::contiguous(data, mask == MaskKind::boolean ? DType::b8 : DType::f32,
                                    {seqlen_q, seqlen_k});
  }
  return w;
}

std::string RunConfig::shape_text() const {
  std::ostringstream s;
  s << "B=" << batch << " Hq=" << heads_q << " Hkv=" << heads_kv;
  if (is_varlen()) {
    s << " Lq=" << join(varlen) << " Lk=" << join(varlen_k);
    if (!seqused_k.empty()) s << " seqused_k=" << join(seqused_k);
    if (page_size > 0) s << " page_size=" << page_size << (pages_in_order ? " pages_in_order" : "");
  } else {
    s << " Lq=" << seqlen_q << " Lk=" << seqlen_k;
  }
  s << " D=" << head_dim << " Dv=" << head_dim_v;
  if (is_cache()) {
    s << " cache_len=" << cache_len << " new_tokens=" << new_tokens;
    s << (page_size > 0 ? " page_size=" + std::to_string(page_size) : std::string(" dense cache"));
    if (pages_in_order) s << " pages_in_order";
  }
  return s.str();
}

void RunConfig::add_shape(JsonObject& j) const {
  j.add("dtype", name_of(dtype));
  j.add("batch", batch);
  j.add("heads_q", heads_q);
  j.add("heads_kv", heads_kv);
  j.add("varlen", is_varlen());
  if (is_varlen()) {
    j.add_json("seqlens_q", json_list(varlen));
    j.add_json("seqlens_k", json_list(varlen_k));
    if (seqused_k.empty()) {
      j.add_null("seqused_k");
    } else {
      j.add_json("seqused_k", json_list(seqused_k));
    }
    j.add("total_q", total_q());
    j.add("total_k", total_k());
    j.add("max_seqlen_q", seqlen_q);
    j.add("max_seqlen_k", seqlen_k);
    j.add("page_size", page_size);  // 0: packed keys, else page pools
    j.add("pages_in_order", pages_in_order);
  } else {
    j.add("seqlen_q", seqlen_q);
    j.add("seqlen_k", seqlen_k);
  }
  j.add("head_dim", head_dim);
  j.add("head_dim_v", head_dim_v);
  j.add("causal", name_of(causal));
  if (is_cache()) {
    j.add("cache_len", cache_len);
    j.add("new_tokens", new_tokens);
    j.add("page_size", page_size);  // 0: a dense cache
    j.add("pages_in_order", pages_in_order);
  } else {
    j.add_null("cache_len");
  }
}

}  // namespace attncore_tools
