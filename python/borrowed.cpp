// Python arrays as TensorViews, and new result arrays (borrowed.h).
#include "borrowed.h"

#include <dlpack/dlpack.h>
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <numeric>

namespace attncore_python {

using attncore::DType;
using attncore::InvalidArgument;
using attncore::TensorView;
using attncore::Unsupported;

namespace {

// DLPack 0.8 added a bool type code; DLPack 0.6 (Debian 12's header) does not name it.
constexpr std::uint8_t kDLBoolCode = 6;

// numpy's and torch's objects this file compares with or calls, looked up once: numpy when
// first needed (the package imports it), torch once the caller has imported it (a tensor can
// only exist then). Never released: both modules live until the interpreter ends.
struct Numpy {
  PyObject* ndarray = nullptr;
  py::dtype f32{"float32"}, f64{"float64"}, f16{"float16"};

  Numpy() : ndarray(py::object(py::module_::import("numpy").attr("ndarray")).release().ptr()) {}
};

const Numpy& numpy() {
  static const Numpy* const api = new Numpy;
  return *api;
}

struct Torch {
  PyObject* tensor = nullptr;
  PyObject* parameter = nullptr;
  PyObject* strided = nullptr;
  PyObject* empty = nullptr;
  PyObject* is_grad_enabled = nullptr;
  // torch's dtype objects, each with the library's DType.
  std::vector<std::pair<PyObject*, DType>> dtypes;

  explicit Torch(py::handle torch) {
    auto get = [&](py::handle from, const char* name) {
      return py::object(from.attr(name)).release().ptr();
    };
    tensor = get(torch, "Tensor");
    parameter = get(torch.attr("nn"), "Parameter");
    strided = get(torch, "strided");
    empty = get(torch, "empty");
    is_grad_enabled = get(torch, "is_grad_enabled");
    for (auto [name, dtype] : {std::pair{"float32", DType::f32},
                               {"float64", DType::f64},
                               {"float16", DType::f16},
                               {"bfloat16", DType::bf16},
                               {"bool", DType::b8},
                               {"int32", DType::i32}})
      dtypes.emplace_back(get(torch, name), dtype);
  }

