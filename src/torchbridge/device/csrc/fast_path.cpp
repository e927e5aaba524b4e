// The eager cache key and the fast path.
//
// The key of an eager call is built here and only here: fast_call builds it for every call it sees,
// and Python's general path (dispatch.run) asks signature() for the same key and keys its compiled
// programs by it, so the two can never disagree about which calls share a program.
//
// Every device kernel the Python side registers is fast_call(op, *args, **kwargs). A repeat call (same
// key as a call the general path already ran and remembered as a FastEntry) is served here: buffer
// lookup, the jitted program, the output tensors. Anything else, or anything unusual on the way, goes
// to the Python fallback, which runs the call through the general path (and may remember it).

#include "native.h"

#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace torchbridge {
namespace {

namespace py = pybind11;
using py::object;
using py::reinterpret_borrow;
using py::reinterpret_steal;

object checked(PyObject* o) {
  if (o == nullptr) throw py::error_already_set();
  return reinterpret_steal<object>(o);
}

// ---- the key -----------------------------------------------------------------------------------
// One pass over a call's arguments. The key holds the op id and a byte string packing every device
// tensor's storage slot (which arguments share a storage), storage size, shape, strides, offset,
// dtype, device and conj/neg bits; every host tensor's shape, dtype and device; the *type* of each
// dynamic scalar (its value is a program input); and every other argument as a constant with its
// Python type (1, 1.0 and True are equal constants but not equal programs). Device storages and
// dynamic scalars are collected in argument order, the order dispatch._Call.encode walks them.
struct Key {
  explicit Key(bool fast_only) : fast_only(fast_only) {}

  bool fast_only;           // stop at the first thing the fast path cannot serve
  bool servable = true;     // the fast path could serve the call: device tensors only, at least one
  bool any_device = false;
  std::string blob;
  py::list consts;
  std::vector<uint64_t> ptrs;  // device storages in first-seen order: slot i is ptrs[i]
  py::list scalars;            // dynamic scalar values, in argument order

  // Describes args[start:] and kwargs (may be null). False when no key can describe the call or,
  // fast_only, when the fast path cannot serve it.
  bool describe(PyObject* args, Py_ssize_t start, PyObject* kwargs, PyObject* dynamic, PyObject* dynamic_kw) {
    Py_ssize_t n = PyTuple_GET_SIZE(args), ndyn = PyTuple_GET_SIZE(dynamic);
    for (Py_ssize_t i = start; i < n; ++i) {
      bool dyn = i - start < ndyn && PyTuple_GET_ITEM(dynamic, i - start) == Py_True;
      if (!add(PyTuple_GET_ITEM(args, i), dyn)) return false;
    }
    if (kwargs != nullptr) {
      PyObject *name, *value;
      Py_ssize_t pos = 0;
      while (PyDict_Next(kwargs, &pos, &name, &value)) {
        put('K');
        consts.append(py::handle(name));
        int dyn = PySet_Contains(dynamic_kw, name);
        if (dyn < 0) throw py::error_already_set();
        if (!add(value, dyn == 1)) return false;
      }
    }
    return any_device || general_only();
  }

  object as_tuple(int64_t op_id) const {
    py::tuple k(2 + consts.size());
    k[0] = py::int_(op_id);
    k[1] = py::bytes(blob);
    for (size_t i = 0; i < consts.size(); ++i) k[2 + i] = consts[i];
    return std::move(k);
  }

 private:
  void put(int64_t v) { blob.append(reinterpret_cast<const char*>(&v), sizeof(v)); }

  // Something only the general path runs: go on describing it, unless only the fast path asked.
  bool general_only() {
    servable = false;
    return !fast_only;
  }

