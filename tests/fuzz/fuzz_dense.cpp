// The dense cases: forward and backward of every option on every backend, and calls of absurd
// size that must be refused before any allocation.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "fuzz_cases.h"
#include "testing/tensors.h"

namespace attncore::fuzz {

void fuzz_dense(Reader& r) {
  Dims s = dims(r);
  while (flops(s, double(s.b * s.lq * s.lk)) > kMaxFlops) s.lk /= 2, s.lq = (s.lq + 1) / 2;
  const DType dtype = value_dtype(r);
  const double magnitude = r.chance(64) ? 1.0 / 16 : 1.0;
  Array q = make_input(dtype, {s.b, s.hq, s.lq, s.d}, layout(r), r, 1, magnitude);
  Array k = make_input(r.chance(4) ? DType::bf16 : dtype, {s.b, s.hkv, s.lk, s.d}, layout(r), r, 2,
                       magnitude);
  Array v = make_input(dtype, {s.b, s.hkv, s.lk, s.dv}, layout(r), r, 3, 1.0);
  Decoded o;
  decode_options(r, s, true, o);
  Array out = make_array(dtype, {s.b, s.hq, s.lq, s.dv}, output_layout(r), 0xa5);
  Array lse = make_array(dtype == DType::f64 ? DType::f64 : DType::f32, {s.b, s.hq, s.lq},
                         output_layout(r), 0xa5);
  describe("dense", s, dtype, o.options, {&q, &k, &v, &out, &lse});
  if (o.mask) describe("mask", s, dtype, o.options, {&*o.mask});
  TensorView out_view = out.view;
  if (r.chance(4)) out_view.data = q.storage.data();  // shares bytes with q (when non-empty)
  std::vector<Array*> inputs{&q, &k, &v};
  if (o.alibi) inputs.push_back(&*o.alibi);
  if (o.mask) inputs.push_back(&*o.mask);
  CallSpec fwd{
      {&out, &lse}, inputs, {}, {out.view, lse.view}, o.options.cancel != nullptr, [&](Backend b) {
        forward_into(q.view, k.view, v.view, out_view, lse.view, o.options, b);
      }};
  const std::vector<Run> runs = run_all_backends(fwd);
  check_forward(runs, dtype, value_bound(v, o.options), s.hq, s.dv, false);
  if (runs.front().outcome != Outcome::ok || r.chance(128)) return;

  // Backward from the reference's out and lse.
  Array ref_out = make_array(dtype, {s.b, s.hq, s.lq, s.dv}, Layout::contiguous);
  Array ref_lse = make_array(lse.view.dtype, {s.b, s.hq, s.lq}, Layout::contiguous);
  test::write_view(ref_out.view, runs.front().results[0]);
  test::write_view(ref_lse.view, runs.front().results[1]);
  Array dout = make_input(dtype, {s.b, s.hq, s.lq, s.dv}, layout(r), r, 5, 1.0);
  Array dq = make_array(q.view.dtype, {s.b, s.hq, s.lq, s.d}, output_layout(r), 0xa5);
  Array dk = make_array(k.view.dtype, {s.b, s.hkv, s.lk, s.d}, output_layout(r), 0xa5);
  Array dv = make_array(dtype, {s.b, s.hkv, s.lk, s.dv}, output_layout(r), 0xa5);
  std::optional<Array> dbias;
  std::vector<Array*> outputs{&dq, &dk, &dv};
  if (o.mask && r.chance(128)) {
    o.options.compute_dbias = true;
    std::vector<std::int64_t> shape(o.mask->view.shape.begin(),
                                    o.mask->view.shape.begin() + o.mask->view.rank);
    dbias = make_array(o.mask->view.dtype, shape, Layout::contiguous, 0xa5);
    outputs.push_back(&*dbias);
  }
  std::vector<Array*> bwd_inputs = inputs;
  bwd_inputs.insert(bwd_inputs.end(), {&ref_out, &ref_lse, &dout});
  std::vector<TensorView> results{dq.view, dk.view, dv.view};
  if (dbias) results.push_back(dbias->view);
  CallSpec bwd{outputs, bwd_inputs, {}, results, false, [&](Backend b) {
                 backward_into(dout.view, q.view, k.view, v.view, ref_out.view, ref_lse.view,
                               dq.view, dk.view, dv.view,
                               dbias ? std::optional<TensorView>(dbias->view) : std::nullopt,
                               o.options, b);
               }};
  // The most query rows one gradient element sums over: a key's, its group's rows (GQA); a
  // mask element's, every (b, h, i) row its broadcast dims cover.
  std::int64_t rows = s.hq / std::max<std::int64_t>(s.hkv, 1) * s.lq;
  if (dbias) {
    const TensorView& m = o.mask->view;
    std::int64_t mask_rows = 1;  // the mask's sizes along [B, Hq, Lq] (right-aligned, then keys)
    for (int dim = 0; dim + 1 < m.rank; ++dim) mask_rows *= std::max<std::int64_t>(m.size(dim), 1);
    rows = std::max(rows, s.b * s.hq * s.lq / std::max<std::int64_t>(mask_rows, 1));
  }
  check_gradients(run_all_backends(bwd), {dtype, s.d, s.dv, rows, &o.options, &q, &k, &v, &dout,
                                          dbias ? &*dbias : nullptr});
}

// Calls no machine can hold: broadcast (stride 0) inputs of 2^40 and more rows into outputs the
// library allocates. They must be refused before any allocation or work.
void fuzz_absurd(Reader& r) {
  Array one = make_input(DType::f32, {64}, Layout::contiguous, r, 1, 1.0);
  TensorView q = TensorView::strided(
      one.storage.data(), DType::f32,
      {std::int64_t{1} << r.range(10, 40), 16, std::int64_t{1} << 20, 64}, {0, 0, 0, 1});
  TensorView k =
      TensorView::strided(one.storage.data(), DType::f32,
                          {q.shape[0], 16, std::int64_t{1} << r.range(0, 57), 64}, {0, 0, 0, 1});
  Options o;
  o.dropout_p = r.chance(128) ? 0.5 : 0.0;
  for (Backend b : {Backend::automatic, Backend::reference, Backend::math, Backend::flash}) {
    try {
      forward(q, k, k, o, b);
    } catch (const InvalidArgument&) {
      continue;
    } catch (const OutOfMemory&) {
      continue;
    } catch (const Unsupported&) {
      continue;
    }
    fail("an absurd call ran");
  }
}

}  // namespace attncore::fuzz
