// The per-tensor part of a step plan's host work (optim._host), in one C++ pass over the tensor list.
//
// A step on a plan (optim._plan) must, for every parameter of the optimizer's groups, read its .grad,
// check that the parameters with gradients are exactly the plan's (same objects, same order, their
// storage where it was) and that each gradient is dense and contiguous, and write each gradient's
// address into the plan's metadata table. In Python that is ~0.35 us per tensor (attribute reads and
// method calls through the interpreter); here it is a few nanoseconds, with no Python object created.
//
// Built by optim/_host.py with the system's C++ compiler against the installed torch's headers; the
// result codes are optim._host.Gather's.

#include <torch/csrc/autograd/python_variable.h>  // first: it brings Python.h and ATen in the order they need

#include <cstdint>

namespace {

constexpr int64_t OK = 0;
constexpr int64_t OTHER_TENSORS = 1;   // the parameters with gradients are not the plan's
constexpr int64_t MOVED = 2;           // a parameter's storage moved (a replaced .data)
constexpr int64_t NOT_CONTIGUOUS = 3;  // a gradient is sparse or not contiguous
constexpr int64_t BAD_ARGUMENTS = 4;

// a contiguous CPU int64 tensor's data, or nullptr
int64_t* int64_data(PyObject* obj, int64_t need) {
    if (!THPVariable_Check(obj)) return nullptr;
    const at::Tensor& t = THPVariable_Unpack(obj);
    if (!t.is_cpu() || t.scalar_type() != at::kLong || !t.is_contiguous() || t.numel() < need) return nullptr;
    return t.data_ptr<int64_t>();
}

// gather(param_lists, plan_params, param_ptrs, table, g_words, grad_ptrs) -> code
//   param_lists: list of the groups' parameter lists; plan_params: list of the plan's n parameters
//   param_ptrs:  int64 [n], the parameters' addresses when the plan was made
//   table:       int64 metadata table (contiguous); g_words: int64 [n], the flat index of each
//                parameter's G word in it, or -1 (a tensor without a row)
//   grad_ptrs:   int64 [n], written: the gradients' addresses
PyObject* gather(PyObject*, PyObject* args) {
    PyObject *lists, *params, *param_ptrs_obj, *table_obj, *g_words_obj, *grad_ptrs_obj;
    if (!PyArg_ParseTuple(args, "O!O!OOOO", &PyList_Type, &lists, &PyList_Type, &params, &param_ptrs_obj,
                          &table_obj, &g_words_obj, &grad_ptrs_obj))
        return nullptr;
    const Py_ssize_t n = PyList_GET_SIZE(params);
    int64_t* param_ptrs = int64_data(param_ptrs_obj, n);
    int64_t* g_words = int64_data(g_words_obj, n);
    int64_t* grad_ptrs = int64_data(grad_ptrs_obj, n);
    int64_t* table = int64_data(table_obj, 0);
    if (!param_ptrs || !g_words || !grad_ptrs || !table) return PyLong_FromLongLong(BAD_ARGUMENTS);
    const int64_t table_words = THPVariable_Unpack(table_obj).numel();
    Py_ssize_t j = 0;
    const Py_ssize_t groups = PyList_GET_SIZE(lists);
    for (Py_ssize_t gi = 0; gi < groups; ++gi) {
        PyObject* group = PyList_GET_ITEM(lists, gi);
        if (!PyList_Check(group)) return PyLong_FromLongLong(BAD_ARGUMENTS);
        const Py_ssize_t count = PyList_GET_SIZE(group);
        for (Py_ssize_t i = 0; i < count; ++i) {
            PyObject* obj = PyList_GET_ITEM(group, i);
            if (!THPVariable_Check(obj)) return PyLong_FromLongLong(BAD_ARGUMENTS);
            const at::Tensor& p = THPVariable_Unpack(obj);
            const at::Tensor& g = p.grad();
            if (!g.defined()) continue;
            if (j >= n || obj != PyList_GET_ITEM(params, j)) return PyLong_FromLongLong(OTHER_TENSORS);
            if (reinterpret_cast<int64_t>(p.data_ptr()) != param_ptrs[j]) return PyLong_FromLongLong(MOVED);
            if (g.layout() != at::kStrided || !g.is_contiguous()) return PyLong_FromLongLong(NOT_CONTIGUOUS);
            const int64_t address = reinterpret_cast<int64_t>(g.data_ptr());
            grad_ptrs[j] = address;
            const int64_t word = g_words[j];
            if (word >= 0) {
                if (word >= table_words) return PyLong_FromLongLong(BAD_ARGUMENTS);
                table[word] = address;
            }
            ++j;
        }
    }
    return PyLong_FromLongLong(j == n ? OK : OTHER_TENSORS);
}

PyMethodDef methods[] = {
    {"gather", gather, METH_VARARGS, "A step plan's gradient addresses and checks (optim._host)."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "optim_plan_host", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_optim_plan_host() { return PyModule_Create(&module); }