  bool add(PyObject* obj, bool dynamic) {
    if (THPVariable_Check(obj)) return add_tensor(THPVariable_Unpack(obj));
    if (dynamic && (PyFloat_CheckExact(obj) || PyLong_CheckExact(obj) || PyBool_Check(obj))) {
      put(PyBool_Check(obj) ? 'b' : PyFloat_CheckExact(obj) ? 'f' : 'i');
      scalars.append(py::handle(obj));
      return true;
    }
    if ((PyList_Check(obj) || PyTuple_Check(obj)) && holds_tensor(obj)) return add_tensor_list(obj);
    if (dynamic && (PyList_Check(obj) || PyTuple_Check(obj)) && numbers_only(obj)) {
      // a Scalar[] argument (a _foreach_ op's per-tensor scalars: Adam's bias corrections change every
      // step): each number a traced value, as dispatch._Call.encode does
      Py_ssize_t n = PySequence_Fast_GET_SIZE(obj);
      put('l');
      put(n);
      for (Py_ssize_t i = 0; i < n; ++i) {
        PyObject* item = PySequence_Fast_GET_ITEM(obj, i);
        put(PyBool_Check(item) ? 'b' : PyFloat_CheckExact(item) ? 'f' : 'i');
        scalars.append(py::handle(item));
      }
      return true;
    }
    put('C');
    put_types(obj);
    consts.append(frozen(obj));
    return true;
  }

  bool add_tensor(const at::Tensor& t) {
    if (!t.defined()) return false;
    if (t.device().type() != kDevice) {  // a CPU scalar or operand, or another device's tensor: Python decides
      if (!general_only()) return false;
      put('H');
      put(t.dim());
      for (auto v : t.sizes()) put(v);
      put(static_cast<int64_t>(t.scalar_type()));
      put(static_cast<int64_t>(t.device().type()));
      put(t.device().index());
      return true;
    }
    any_device = true;
    const auto& storage = t.storage();
    auto p = reinterpret_cast<uint64_t>(storage.data());
    int64_t slot = -1;
    for (size_t i = 0; i < ptrs.size(); ++i)
      if (ptrs[i] == p) slot = static_cast<int64_t>(i);
    if (slot < 0) {
      slot = static_cast<int64_t>(ptrs.size());
      ptrs.push_back(p);
    }
    put('T');
    put(slot);
    put(static_cast<int64_t>(storage.nbytes()));
    put(t.dim());
    for (auto v : t.sizes()) put(v);
    for (auto v : t.strides()) put(v);
    put(t.storage_offset());
    put(static_cast<int64_t>(t.scalar_type()));
    put(t.device().index());
    // conj/neg views reach some kernels unresolved (mm, dot, ...): a different program
    put(static_cast<int64_t>(t.is_conj()) | (static_cast<int64_t>(t.is_neg()) << 1));
    return true;
  }

  static bool numbers_only(PyObject* seq) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject** items = PySequence_Fast_ITEMS(seq);
    if (n == 0) return false;
    for (Py_ssize_t i = 0; i < n; ++i)
      if (!(PyFloat_CheckExact(items[i]) || PyLong_CheckExact(items[i]) || PyBool_Check(items[i]))) return false;
    return true;
  }

  static bool holds_tensor(PyObject* seq) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject** items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; ++i)
      if (THPVariable_Check(items[i])) return true;
    return false;
  }

  // cat's inputs, a _foreach_ op's operands (served fast); index's optional indices (None among the
  // tensors) and other mixed lists only on the general path.
  bool add_tensor_list(PyObject* seq) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject** items = PySequence_Fast_ITEMS(seq);
    put('L');
    put(n);
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (!THPVariable_Check(items[i]) && !general_only()) return false;
      if (!add(items[i], false)) return false;
    }
    return true;
  }

  void put_types(PyObject* obj) {
    if (PyList_Check(obj) || PyTuple_Check(obj)) {
      put('(');
      Py_ssize_t n = PySequence_Fast_GET_SIZE(obj);
      for (Py_ssize_t i = 0; i < n; ++i) put_types(PySequence_Fast_GET_ITEM(obj, i));
      put(')');
    } else {
      put(reinterpret_cast<int64_t>(Py_TYPE(obj)));
    }
  }

  // A hashable constant: lists (also nested ones) become tuples.
  static object frozen(PyObject* obj) {
    if (!(PyList_Check(obj) || PyTuple_Check(obj))) return reinterpret_borrow<object>(obj);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(obj);
    py::tuple out(n);
    for (Py_ssize_t i = 0; i < n; ++i) out[i] = frozen(PySequence_Fast_GET_ITEM(obj, i));
    return std::move(out);
  }
};

