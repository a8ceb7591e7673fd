// Python arrays seen as attncore::TensorViews onto their own memory (no copies), and new arrays
// of the caller's kind for results: the part of the extension module attncore._core that reads
// and makes arrays. numpy arrays (and any other buffer-protocol object) are read through the
// buffer protocol; plain CPU torch tensors through their attributes (data_ptr, shape, stride,
// dtype: no DLPack export, no detach); everything else through `__dlpack__`.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "attncore/attncore.h"

struct DLManagedTensor;

namespace attncore_python {

namespace py = pybind11;

// The data addresses of the arrays of this thread's last call, by argument name: lets the
// tests prove that a strided view reached the kernels without a copy.
std::map<std::string, std::uintptr_t>& last_call_addresses();

// How a Borrowed reads its array.
enum class ArrayKind {
  numpy,  // exactly numpy.ndarray, through the buffer protocol
  torch,  // a torch.Tensor or Parameter in CPU memory, strided, not nested or lazily negated,
          // through its attributes
  other,  // anything else: the buffer protocol or DLPack
};

// Whether torch is imported and its grad mode is on.
bool grad_enabled();

// One Python array seen as a TensorView onto its own memory, valid while this object lives.
// Errors name the array as "<op>: <name>", the library's message form.
class Borrowed {
 public:
  Borrowed(py::handle obj, const char* op, const char* name, bool writable, bool is_mask = false);
  // A numpy array (exactly numpy.ndarray) or a torch tensor that the fast path reads as it is
  // (ArrayKind::numpy or torch, a dtype the library names, rank <= 4, whole non-negative
  // strides), else nullopt: the caller takes the general path. Read only.
  static std::optional<Borrowed> plain(py::handle obj, const char* op, const char* name);
  Borrowed(Borrowed&&) noexcept;
  Borrowed& operator=(Borrowed&&) = delete;
  ~Borrowed();

  const attncore::TensorView& view() const { return view_; }
  ArrayKind kind() const { return kind_; }
  bool requires_grad() const { return requires_grad_; }  // a torch tensor that requires grad

 private:
  Borrowed() = default;
  // false where the array is not plain (refuse: throw the library's InvalidArgument instead).
  bool from_buffer(py::handle obj, const std::string& what, bool writable, bool refuse);
  bool from_torch(py::handle obj);
  void from_dlpack(py::handle obj, const std::string& what, bool is_mask);

  struct CallDeleter {
    void operator()(DLManagedTensor* t) const;
  };

  attncore::TensorView view_;
  ArrayKind kind_ = ArrayKind::other;
  bool requires_grad_ = false;
  std::optional<py::buffer_info> buffer_;  // released (with the GIL held) on destruction
  std::unique_ptr<DLManagedTensor, CallDeleter> managed_;  // DLPack: deleter runs on destruction
};

std::optional<Borrowed> borrow_optional(py::handle obj, const char* op, const char* name,
                                        bool writable, bool is_mask = false);

std::optional<attncore::TensorView> view_of(const std::optional<Borrowed>& b);

// A new uninitialised array of `kind` (numpy or torch) with this shape and dtype (f32, f64, f16;
// bf16 for torch only), its dims laid out in memory in the order of `like_stride` (largest
// first; the last dim innermost): results of a [B, L, H, D] buffer seen as [B, H, L, D] are
// themselves such views. like_stride empty: contiguous.
py::object new_array(ArrayKind kind, const std::vector<std::int64_t>& shape, attncore::DType dtype,
                     const std::vector<std::int64_t>& like_stride = {});

}  // namespace attncore_python