  PyObject* dtype_object(DType dtype) const {
    for (const auto& [object, d] : dtypes)
      if (d == dtype) return object;
    throw InvalidArgument("no torch dtype for " + std::string(attncore::name_of(dtype)));
  }
};

// torch's objects, or nullptr while torch is not imported.
const Torch* torch_api() {
  static const Torch* api = nullptr;
  if (api == nullptr) {
    PyObject* torch = PyDict_GetItemString(PyImport_GetModuleDict(), "torch");  // borrowed
    if (torch == nullptr) return nullptr;
    api = new Torch(torch);
  }
  return api;
}

// obj.<name> (a new reference); `name` is a string literal, interned at its first use.
template <const char* name>
py::object attribute(py::handle obj) {
  static PyObject* const interned = PyUnicode_InternFromString(name);
  PyObject* value = PyObject_GetAttr(obj.ptr(), interned);
  if (value == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(value);
}

// obj.<name>() (a new reference).
template <const char* name>
py::object method(py::handle obj) {
  static PyObject* const interned = PyUnicode_InternFromString(name);
  PyObject* value = PyObject_CallMethodNoArgs(obj.ptr(), interned);
  if (value == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(value);
}

constexpr char kDtype[] = "dtype", kLayout[] = "layout", kIsCpu[] = "is_cpu",
               kIsNested[] = "is_nested", kIsNeg[] = "is_neg", kShape[] = "shape",
               kStride[] = "stride", kDataPtr[] = "data_ptr", kRequiresGrad[] = "requires_grad";

// The library's dtype of a torch dtype object, or nullopt for one it has no name for.
std::optional<DType> torch_dtype(const Torch& torch, PyObject* dtype) {
  for (const auto& [object, d] : torch.dtypes)
    if (object == dtype) return d;
  return std::nullopt;
}

DType dtype_from_format(std::string format, py::ssize_t itemsize, const std::string& name) {
  // Native or explicitly little-endian byte order only (this library runs on little-endian CPUs).
  if (!format.empty() && (format[0] == '@' || format[0] == '=' || format[0] == '<'))
    format.erase(0, 1);
  if (format == "f" && itemsize == 4) return DType::f32;
  if (format == "d" && itemsize == 8) return DType::f64;
  if (format == "e" && itemsize == 2) return DType::f16;
  if (format == "?" && itemsize == 1) return DType::b8;
  // numpy's int32 is 'i' ('l' where a C long has 4 bytes).
  if ((format == "i" || format == "l") && itemsize == 4) return DType::i32;
  throw InvalidArgument(name + " has an unsupported element type (format='" + format +
                        "', itemsize=" + std::to_string(itemsize) +
                        ", expected float32, float64 or float16 for values, bool for masks, int32 "
                        "for indices)");
}

DType dtype_from_dlpack(const DLDataType& t, bool is_mask, const std::string& name) {
  if (t.lanes == 1) {
    if (t.code == kDLFloat && t.bits == 32) return DType::f32;
    if (t.code == kDLFloat && t.bits == 64) return DType::f64;
    if (t.code == kDLFloat && t.bits == 16) return DType::f16;
    if (t.code == kDLBfloat && t.bits == 16) return DType::bf16;
    if (t.code == kDLBoolCode && t.bits == 8) return DType::b8;
    if (t.code == kDLInt && t.bits == 32) return DType::i32;
    // Producers that cannot export bool (torch 1.13) pass a bool mask's bytes as uint8.
    if (is_mask && t.code == kDLUInt && t.bits == 8) return DType::b8;
  }
  throw InvalidArgument(name +
                        " has an unsupported element type (dlpack code=" + std::to_string(t.code) +
                        ", bits=" + std::to_string(t.bits) + ", lanes=" + std::to_string(t.lanes) +
                        ", expected float32, float64, float16 or bfloat16 for values, bool for "
                        "masks, int32 for indices)");
}

std::string type_name(py::handle obj) {
  return std::string(py::str(py::type::of(obj).attr("__name__")));
}

}  // namespace

std::map<std::string, std::uintptr_t>& last_call_addresses() {
  thread_local std::map<std::string, std::uintptr_t> addresses;
  return addresses;
}

bool grad_enabled() {
  const Torch* torch = torch_api();
  return torch != nullptr &&
         py::reinterpret_steal<py::object>(PyObject_CallNoArgs(torch->is_grad_enabled)).ptr() ==
             Py_True;
}

std::optional<Borrowed> Borrowed::plain(py::handle obj, const char* op, const char* name) {
  PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(obj.ptr()));
  std::optional<Borrowed> b;
  if (type == numpy().ndarray) {
    b.emplace(Borrowed());
    b->kind_ = ArrayKind::numpy;
    const std::string what = std::string(op) + ": " + name;
    if (!b->from_buffer(obj, what, false, /*refuse=*/false)) b.reset();
  } else if (const Torch* torch = torch_api();
             torch != nullptr && (type == torch->tensor || type == torch->parameter)) {
    b.emplace(Borrowed());
    b->kind_ = ArrayKind::torch;
    if (!b->from_torch(obj)) b.reset();
  }
  if (b) last_call_addresses()[name] = reinterpret_cast<std::uintptr_t>(b->view_.data);
  return b;
}

Borrowed::Borrowed(py::handle obj, const char* op, const char* name, bool writable, bool is_mask) {
  const std::string what = std::string(op) + ": " + name;
  const Torch* torch = torch_api();
  PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(obj.ptr()));
  if (PyObject_CheckBuffer(obj.ptr())) {
    from_buffer(obj, what, writable, /*refuse=*/true);
  } else if (torch != nullptr && (type == torch->tensor || type == torch->parameter) &&
             from_torch(obj)) {
    kind_ = ArrayKind::torch;
  } else if (torch != nullptr && (type == torch->tensor || type == torch->parameter) &&
             method<kIsNeg>(obj).ptr() == Py_True) {
    // (torch 1.13 exports such a view's memory through DLPack without its negation.)
    throw InvalidArgument(what + " is a lazily negated view (is_neg=True, expected a resolved " +
                          "tensor); pass its .resolve_neg()");
  } else if (py::hasattr(obj, "__dlpack__")) {
    from_dlpack(obj, what, is_mask);
  } else {
    throw py::type_error(what + " is not an array (type=" + type_name(obj) +
                         ", expected a numpy array or an object with __dlpack__)");
  }
  last_call_addresses()[name] = reinterpret_cast<std::uintptr_t>(view_.data);
}

Borrowed::Borrowed(Borrowed&&) noexcept = default;
Borrowed::~Borrowed() = default;

void Borrowed::CallDeleter::operator()(DLManagedTensor* t) const {
  if (t->deleter != nullptr) t->deleter(t);
}

bool Borrowed::from_buffer(py::handle obj, const std::string& what, bool writable, bool refuse) {
  try {
    buffer_ = py::reinterpret_borrow<py::buffer>(obj).request(writable);
  } catch (const py::error_already_set&) {
    // Some arrays cannot be exported as a buffer (numpy's dates): the plain path leaves them to
    // the general one, which names them in attncore's form.
    if (refuse) throw;
    return false;
  }
  const py::buffer_info& b = *buffer_;
  if (b.ndim > attncore::kMaxRank) {
    if (!refuse) return false;
    throw InvalidArgument(what + " has too many dimensions (rank=" + std::to_string(b.ndim) +
                          ", expected <= 4)");
  }
  view_.rank = static_cast<int>(b.ndim);
  try {
    view_.dtype = dtype_from_format(b.format, b.itemsize, what);
  } catch (const InvalidArgument&) {
    if (refuse) throw;
    return false;
  }
  view_.data = b.ptr;
  for (int d = 0; d < view_.rank; ++d) {
    const auto stride = b.strides[static_cast<std::size_t>(d)];
    if (stride < 0 || stride % b.itemsize != 0) {
      if (!refuse) return false;
      throw InvalidArgument(
          what + " has a stride that is not a non-negative multiple of its " +
          "item size (stride[" + std::to_string(d) + "]=" + std::to_string(stride) +
          " bytes, itemsize=" + std::to_string(b.itemsize) + "); pass a contiguous copy");
    }
    view_.shape[static_cast<std::size_t>(d)] = b.shape[static_cast<std::size_t>(d)];
    view_.stride[static_cast<std::size_t>(d)] = stride / b.itemsize;
  }
  return true;
}

// A torch tensor whose memory data_ptr() (storage offset included), shape and stride() (in
// elements) describe as they are: a dtype the library names (complex ones, which may carry a
// lazy conjugation, are not among them), rank <= 4, CPU memory, strided, not nested, not lazily
// negated. false (nothing read) for any other. The caller's reference keeps the memory alive.
bool Borrowed::from_torch(py::handle obj) {
  const Torch& torch = *torch_api();
  const auto dtype = torch_dtype(torch, attribute<kDtype>(obj).ptr());
  if (!dtype || attribute<kLayout>(obj).ptr() != torch.strided ||
      attribute<kIsCpu>(obj).ptr() != Py_True || attribute<kIsNested>(obj).ptr() == Py_True ||
      method<kIsNeg>(obj).ptr() == Py_True)
    return false;
  const py::object shape = attribute<kShape>(obj);  // nested tensors have none
  const auto rank = PyTuple_GET_SIZE(shape.ptr());
  if (rank > attncore::kMaxRank) return false;
  const py::object stride = method<kStride>(obj), data = method<kDataPtr>(obj);
  view_.dtype = *dtype;
  view_.rank = static_cast<int>(rank);
  view_.data = PyLong_AsVoidPtr(data.ptr());
  for (int d = 0; d < view_.rank; ++d) {
    view_.shape[static_cast<std::size_t>(d)] = PyLong_AsLongLong(PyTuple_GET_ITEM(shape.ptr(), d));
    view_.stride[static_cast<std::size_t>(d)] =
        PyLong_AsLongLong(PyTuple_GET_ITEM(stride.ptr(), d));
  }
  requires_grad_ = attribute<kRequiresGrad>(obj).ptr() == Py_True;
  return true;
}

void Borrowed::from_dlpack(py::handle obj, const std::string& what, bool is_mask) {
  // A producer that names its device is asked first, so that memory of another device is
  // refused before an export (which some producers refuse with errors of their own).
  if (py::hasattr(obj, "__dlpack_device__")) {
    int device_type = -1;
    try {
      device_type = obj.attr("__dlpack_device__")()[py::int_(0)].cast<int>();
    } catch (const std::exception& e) {  // the producer's error, or no int where expected
      throw InvalidArgument(what + " cannot be read through DLPack (type=" + type_name(obj) +
                            ", error='" + e.what() + "', expected an array in CPU memory)");
    }
    if (device_type != kDLCPU && device_type != kDLCUDAHost) {
      throw Unsupported(what +
                        " is not in CPU memory (dlpack device_type=" + std::to_string(device_type) +
                        ", expected CPU); attncore has CPU backends only");
    }
  }
  py::object exported;
  try {
    exported = obj.attr("__dlpack__")();
  } catch (const py::error_already_set& e) {
    throw InvalidArgument(what + " cannot be read through DLPack (type=" + type_name(obj) +
                          ", error='" + e.what() + "', expected a strided CPU array)");
  }
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(exported.ptr(), "dltensor"));
  if (managed == nullptr) {
    PyErr_Clear();
    throw InvalidArgument(what + " gave no DLPack capsule (type=" + type_name(obj) +
                          ", expected __dlpack__() to return an unused 'dltensor' capsule)");
  }
  // The capsule is consumed: from here on, this object calls the deleter.
  PyCapsule_SetName(exported.ptr(), "used_dltensor");
  managed_.reset(managed);
  const DLTensor& t = managed->dl_tensor;
  if (t.device.device_type != kDLCPU && t.device.device_type != kDLCUDAHost) {
    throw Unsupported(what + " is not in CPU memory (dlpack device_type=" +
                      std::to_string(static_cast<int>(t.device.device_type)) +
                      ", expected CPU); attncore has CPU backends only");
  }
  if (t.ndim > attncore::kMaxRank) {
    throw InvalidArgument(what + " has too many dimensions (rank=" + std::to_string(t.ndim) +
                          ", expected <= 4)");
  }
  view_.rank = t.ndim;
  view_.dtype = dtype_from_dlpack(t.dtype, is_mask, what);
  view_.data = static_cast<char*>(t.data) + t.byte_offset;
  std::int64_t running = 1;
  for (int d = view_.rank; d-- > 0;) {
    view_.shape[static_cast<std::size_t>(d)] = t.shape[d];
    view_.stride[static_cast<std::size_t>(d)] = t.strides != nullptr ? t.strides[d] : running;
    running *= t.shape[d];
  }
}