// signature(op_id, args, kwargs, dynamic, dynamic_kw) -> (key, storage addresses, dynamic scalars,
// servable) for the general path, or None when an argument is an undefined tensor. `dynamic` names,
// per position, the arguments whose numbers are traced values; `dynamic_kw` the keyword ones.
object signature(int64_t op_id, py::tuple args, py::dict kwargs, py::tuple dynamic, py::frozenset dynamic_kw) {
  Key key(/*fast_only=*/false);
  if (!key.describe(args.ptr(), 0, kwargs.ptr(), dynamic.ptr(), dynamic_kw.ptr())) return py::none();
  py::tuple ptrs(key.ptrs.size());
  for (size_t i = 0; i < key.ptrs.size(); ++i) ptrs[i] = py::int_(key.ptrs[i]);
  return py::make_tuple(key.as_tuple(op_id), ptrs, py::tuple(key.scalars), key.servable);
}

// ---- what the fast path serves -------------------------------------------------------------------
struct OutputSpec {
  std::vector<int64_t> shape, strides;
  at::ScalarType dtype;
};

// A call the general path ran, remembered (dispatch._remember_fast) so that fast_call serves its repeats.
struct FastEntry {
  object program;  // dispatch._Program: fused mode records it
  object call;     // program.call: runs it, donating large written buffers nothing else holds
  object fn;       // program.fn: the jitted program, called directly when it writes no storage
  std::vector<Py_ssize_t> writes;  // program.writes: storage slots it returns updated, in order
  object random;                   // program.random: values drawn (0: not random)
  bool is_random;
  object out_struct;               // program.out_struct: how the new outputs make the return value
  std::vector<object> buffer_dtypes;  // per storage slot: the buffer dtype the program was traced for
  object dev_index;                   // a Python int (a key of the last-results dict)
  c10::DeviceIndex device;
  object returns;     // None: new outputs; else positions (int) / kwarg names (str) of the returned arguments
  bool returns_none;  // the op returns nothing (_fused_adam_ writes its lists)
  std::vector<object> zeros;  // per storage slot: storage.zeros' arguments, for a never-written storage
  std::vector<OutputSpec> outputs;
  bool single;  // exactly one new output: returned as it is
  bool zeroes;  // zero_ of one storage: a never-written storage already reads as zeros, nothing to do
};

FastEntry make_entry(object program, py::sequence buffer_dtypes, int dev_index, object returns, bool returns_none,
                     py::sequence zeros, py::sequence outputs, bool single, bool zeroes) {
  FastEntry e;
  e.program = program;
  e.call = program.attr("call");
  e.fn = program.attr("fn");
  for (auto w : py::tuple(program.attr("writes"))) e.writes.push_back(w.cast<Py_ssize_t>());
  e.random = program.attr("random");
  e.is_random = e.random.cast<int64_t>() != 0;
  e.out_struct = program.attr("out_struct");
  for (auto d : buffer_dtypes) e.buffer_dtypes.push_back(reinterpret_borrow<object>(d));
  e.dev_index = py::int_(dev_index);
  e.device = static_cast<c10::DeviceIndex>(dev_index);
  e.returns = returns;
  e.returns_none = returns_none;
  for (auto z : zeros) e.zeros.push_back(py::tuple(z));
  for (auto o : outputs) {
    auto spec = o.cast<std::tuple<std::vector<int64_t>, std::vector<int64_t>, int>>();
    e.outputs.push_back({std::get<0>(spec), std::get<1>(spec), static_cast<at::ScalarType>(std::get<2>(spec))});
  }
  e.single = single;
  e.zeroes = zeroes;
  TORCH_CHECK(e.zeros.size() == e.buffer_dtypes.size(), "torchbridge: FastEntry: ", e.zeros.size(),
              " zero buffers for ", e.buffer_dtypes.size(), " storages");
  return e;
}

