// best_mm_fp4's warm-path key: the metadata of every tensor of a call, read in one C++ call.
//
// fp4select/native_key.py builds this file, loads it and says why it exists. One function:
//
//   key(t0, t1, ...) -> int | None
//
// Each argument is a tensor or None. The words below (Python type, dispatch keys, dtype,
// requires_grad, device, dim, every size and stride) are exactly what the warm path must see
// of each tensor; they are interned: two calls get the same int if and only if every word of
// every argument is equal (no hash decides a match). None comes back for anything this
// cannot read exactly (not a tensor, symbolic or sparse sizes, too many dimensions, a full
// table): the caller then takes its Python path, which checks in full.
//
// Every call holds the GIL and calls nothing that could release it, so the table needs no
// lock of its own.

#include <Python.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <string>
#include <unordered_map>

namespace {

constexpr size_t kMaxWords = 160;               // six tensors of up to eight dimensions
constexpr size_t kMaxKeys = size_t{1} << 18;    // distinct metadata sets one process keeps

// Never freed: a process-lifetime table whose ints the Python side keeps in its own keys.
std::unordered_map<std::string, long long>* interned = nullptr;

PyObject* key(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  int64_t words[kMaxWords];
  size_t n = 0;
  try {
    for (Py_ssize_t i = 0; i < nargs; ++i) {
      PyObject* arg = args[i];
      if (arg == Py_None) {
        if (n + 1 > kMaxWords) Py_RETURN_NONE;
        words[n++] = -1;
        continue;
      }
      if (!THPVariable_Check(arg)) Py_RETURN_NONE;
      const at::Tensor& t = THPVariable_Unpack(arg);
      if (t.layout() != c10::kStrided) Py_RETURN_NONE;
      if (t.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) Py_RETURN_NONE;
      const int64_t dim = t.dim();
      if (dim < 0 || n + 5 + 2 * static_cast<size_t>(dim) > kMaxWords) Py_RETURN_NONE;
      const c10::Device device = t.device();
      words[n++] = static_cast<int64_t>(reinterpret_cast<intptr_t>(Py_TYPE(arg)));
      words[n++] = static_cast<int64_t>(t.key_set().raw_repr());
      words[n++] = static_cast<int64_t>(t.scalar_type()) | (int64_t{t.requires_grad()} << 32);
      words[n++] = (static_cast<int64_t>(device.type()) << 32) |
                   static_cast<uint16_t>(device.index());
      words[n++] = dim;
      const auto sizes = t.sizes();
      const auto strides = t.strides();
      for (int64_t d = 0; d < dim; ++d) {
        words[n++] = sizes[d];
        words[n++] = strides[d];
      }
    }
  } catch (...) {  // a tensor whose sizes or strides cannot be read as plain integers
    Py_RETURN_NONE;
  }
  std::string encoded(reinterpret_cast<const char*>(words), n * sizeof(int64_t));
  if (interned == nullptr) interned = new std::unordered_map<std::string, long long>();
  auto found = interned->find(encoded);
  if (found != interned->end()) return PyLong_FromLongLong(found->second);
  if (interned->size() >= kMaxKeys) Py_RETURN_NONE;
  const long long id = static_cast<long long>(interned->size());
  interned->emplace(std::move(encoded), id);
  return PyLong_FromLongLong(id);
}

PyMethodDef methods[] = {
    {"key", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(key)), METH_FASTCALL,
     "key(*tensors_or_none) -> int | None: one int per exact set of tensor metadata"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "fp4select_native_key", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_fp4select_native_key(void) { return PyModule_Create(&module); }