std::optional<Borrowed> borrow_optional(py::handle obj, const char* op, const char* name,
                                        bool writable, bool is_mask) {
  std::optional<Borrowed> b;
  if (!obj.is_none()) b.emplace(obj, op, name, writable, is_mask);
  return b;
}

std::optional<TensorView> view_of(const std::optional<Borrowed>& b) {
  if (!b) return std::nullopt;
  return b->view();
}

py::object new_array(ArrayKind kind, const std::vector<std::int64_t>& shape, DType dtype,
                     const std::vector<std::int64_t>& like_stride) {
  // order: the dims from outermost to innermost in memory.
  const std::size_t rank = shape.size();
  std::vector<std::size_t> order(rank);
  std::iota(order.begin(), order.end(), 0);
  if (!like_stride.empty() && rank > 1) {
    std::stable_sort(order.begin(), order.end() - 1,
                     [&](std::size_t a, std::size_t b) { return like_stride[a] > like_stride[b]; });
  }
  std::vector<std::int64_t> stride(rank);
  std::int64_t running = 1;
  for (std::size_t i = rank; i-- > 0;) {
    stride[order[i]] = running;
    running *= shape[order[i]];
  }
  if (kind == ArrayKind::numpy) {
    const Numpy& np = numpy();
    const py::dtype& dt = dtype == DType::f32   ? np.f32
                          : dtype == DType::f64 ? np.f64
                          : dtype == DType::f16 ? np.f16
                                                : throw InvalidArgument("no numpy dtype for bf16");
    std::vector<py::ssize_t> bytes(rank);
    for (std::size_t d = 0; d < rank; ++d) bytes[d] = stride[d] * dt.itemsize();
    return py::array(dt, std::vector<py::ssize_t>(shape.begin(), shape.end()), bytes);
  }
  const Torch* torch = torch_api();
  std::vector<std::int64_t> memory_shape(rank);
  for (std::size_t i = 0; i < rank; ++i) memory_shape[i] = shape[order[i]];
  py::dict kwargs;
  kwargs["dtype"] = py::handle(torch->dtype_object(dtype));
  py::object buffer = py::reinterpret_steal<py::object>(
      PyObject_Call(torch->empty, py::tuple(py::cast(memory_shape)).ptr(), kwargs.ptr()));
  if (!buffer) throw py::error_already_set();
  bool identity = true;
  for (std::size_t i = 0; i < rank; ++i) identity = identity && order[i] == i;
  if (identity) return buffer;
  std::vector<std::size_t> inverse(rank);
  for (std::size_t i = 0; i < rank; ++i) inverse[order[i]] = i;
  return buffer.attr("permute")(*py::tuple(py::cast(inverse)));
}

}  // namespace attncore_python