// What the fast path calls back into and the dictionaries it shares with Python, set once by
// dispatch.install_fast_path (by name) and kept for the life of the process.
struct Hooks {
  PyObject* entries = nullptr;       // dict: key -> FastEntry (dispatch._fast)
  PyObject* table = nullptr;         // dict: storage address -> buffer (the storage table)
  PyObject* array_type = nullptr;    // the concrete buffer class; anything else goes slow ...
  PyObject* pending_type = nullptr;  // ... but fused mode's placeholders (fused.Pending) while it records
  PyObject* last = nullptr;          // dict: device index -> last results (what synchronize() waits on)
  PyObject* fallback = nullptr;      // fallback.fallback(op, *args, **kwargs): the general path
  PyObject* drain = nullptr;         // the storage table's drain()
  PyObject* next_rng = nullptr;      // STATE.next_rng(device index, values drawn) -> (seed, offset)
  PyObject* rebuild = nullptr;       // dispatch._rebuild(out_struct, outputs)
  PyObject* record = nullptr;        // fused.record_fast(program, bufs, scalars, rng) -> (updated, new, flush)
  PyObject* flush = nullptr;         // the storage table's flush(): runs what fused mode recorded
  PyObject* zeros = nullptr;         // storage.zeros(count, dtype, device): a fresh storage's shared zero buffer
};
Hooks g;
PyObject* g_dtype = nullptr;  // "dtype"
bool g_fused = false;         // fused eager mode: a hit records the program instead of running it
uint64_t g_hits = 0;          // calls served here (torchbridge.metrics()["fast_path_hits"])
std::unordered_map<PyObject*, std::pair<PyObject*, PyObject*>> g_ops;  // op -> (dynamic per position, dynamic kwargs)

void setup(py::dict entries, py::dict table, py::type array_type, py::type pending_type, py::dict last,
           object fallback, object drain, object next_rng, object rebuild, object record, object flush,
           object zeros) {
  g.entries = entries.release().ptr();
  g.table = table.release().ptr();
  g.array_type = array_type.release().ptr();
  g.pending_type = pending_type.release().ptr();
  g.last = last.release().ptr();
  g.fallback = fallback.release().ptr();
  g.drain = drain.release().ptr();
  g.next_rng = next_rng.release().ptr();
  g.rebuild = rebuild.release().ptr();
  g.record = record.release().ptr();
  g.flush = flush.release().ptr();
  g.zeros = zeros.release().ptr();
  g_dtype = PyUnicode_InternFromString("dtype");
}

void register_op(object op, py::tuple dynamic, py::frozenset dynamic_kw) {
  if (g_ops.count(op.ptr())) return;
  g_ops.emplace(op.release().ptr(), std::make_pair(dynamic.release().ptr(), dynamic_kw.release().ptr()));
}

object finish(const FastEntry& e, PyObject* args, PyObject* kwargs, const object& fresh);

// The result of a hit, or a null object for "take the general path" (no Python error set).
object hit(PyObject* op, PyObject* args, PyObject* kwargs) {
  auto known = g_ops.find(op);
  if (known == g_ops.end()) return object();
  Key key(/*fast_only=*/true);
  if (!key.describe(args, 1, kwargs, known->second.first, known->second.second)) return object();
  object k = key.as_tuple(reinterpret_cast<int64_t>(op));
  PyObject* found = PyDict_GetItemWithError(g.entries, k.ptr());  // borrowed
  if (found == nullptr) {
    if (PyErr_Occurred()) throw py::error_already_set();
    return object();
  }
  object hold = reinterpret_borrow<object>(found);  // the program call may run Python that clears the cache
  const FastEntry& e = hold.cast<const FastEntry&>();
  std::vector<object> keys;
  keys.reserve(key.ptrs.size());
  py::list bufs(key.ptrs.size());
  for (size_t i = 0; i < key.ptrs.size(); ++i) {
    keys.push_back(checked(PyLong_FromUnsignedLongLong(key.ptrs[i])));
    PyObject* b = PyDict_GetItemWithError(g.table, keys.back().ptr());
    if (b == nullptr) {  // never written (torch.zeros' empty before its fill_, a fresh out= tensor): zeros
      if (PyErr_Occurred()) throw py::error_already_set();
      if (e.zeroes) return finish(e, args, kwargs, object());  // zero_ of it (e.g. autograd's zero gradients)
      object z = checked(PyObject_Call(g.zeros, e.zeros.at(i).ptr(), nullptr));
      if (PyDict_SetItem(g.table, keys.back().ptr(), z.ptr()) < 0) throw py::error_already_set();
      b = z.ptr();  // the table holds it now
    }
    PyTypeObject* type = Py_TYPE(b);
    if (type != reinterpret_cast<PyTypeObject*>(g.array_type) &&
        !(g_fused && type == reinterpret_cast<PyTypeObject*>(g.pending_type)))
      return object();
    object dt = checked(PyObject_GetAttr(b, g_dtype));
    int same = PyObject_RichCompareBool(dt.ptr(), e.buffer_dtypes.at(i).ptr(), Py_EQ);
    if (same < 0) throw py::error_already_set();
    if (!same) return object();  // the storage holds another dtype's bits now
    bufs[i] = reinterpret_borrow<object>(b);
  }
  // a random op draws `random` values: the device's (seed, offset), then the offset moves past them
  object rng = e.is_random ? checked(PyObject_CallFunctionObjArgs(g.next_rng, e.dev_index.ptr(), e.random.ptr(), nullptr))
                           : reinterpret_borrow<object>(Py_None);
  object scalars = checked(PySequence_Tuple(key.scalars.ptr()));
  object empty = checked(PyTuple_New(0));
  object result;
  bool flush = false;
  if (g_fused) {  // record it; the table takes the placeholders of its results below
    object tup = checked(PyList_AsTuple(bufs.ptr()));
    object rec = checked(PyObject_CallFunctionObjArgs(g.record, e.program.ptr(), tup.ptr(), scalars.ptr(), rng.ptr(),
                                                      nullptr));
    flush = PyObject_IsTrue(PyTuple_GET_ITEM(rec.ptr(), 2)) == 1;
    result = checked(PyTuple_GetSlice(rec.ptr(), 0, 2));
  } else if (!e.writes.empty()) {
    // _Program.call decides on buffer donation from reference counts: `bufs` must hold the only
    // references besides the table's.
    result = checked(PyObject_CallFunctionObjArgs(e.call.ptr(), bufs.ptr(), scalars.ptr(), empty.ptr(), empty.ptr(),
                                                  rng.ptr(), e.dev_index.ptr(), nullptr));
  } else {
    object tup = checked(PyList_AsTuple(bufs.ptr()));
    result = checked(PyObject_CallFunctionObjArgs(e.fn.ptr(), tup.ptr(), scalars.ptr(), empty.ptr(), empty.ptr(),
                                                  rng.ptr(), nullptr));
  }
  bufs = py::list();
  object parts = checked(PySequence_Tuple(result.ptr()));
  TORCH_CHECK(PyTuple_GET_SIZE(parts.ptr()) == 2, "torchbridge: a device program returned ",
              PyTuple_GET_SIZE(parts.ptr()), " parts, expected (updated, new)");
  if (!g_fused && PyDict_SetItem(g.last, e.dev_index.ptr(), parts.ptr()) < 0) throw py::error_already_set();
  object updated = checked(PySequence_Fast(PyTuple_GET_ITEM(parts.ptr(), 0), "updated buffers"));
  object fresh = checked(PySequence_Fast(PyTuple_GET_ITEM(parts.ptr(), 1), "new buffers"));
  TORCH_CHECK(PySequence_Fast_GET_SIZE(updated.ptr()) == static_cast<Py_ssize_t>(e.writes.size()),
              "torchbridge: a device program updated the wrong number of buffers");
  for (size_t i = 0; i < e.writes.size(); ++i) {
    if (PyDict_SetItem(g.table, keys.at(e.writes[i]).ptr(), PySequence_Fast_GET_ITEM(updated.ptr(), i)) < 0)
      throw py::error_already_set();
  }
  object ret = finish(e, args, kwargs, fresh);
  if (flush) checked(PyObject_CallNoArgs(g.flush));  // after the table holds this op's placeholders
  return ret;
}

// The return value of a hit whose written buffers are in the table: the written arguments, or
// new output tensors holding `fresh`.
object finish(const FastEntry& e, PyObject* args, PyObject* kwargs, const object& fresh) {
  if (!e.returns.is_none()) {
    if (e.returns_none) return reinterpret_borrow<object>(Py_None);
    PyObject* returns = e.returns.ptr();
    Py_ssize_t nr = PyTuple_GET_SIZE(returns);
    py::tuple vals(nr);
    for (Py_ssize_t i = 0; i < nr; ++i) {
      PyObject* r = PyTuple_GET_ITEM(returns, i);
      PyObject* v = PyLong_Check(r) ? PyTuple_GET_ITEM(args, 1 + PyLong_AsSsize_t(r)) : PyDict_GetItem(kwargs, r);
      TORCH_CHECK(v != nullptr, "torchbridge: fast path lost a returned argument");
      vals[i] = reinterpret_borrow<object>(v);
    }
    return nr == 1 ? object(vals[0]) : object(vals);
  }
  Py_ssize_t no = static_cast<Py_ssize_t>(e.outputs.size());
  TORCH_CHECK(PySequence_Fast_GET_SIZE(fresh.ptr()) == no, "torchbridge: a device program made the wrong number of outputs");
  py::list outs(no);
  for (Py_ssize_t i = 0; i < no; ++i) {
    const OutputSpec& spec = e.outputs[i];
    at::Tensor t = new_device_tensor(spec.shape, spec.strides, spec.dtype, e.device);
    object k = checked(PyLong_FromUnsignedLongLong(reinterpret_cast<uint64_t>(t.storage().data())));
    if (PyDict_SetItem(g.table, k.ptr(), PySequence_Fast_GET_ITEM(fresh.ptr(), i)) < 0)
      throw py::error_already_set();
    outs[i] = checked(THPVariable_Wrap(std::move(t)));
  }
  if (e.single) return outs[0];
  return checked(PyObject_CallFunctionObjArgs(g.rebuild, e.out_struct.ptr(), outs.ptr(), nullptr));
}

PyObject* fast_call(PyObject*, PyObject* args, PyObject* kwargs) {
  if (!PyTuple_Check(args) || PyTuple_GET_SIZE(args) < 1) {
    PyErr_SetString(PyExc_TypeError, "torchbridge: fast_call(op, *args, **kwargs)");
    return nullptr;
  }
  if (g.fallback == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "torchbridge: fast_call before fast_setup (the device is not registered)");
    return nullptr;
  }
  try {
    if (has_storage_events()) checked(PyObject_CallNoArgs(g.drain));
    object r = hit(PyTuple_GET_ITEM(args, 0), args, kwargs);
    if (r) {
      ++g_hits;
      return r.release().ptr();
    }
  } catch (py::error_already_set& e) {
    e.restore();
    return nullptr;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  return PyObject_Call(g.fallback, args, kwargs);
}

PyMethodDef g_fast_call_def = {"fast_call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&fast_call)),
                               METH_VARARGS | METH_KEYWORDS,
                               "fast_call(op, *args, **kwargs): the device kernel of every op (see fast_path.cpp)"};

}  // namespace

void bind_fast_path(py::module_& m) {
  m.def("signature", &signature, "the eager cache key of one call (see fast_path.cpp), or None");
  py::class_<FastEntry>(m, "FastEntry", "a call the general path ran, for fast_call to serve its repeats")
      .def(py::init(&make_entry), py::kw_only(), py::arg("program"), py::arg("buffer_dtypes"), py::arg("dev_index"),
           py::arg("returns"), py::arg("returns_none"), py::arg("zeros"), py::arg("outputs"), py::arg("single"),
           py::arg("zeroes"));
  m.def("fast_setup", &setup, "hand the fast path its dictionaries and Python hooks (by name, once)", py::kw_only(),
        py::arg("entries"), py::arg("table"), py::arg("array_type"), py::arg("pending_type"), py::arg("last"),
        py::arg("fallback"), py::arg("drain"), py::arg("next_rng"), py::arg("rebuild"), py::arg("record"),
        py::arg("flush"), py::arg("zeros"));
  m.def("fast_register_op", &register_op, "let fast_call serve this op's remembered calls");
  m.def("fast_hits", []() { return g_hits; });
  m.def("fast_fused", [](bool on) { g_fused = on; }, "fused eager mode: hits record instead of run");
  m.add_object("fast_call", reinterpret_steal<object>(PyCFunction_NewEx(&g_fast_call_def, nullptr, nullptr)));
}

}  // namespace torchbridge
