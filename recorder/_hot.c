/* The recorder's hot path, compiled: one torch call of the user's forward pass.
 *
 * ``Fused.__torch_function__`` is the fusion of two Python functions, for the common
 * call only: ``intercept._Mode.__torch_function__`` (name the function, call it) and
 * ``labels.Labeller.on_call`` (parents, source site, shape, layer numbers, one row).
 * The common call is: a function already named, that writes nothing in place, whose
 * arguments are tensors, scalars and torch's small values (argkeys.VALUE_TYPES), and
 * tuples of those (no lists), outside any repeated module call, returning one tensor. Its non-tensor
 * arguments go into the row as they are (``arg_values``, TorchLens's loop keys). Every other call goes to the Python code, which
 * stays the reference: tests/test_compiled.py checks that both give the same tables.
 *
 * Rows are built exactly as ``Labeller.on_call`` builds them, field by field by name
 * (``_record.h``, generated from the op record's declaration in record.py); fields this
 * path does not produce get their declared defaults. The labeller's changing state (``Labeller._live``: the stack top's root, the
 * stack key, the layer count) is a list both read and advance, so they share it.
 * A failure after the call is reported to ``on_error`` and never reaches the forward
 * pass, as in Python. Python 3.11+ C API only; no torch headers.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <math.h>
#include <string.h>

#include "_record.h" /* the row's fields by name, generated from recorder/record.py */

#define MAX_ITEMS 16 /* parents or parameters per call handled here; more go to Python */
#define SITE_SLOTS 64 /* call sites remembered, direct-mapped */
#define FUNC_SLOTS 32 /* functions' (name, writes) remembered, direct-mapped */
#define LIVE_ROOT 0     /* Labeller._live's items (labels._ROOT, ...) */
#define LIVE_STACK_KEY 1
#define LIVE_N_LAYERS 2

static PyObject *str_shape, *str_dtype,
    *str_device, *str_is_cpu, *str_op, *str_out, *str_inplace;
static PyObject *int_zero, *int_one, *int_minus_one, *empty_tuple;
static PyObject *single_where[MAX_ITEMS]; /* (0,), (1,), ...: shared like labels._SINGLE */
/* Row numbers and counters below SHARED_INTS are one object per value for the whole
 * process (made on first use), and so are the one-parent tuples of them: no int or tuple
 * is made per row for them, and the rows of a graph recorded again hold the very objects
 * the earlier rows held, so OpTable.finish's comparison of the two is identity checks. */
#define SHARED_INTS 65536
static PyObject *shared_ints[SHARED_INTS], *shared_singles[SHARED_INTS];
/* The device of CPU tensors: one object for every CPU row of every recording (the getter
 * makes a new one per call). */
static PyObject *cpu_device;

/* The last addresses met as keys of the producers dict (id(tensor)), each with its int:
 * the tensor an op returns is most often the next op's argument, and then the same int
 * object is looked up that was stored (no int made, and the dict matches it by
 * identity). An entry is only ever an address with the int of its value. */
#define ID_SLOTS 256
static struct {
    const void *address;
    PyObject *key;
} id_keys[ID_SLOTS];

/* id(obj) as an int. New reference. */
static PyObject *id_key(PyObject *obj) {
    size_t slot = ((uintptr_t)obj >> 4) % ID_SLOTS;
    if (id_keys[slot].address == obj && id_keys[slot].key) {
        Py_INCREF(id_keys[slot].key);
        return id_keys[slot].key;
    }
    PyObject *key = PyLong_FromVoidPtr(obj);
    if (!key) return NULL;
    Py_INCREF(key);
    Py_XSETREF(id_keys[slot].key, key);
    id_keys[slot].address = obj;
    return key;
}

/* The int ``v`` (shared below SHARED_INTS). New reference. */
static PyObject *shared_int(Py_ssize_t v) {
    if (v < 0 || v >= SHARED_INTS) return PyLong_FromSsize_t(v);
    PyObject *o = shared_ints[v];
    if (!o && !(o = shared_ints[v] = PyLong_FromSsize_t(v))) return NULL;
    Py_INCREF(o);
    return o;
}

/* ``count + 1`` (shared below SHARED_INTS). New reference. */
static PyObject *next_int(PyObject *count) {
    if (PyLong_CheckExact(count)) {
        Py_ssize_t v = PyLong_AsSsize_t(count);
        if (v >= 0 && v < PY_SSIZE_T_MAX) return shared_int(v + 1);
        if (PyErr_Occurred()) PyErr_Clear();
    }
    return PyNumber_Add(count, int_one);
}

/* ``(v,)`` for the int ``item`` == v (shared below SHARED_INTS); NULL without an error
 * set when ``item`` is no such int. New reference. */
static PyObject *shared_single(PyObject *item) {
    if (!PyLong_CheckExact(item)) return NULL;
    Py_ssize_t v = PyLong_AsSsize_t(item);
    if (v < 0 || v >= SHARED_INTS) {
        PyErr_Clear();
        return NULL;
    }
    PyObject *t = shared_singles[v];
    if (!t) {
        PyObject *o = shared_int(v);
        if (!o) return NULL;
        t = PyTuple_Pack(1, o);
        Py_DECREF(o);
        if (!t) return NULL;
        PyObject_GC_UnTrack(t); /* an int in it: nothing for the GC to follow */
        shared_singles[v] = t;
    }
    Py_INCREF(t);
    return t;
}

typedef struct {
    PyObject_HEAD
    PyObject *state;     /* Labeller._live: [root, stack key, layers so far] */
    PyObject *funcs;     /* func -> (name, writes) */
    PyObject *producers; /* id(tensor) -> row index */
    PyObject *refs;      /* row index -> weakref to its tensor */
    PyObject *params;    /* id(parameter or buffer) -> name */
    PyObject *rows;
    PyObject *shapes;    /* torch.Size -> shared tuple */
    PyObject *counts;    /* func name -> layers so far */
    PyObject *codes;     /* id(code) -> False | {offset: (code, offset)} */
    PyObject *classify;  /* code -> what codes[id(code)] becomes */
    PyObject *emit;      /* (index, tensor, -1) or None */
    PyObject *slow;      /* the Python __torch_function__, unbound */
    PyObject *record;    /* the Python handling of other outputs (_Mode._record), unbound */
    PyObject *on_error;  /* (what, exception) */
    PyObject *tensor_type;
    PyObject *row_defaults; /* record.ROW_DEFAULTS: a value for every row field */
    PyObject *value_types;  /* argkeys.VALUE_TYPES: non-tensor arguments kept as they are */
    PyObject *empty_list;   /* argkeys.EMPTY_LIST: what a row keeps for an empty list */
    /* torch.Tensor's own shape, dtype and device getters, called directly on tensors of
     * exactly that type (they are data descriptors: nothing on the instance hides them) */
    PyObject *get_shape, *get_dtype, *get_device, *get_is_cpu;
    /* The last call sites met in user code: (code, bytecode offset) -> the shared site,
     * so a loop's calls skip the dictionaries. Strong references, dropped by unbind. */
    struct {
        PyObject *code;
        int lasti;
        PyObject *site;
    } sites[SITE_SLOTS];
    /* The last functions called: func -> funcs[func]. Strong references. */
    struct {
        PyObject *func;
        PyObject *known;
    } funcs_seen[FUNC_SLOTS];
    PyObject *last_shape; /* the previous op's shape tuple: the next one is often equal */
    PyObject *call; /* this mode's FusedCall, made on torch's first look-up (Fused_getattr) */
    int plain_defaults; /* no row default is a tracked object (bind): settle_row may skip them */
} Fused;

#define FIELDS(X)                                                                        \
    X(state) X(funcs) X(producers) X(refs) X(params) X(rows) X(shapes) X(counts)         \
        X(codes) X(classify) X(emit) X(slow) X(record) X(on_error) X(tensor_type)        \
            X(row_defaults) X(value_types) X(empty_list) \
                X(get_shape) X(get_dtype) X(get_device) X(get_is_cpu) X(last_shape) X(call)

/* Every reference a Fused holds, for X(field) statements: the fields, then the slots. */
#define EACH_REF(X)                                                                        \
    do {                                                                                   \
        FIELDS(X)                                                                          \
        for (int k = 0; k < SITE_SLOTS; k++) {                                             \
            X(sites[k].code) X(sites[k].site)                                              \
        }                                                                                  \
        for (int k = 0; k < FUNC_SLOTS; k++) {                                             \
            X(funcs_seen[k].func) X(funcs_seen[k].known)                                   \
        }                                                                                  \
    } while (0)

static int Fused_traverse(Fused *self, visitproc visit, void *arg) {
#define VISIT(f) Py_VISIT(self->f);
    EACH_REF(VISIT);
#undef VISIT
    return 0;
}

/* How many rows the last recording made: the next, most often of the same model, has
 * its rows and refs lists reserved that long at bind (a list grown one append at a
 * time is reallocated and copied again and again; benchmarks/instructions.py). */
#define RESERVE_MAX ((Py_ssize_t)1 << 20)
static Py_ssize_t rows_hint = 0;

/* Room for n items in a list, as its own growth would make (best effort). */
static void reserve(PyObject *list, Py_ssize_t n) {
#ifndef Py_GIL_DISABLED
    PyListObject *l = (PyListObject *)list;
    if (!PyList_CheckExact(list) || n <= l->allocated || n > RESERVE_MAX)
        return;
    PyObject **items = PyMem_Realloc(l->ob_item, (size_t)n * sizeof(PyObject *));
    if (!items) return; /* (no exception set: the appends grow it as usual) */
    l->ob_item = items;
    l->allocated = n;
#endif
}

static int Fused_clear(Fused *self) {
    if (self->rows && PyList_Check(self->rows)) rows_hint = PyList_GET_SIZE(self->rows);
#define CLEAR(f) Py_CLEAR(self->f);
    EACH_REF(CLEAR);
#undef CLEAR
    return 0;
}

static void Fused_dealloc(Fused *self) {
    PyObject_GC_UnTrack(self);
    Fused_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static void settle(PyObject *t, int depth);
static int stays_tracked(PyObject *item, int depth);
static PyObject *Fused_getattr(Fused *self, char *name);

static PyObject *Fused_bind(Fused *self, PyObject *args) {
    PyObject *v[17];
    if (!PyArg_UnpackTuple(args, "bind", 17, 17, &v[0], &v[1], &v[2], &v[3], &v[4], &v[5],
                           &v[6], &v[7], &v[8], &v[9], &v[10], &v[11], &v[12], &v[13],
                           &v[14], &v[15], &v[16]))
        return NULL;
    if (!PyList_CheckExact(v[0]) || PyList_GET_SIZE(v[0]) != 3 || !PyDict_Check(v[1]) || !PyDict_Check(v[2]) ||
        !PyList_Check(v[3]) || !PyDict_Check(v[4]) || !PyList_Check(v[5]) ||
        !PyDict_Check(v[6]) || !PyDict_Check(v[7]) || !PyDict_Check(v[8]) ||
        !PyType_Check(v[14]) || !PyTuple_CheckExact(v[15]) ||
        PyTuple_GET_SIZE(v[15]) != ROW_WIDTH || !PyTuple_CheckExact(v[16]) ||
        PyTuple_GET_SIZE(v[16]) != 2 || !PyTuple_CheckExact(PyTuple_GET_ITEM(v[16], 0))) {
        PyErr_SetString(PyExc_TypeError, "Fused.bind: wrong container types");
        return NULL;
    }
    PyObject *getters[4];
    PyObject *names[4] = {str_shape, str_dtype, str_device, str_is_cpu};
    for (int k = 0; k < 4; k++) {
        getters[k] = PyObject_GetAttr(v[14], names[k]);
        if (getters[k] && !Py_TYPE(getters[k])->tp_descr_get) Py_CLEAR(getters[k]);
        if (!getters[k]) {
            for (int j = 0; j < k; j++) Py_DECREF(getters[j]);
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "Fused.bind: tensor getters not found");
            return NULL;
        }
    }
    Fused_clear(self);
    PyObject **slots[16] = {&self->state, &self->funcs, &self->producers, &self->refs,
                            &self->params, &self->rows, &self->shapes, &self->counts,
                            &self->codes, &self->classify, &self->emit, &self->slow,
                            &self->record, &self->on_error, &self->tensor_type,
                            &self->row_defaults};
    for (int k = 0; k < 16; k++) {
        Py_INCREF(v[k]);
        *slots[k] = v[k];
    }
    /* A Python subclass (intercept._FusedMode) does not inherit tp_getattr (its class
     * statement sets tp_getattro): it gets Fused's, which answers torch's look-ups as
     * the generic one would, where the generic one is what its instances use. */
    PyTypeObject *type = Py_TYPE(self);
    if (!type->tp_getattr && type->tp_getattro == PyObject_GenericGetAttr)
        type->tp_getattr = (getattrfunc)Fused_getattr;
    reserve(self->rows, rows_hint);
    reserve(self->refs, rows_hint);
    self->value_types = PyTuple_GET_ITEM(v[16], 0); /* argkeys.KEPT */
    self->empty_list = PyTuple_GET_ITEM(v[16], 1);
    self->plain_defaults = 1;
    for (Py_ssize_t k = 0; k < ROW_WIDTH; k++)
        if (stays_tracked(PyTuple_GET_ITEM(self->row_defaults, k), 0)) self->plain_defaults = 0;
    Py_INCREF(self->value_types);
    Py_INCREF(self->empty_list);
    self->get_shape = getters[0];
    self->get_dtype = getters[1];
    self->get_device = getters[2];
    self->get_is_cpu = getters[3];
    Py_RETURN_NONE;
}

static PyObject *Fused_unbind(Fused *self, PyObject *Py_UNUSED(ignored)) {
    Fused_clear(self);
    Py_RETURN_NONE;
}

/* The whole call, in Python: slow(self, *a, **kw). */
static PyObject *call_slow(Fused *self, PyObject *slow, PyObject *const *a, Py_ssize_t nargs,
                           PyObject *kwnames) {
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    PyObject *small[8];
    PyObject **stack = small;
    if (nargs + nkw + 1 > 8) {
        stack = PyMem_Malloc((nargs + nkw + 1) * sizeof(PyObject *));
        if (!stack) return PyErr_NoMemory();
    }
    stack[0] = (PyObject *)self;
    for (Py_ssize_t k = 0; k < nargs + nkw; k++) stack[k + 1] = a[k];
    PyObject *out = PyObject_Vectorcall(slow, stack, nargs + 1, kwnames);
    if (stack != small) PyMem_Free(stack);
    return out;
}

/* Report the pending exception to on_error(name, exc), as the Python code's
 * ``except Exception``; anything else (KeyboardInterrupt) stays raised. 0 if reported. */
static int report(Fused *self, PyObject *name) {
    if (!PyErr_ExceptionMatches(PyExc_Exception)) return -1;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb && value) PyException_SetTraceback(value, tb);
    PyObject *r = self->on_error ? PyObject_CallFunctionObjArgs(self->on_error, name,
                                                                 value ? value : Py_None, NULL)
                                 : NULL;
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    if (!r) return -1;
    Py_DECREF(r);
    return 0;
}

/* The user's call site: (code, offset) of the first frame outside torch and tracelake,
 * shared per site; None if there is none. New reference, NULL on error. */
static PyObject *find_site(Fused *self) {
    PyFrameObject *frame = PyEval_GetFrame();
    if (!frame) Py_RETURN_NONE;
    Py_INCREF(frame);
    int first = 1;
    while (frame) {
        PyCodeObject *code = PyFrame_GetCode(frame);
        int lasti = PyFrame_GetLasti(frame);
        size_t slot = (((uintptr_t)code >> 4) ^ ((size_t)lasti * 40503u)) % SITE_SLOTS;
        if (first && self->sites[slot].code == (PyObject *)code &&
            self->sites[slot].lasti == lasti) { /* the innermost frame is this user site */
            PyObject *site = self->sites[slot].site;
            Py_INCREF(site);
            Py_DECREF(code);
            Py_DECREF(frame);
            return site;
        }
        PyObject *key = PyLong_FromVoidPtr(code);
        if (!key) goto fail_code;
        PyObject *sites = PyDict_GetItemWithError(self->codes, key);
        Py_DECREF(key);
        if (sites) {
            Py_INCREF(sites);
        } else {
            if (PyErr_Occurred()) goto fail_code;
            sites = PyObject_CallOneArg(self->classify, (PyObject *)code);
            if (!sites) goto fail_code;
        }
        if (sites != Py_False) {
            PyObject *site = NULL;
            PyObject *offset = PyLong_FromLong(lasti);
            if (offset && PyDict_Check(sites)) {
                site = PyDict_GetItemWithError(sites, offset);
                if (site) {
                    Py_INCREF(site);
                } else if (!PyErr_Occurred()) {
                    site = PyTuple_Pack(2, (PyObject *)code, offset);
                    if (site && PyDict_SetItem(sites, offset, site) < 0) Py_CLEAR(site);
                }
            } else if (offset) {
                PyErr_SetString(PyExc_TypeError, "SourceFinder: sites must be a dict");
            }
            if (site && first) { /* remember it: the site depends on this frame alone */
                Py_INCREF(code);
                Py_INCREF(site);
                Py_XSETREF(self->sites[slot].code, (PyObject *)code);
                Py_XSETREF(self->sites[slot].site, site);
                self->sites[slot].lasti = lasti;
            }
            Py_XDECREF(offset);
            Py_DECREF(sites);
            Py_DECREF(code);
            Py_DECREF(frame);
            return site;
        }
        Py_DECREF(sites);
        Py_DECREF(code);
        PyFrameObject *back = PyFrame_GetBack(frame);
        Py_DECREF(frame);
        frame = back;
        first = 0;
        continue;
    fail_code:
        Py_DECREF(code);
        Py_DECREF(frame);
        return NULL;
    }
    Py_RETURN_NONE;
}

typedef struct {
    PyObject *parents[MAX_ITEMS]; /* owned row indices */
    PyObject *where[MAX_ITEMS];   /* owned positions (ints) or keyword names */
    PyObject *params[MAX_ITEMS];  /* owned parameter names */
    PyObject *values[2 * MAX_ITEMS]; /* owned (position or keyword, value) pairs, flat */
    Py_ssize_t n_parents, n_params, n_values;
    Py_ssize_t single_pos;        /* the one parent's position, if positional, else -1 */
} Scan;

static void scan_free(Scan *s) {
    for (Py_ssize_t k = 0; k < s->n_parents; k++) {
        Py_DECREF(s->parents[k]);
        Py_DECREF(s->where[k]);
    }
    for (Py_ssize_t k = 0; k < s->n_params; k++) Py_DECREF(s->params[k]);
    for (Py_ssize_t k = 0; k < s->n_values; k++) Py_DECREF(s->values[k]);
    s->n_parents = s->n_params = s->n_values = 0;
}

/* Whether weak reference ``ref`` still points at ``value`` (an object alive here). */
static int referent_is(PyObject *ref, PyObject *value) {
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *obj = NULL;
    if (PyWeakref_GetRef(ref, &obj) < 0) {
        PyErr_Clear();
        return 0;
    }
    Py_XDECREF(obj); /* value is alive (an argument), so obj == value stays meaningful */
    return obj == value;
#else
    return PyWeakref_GET_OBJECT(ref) == value;
#endif
}

/* A non-tensor argument, kept with its position or keyword for the row's arg_values
 * (recorder/argkeys.py). 1: kept, 0: too many (the Python path). */
static int keep_value(Scan *s, PyObject *value, PyObject *where) {
    if (s->n_values >= 2 * MAX_ITEMS) return 0;
    Py_INCREF(where);
    Py_INCREF(value);
    s->values[s->n_values++] = where;
    s->values[s->n_values++] = value;
    return 1;
}

/* Whether ``value``'s class is one of argkeys.VALUE_TYPES (kept as it is, as Python's
 * argkeys.capture keeps it; an empty list is kept as argkeys.EMPTY_LIST). */
static int value_type(Fused *self, PyObject *value) {
    PyObject *types = self->value_types;
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(types); k++)
        if ((PyObject *)Py_TYPE(value) == PyTuple_GET_ITEM(types, k)) return 1;
    return 0;
}

/* Whether ``value`` is None, a bool, or exactly an int, a float or a str. */
static int scalar_value(PyObject *value) {
    return value == Py_None || PyLong_CheckExact(value) || PyFloat_CheckExact(value) ||
           PyBool_Check(value) || PyUnicode_CheckExact(value);
}

/* Whether a row keeps ``value`` as it is: a scalar or one of argkeys.VALUE_TYPES
 * (argkeys._PLAIN, by exact class). */
static int plain_value(Fused *self, PyObject *value) {
    return scalar_value(value) || value_type(self, value);
}

/* One argument. 1: scanned, 0: the call needs the Python path, -1: error. */
static int scan_value(Fused *self, Scan *s, PyObject *value, PyObject *where) {
    if (scalar_value(value)) return keep_value(s, value, where);
    if (PyTuple_CheckExact(value)) {
        /* a tuple of plain values (x.view((b, -1)), layer_norm's normalized_shape): kept
         * as it is, as argkeys.capture keeps it; tensors or anything else inside: Python */
        for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(value); k++)
            if (!plain_value(self, PyTuple_GET_ITEM(value, k))) return 0;
        return keep_value(s, value, where);
    }
    if (PyList_CheckExact(value) && PyList_GET_SIZE(value) == 0)
        return keep_value(s, self->empty_list, where);
    if (PyList_CheckExact(value))
        return 0; /* tensors inside lists, a list Python keeps by its tokens: Python */
    if (!PyObject_TypeCheck(value, (PyTypeObject *)self->tensor_type))
        return value_type(self, value) ? keep_value(s, value, where) : 0;
    if (s->n_parents >= MAX_ITEMS || s->n_params >= MAX_ITEMS) return 0;
    PyObject *key = id_key(value);
    if (!key) return -1;
    PyObject *index = PyDict_GetItemWithError(self->producers, key);
    if (index) {
        Py_ssize_t i = PyLong_AsSsize_t(index);
        if (i == -1 && PyErr_Occurred()) goto fail;
        if (i >= 0 && i < PyList_GET_SIZE(self->refs)) {
            PyObject *ref = PyList_GET_ITEM(self->refs, i);
            if (PyWeakref_Check(ref) && referent_is(ref, value)) {
                Py_INCREF(index);
                Py_INCREF(where);
                s->parents[s->n_parents] = index;
                s->where[s->n_parents++] = where;
                Py_DECREF(key);
                return 1;
            }
        }
    } else if (PyErr_Occurred()) {
        goto fail;
    }
    PyObject *param = PyDict_GetItemWithError(self->params, key);
    if (param && !PyUnicode_CheckExact(param)) {
        Py_DECREF(key);
        return 0; /* a buffer's first read: the Python path makes its entry */
    }
    if (param) {
        Py_INCREF(param);
        s->params[s->n_params++] = param;
    } else if (PyErr_Occurred()) {
        goto fail;
    }
    Py_DECREF(key);
    return 1;
fail:
    Py_DECREF(key);
    return -1;
}

/* All arguments; same results as Labeller.on_call's loop and _scan_more. */
static int scan(Fused *self, Scan *s, PyObject *args, PyObject *kwargs) {
    s->n_parents = s->n_params = s->n_values = 0;
    s->single_pos = -1;
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    for (Py_ssize_t pos = 0; pos < n; pos++) {
        PyObject *where = PyLong_FromSsize_t(pos);
        if (!where) return -1;
        Py_ssize_t before = s->n_parents;
        int r = scan_value(self, s, PyTuple_GET_ITEM(args, pos), where);
        Py_DECREF(where);
        if (r <= 0) return r;
        if (before == 0 && s->n_parents == 1) s->single_pos = pos;
    }
    if (kwargs) {
        Py_ssize_t it = 0;
        PyObject *key, *value;
        while (PyDict_Next(kwargs, &it, &key, &value)) {
            /* out= and inplace=True write in place: the Python path */
            if (key == str_out || key == str_inplace ||
                (PyUnicode_Check(key) && (PyUnicode_Compare(key, str_out) == 0 ||
                                          PyUnicode_Compare(key, str_inplace) == 0)))
                return 0;
            int r = scan_value(self, s, value, key);
            if (r <= 0) return r;
        }
    }
    return 1;
}

/* A tuple of ints and strs (parents, positions, parameter names): the GC never needs
 * to look at it, so it is untracked at once. */
static PyObject *tuple_of(PyObject **items, Py_ssize_t n) {
    PyObject *t = PyTuple_New(n);
    if (!t) return NULL;
    int plain = 1;
    for (Py_ssize_t k = 0; k < n; k++) {
        Py_INCREF(items[k]);
        PyTuple_SET_ITEM(t, k, items[k]);
        plain &= !PyObject_IS_GC(items[k]);
    }
    if (n && plain) PyObject_GC_UnTrack(t);
    return t;
}

/* A row's arg_values of up to VALUE_KEY items: one tuple per distinct set of argument
 * objects met lately (direct-mapped, strong references), so that a loop's ``x * 0.5``
 * rows share one tuple, made once, and a graph recorded again holds the very tuples the
 * earlier rows held (identity checks in same_rows). */
#define VALUE_SLOTS 64
#define VALUE_KEY 4
static struct {
    Py_ssize_t n;
    PyObject *items[VALUE_KEY];
    PyObject *tuple;
} value_cache[VALUE_SLOTS];

/* The row's arg_values: None when the call had only tensor arguments. New reference. */
static PyObject *values_of(Scan *s) {
    Py_ssize_t n = s->n_values;
    if (n == 0) {
        Py_INCREF(Py_None);
        return Py_None;
    }
    if (n > VALUE_KEY) return tuple_of(s->values, n);
    uintptr_t h = 0;
    for (Py_ssize_t k = 0; k < n; k++) h = h * 31 + ((uintptr_t)s->values[k] >> 4);
    size_t slot = h % VALUE_SLOTS;
    if (value_cache[slot].tuple && value_cache[slot].n == n) {
        Py_ssize_t k = 0;
        while (k < n && value_cache[slot].items[k] == s->values[k]) k++;
        if (k == n) {
            Py_INCREF(value_cache[slot].tuple);
            return value_cache[slot].tuple;
        }
    }
    PyObject *t = tuple_of(s->values, n);
    if (!t) return NULL;
    Py_CLEAR(value_cache[slot].tuple);
    for (Py_ssize_t k = 0; k < value_cache[slot].n; k++) Py_CLEAR(value_cache[slot].items[k]);
    for (Py_ssize_t k = 0; k < n; k++) {
        Py_INCREF(s->values[k]);
        value_cache[slot].items[k] = s->values[k];
    }
    value_cache[slot].n = n;
    Py_INCREF(t);
    value_cache[slot].tuple = t;
    return t;
}

/* An attribute of ``out`` read through torch.Tensor's own getter when ``out`` is exactly
 * a torch.Tensor (no subclass can hide it then), else as Python reads it. */
static PyObject *tensor_attr(Fused *self, PyObject *out, PyObject *getter, PyObject *name) {
    if (Py_TYPE(out) == (PyTypeObject *)self->tensor_type)
        return Py_TYPE(getter)->tp_descr_get(getter, out, self->tensor_type);
    return PyObject_GetAttr(out, name);
}

/* Stop the GC from tracking a tuple (and tuples in it, two levels down) whose items are
 * all untracked: what a collection would conclude about it anyway, without the
 * collections having to look at every row first. Rows hold only such values. */
static void settle(PyObject *t, int depth) {
    if (!PyObject_GC_IsTracked(t)) return;
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(t); k++)
        if (stays_tracked(PyTuple_GET_ITEM(t, k), depth)) return;
    PyObject_GC_UnTrack(t);
}

/* Whether ``item`` is, after settling it (``depth`` levels of tuples below it), a tracked
 * object: one that keeps a tuple holding it tracked. */
static int stays_tracked(PyObject *item, int depth) {
    PyTypeObject *type = Py_TYPE(item);
    /* PyObject_IS_GC, inline (a call per field was most of settle's cost) */
    if (!PyType_IS_GC(type) || (type->tp_is_gc && !type->tp_is_gc(item)))
        return 0; /* str, int, dtype, device: never tracked */
    if (!PyObject_GC_IsTracked(item)) return 0;
    if (depth == 0 || !PyTuple_CheckExact(item)) return 1;
    settle(item, depth - 1);
    return PyObject_GC_IsTracked(item);
}

/* The fields of a row add_row makes that may hold a tracked object: the others hold its
 * own ints, strs and bools (kind, out index, in place, layer index, pass, counters), or
 * the row defaults (bind checks them: plain_defaults). */
static const int ROW_OBJECTS[] = {ROW_FUNC,    ROW_MODULES, ROW_SHAPE,       ROW_DTYPE,
                                  ROW_DEVICE,  ROW_PARAMS,  ROW_PARENTS,     ROW_PARENT_ARGS,
                                  ROW_SITE,    ROW_ARG_VALUES};

/* settle(row, 2) for a row add_row made, looking only at the fields that may need it
 * (most of settle's cost was the walk over every field). */
static void settle_row(Fused *self, PyObject *row) {
    if (!self->plain_defaults) {
        settle(row, 2);
        return;
    }
    for (size_t k = 0; k < sizeof ROW_OBJECTS / sizeof ROW_OBJECTS[0]; k++) {
        PyObject *item = PyTuple_GET_ITEM(row, ROW_OBJECTS[k]);
        PyTypeObject *type = Py_TYPE(item);
        if (!PyType_IS_GC(type) || (type->tp_is_gc && !type->tp_is_gc(item)) ||
            !PyObject_GC_IsTracked(item))
            continue; /* (stays_tracked's first tests, inline: most fields end here) */
        if (stays_tracked(item, 2)) return;
    }
    PyObject_GC_UnTrack(row);
}

static PyObject *shape_lookup(Fused *self, PyObject *size);

/* Shape tuples, one object per value for the whole process (bounded: forgotten past
 * SHARED_SHAPES), so that rows of a graph recorded again hold the very shapes the earlier
 * rows held, as they do the row numbers (shared_int). */
#define SHARED_SHAPES 4096
static PyObject *shared_shapes; /* tuple -> itself */

/* The process's tuple equal to ``shape`` (a new reference to a tuple of ints, stolen).
 * New reference, NULL on error. */
static PyObject *shared_shape(PyObject *shape) {
    if (!shared_shapes && !(shared_shapes = PyDict_New())) goto fail;
    if (PyDict_GET_SIZE(shared_shapes) >= SHARED_SHAPES) PyDict_Clear(shared_shapes);
    PyObject *known = PyDict_SetDefault(shared_shapes, shape, shape);
    if (!known) goto fail;
    Py_INCREF(known);
    Py_DECREF(shape);
    return known;
fail:
    Py_DECREF(shape);
    return NULL;
}

/* Shape as the shared tuple of its torch.Size. New reference. */
static PyObject *shape_of(Fused *self, PyObject *size) {
    PyObject *last = self->last_shape;
    if (last && PyTuple_Check(size) && PyTuple_GET_SIZE(size) == PyTuple_GET_SIZE(last)) {
        Py_ssize_t k = 0, n = PyTuple_GET_SIZE(last);
        for (; k < n; k++) {
            PyObject *a = PyTuple_GET_ITEM(size, k), *b = PyTuple_GET_ITEM(last, k);
            if (a == b) continue;
            if (!PyLong_CheckExact(a) || !PyLong_CheckExact(b)) break;
            Py_ssize_t x = PyLong_AsSsize_t(a), y = PyLong_AsSsize_t(b);
            if (x != y || (x == -1 && PyErr_Occurred())) break;
        }
        if (PyErr_Occurred()) return NULL;
        if (k == n) {
            Py_INCREF(last);
            return last;
        }
    }
    PyObject *shape = shape_lookup(self, size);
    if (shape) { /* one reference for the caller, one for last_shape */
        Py_INCREF(shape);
        Py_XSETREF(self->last_shape, shape);
    }
    return shape;
}

/* Shape from the shapes dict (made and remembered there if new). New reference. */
static PyObject *shape_lookup(Fused *self, PyObject *size) {
    PyObject *shape = PyDict_GetItemWithError(self->shapes, size);
    if (shape) { /* (the Python path's rows put their own tuples there) */
        Py_INCREF(shape);
        return PyTuple_CheckExact(shape) ? shared_shape(shape) : shape;
    }
    if (PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_TypeError)) return NULL;
        PyErr_Clear(); /* symbolic sizes are not hashable */
        return PySequence_Tuple(size);
    }
    shape = PySequence_Tuple(size);
    if (shape) shape = shared_shape(shape);
    if (shape && PyDict_SetItem(self->shapes, size, shape) < 0) Py_CLEAR(shape);
    return shape;
}

/* The fields add_row sets itself; the others (``defaulted``, found once by the module's
 * init) take the row defaults. */
static const int ROW_SET[] = {ROW_FUNC,     ROW_KIND,    ROW_MODULES, ROW_PARENTS,
                              ROW_PARENT_ARGS, ROW_SITE, ROW_ARG_VALUES, ROW_SHAPE,
                              ROW_DTYPE,    ROW_DEVICE,  ROW_OUT_INDEX, ROW_INPLACE,
                              ROW_PARAMS,   ROW_LAYER_IDX, ROW_PASS,  ROW_N_FUNC,
                              ROW_N_LAYER};
static int defaulted[ROW_WIDTH], n_defaulted;

static void find_defaulted(void) {
    n_defaulted = 0;
    for (int k = 0; k < ROW_WIDTH; k++) {
        int set = 0;
        for (size_t j = 0; j < sizeof ROW_SET / sizeof ROW_SET[0]; j++) set |= ROW_SET[j] == k;
        if (!set) defaulted[n_defaulted++] = k;
    }
}

/* Append the row of a new op producing ``out``. 0 on success. */
static int add_row(Fused *self, PyObject *name, PyObject *out, Scan *s) {
    int ok = -1;
    PyObject *site = NULL, *size = NULL, *shape = NULL, *dtype = NULL, *device = NULL,
             *parents = NULL, *where = NULL, *params = NULL, *index = NULL, *n_func = NULL,
             *n_layer = NULL, *row = NULL, *key = NULL, *ref = NULL, *values = NULL;
    site = find_site(self);
    if (!site) goto done;
    size = tensor_attr(self, out, self->get_shape, str_shape);
    if (!size) goto done;
    shape = shape_of(self, size);
    if (!shape) goto done;
    dtype = tensor_attr(self, out, self->get_dtype, str_dtype);
    if (!dtype) goto done;
    /* A CPU tensor's device: the one device object every CPU row shares (the getter
     * would make a new one per call, and each row would keep its own). */
    int exact = Py_TYPE(out) == (PyTypeObject *)self->tensor_type, on_cpu = 0;
    if (exact) {
        PyObject *is_cpu = Py_TYPE(self->get_is_cpu)->tp_descr_get(self->get_is_cpu, out,
                                                                   self->tensor_type);
        if (!is_cpu) goto done;
        on_cpu = is_cpu == Py_True;
        Py_DECREF(is_cpu);
    }
    if (on_cpu && cpu_device) {
        device = cpu_device;
        Py_INCREF(device);
    } else {
        device = tensor_attr(self, out, self->get_device, str_device);
        if (!device) goto done;
        if (on_cpu) {
            Py_INCREF(device);
            cpu_device = device;
        }
    }
    if (PyList_GET_SIZE(self->state) != 3) {
        PyErr_SetString(PyExc_ValueError, "labeller state has changed shape");
        goto done;
    }
    PyObject *stack_key = PyList_GET_ITEM(self->state, LIVE_STACK_KEY);
    PyObject *n_layers = PyList_GET_ITEM(self->state, LIVE_N_LAYERS);
    parents = s->n_parents == 1 ? shared_single(s->parents[0]) : NULL;
    if (!parents && !PyErr_Occurred()) parents = tuple_of(s->parents, s->n_parents);
    if (!parents) goto done;
    if (s->n_parents == 1 && s->single_pos >= 0 && s->single_pos < MAX_ITEMS) {
        where = single_where[s->single_pos];
        Py_INCREF(where);
    } else {
        where = tuple_of(s->where, s->n_parents);
    }
    if (!where) goto done;
    params = tuple_of(s->params, s->n_params);
    if (!params) goto done;
    values = values_of(s);
    if (!values) goto done;
    index = shared_int(PyList_GET_SIZE(self->rows));
    if (!index) goto done;
    PyObject *count = PyDict_GetItemWithError(self->counts, name);
    if (!count && PyErr_Occurred()) goto done;
    n_func = count ? next_int(count) : (Py_INCREF(int_one), int_one);
    if (!n_func) goto done;
    n_layer = next_int(n_layers);
    if (!n_layer) goto done;
    row = PyTuple_New(ROW_WIDTH);
    if (!row) goto done;
#define SET(field, value) (Py_INCREF(value), PyTuple_SET_ITEM(row, ROW_##field, (value)))
    /* (every field below is in ROW_SET: the rest are filled from the defaults) */
    SET(FUNC, name);
    SET(KIND, str_op);
    SET(MODULES, stack_key);
    SET(PARENTS, parents);
    SET(PARENT_ARGS, where);
    SET(SITE, site);
    SET(ARG_VALUES, values);
    SET(SHAPE, shape);
    SET(DTYPE, dtype);
    SET(DEVICE, device);
    SET(OUT_INDEX, int_zero);
    SET(INPLACE, Py_False);
    SET(PARAMS, params);
    SET(LAYER_IDX, index);
    SET(PASS, int_one);
    SET(N_FUNC, n_func);
    SET(N_LAYER, n_layer);
#undef SET
    for (int j = 0; j < n_defaulted; j++) { /* (the fields not SET above) */
        PyObject *value = PyTuple_GET_ITEM(self->row_defaults, defaulted[j]);
        Py_INCREF(value);
        PyTuple_SET_ITEM(row, defaulted[j], value);
    }
    settle_row(self, row);
    key = id_key(out);
    if (!key) goto done;
    ref = PyWeakref_NewRef(out, NULL);
    if (!ref) goto done;
    /* Everything that can fail for want of memory or a weak reference is done: mutate. */
    if (PyDict_SetItem(self->counts, name, n_func) < 0 ||
        (Py_INCREF(n_layer), PyList_SetItem(self->state, LIVE_N_LAYERS, n_layer)) < 0 ||
        PyList_Append(self->rows, row) < 0 || PyDict_SetItem(self->producers, key, index) < 0 ||
        PyList_Append(self->refs, ref) < 0)
        goto done;
    if (self->emit && self->emit != Py_None) {
        PyObject *stack[3] = {index, out, int_minus_one};
        PyObject *r = PyObject_Vectorcall(self->emit, stack, 3, NULL);
        if (!r) goto done;
        Py_DECREF(r);
    }
    ok = 0;
done:
    Py_XDECREF(site);
    Py_XDECREF(size);
    Py_XDECREF(shape);
    Py_XDECREF(dtype);
    Py_XDECREF(device);
    Py_XDECREF(parents);
    Py_XDECREF(where);
    Py_XDECREF(params);
    Py_XDECREF(values);
    Py_XDECREF(index);
    Py_XDECREF(n_func);
    Py_XDECREF(n_layer);
    Py_XDECREF(row);
    Py_XDECREF(key);
    Py_XDECREF(ref);
    return ok;
}

/* __torch_function__(func, types, args=(), kwargs=None) */
static PyObject *Fused_torch_function(Fused *self, PyObject *const *a, size_t nargsf,
                                      PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (!self->slow) {
        PyErr_SetString(PyExc_RuntimeError, "tracelake's fused mode is not bound");
        return NULL;
    }
    if (kwnames || nargs < 2 || nargs > 4) return call_slow(self, self->slow, a, nargs, kwnames);
    PyObject *func = a[0];
    PyObject *args = nargs > 2 ? a[2] : empty_tuple;
    PyObject *kwargs = nargs > 3 ? a[3] : NULL;
    if (kwargs == Py_None) kwargs = NULL;
    if (!PyTuple_CheckExact(args) || (kwargs && !PyDict_CheckExact(kwargs))) goto slow;
    if (kwargs && PyDict_GET_SIZE(kwargs) == 0) kwargs = NULL;
    size_t slot = ((uintptr_t)func >> 4) % FUNC_SLOTS;
    PyObject *known = self->funcs_seen[slot].known;
    if (self->funcs_seen[slot].func != func) {
        known = PyDict_GetItemWithError(self->funcs, func);
        if (!known) {
            PyErr_Clear(); /* unnamed yet, or unhashable: Python names it (or raises) */
            goto slow;
        }
        Py_INCREF(func);
        Py_INCREF(known);
        Py_XSETREF(self->funcs_seen[slot].func, func);
        Py_XSETREF(self->funcs_seen[slot].known, known);
    }
    if (!PyTuple_CheckExact(known) || PyTuple_GET_SIZE(known) != 2 ||
        PyTuple_GET_ITEM(known, 1) != Py_False)
        goto slow; /* writes in place: Python warns the emitter first */
    if (PyList_GET_SIZE(self->state) != 3 || PyList_GET_ITEM(self->state, LIVE_ROOT) != Py_None)
        goto slow; /* inside a repeated module call: Python matches the first call */
    Scan s;
    int r = scan(self, &s, args, kwargs);
    if (r <= 0) {
        scan_free(&s);
        if (r < 0) PyErr_Clear();
        goto slow;
    }
    PyObject *name = PyTuple_GET_ITEM(known, 0);
    Py_INCREF(name); /* the call may run code that changes funcs */
    PyObject *out = PyObject_Call(func, args, kwargs);
    if (!out) {
        /* the user's call raised: it propagates unchanged */
    } else if (Py_IS_TYPE(out, (PyTypeObject *)self->tensor_type)) {
        if (add_row(self, name, out, &s) < 0 && report(self, name) < 0) Py_CLEAR(out);
    } else if (PyTuple_Check(out) || PyList_Check(out) ||
               PyObject_TypeCheck(out, (PyTypeObject *)self->tensor_type)) {
        /* several outputs, or a subclass's (a parameter handed back is no output): the
         * Python code flattens and labels them, or reports */
        PyObject *no_kwargs = kwargs ? (Py_INCREF(kwargs), kwargs) : PyDict_New();
        PyObject *res = NULL;
        if (no_kwargs) {
            PyObject *stack[7] = {(PyObject *)self, name, func, args, no_kwargs, out, Py_False};
            res = PyObject_Vectorcall(self->record, stack, 7, NULL);
            Py_DECREF(no_kwargs);
        }
        Py_DECREF(out);
        out = res;
    }
    scan_free(&s);
    Py_DECREF(name);
    return out;
slow:
    return call_slow(self, self->slow, a, nargs, kwnames);
}

static PyMethodDef Fused_methods[] = {
    {"__torch_function__", (PyCFunction)(void (*)(void))Fused_torch_function,
     METH_FASTCALL | METH_KEYWORDS,
     "The common torch call, recorded here; the rest goes to the Python mode."},
    {"bind", (PyCFunction)Fused_bind, METH_VARARGS,
     "bind(state, funcs, producers, refs, params, rows, shapes, counts, codes, classify, "
     "emit, slow, record, on_error, tensor_type, row_defaults)"},
    {"unbind", (PyCFunction)Fused_unbind, METH_NOARGS, "Drop every reference bind took."},
    {NULL},
};

static PyObject *Fused_is_bound(Fused *self, void *Py_UNUSED(closure)) {
    return PyBool_FromLong(self->slow != NULL);
}

static PyGetSetDef Fused_getset[] = {
    {"bound", (getter)Fused_is_bound, NULL, "Whether bind() was called (and not unbind())."},
    {NULL},
};

/* ---- torch's look-ups of the mode's __torch_function__ ------------------------------
 * For every call, torch (torch/csrc/utils/python_strings.h, PyObject_FastGetAttrString,
 * before Python 3.13) looks up ``mode.__torch_function__`` and then that bound method's
 * ``__self__`` (a check that it is no classmethod), each through the type's
 * ``tp_getattr`` where it has one, else by making a new str of the name and the generic
 * look-up, which a new str misses the type's method cache with: two MRO walks, a bound
 * method made and freed (most of the chain's per-op cost over the bare mode, as
 * benchmarks/instructions.py counts it). A Fused answers the first with one FusedCall it keeps (``call``),
 * whose own tp_getattr answers ``__self__``; any other name, or a subclass that defines
 * its own ``__torch_function__``, takes Python's own look-up. Python code never sees
 * the difference: its look-ups go through tp_getattro, which stays the generic one.
 * (Not consulted: an instance attribute named ``__torch_function__``, which torch would
 * refuse anyway unless it were a method bound to the mode.) */
static PyObject *str_torch_function, *fused_tf; /* "__torch_function__", Fused's method */

typedef struct {
    PyObject_HEAD
    PyObject *mode; /* the Fused it calls */
    vectorcallfunc vectorcall;
} FusedCall;

static PyObject *Fused_torch_function(Fused *self, PyObject *const *a, size_t nargsf,
                                      PyObject *kwnames);

/* (mode is NULL only after the GC cleared a cycle no one can reach any more) */
static PyObject *FusedCall_vectorcall(FusedCall *self, PyObject *const *a, size_t nargsf,
                                      PyObject *kwnames) {
    if (!self->mode) {
        PyErr_SetString(PyExc_RuntimeError, "tracelake's fused mode is gone");
        return NULL;
    }
    return Fused_torch_function((Fused *)self->mode, a, nargsf, kwnames);
}

/* A name given as char *, as Python's generic look-up would answer it. */
static PyObject *getattr_string(PyObject *obj, const char *name) {
    PyObject *s = PyUnicode_InternFromString(name);
    if (!s) return NULL;
    PyObject *r = PyObject_GetAttr(obj, s);
    Py_DECREF(s);
    return r;
}

static PyObject *FusedCall_getattr(FusedCall *self, char *name) {
    if (self->mode && !strcmp(name, "__self__")) return Py_NewRef(self->mode);
    return getattr_string((PyObject *)self, name);
}

static int FusedCall_traverse(FusedCall *self, visitproc visit, void *arg) {
    Py_VISIT(self->mode);
    return 0;
}

static int FusedCall_clear(FusedCall *self) {
    Py_CLEAR(self->mode);
    return 0;
}

static void FusedCall_dealloc(FusedCall *self) {
    PyObject_GC_UnTrack(self);
    FusedCall_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *FusedCall_self(FusedCall *self, void *Py_UNUSED(closure)) {
    return Py_NewRef(self->mode ? self->mode : Py_None);
}

static PyGetSetDef FusedCall_getset[] = {
    {"__self__", (getter)FusedCall_self, NULL, "The mode it calls."},
    {NULL},
};

static PyTypeObject FusedCallType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tracelake.recorder._hot.FusedCall",
    .tp_basicsize = sizeof(FusedCall),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "A Fused mode's __torch_function__, bound, as torch looks it up.",
    .tp_vectorcall_offset = offsetof(FusedCall, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_getattr = (getattrfunc)FusedCall_getattr,
    .tp_getattro = PyObject_GenericGetAttr,
    .tp_getset = FusedCall_getset,
    .tp_traverse = (traverseproc)FusedCall_traverse,
    .tp_clear = (inquiry)FusedCall_clear,
    .tp_dealloc = (destructor)FusedCall_dealloc,
};

static PyObject *Fused_getattr(Fused *self, char *name) {
    if (!strcmp(name, "__torch_function__") &&
        _PyType_Lookup(Py_TYPE(self), str_torch_function) == fused_tf) {
        if (!self->call) {
            FusedCall *call = PyObject_GC_New(FusedCall, &FusedCallType);
            if (!call) return NULL;
            call->mode = Py_NewRef(self);
            call->vectorcall = (vectorcallfunc)FusedCall_vectorcall;
            PyObject_GC_Track(call);
            self->call = (PyObject *)call;
        }
        return Py_NewRef(self->call);
    }
    return getattr_string((PyObject *)self, name);
}

static PyTypeObject FusedType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tracelake.recorder._hot.Fused",
    .tp_basicsize = sizeof(Fused),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Base of the fused interception mode (see recorder/_hot.c).",
    .tp_traverse = (traverseproc)Fused_traverse,
    .tp_clear = (inquiry)Fused_clear,
    .tp_dealloc = (destructor)Fused_dealloc,
    .tp_getattr = (getattrfunc)Fused_getattr,
    .tp_getattro = PyObject_GenericGetAttr,
    .tp_methods = Fused_methods,
    .tp_getset = Fused_getset,
    .tp_new = PyType_GenericNew,
};

/* ------------------------------------------------------------------------------------
 * Packer: ``StoreEmitter.on_entry`` for the common small tensor, compiled.
 *
 * Saving every op (``save=None``) keeps each op's output as it is made; for a small one
 * (below ``small`` bytes: no alias to look for, no inner chunk to refer to) the Python
 * path is ``on_entry`` -> ``_keep`` -> ``TensorWriter.save``: a memmove into its pack's
 * open buffer and a slot tuple, behind four Python frames and some forty attribute
 * reads (~3-6 us an op, more than the op's recording). This does the same for a plain
 * contiguous CPU torch.Tensor of a dtype whose pack is planned and plain (a byte copy is
 * exact) when the pack's open chunk has room, and hands every other entry to the Python
 * ``fallback``, which stays the reference (tests/test_compiled.py compares the two). It
 * writes what the Python writes, in the same order: the tensor's bytes at the aligned
 * end of the open chunk, the stream's ``used`` and ``members``, the writer's slot tuple
 * (array, byte offset, nbytes, shape, dtype, step), the emitter's version and op slot.
 * Nothing is changed until everything that can fail has been made.
 */
/* torch.Tensor's getters (data descriptors, called straight) and methods that the
 * compiled entries (Packer, Reducer) read, looked up once on the type. */
typedef struct {
    PyObject *tensor_type;
    PyObject *get_layout, *get_is_cpu, *get_version, *get_nbytes, *get_dtype;
    PyObject *get_shape;
    PyObject *is_contiguous, *is_neg, *data_ptr, *stride;
} TensorAttrs;

#define TENSOR_ATTRS(X)                                                                    \
    X(t.tensor_type) X(t.get_layout) X(t.get_is_cpu) X(t.get_version) X(t.get_nbytes)      \
        X(t.get_dtype) X(t.get_shape) X(t.is_contiguous) X(t.is_neg) X(t.data_ptr) X(t.stride)

/* A compiled entry's tp_traverse, tp_clear and tp_dealloc, over the object fields that
 * REFS lists. */
#define GC_SLOTS(Type, REFS)                                                               \
    static int Type##_traverse(Type *self, visitproc visit, void *arg) {                   \
        REFS(GC_VISIT)                                                                      \
        return 0;                                                                           \
    }                                                                                       \
    static int Type##_clear(Type *self) {                                                  \
        REFS(GC_CLEAR)                                                                      \
        return 0;                                                                           \
    }                                                                                       \
    static void Type##_dealloc(Type *self) {                                               \
        PyObject_GC_UnTrack(self);                                                          \
        Type##_clear(self);                                                                 \
        Py_TYPE(self)->tp_free((PyObject *)self);                                           \
    }
#define GC_VISIT(f) Py_VISIT(self->f);
#define GC_CLEAR(f) Py_CLEAR(self->f);

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *fallback; /* the Python on_entry(index, tensor, same_as) */
    PyObject *writer;   /* TensorWriter: its ``step`` is read per entry */
    PyObject *slots;    /* writer.slots */
    PyObject *plans;    /* writer._plans: dtype -> (stream, plain) */
    PyObject *errors;   /* writer._errors: non-empty -> Python raises */
    PyObject *rows;     /* the table's rows: an entry's shape */
    PyObject *op_slots; /* emitter: op entry -> slot */
    PyObject *versions; /* emitter: slot -> the tensor's version when saved */
    PyObject *strided;
    TensorAttrs t;
    Py_ssize_t chunk_bytes, align, small_bytes;
} Packer;

#define PACKER_REFS(X)                                                                     \
    X(fallback) X(writer) X(slots) X(plans) X(errors) X(rows) X(op_slots) X(versions)      \
        X(strided) TENSOR_ATTRS(X)

static PyObject *str_used, *str_address, *str_buffer, *str_chunk, *str_name, *str_members,
    *str_step;

GC_SLOTS(Packer, PACKER_REFS)

/* The torch.Tensor getters (data descriptors) and methods the compiled entries read, in
 * the order of their fields. */
static const char *const TENSOR_GETTERS[6] = {"layout", "is_cpu", "_version",
                                              "nbytes", "dtype",  "shape"};
static const char *const TENSOR_METHODS[4] = {"is_contiguous", "is_neg", "data_ptr", "stride"};

/* torch.Tensor's attribute through its own getter (the caller checked the exact type). */
static PyObject *tensor_get(TensorAttrs *t, PyObject *getter, PyObject *tensor) {
    return Py_TYPE(getter)->tp_descr_get(getter, tensor, t->tensor_type);
}

/* The attributes of torch.Tensor (`type`) into `t`: 0, or -1 with an error set. */
static int tensor_attrs(TensorAttrs *t, PyObject *type) {
    Py_INCREF(type);
    t->tensor_type = type;
    PyObject **const out[10] = {&t->get_layout, &t->get_is_cpu, &t->get_version,
                                &t->get_nbytes, &t->get_dtype,  &t->get_shape,
                                &t->is_contiguous, &t->is_neg, &t->data_ptr,
                                &t->stride};
    for (int k = 0; k < 10; k++) {
        int getter = k < 6;
        const char *name = getter ? TENSOR_GETTERS[k] : TENSOR_METHODS[k - 6];
        *out[k] = PyObject_GetAttrString(type, name);
        if (*out[k] && getter && !Py_TYPE(*out[k])->tp_descr_get) Py_CLEAR(*out[k]);
        if (!*out[k]) {
            if (!PyErr_Occurred()) PyErr_Format(PyExc_TypeError, "torch.Tensor: no %s", name);
            return -1;
        }
    }
    return 0;
}

static PyObject *tensor_method(PyObject *method, PyObject *tensor) {
    return PyObject_Vectorcall(method, &tensor, 1, NULL);
}

/* An int attribute as a Py_ssize_t; -1 with an error set if it is not one. */
static Py_ssize_t ssize_attr(PyObject *obj, PyObject *name) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (!v) return -1;
    Py_ssize_t n = PyLong_CheckExact(v) ? PyLong_AsSsize_t(v) : -1;
    if (n < 0 && !PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "not a size");
    Py_DECREF(v);
    return n;
}

/* A compiled entry's outcome `done`, its error dealt with: not done, an Exception is
 * cleared (the Python path does the entry, or raises what it meets itself), but anything
 * else (a KeyboardInterrupt from a signal handled in Python code it called) is the
 * caller's: -1, raised. */
static int entry_outcome(int done) {
    if (done || !PyErr_Occurred()) return done;
    if (!PyErr_ExceptionMatches(PyExc_Exception)) return -1;
    PyErr_Clear();
    return 0;
}

/* The entry saved here: 1; not one for this path: 0 (no error set, nothing changed);
 * -1: a change failed part way (the error set, as the Python's would be). */
static int pack(Packer *self, PyObject *index, PyObject *tensor, PyObject *same_as) {
    int done = 0;
    PyObject *layout = NULL, *is_cpu = NULL, *version = NULL, *nbytes = NULL, *dtype = NULL,
             *buffer = NULL, *flag = NULL, *ptr = NULL, *name = NULL, *members = NULL,
             *step = NULL, *slot = NULL, *offset = NULL, *used = NULL, *entry = NULL;
    if (Py_TYPE(tensor) != (PyTypeObject *)self->t.tensor_type || !PyLong_CheckExact(index) ||
        !PyLong_CheckExact(same_as) || PyList_GET_SIZE(self->errors))
        return 0;
    Py_ssize_t at = PyLong_AsSsize_t(index); /* (-1 on an error: out clears it) */
    long same = PyLong_AsLong(same_as);
    if (PyErr_Occurred() || same >= 0 || at < 0 || at >= PyList_GET_SIZE(self->rows)) goto out;
    PyObject *row = PyList_GET_ITEM(self->rows, at);
    if (!PyTuple_CheckExact(row) || PyTuple_GET_SIZE(row) != ROW_WIDTH) goto out;
    PyObject *shape = PyTuple_GET_ITEM(row, ROW_SHAPE);
    if (!(layout = tensor_get(&self->t, self->t.get_layout, tensor)) || layout != self->strided)
        goto out;
    if (!(is_cpu = tensor_get(&self->t, self->t.get_is_cpu, tensor)) || is_cpu != Py_True) goto out;
    if (!(version = tensor_get(&self->t, self->t.get_version, tensor))) goto out; /* inference */
    if (!(nbytes = tensor_get(&self->t, self->t.get_nbytes, tensor)) || !PyLong_CheckExact(nbytes))
        goto out;
    Py_ssize_t n = PyLong_AsSsize_t(nbytes);
    if (n <= 0 || n >= self->small_bytes || n > self->chunk_bytes) goto out;
    if (!(dtype = tensor_get(&self->t, self->t.get_dtype, tensor))) goto out;
    PyObject *plan = PyDict_GetItemWithError(self->plans, dtype);
    if (!plan || !PyTuple_CheckExact(plan) || PyTuple_GET_SIZE(plan) != 2 ||
        PyTuple_GET_ITEM(plan, 1) != Py_True)
        goto out; /* no plan yet (Python makes it), or not a plain byte copy */
    PyObject *stream = PyTuple_GET_ITEM(plan, 0);
    if (!(buffer = PyObject_GetAttr(stream, str_buffer)) || buffer == Py_None) goto out;
    Py_ssize_t was = ssize_attr(stream, str_used);
    if (was < 0) goto out;
    Py_ssize_t start = (was + self->align - 1) & -self->align;
    if (start + n > self->chunk_bytes) goto out; /* Python flushes the full chunk */
    if (!(flag = tensor_method(self->t.is_contiguous, tensor)) || flag != Py_True) goto out;
    Py_CLEAR(flag);
    if (!(flag = tensor_method(self->t.is_neg, tensor)) || flag != Py_False) goto out;
    if (!(ptr = tensor_method(self->t.data_ptr, tensor))) goto out;
    void *from = PyLong_AsVoidPtr(ptr);
    Py_ssize_t chunk = ssize_attr(stream, str_chunk);
    PyObject *address_obj = PyObject_GetAttr(stream, str_address);
    if ((!from && PyErr_Occurred()) || chunk < 0 || !address_obj) {
        Py_XDECREF(address_obj);
        goto out;
    }
    char *address = PyLong_AsVoidPtr(address_obj);
    Py_DECREF(address_obj);
    if ((!address && PyErr_Occurred()) || !address) goto out;
    if (!(name = PyObject_GetAttr(stream, str_name)) ||
        !(members = PyObject_GetAttr(stream, str_members)) || !PyList_CheckExact(members) ||
        !(step = PyObject_GetAttr(self->writer, str_step)) ||
        !(slot = PyLong_FromSsize_t(PyList_GET_SIZE(self->slots))) ||
        !(offset = PyLong_FromSsize_t(chunk * self->chunk_bytes + start)) ||
        !(used = PyLong_FromSsize_t(start + n)) ||
        !(entry = PyTuple_Pack(6, name, offset, nbytes, shape, dtype, step)))
        goto out;
    /* Everything is made: copy and record, as TensorWriter.save and StoreEmitter._keep
     * (the padding before the tensor zeroed, as there). */
    memset(address + was, 0, (size_t)(start - was));
    memcpy(address + start, from, (size_t)n);
    done = PyObject_SetAttr(stream, str_used, used) < 0 || PyList_Append(members, slot) < 0 ||
                   PyList_Append(self->slots, entry) < 0 ||
                   PyDict_SetItem(self->versions, slot, version) < 0 ||
                   PyDict_SetItem(self->op_slots, index, slot) < 0
               ? -1
               : 1;
out:
    done = entry_outcome(done);
    Py_XDECREF(layout);
    Py_XDECREF(is_cpu);
    Py_XDECREF(version);
    Py_XDECREF(nbytes);
    Py_XDECREF(dtype);
    Py_XDECREF(buffer);
    Py_XDECREF(flag);
    Py_XDECREF(ptr);
    Py_XDECREF(name);
    Py_XDECREF(members);
    Py_XDECREF(step);
    Py_XDECREF(slot);
    Py_XDECREF(offset);
    Py_XDECREF(used);
    Py_XDECREF(entry);
    return done;
}

/* A compiled entry's constructor arguments: exactly n, positional, borrowed into v. */
static int entry_args(const char *name, PyObject *args, PyObject *kwargs, Py_ssize_t n,
                      PyObject **v) {
    if ((kwargs && PyDict_GET_SIZE(kwargs)) || !PyTuple_Check(args) ||
        PyTuple_GET_SIZE(args) != n) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd positional arguments", name, n);
        return -1;
    }
    for (Py_ssize_t k = 0; k < n; k++) v[k] = PyTuple_GET_ITEM(args, k);
    return 0;
}

/* New references to values[k] in *fields[k]. */
static void keep_refs(PyObject **const *fields, PyObject *const *values, int n) {
    for (int k = 0; k < n; k++) {
        Py_INCREF(values[k]);
        *fields[k] = values[k];
    }
}

/* A compiled entry called as on_entry(index, tensor, same_as): its fast path `fast`
 * (1: done, 0: not its case, -1: failed with an error set), else the Python fallback. */
static PyObject *entry_call(PyObject *self, PyObject *fallback,
                            int (*fast)(PyObject *, PyObject *const *), PyObject *const *a,
                            size_t nargsf, PyObject *kwnames) {
    if (!fallback) {
        PyErr_Format(PyExc_RuntimeError, "%s was cleared", Py_TYPE(self)->tp_name);
        return NULL;
    }
    if (!kwnames && PyVectorcall_NARGS(nargsf) == 3) {
        int r = fast(self, a);
        if (r < 0) return NULL;
        if (r > 0) Py_RETURN_NONE;
    }
    return PyObject_Vectorcall(fallback, a, nargsf, kwnames);
}

static int pack_entry(PyObject *self, PyObject *const *a) {
    return pack((Packer *)self, a[0], a[1], a[2]);
}

static PyObject *Packer_vectorcall(Packer *self, PyObject *const *a, size_t nargsf,
                                   PyObject *kwnames) {
    return entry_call((PyObject *)self, self->fallback, pack_entry, a, nargsf, kwnames);
}

/* Packer(fallback, writer, slots, plans, errors, rows, op_slots, versions, tensor_type,
 *        strided, (chunk_bytes, align, small_bytes)) */
static PyObject *Packer_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *v[11];
    Py_ssize_t limits[3];
    if (entry_args("Packer", args, kwargs, 11, v) < 0) return NULL;
    if (!PyList_CheckExact(v[2]) || !PyDict_CheckExact(v[3]) || !PyList_CheckExact(v[4]) ||
        !PyList_CheckExact(v[5]) || !PyDict_CheckExact(v[6]) || !PyDict_CheckExact(v[7]) ||
        !PyType_Check(v[8]) || !PyArg_ParseTuple(v[10], "nnn", &limits[0], &limits[1],
                                                  &limits[2]) ||
        limits[1] <= 0 || (limits[1] & (limits[1] - 1))) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "Packer: wrong arguments");
        return NULL;
    }
    Packer *self = (Packer *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    self->vectorcall = (vectorcallfunc)Packer_vectorcall;
    PyObject **const given[8] = {&self->fallback, &self->writer, &self->slots,
                                 &self->plans,    &self->errors, &self->rows,
                                 &self->op_slots, &self->versions};
    keep_refs(given, v, 8);
    keep_refs((PyObject **const[]){&self->strided}, v + 9, 1);
    if (tensor_attrs(&self->t, v[8]) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    self->chunk_bytes = limits[0];
    self->align = limits[1];
    self->small_bytes = limits[2];
    return (PyObject *)self;
}

static PyTypeObject PackerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tracelake.recorder._hot.Packer",
    .tp_basicsize = sizeof(Packer),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "StoreEmitter.on_entry for the common small tensor (see recorder/_hot.c).",
    .tp_vectorcall_offset = offsetof(Packer, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_traverse = (traverseproc)Packer_traverse,
    .tp_clear = (inquiry)Packer_clear,
    .tp_dealloc = (destructor)Packer_dealloc,
    .tp_new = Packer_new,
};

/* Decimal digits of a non-negative int into buf; the count, or -1 if ``v`` is not one. */
static int put_int(char *buf, PyObject *v) {
    if (!PyLong_CheckExact(v)) return -1;
    long long x = PyLong_AsLongLong(v);
    if (x < 0) {
        PyErr_Clear();
        return -1;
    }
    char tmp[24];
    int n = 0;
    do {
        tmp[n++] = (char)('0' + x % 10);
        x /= 10;
    } while (x);
    for (int k = 0; k < n; k++) buf[k] = tmp[n - 1 - k];
    return n;
}

/* f"{func[:func_len]}_{a}" + (f"_{b}" if b) + suffix, built directly for an ASCII name
 * and non-negative ints (every label the recorder makes); NULL without an error set when
 * it does not apply. */
static PyObject *quick_label(PyObject *func, Py_ssize_t func_len, PyObject *a, PyObject *b,
                             const char *suffix) {
    char buf[96];
    if (!PyUnicode_IS_COMPACT_ASCII(func) || func_len > 40) return NULL;
    memcpy(buf, PyUnicode_DATA(func), func_len);
    Py_ssize_t n = func_len;
    buf[n++] = '_';
    int k = put_int(buf + n, a);
    if (k < 0) return NULL;
    n += k;
    if (b) {
        buf[n++] = '_';
        k = put_int(buf + n, b);
        if (k < 0) return NULL;
        n += k;
    }
    size_t extra = strlen(suffix);
    memcpy(buf + n, suffix, extra);
    n += (Py_ssize_t)extra;
    PyObject *label = PyUnicode_New(n, 127);
    if (label) memcpy(PyUnicode_DATA(label), buf, n);
    return label;
}

/* labels(rows, passes): OpTable.finish's labels, as its Python loop writes them. */
static PyObject *labels(PyObject *module, PyObject *const *a, Py_ssize_t nargs) {
    if (nargs != 2 || !PyList_Check(a[0]) || !PyDict_Check(a[1])) {
        PyErr_SetString(PyExc_TypeError, "labels(rows: list, passes: dict)");
        return NULL;
    }
    PyObject *rows = a[0], *passes = a[1];
    Py_ssize_t n = PyList_GET_SIZE(rows);
    PyObject *out = PyList_New(n);
    if (!out) return NULL;
    for (Py_ssize_t index = 0; index < n; index++) {
        PyObject *row = PyList_GET_ITEM(rows, index), *label = NULL;
        if (!PyTuple_Check(row) || PyTuple_GET_SIZE(row) != ROW_WIDTH) {
            PyErr_Format(PyExc_TypeError, "row %zd is not a %d-field tuple", index, ROW_WIDTH);
            goto fail;
        }
        PyObject *func = PyTuple_GET_ITEM(row, ROW_FUNC),
                 *inplace = PyTuple_GET_ITEM(row, ROW_INPLACE),
                 *layer = PyTuple_GET_ITEM(row, ROW_LAYER_IDX),
                 *pass_num = PyTuple_GET_ITEM(row, ROW_PASS),
                 *n_func = PyTuple_GET_ITEM(row, ROW_N_FUNC),
                 *n_layer = PyTuple_GET_ITEM(row, ROW_N_LAYER);
        Py_ssize_t first = PyLong_AsSsize_t(layer);
        if (first == -1 && PyErr_Occurred()) goto fail;
        if (first != index) { /* a later pass of the layer its first entry labels */
            if (first < 0 || first >= index || !PyUnicode_Check(func)) {
                PyErr_Format(PyExc_ValueError, "row %zd: bad layer %zd", index, first);
                goto fail;
            }
            PyObject *base = PyList_GET_ITEM(out, first);
            PyObject *bare = PyUnicode_Substring(base, 0, PyUnicode_GET_LENGTH(base) - 2);
            if (!bare) goto fail;
            label = PyUnicode_FromFormat("%U:%S", bare, pass_num);
            Py_DECREF(bare);
        } else {
            int numbered = PyObject_IsTrue(n_layer), changed = 0;
            if (numbered < 0 || !PyUnicode_Check(func)) goto fail;
            if (!numbered) { /* input_1, output_1 */
                label = quick_label(func, PyUnicode_GET_LENGTH(func), n_func, NULL, "");
                if (!label && !PyErr_Occurred())
                    label = PyUnicode_FromFormat("%U_%S", func, n_func);
            } else {
                int multi = PyDict_Contains(passes, layer), writes = PyObject_IsTrue(inplace);
                if (multi < 0 || writes < 0) goto fail;
                Py_ssize_t len = PyUnicode_GET_LENGTH(func);
                Py_ssize_t used = len;
                if (writes && len > 0 && PyUnicode_READ_CHAR(func, len - 1) == '_') used--;
                label = quick_label(func, used, n_func, n_layer, multi ? ":1" : "");
                if (label || PyErr_Occurred()) goto done;
                if (used < len) {
                    /* in-place variants count with their function */
                    func = PyUnicode_Substring(func, 0, len - 1);
                    if (!func) goto fail;
                    changed = 1;
                }
                label = PyUnicode_FromFormat(multi ? "%U_%S_%S:1" : "%U_%S_%S", func, n_func,
                                             n_layer);
                if (changed) Py_DECREF(func);
            }
        }
    done:
        if (!label) goto fail;
        PyList_SET_ITEM(out, index, label);
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

/* same_rows(a, b): ``a == b`` for two tuples of row tuples (OpTable.finish's question: is
 * this graph one recorded before?), with each field's identity checked inline first: the
 * rows of a graph recorded again hold the same objects (shared ints, shapes, sites), and
 * tuple equality would make a call per field to find that out. */
static PyObject *same_rows(PyObject *module, PyObject *const *a, Py_ssize_t nargs) {
    if (nargs != 2 || !PyTuple_CheckExact(a[0]) || !PyTuple_CheckExact(a[1])) {
        PyErr_SetString(PyExc_TypeError, "same_rows(a: tuple, b: tuple)");
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(a[0]);
    if (n != PyTuple_GET_SIZE(a[1])) Py_RETURN_FALSE;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *r = PyTuple_GET_ITEM(a[0], i), *s = PyTuple_GET_ITEM(a[1], i);
        if (r == s) continue;
        if (!PyTuple_CheckExact(r) || !PyTuple_CheckExact(s)) {
            int eq = PyObject_RichCompareBool(r, s, Py_EQ);
            if (eq < 0) return NULL;
            if (!eq) Py_RETURN_FALSE;
            continue;
        }
        Py_ssize_t m = PyTuple_GET_SIZE(r);
        if (m != PyTuple_GET_SIZE(s)) Py_RETURN_FALSE;
        /* every field the very object (a graph recorded again: shared values): one
         * comparison of the item arrays, not a loop over the fields */
        if (!memcmp(&PyTuple_GET_ITEM(r, 0), &PyTuple_GET_ITEM(s, 0), m * sizeof(PyObject *)))
            continue;
        for (Py_ssize_t k = 0; k < m; k++) {
            PyObject *u = PyTuple_GET_ITEM(r, k), *v = PyTuple_GET_ITEM(s, k);
            if (u == v) continue;
            int eq = PyObject_RichCompareBool(u, v, Py_EQ);
            if (eq < 0) return NULL;
            if (!eq) Py_RETURN_FALSE;
        }
    }
    Py_RETURN_TRUE;
}

/* ---- statistics: one fused pass over a float32 tensor (recorder/stats.py) ---------- */

/* Lane j of LANES sums the elements i = j (mod LANES), in float64 (a float32 squared is exact in
 * a double, so a fused multiply-add gives what a multiply and an add give); the lanes are
 * added in order at the end. Every implementation below keeps exactly this order, so
 * they all give the same bits. The minimum and maximum are of float32s; a NaN or Inf
 * makes the sums non-finite, and the caller then takes its careful path. */
/* 16: the sums' chains of dependent adds, not the memory, bound the pass (a multiply-add's
 * latency a vector of lanes): 8 lanes (two AVX2 chains) took 17.8 µs for 512 KiB, 16
 * lanes 15.6 with AVX2 and 13.5 with AVX-512, 32 lanes 20.8 (registers spilled). */
#define LANES 16
#define BLOCK ((Py_ssize_t)1 << 24) /* elements per block: int32 zero counts cannot wrap */

typedef struct {
    double sum[LANES], sq[LANES];
    float lo[LANES], hi[LANES];
    long long zeros;
} Moments;

static void moments_tail(const float *x, Py_ssize_t start, Py_ssize_t n, Moments *m) {
    for (Py_ssize_t i = start; i < n; i++) {
        int j = (int)(i % LANES);
        float v = x[i];
        double d = (double)v;
        m->sum[j] += d;
        m->sq[j] += d * d;
        m->lo[j] = v < m->lo[j] ? v : m->lo[j];
        m->hi[j] = v > m->hi[j] ? v : m->hi[j];
        m->zeros += v == 0.0f;
    }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_SIMD 1

/* SSE2 (every x86-64): lane pairs 2k, 2k + 1 in s[k] and q[k]. */
static Py_ssize_t moments_sse2(const float *x, Py_ssize_t n, Moments *m) {
    __m128d s[LANES / 2], q[LANES / 2];
    __m128 lo[LANES / 4], hi[LANES / 4];
    for (int k = 0; k < LANES / 2; k++)
        s[k] = _mm_loadu_pd(m->sum + 2 * k), q[k] = _mm_loadu_pd(m->sq + 2 * k);
    for (int k = 0; k < LANES / 4; k++)
        lo[k] = _mm_loadu_ps(m->lo + 4 * k), hi[k] = _mm_loadu_ps(m->hi + 4 * k);
    __m128 zero = _mm_setzero_ps();
    Py_ssize_t i = 0;
    while (i + LANES <= n) {
        Py_ssize_t end = i + BLOCK < n ? i + BLOCK : n;
        __m128i z = _mm_setzero_si128();
        for (; i + LANES <= end; i += LANES) {
#pragma GCC unroll 4
            for (int k = 0; k < LANES / 4; k++) {
                __m128 a = _mm_loadu_ps(x + i + 4 * k);
                __m128d d0 = _mm_cvtps_pd(a), d1 = _mm_cvtps_pd(_mm_movehl_ps(a, a));
                s[2 * k] = _mm_add_pd(s[2 * k], d0);
                s[2 * k + 1] = _mm_add_pd(s[2 * k + 1], d1);
                q[2 * k] = _mm_add_pd(q[2 * k], _mm_mul_pd(d0, d0));
                q[2 * k + 1] = _mm_add_pd(q[2 * k + 1], _mm_mul_pd(d1, d1));
                lo[k] = _mm_min_ps(a, lo[k]), hi[k] = _mm_max_ps(a, hi[k]);
                z = _mm_sub_epi32(z, _mm_castps_si128(_mm_cmpeq_ps(a, zero)));
            }
        }
        int counts[4];
        _mm_storeu_si128((__m128i *)counts, z);
        m->zeros += (long long)counts[0] + counts[1] + counts[2] + counts[3];
    }
    for (int k = 0; k < LANES / 2; k++)
        _mm_storeu_pd(m->sum + 2 * k, s[k]), _mm_storeu_pd(m->sq + 2 * k, q[k]);
    for (int k = 0; k < LANES / 4; k++)
        _mm_storeu_ps(m->lo + 4 * k, lo[k]), _mm_storeu_ps(m->hi + 4 * k, hi[k]);
    return i;
}

/* AVX2 where the processor has it: lanes 4k to 4k + 3 in s[k] and q[k]. Each group of
 * four lanes is converted straight from memory (a 128-bit load into vcvtps2pd, no shuffle
 * to split a 256-bit load): what is left bounding the loop is the chain of adds and
 * multiply-adds of each s[k] and q[k], one step a LANES elements, whose order sets the
 * bits. */
__attribute__((target("avx2,fma"))) static Py_ssize_t moments_avx2(const float *x, Py_ssize_t n,
                                                                   Moments *m) {
    __m256d s[LANES / 4], q[LANES / 4];
    __m256 lo[LANES / 8], hi[LANES / 8];
    for (int k = 0; k < LANES / 4; k++)
        s[k] = _mm256_loadu_pd(m->sum + 4 * k), q[k] = _mm256_loadu_pd(m->sq + 4 * k);
    for (int k = 0; k < LANES / 8; k++)
        lo[k] = _mm256_loadu_ps(m->lo + 8 * k), hi[k] = _mm256_loadu_ps(m->hi + 8 * k);
    __m256 zero = _mm256_setzero_ps();
    Py_ssize_t i = 0;
    while (i + LANES <= n) {
        Py_ssize_t end = i + BLOCK < n ? i + BLOCK : n;
        __m256i z = _mm256_setzero_si256();
        for (; i + LANES <= end; i += LANES) {
            const float *p = x + i;
            /* 4 KiB ahead: a forward's activations come from L3, which the hardware's
             * prefetch alone does not hide (a hint: nothing faults past the end) */
            _mm_prefetch((const char *)(p + 1024), _MM_HINT_T0);
#pragma GCC unroll 4
            for (int k = 0; k < LANES / 4; k++) {
                __m256d d = _mm256_cvtps_pd(_mm_loadu_ps(p + 4 * k));
                s[k] = _mm256_add_pd(s[k], d);
                q[k] = _mm256_fmadd_pd(d, d, q[k]);
            }
#pragma GCC unroll 2
            for (int k = 0; k < LANES / 8; k++) {
                __m256 a = _mm256_loadu_ps(p + 8 * k);
                lo[k] = _mm256_min_ps(a, lo[k]), hi[k] = _mm256_max_ps(a, hi[k]);
                z = _mm256_sub_epi32(z, _mm256_castps_si256(_mm256_cmp_ps(a, zero, _CMP_EQ_OQ)));
            }
        }
        int counts[8];
        _mm256_storeu_si256((__m256i *)counts, z);
        for (int k = 0; k < 8; k++) m->zeros += counts[k];
    }
    for (int k = 0; k < LANES / 4; k++)
        _mm256_storeu_pd(m->sum + 4 * k, s[k]), _mm256_storeu_pd(m->sq + 4 * k, q[k]);
    for (int k = 0; k < LANES / 8; k++)
        _mm256_storeu_ps(m->lo + 8 * k, lo[k]), _mm256_storeu_ps(m->hi + 8 * k, hi[k]);
    return i;
}

/* AVX-512 where the processor has it: lanes 8k to 8k + 7 in s[k] and q[k], the zeros
 * counted from a compare's mask (off the vector units, which the sums keep busy). */
__attribute__((target("avx512f,popcnt"))) static Py_ssize_t moments_avx512(const float *x,
                                                                           Py_ssize_t n,
                                                                           Moments *m) {
    __m512d s[LANES / 8], q[LANES / 8];
    __m512 lo[LANES / 16], hi[LANES / 16];
    for (int k = 0; k < LANES / 8; k++)
        s[k] = _mm512_loadu_pd(m->sum + 8 * k), q[k] = _mm512_loadu_pd(m->sq + 8 * k);
    for (int k = 0; k < LANES / 16; k++)
        lo[k] = _mm512_loadu_ps(m->lo + 16 * k), hi[k] = _mm512_loadu_ps(m->hi + 16 * k);
    __m512 zero = _mm512_setzero_ps();
    long long zeros = 0;
    Py_ssize_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        const float *p = x + i;
        _mm_prefetch((const char *)(p + 1024), _MM_HINT_T0); /* as moments_avx2 */
#pragma GCC unroll 2
        for (int k = 0; k < LANES / 8; k++) {
            __m512d d = _mm512_cvtps_pd(_mm256_loadu_ps(p + 8 * k));
            s[k] = _mm512_add_pd(s[k], d);
            q[k] = _mm512_fmadd_pd(d, d, q[k]);
        }
        for (int k = 0; k < LANES / 16; k++) {
            __m512 a = _mm512_loadu_ps(p + 16 * k);
            lo[k] = _mm512_min_ps(a, lo[k]), hi[k] = _mm512_max_ps(a, hi[k]);
            zeros += __builtin_popcount(_mm512_cmp_ps_mask(a, zero, _CMP_EQ_OQ));
        }
    }
    m->zeros += zeros;
    for (int k = 0; k < LANES / 8; k++)
        _mm512_storeu_pd(m->sum + 8 * k, s[k]), _mm512_storeu_pd(m->sq + 8 * k, q[k]);
    for (int k = 0; k < LANES / 16; k++)
        _mm512_storeu_ps(m->lo + 16 * k, lo[k]), _mm512_storeu_ps(m->hi + 16 * k, hi[k]);
    return i;
}
#endif

/* (sum, sum of squares, min, max, zeros) of count > 0 runs of run > 0 contiguous float32s,
 * run k starting step elements after run k - 1 (a dense tensor: one run; a dense tensor's
 * slice or permutation: rows of its innermost contiguous block). Each run is summed by
 * lanes from its own start, so the bits depend on the layout, never on the processor. */
static void moments_start(const float *x, Moments *m) {
    *m = (Moments){{0}, {0}, {0}, {0}, 0};
    for (int j = 0; j < LANES; j++) m->lo[j] = m->hi[j] = x[0];
}

static int has_avx2 = 0, has_avx512 = 0; /* (set when the module loads) */

/* Which implementation: the best the processor has, or (for the tests that check they
 * all give the same bits) one named: moment_passes() lists those this processor runs. */
typedef enum { PASS_BEST, PASS_SSE2, PASS_C, PASS_AVX2, PASS_AVX512 } Pass;

/* n contiguous float32s into m, lane j taking the elements i = j (mod LANES) counted from
 * row: so rows cut at multiples of LANES elements give the bits of one row. */
static void moments_row(const float *row, Py_ssize_t n, Moments *m, Pass pass) {
    Py_ssize_t done = 0;
#ifdef HAVE_SIMD
    if (pass == PASS_BEST) pass = has_avx512 ? PASS_AVX512 : has_avx2 ? PASS_AVX2 : PASS_SSE2;
    if (pass == PASS_AVX512)
        done = moments_avx512(row, n, m);
    else if (pass == PASS_AVX2)
        done = moments_avx2(row, n, m);
    else if (pass == PASS_SSE2)
        done = moments_sse2(row, n, m);
#endif
    moments_tail(row, done, n, m);
}

static void moments_end(const Moments *mm, double *out) {
    Moments m = *mm;
    double sum = 0, sq = 0;
    float low = m.lo[0], high = m.hi[0];
    for (int j = 0; j < LANES; j++) {
        sum += m.sum[j];
        sq += m.sq[j];
        low = m.lo[j] < low ? m.lo[j] : low;
        high = m.hi[j] > high ? m.hi[j] : high;
    }
    out[0] = sum, out[1] = sq, out[2] = low, out[3] = high, out[4] = (double)m.zeros;
}

static void moments_f32(const float *x, Py_ssize_t run, Py_ssize_t count, Py_ssize_t step,
                        double *out, Pass pass) {
    Moments m;
    moments_start(x, &m);
    for (Py_ssize_t r = 0; r < count; r++) moments_row(x + r * step, run, &m, pass);
    moments_end(&m, out);
}

/* ---- CRC32C (Castagnoli), as Zarr v3's crc32c codec checks it (store/codecs.py) ---------
 * The value of a message, as google_crc32c.value gives it: reflected, initial value and
 * final xor all ones. With SSE4.2 its crc32 instruction in three interleaved streams (one
 * alone waits on the instruction's latency), the streams joined by the multiplication of
 * a CRC by x^(8n) modulo the polynomial (zlib's crc32_combine); else a byte table. */
#define CRC32C_POLY 0x82f63b78u
static uint32_t crc32c_table[256];
static uint32_t crc32c_x2n[32]; /* x^(2^k) modulo the polynomial */

/* a(x) b(x) modulo the polynomial (reflected bits) */
static uint32_t crc32c_mult(uint32_t a, uint32_t b) {
    uint32_t m = (uint32_t)1 << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0) break;
        }
        m >>= 1;
        b = b & 1 ? (b >> 1) ^ CRC32C_POLY : b >> 1;
    }
    return p;
}

/* x^(8 n) modulo the polynomial: what appending n zero bytes multiplies a CRC by */
static uint32_t crc32c_shift(size_t n) {
    uint32_t p = (uint32_t)1 << 31; /* x^0 */
    for (unsigned k = 3; n; n >>= 1, k++)
        if (n & 1) p = crc32c_mult(crc32c_x2n[k & 31], p);
    return p;
}

static void crc32c_init(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ CRC32C_POLY : c >> 1;
        crc32c_table[n] = c;
    }
    uint32_t p = (uint32_t)1 << 30; /* x^1 */
    crc32c_x2n[0] = p;
    for (int k = 1; k < 32; k++) crc32c_x2n[k] = p = crc32c_mult(p, p);
}

static uint32_t crc32c_bytes(uint32_t crc, const unsigned char *p, size_t n) {
    crc = ~crc;
    while (n--) crc = crc32c_table[(crc ^ *p++) & 0xff] ^ (crc >> 8);
    return ~crc;
}

#ifdef HAVE_SIMD
__attribute__((target("sse4.2"))) static uint32_t crc32c_hw_run(uint32_t reg,
                                                                const unsigned char *p,
                                                                size_t n) {
    for (; n >= 8; p += 8, n -= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        reg = (uint32_t)_mm_crc32_u64(reg, v);
    }
    for (; n; n--) reg = _mm_crc32_u8(reg, *p++);
    return reg;
}

/* three streams of `third` bytes each (a multiple of 8), joined by `shift`, which is
 * crc32c_shift(third), then the rest */
__attribute__((target("sse4.2"))) static uint32_t crc32c_hw3(uint32_t crc,
                                                             const unsigned char *p,
                                                             size_t n, size_t third,
                                                             uint32_t shift) {
    const unsigned char *q = p + third, *r = q + third;
    uint32_t a = ~crc, b = 0xffffffffu, c = 0xffffffffu;
    for (size_t i = 0; i < third; i += 8) {
        uint64_t u, v, w;
        memcpy(&u, p + i, 8), memcpy(&v, q + i, 8), memcpy(&w, r + i, 8);
        a = (uint32_t)_mm_crc32_u64(a, u);
        b = (uint32_t)_mm_crc32_u64(b, v);
        c = (uint32_t)_mm_crc32_u64(c, w);
    }
    crc = crc32c_mult(shift, crc32c_mult(shift, ~a) ^ ~b) ^ ~c;
    return ~crc32c_hw_run(~crc, r + third, n - 3 * third);
}
#endif

static int crc32c_hardware = 0; /* (set when the module loads) */
#define CRC32C_STREAMS_FROM (3 * 8192) /* bytes: below, one stream */

/* How crc32c_with cuts n bytes: the streams' length and the shift that joins them. */
typedef struct {
    size_t third;
    uint32_t shift;
} Cut;

static Cut crc32c_cut(size_t n) {
    Cut cut = {0, 0};
    if (crc32c_hardware && n >= CRC32C_STREAMS_FROM) {
        cut.third = (n / 3) & ~(size_t)7;
        cut.shift = crc32c_shift(cut.third);
    }
    return cut;
}

static uint32_t crc32c_with(uint32_t crc, const unsigned char *p, size_t n, Cut cut) {
#ifdef HAVE_SIMD
    if (crc32c_hardware)
        return cut.third ? crc32c_hw3(crc, p, n, cut.third, cut.shift)
                         : ~crc32c_hw_run(~crc, p, n);
#endif
    return crc32c_bytes(crc, p, n);
}

static uint32_t crc32c(uint32_t crc, const unsigned char *p, size_t n) {
    return crc32c_with(crc, p, n, crc32c_cut(n));
}

/* crc32c(address, nbytes[, hardware]): the CRC32C of the bytes at address, the GIL
 * released meanwhile; hardware=False: the byte table's (tests compare both). */
static PyObject *crc32c_py(PyObject *module, PyObject *const *a, Py_ssize_t nargs) {
    if (nargs != 2 && nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "crc32c(address, nbytes[, hardware])");
        return NULL;
    }
    const unsigned char *address = PyLong_AsVoidPtr(a[0]);
    Py_ssize_t n = PyLong_AsSsize_t(a[1]);
    int hardware = nargs == 3 ? PyObject_IsTrue(a[2]) : 1;
    if (PyErr_Occurred()) return NULL;
    if ((!address && n) || n < 0) {
        PyErr_SetString(PyExc_ValueError, "crc32c: no bytes there");
        return NULL;
    }
    uint32_t crc;
    Py_BEGIN_ALLOW_THREADS
    crc = hardware ? crc32c(0, address, (size_t)n) : crc32c_bytes(0, address, (size_t)n);
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLong(crc);
}

/* crc_moments_f32(address, count, skip, blocks, block, crcs): moments_f32 of count
 * contiguous float32s at address, and the CRC32C of each of `blocks` blocks of `block`
 * bytes from byte `skip` on, into the uint32s at crcs, in one pass over memory: each
 * block checksummed, then reduced while in cache (a store's worker writes a packed
 * tensor's whole inner chunks from its memory). skip and block are multiples of
 * LANES * 4 bytes, so the moments are moments_f32's, to the bit. */
static PyObject *crc_moments_f32_py(PyObject *module, PyObject *const *a, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError,
                        "crc_moments_f32(address, count, skip, blocks, block, crcs)");
        return NULL;
    }
    const float *x = PyLong_AsVoidPtr(a[0]);
    Py_ssize_t count = PyLong_AsSsize_t(a[1]), skip = PyLong_AsSsize_t(a[2]);
    Py_ssize_t blocks = PyLong_AsSsize_t(a[3]), block = PyLong_AsSsize_t(a[4]);
    uint32_t *crcs = PyLong_AsVoidPtr(a[5]);
    if (PyErr_Occurred()) return NULL;
    const Py_ssize_t unit = LANES * (Py_ssize_t)sizeof(float);
    if (!x || count <= 0 || skip < 0 || blocks < 0 || block <= 0 || skip % unit ||
        block % unit || (blocks && !crcs) || skip + blocks * block > count * 4) {
        PyErr_SetString(PyExc_ValueError, "crc_moments_f32: blocks outside the elements");
        return NULL;
    }
    double out[5];
    Py_BEGIN_ALLOW_THREADS
    Moments m;
    moments_start(x, &m);
    const unsigned char *bytes = (const unsigned char *)x;
    Py_ssize_t at = skip / 4, per = block / 4;
    Cut cut = crc32c_cut((size_t)block);
    moments_row(x, at, &m, PASS_BEST);
    for (Py_ssize_t k = 0; k < blocks; k++, at += per) {
        crcs[k] = crc32c_with(0, bytes + skip + k * block, (size_t)block, cut);
        moments_row(x + at, per, &m, PASS_BEST);
    }
    moments_row(x + at, count - at, &m, PASS_BEST);
    moments_end(&m, out);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(ddddd)", out[0], out[1], out[2], out[3], out[4]);
}

/* Whether this processor runs implementation `pass` (not PASS_BEST). */
static int pass_runs(Pass pass) {
    switch (pass) {
    case PASS_C: return 1;
#ifdef HAVE_SIMD
    case PASS_SSE2: return 1;
    case PASS_AVX2: return has_avx2;
    case PASS_AVX512: return has_avx512;
#endif
    default: return 0;
    }
}

/* moment_passes(): the implementations of the pass this processor runs, as the numbers
 * moments_f32 takes, each with its name. */
static PyObject *moment_passes(PyObject *module, PyObject *unused) {
    static const struct {
        Pass pass;
        const char *name;
    } all[] = {{PASS_C, "c"}, {PASS_SSE2, "sse2"}, {PASS_AVX2, "avx2"}, {PASS_AVX512, "avx512"}};
    PyObject *out = PyDict_New();
    for (size_t k = 0; out && k < sizeof all / sizeof all[0]; k++) {
        if (!pass_runs(all[k].pass)) continue;
        PyObject *number = PyLong_FromLong(all[k].pass);
        int failed = !number || PyDict_SetItemString(out, all[k].name, number) < 0;
        Py_XDECREF(number);
        if (failed) Py_CLEAR(out);
    }
    return out;
}

/* moments_f32(address, run, count, step[, pass]): moments_f32's (sum, sum of squares, min,
 * max, zeros) of the float32s at address, in float64, the GIL released meanwhile. pass
 * (tests): 0 the best implementation here, else one of moment_passes(). */
static PyObject *moments_f32_py(PyObject *module, PyObject *const *a, Py_ssize_t nargs) {
    if (nargs != 4 && nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "moments_f32(address, run, count, step[, pass])");
        return NULL;
    }
    void *address = PyLong_AsVoidPtr(a[0]);
    Py_ssize_t run = PyLong_AsSsize_t(a[1]), count = PyLong_AsSsize_t(a[2]);
    Py_ssize_t step = PyLong_AsSsize_t(a[3]);
    long pass = nargs == 5 ? PyLong_AsLong(a[4]) : PASS_BEST;
    if (PyErr_Occurred()) return NULL;
    if (pass != PASS_BEST && !pass_runs((Pass)pass)) {
        PyErr_Format(PyExc_ValueError,
                     "moments_f32: pass %ld does not run here (moment_passes() lists those "
                     "that do)",
                     pass);
        return NULL;
    }
    if (!address || run <= 0 || count <= 0 || (count > 1 && step < run)) {
        PyErr_SetString(PyExc_ValueError, "moments_f32: no elements, or overlapping runs");
        return NULL;
    }
    double out[5];
    Py_BEGIN_ALLOW_THREADS
    moments_f32((const float *)address, run, count, step, out, (Pass)pass);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(ddddd)", out[0], out[1], out[2], out[3], out[4]);
}

/* ------------------------------------------------------------------------------------
 * Reducer: ``SelectingEmitter.on_entry`` under ``stats="all"`` with nothing saved, for a
 * tensor too large to gather, compiled.
 *
 * Its Python path is on_entry -> StatsGatherer.add -> ViewedStats.stats -> fused_layout
 * -> tensor_version -> fused_stats -> _fused_partial -> moments_f32 -> _finish: ten
 * frames and some thirty attribute reads an op, interleaved with a forward whose
 * activations evict them from the caches. This does the same for a plain float32 CPU
 * torch.Tensor of more than ``gather_max`` bytes (the gatherer takes the smaller ones)
 * whose dimensions fold into rows (fold_runs, as stats._runs): the layout key, the
 * version, the look-up of a layout reduced before in
 * ViewedStats's dict (shared: either path finds what the other put there), and on a
 * miss the compiled pass and the arithmetic of _fused_partial and _finish, in the same
 * order of operations (so the same bits: tests/test_compiled.py compares the two paths).
 * A NaN or Inf (the sums not finite), a mean that dwarfs the spread (_std's second pass),
 * a tensor without a version, and every other tensor go to the Python ``fallback``,
 * which stays the reference.
 * ------------------------------------------------------------------------------------ */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *fallback; /* the Python on_entry(index, tensor, same_as) */
    PyObject *stats;    /* emitter._stats: op entry -> Stats */
    PyObject *seen;     /* ViewedStats._seen: layout -> (weakref, version, Stats) */
    PyObject *make;     /* Stats(mean, std, min, max, absmax, l2, frac_zero, nans, infs) */
    PyObject *strided, *float32;
    TensorAttrs t;
    Py_ssize_t gather_max;
    double exact_squares; /* stats._EXACT_SQUARES */
} Reducer;

#define REDUCER_REFS(X)                                                                    \
    X(fallback) X(stats) X(seen) X(make) X(strided) X(float32) TENSOR_ATTRS(X)

GC_SLOTS(Reducer, REDUCER_REFS)

/* Whether `seen` (a ViewedStats value) still holds for a tensor at `version`: the tensor
 * first reduced is alive and neither it nor this one was written since. */
static int still_seen(Reducer *self, PyObject *seen, PyObject *version) {
    if (!PyTuple_CheckExact(seen) || PyTuple_GET_SIZE(seen) != 3) return 0;
    PyObject *ref = PyTuple_GET_ITEM(seen, 0), *when = PyTuple_GET_ITEM(seen, 1);
    if (!PyWeakref_Check(ref) || PyObject_RichCompareBool(when, version, Py_EQ) != 1) return 0;
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *kept = NULL;
    if (PyWeakref_GetRef(ref, &kept) <= 0) return 0;
#else
    PyObject *kept = PyWeakref_GET_OBJECT(ref);
    if (kept == Py_None) return 0;
    Py_INCREF(kept);
#endif
    int same = 0;
    if (Py_TYPE(kept) == (PyTypeObject *)self->t.tensor_type) {
        PyObject *now = tensor_get(&self->t, self->t.get_version, kept);
        same = now && PyObject_RichCompareBool(now, version, Py_EQ) == 1;
        Py_XDECREF(now);
    }
    Py_DECREF(kept);
    return same;
}

/* _fused_partial's and _finish's arithmetic, each operation as Python does it (no fused
 * multiply-add: a contracted product would change the bits). 1: Stats's first seven
 * fields in `out` (its NaN and Inf counts are 0 here); 0: the Python path (sums not
 * finite, or the mean dwarfs the spread). */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
static int finished_stats(const double *m, Py_ssize_t numel, double exact_squares,
                          double *out) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
    double total = m[0], squares = m[1], low = m[2], high = m[3], zeros = m[4];
    if (!isfinite(total) || !isfinite(squares)) return 0;
    double n = (double)numel;
    double l2 = sqrt(squares), mean = total / n;
    double spread = squares / n - mean * mean;
    if (!(spread >= exact_squares * squares / n)) return 0;
    double m2 = spread * n, nonzero = n - zeros;
    double kept = 0.0 > m2 ? 0.0 : m2; /* Python's max(m2, 0.0) */
    double a = fabs(low), b = fabs(high);
    out[0] = mean, out[1] = sqrt(kept / n), out[2] = low, out[3] = high;
    out[4] = b > a ? b : a; /* Python's max(abs(min), abs(max)) */
    out[5] = l2, out[6] = (n - nonzero) / n;
    return 1;
}

/* stats._runs of a tensor that is not contiguous: its elements as `rows` runs of `run`
 * contiguous elements `step` apart, its dimensions (those of more than one element) taken
 * by increasing stride (then size), as Python sorts the (stride, size) pairs. 1: folded;
 * 0: they do not fold so (broadcast strides, say), or more dimensions than this keeps,
 * or an error (set): the Python path says. */
#define FOLD_DIMS 16
static int fold_runs(Reducer *self, PyObject *tensor, Py_ssize_t *run, Py_ssize_t *rows,
                     Py_ssize_t *step) {
    PyObject *shape = tensor_get(&self->t, self->t.get_shape, tensor);
    PyObject *strides = shape ? tensor_method(self->t.stride, tensor) : NULL;
    int folded = 0;
    Py_ssize_t dims[FOLD_DIMS][2], n = 0; /* (stride, size) */
    if (!strides || !PyTuple_Check(shape) || !PyTuple_CheckExact(strides) ||
        PyTuple_GET_SIZE(shape) != PyTuple_GET_SIZE(strides))
        goto out;
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(shape); k++) {
        Py_ssize_t size = PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, k));
        Py_ssize_t stride = PyLong_AsSsize_t(PyTuple_GET_ITEM(strides, k));
        if (PyErr_Occurred() || n == FOLD_DIMS) goto out;
        if (size <= 1) continue;
        Py_ssize_t at = n++; /* insertion sort: a handful of dimensions */
        while (at > 0 && (dims[at - 1][0] > stride ||
                          (dims[at - 1][0] == stride && dims[at - 1][1] > size))) {
            dims[at][0] = dims[at - 1][0], dims[at][1] = dims[at - 1][1];
            at--;
        }
        dims[at][0] = stride, dims[at][1] = size;
    }
    Py_ssize_t r = 1, count = 1, gap = 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        Py_ssize_t stride = dims[k][0], size = dims[k][1];
        if (stride == 0) goto out; /* broadcast: elements repeat */
        if (count == 1 && stride == r)
            r *= size; /* still the innermost contiguous block */
        else if (count == 1 && stride > r)
            count = size, gap = stride; /* the first gap: the rows begin */
        else if (stride == gap * count)
            count *= size; /* rows that continue the rows before them */
        else
            goto out;
    }
    *run = r, *rows = count, *step = count > 1 ? gap : r;
    folded = 1;
out:
    Py_XDECREF(shape);
    Py_XDECREF(strides);
    return folded;
}

/* The entry's statistics taken: 1; not one for this path: 0 (no error set, nothing
 * changed); -1: a change failed part way, or an interrupt came (the error set). */
static int reduce_entry(Reducer *self, PyObject *index, PyObject *tensor) {
    int done = 0;
    PyObject *layout = NULL, *is_cpu = NULL, *dtype = NULL, *nbytes = NULL, *version = NULL,
             *flag = NULL, *ptr = NULL, *key = NULL, *ref = NULL, *stats = NULL,
             *value = NULL;
    if (Py_TYPE(tensor) != (PyTypeObject *)self->t.tensor_type || !PyLong_CheckExact(index))
        return 0;
    if (!(layout = tensor_get(&self->t, self->t.get_layout, tensor)) || layout != self->strided)
        goto out;
    if (!(is_cpu = tensor_get(&self->t, self->t.get_is_cpu, tensor)) || is_cpu != Py_True) goto out;
    if (!(dtype = tensor_get(&self->t, self->t.get_dtype, tensor)) || dtype != self->float32)
        goto out;
    if (!(nbytes = tensor_get(&self->t, self->t.get_nbytes, tensor)) || !PyLong_CheckExact(nbytes))
        goto out;
    Py_ssize_t n = PyLong_AsSsize_t(nbytes);
    if (n <= self->gather_max) goto out; /* (-1 on an error: out clears it) */
    if (!(version = tensor_get(&self->t, self->t.get_version, tensor))) goto out; /* inference */
    if (!(flag = tensor_method(self->t.is_neg, tensor)) || flag != Py_False) goto out;
    Py_CLEAR(flag);
    Py_ssize_t numel = n / (Py_ssize_t)sizeof(float), run = numel, rows = 1, step = numel;
    if (!(flag = tensor_method(self->t.is_contiguous, tensor))) goto out;
    if (flag != Py_True && !fold_runs(self, tensor, &run, &rows, &step)) goto out;
    if (run * rows != numel || !(ptr = tensor_method(self->t.data_ptr, tensor))) goto out;
    const float *x = PyLong_AsVoidPtr(ptr);
    if (!x || !(key = Py_BuildValue("(Onnn)", ptr, run, rows, step))) goto out;
    PyObject *seen = PyDict_GetItemWithError(self->seen, key);
    if (seen) {
        Py_INCREF(seen); /* (kept while it is looked at: the checks call torch's getters) */
        if (still_seen(self, seen, version)) {
            stats = PyTuple_GET_ITEM(seen, 2);
            Py_INCREF(stats);
        }
        Py_DECREF(seen);
        if (stats) {
            done = PyDict_SetItem(self->stats, index, stats) < 0 ? -1 : 1;
            goto out;
        }
    }
    if (PyErr_Occurred()) goto out;
    double moments[5], fields[7];
    Py_BEGIN_ALLOW_THREADS
    moments_f32(x, run, rows, step, moments, PASS_BEST);
    Py_END_ALLOW_THREADS
    if (!finished_stats(moments, numel, self->exact_squares, fields)) goto out;
    PyObject *args[9] = {NULL};
    for (int k = 0; k < 7; k++)
        if (!(args[k] = PyFloat_FromDouble(fields[k]))) break;
    if (args[6]) {
        args[7] = args[8] = int_zero; /* no NaN, no Inf: the sums are finite */
        stats = PyObject_Vectorcall(self->make, args, 9, NULL);
    }
    for (int k = 0; k < 7; k++) Py_XDECREF(args[k]);
    if (!stats || !(ref = PyWeakref_NewRef(tensor, NULL)) ||
        !(value = PyTuple_Pack(3, ref, version, stats)))
        goto out;
    done = PyDict_SetItem(self->seen, key, value) < 0 || PyDict_SetItem(self->stats, index, stats) < 0
               ? -1
               : 1;
out:
    done = entry_outcome(done);
    PyObject *const owned[] = {layout, is_cpu, dtype, nbytes, version, flag,
                               ptr,    key,    ref,   stats,  value};
    for (size_t k = 0; k < sizeof owned / sizeof *owned; k++) Py_XDECREF(owned[k]);
    return done;
}

static int reduce_args(PyObject *self, PyObject *const *a) {
    return reduce_entry((Reducer *)self, a[0], a[1]);
}

static PyObject *Reducer_vectorcall(Reducer *self, PyObject *const *a, size_t nargsf,
                                    PyObject *kwnames) {
    return entry_call((PyObject *)self, self->fallback, reduce_args, a, nargsf, kwnames);
}

/* Reducer(fallback, stats, seen, make, tensor_type, strided, float32,
 *         (gather_max, exact_squares)) */
static PyObject *Reducer_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *v[8];
    Py_ssize_t gather_max;
    double exact_squares;
    if (entry_args("Reducer", args, kwargs, 8, v) < 0) return NULL;
    if (!PyDict_CheckExact(v[1]) || !PyDict_CheckExact(v[2]) || !PyCallable_Check(v[3]) ||
        !PyType_Check(v[4]) || !PyArg_ParseTuple(v[7], "nd", &gather_max, &exact_squares)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "Reducer: wrong arguments");
        return NULL;
    }
    Reducer *self = (Reducer *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    self->vectorcall = (vectorcallfunc)Reducer_vectorcall;
    PyObject **const given[4] = {&self->fallback, &self->stats, &self->seen, &self->make};
    keep_refs(given, v, 4);
    keep_refs((PyObject **const[]){&self->strided, &self->float32}, v + 5, 2);
    if (tensor_attrs(&self->t, v[4]) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    self->gather_max = gather_max;
    self->exact_squares = exact_squares;
    return (PyObject *)self;
}

static PyTypeObject ReducerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tracelake.recorder._hot.Reducer",
    .tp_basicsize = sizeof(Reducer),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "SelectingEmitter.on_entry for a large float32 tensor's statistics "
              "(see recorder/_hot.c).",
    .tp_vectorcall_offset = offsetof(Reducer, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_traverse = (traverseproc)Reducer_traverse,
    .tp_clear = (inquiry)Reducer_clear,
    .tp_dealloc = (destructor)Reducer_dealloc,
    .tp_new = Reducer_new,
};

/* ------------------------------------------------------------------------------------
 * ModuleEvents: ``Labeller.on_module_enter`` and ``on_module_exit`` (recorder/labels.py),
 * compiled, for the common module call: part of the model, given tensors and plain
 * values (in a flat tuple, and a dict of keyword arguments), one tensor or a flat tuple
 * or list of them out, no tensor written through a view so far, and (at the exit) no
 * output handed back from the call's own inputs. Python's pair ran some three hundred bytecodes a
 * call (a GPT-2 block's forward makes eight such calls); this makes the same module
 * entries, frames, stack keys and emitter calls, in the same order, and hands every
 * other call to the Python ``fallback`` methods, which stay the reference
 * (tests/test_compiled.py compares the two). Nothing is changed until everything that
 * can send a call to Python has been looked at.
 * ------------------------------------------------------------------------------------ */
typedef struct {
    PyObject_HEAD
    PyObject *labeller;                   /* its ``_aliases`` is read at each exit */
    PyObject *enter_fallback, *exit_fallback; /* the Python methods, bound */
    PyObject *modules;    /* id(module) -> (weakref, path) */
    PyObject *calls;      /* path -> calls so far */
    PyObject *first_call; /* path -> [start, end] of its first call */
    PyObject *rows, *entries, *stack, *live, *producers, *refs, *params, *identities;
    PyObject *entry_type, *frame_type, *emit_enter, *emit_exit, *tensor_type;
} ModuleEvents;

#define MODULE_EVENTS_REFS(X)                                                              \
    X(labeller) X(enter_fallback) X(exit_fallback) X(modules) X(calls) X(first_call)       \
        X(rows) X(entries) X(stack) X(live) X(producers) X(refs) X(params) X(identities)  \
        X(entry_type) X(frame_type) X(emit_enter) X(emit_exit) X(tensor_type)

GC_SLOTS(ModuleEvents, MODULE_EVENTS_REFS)

static PyObject *str_module, *str_root, *str_given, *str_pass_num, *str_start, *str_entry,
    *str_path, *str_input_indices, *str_output_indices, *str_op_range, *str_aliases;

/* The module's path in the model (Labeller._path_of), borrowed; NULL without an error set
 * when it is not one of the model's modules. */
static PyObject *events_path(ModuleEvents *self, PyObject *module) {
    PyObject *key = id_key(module);
    if (!key) return NULL;
    PyObject *rec = PyDict_GetItemWithError(self->modules, key);
    Py_DECREF(key);
    if (!rec || !PyTuple_CheckExact(rec) || PyTuple_GET_SIZE(rec) != 2 ||
        !PyWeakref_Check(PyTuple_GET_ITEM(rec, 0)) ||
        !referent_is(PyTuple_GET_ITEM(rec, 0), module))
        return NULL;
    return PyTuple_GET_ITEM(rec, 1);
}

/* [a, b] (b NULL: [a]). New reference. */
static PyObject *list_of(PyObject *a, PyObject *b) {
    PyObject *list = PyList_New(b ? 2 : 1);
    if (!list) return NULL;
    Py_INCREF(a);
    PyList_SET_ITEM(list, 0, a);
    if (b) {
        Py_INCREF(b);
        PyList_SET_ITEM(list, 1, b);
    }
    return list;
}

/* intercept.flatten_tensors for a tensor, or a flat tuple or list of tensors and plain
 * values: a new list; NULL without an error set for anything else (Python's walk). */
static PyObject *events_flatten(ModuleEvents *self, PyObject *obj) {
    PyTypeObject *tensor = (PyTypeObject *)self->tensor_type;
    if (PyObject_TypeCheck(obj, tensor)) return list_of(obj, NULL);
    if (!PyTuple_CheckExact(obj) && !PyList_CheckExact(obj)) return NULL;
    PyObject *seq = PySequence_Fast(obj, "");
    if (!seq) return NULL;
    PyObject *found = PyList_New(0);
    for (Py_ssize_t k = 0; found && k < PySequence_Fast_GET_SIZE(seq); k++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, k);
        if (PyObject_TypeCheck(item, tensor)) {
            if (PyList_Append(found, item) < 0) Py_CLEAR(found);
        } else if (!(item == Py_None || PyLong_Check(item) || PyFloat_Check(item) ||
                     PyUnicode_Check(item))) {
            Py_CLEAR(found); /* (bool is an int) a container or an object: Python */
        }
    }
    Py_DECREF(seq);
    return found;
}

/* The producers of ``tensors`` (Labeller._producer): a new list of ints; NULL without an
 * error set where one was written through a view (Python's _aliased). */
static PyObject *events_producers(ModuleEvents *self, PyObject *tensors) {
    Py_ssize_t n = PyList_GET_SIZE(tensors);
    PyObject *out = PyList_New(n);
    for (Py_ssize_t k = 0; out && k < n; k++) {
        PyObject *t = PyList_GET_ITEM(tensors, k), *found = NULL;
        PyObject *key = id_key(t);
        if (!key) goto fail;
        PyObject *index = PyDict_GetItemWithError(self->producers, key);
        if (index) {
            Py_ssize_t i = PyLong_AsSsize_t(index);
            if (i == -1 && PyErr_Occurred()) PyErr_Clear(); /* (not an index: Python) */
            else if (i >= 0 && i < PyList_GET_SIZE(self->refs) &&
                     PyWeakref_Check(PyList_GET_ITEM(self->refs, i)) &&
                     referent_is(PyList_GET_ITEM(self->refs, i), t))
                found = index;
        }
        if (!found && !PyErr_Occurred()) {
            PyObject *known = PyDict_GetItemWithError(self->params, key);
            if (known && !PyUnicode_CheckExact(known) && !PyTuple_CheckExact(known)) {
                Py_DECREF(key);
                Py_CLEAR(out); /* an alias: Python finds the write through the view */
                return NULL;
            }
            found = int_minus_one;
        }
        Py_DECREF(key);
        if (PyErr_Occurred()) goto fail;
        Py_INCREF(found);
        PyList_SET_ITEM(out, k, found);
    }
    return out;
fail:
    Py_XDECREF(out);
    return NULL;
}

/* 1: the call's entry made; 0: Python's (nothing changed); -1: an error (set). */
static int events_enter(ModuleEvents *self, PyObject *module, PyObject *args,
                        PyObject *kwargs) {
    PyObject *tensors = NULL, *producers = NULL, *count = NULL, *start = NULL, *name = NULL,
             *entry = NULL, *frame = NULL, *indices = NULL, *key = NULL, *r = NULL,
             *values = NULL, *given = NULL, *more = NULL;
    int done = 0;
    PyObject *path = events_path(self, module);
    if (!path) return PyErr_Occurred() ? -1 : 1; /* not one of the model's: nothing */
    Py_INCREF(path);
    if (!(tensors = events_flatten(self, args)) || !(producers = events_producers(self, tensors)))
        goto out;
    if (kwargs && kwargs != Py_None) {
        /* the keyword arguments' tensors are given too (what an output handed back is
         * looked for among): a dict of tensors and plain values here, else Python */
        if (!PyDict_CheckExact(kwargs)) goto out;
        if (PyDict_GET_SIZE(kwargs)) {
            PyObject *kw_tensors = (values = PyDict_Values(kwargs)) ? events_flatten(self, values)
                                                                   : NULL;
            more = kw_tensors ? events_producers(self, kw_tensors) : NULL;
            Py_XDECREF(kw_tensors);
            if (!more) goto out;
        }
    }
    if (PyList_GET_SIZE(self->live) != 3) goto out;
    /* -- from here on, the changes (an error: -1, as Python's would raise part way) -- */
    done = -1;
    PyObject *before = PyDict_GetItemWithError(self->calls, path);
    if (!before && PyErr_Occurred()) goto out;
    int repeated = before != NULL; /* calls > 1 (before: borrowed, replaced below) */
    if (!(count = before ? next_int(before) : (Py_INCREF(int_one), int_one))) goto out;
    if (PyDict_SetItem(self->calls, path, count) < 0) goto out;
    if (!(start = shared_int(PyList_GET_SIZE(self->rows)))) goto out;
    if (!repeated) { /* the first call (calls == 1) */
        PyObject *span = list_of(start, int_minus_one);
        int failed = !span || PyDict_SetItem(self->first_call, path, span) < 0;
        Py_XDECREF(span);
        if (failed) goto out;
    }
    if (!(name = PyType_GetName(Py_TYPE(module))) ||
        !(key = shared_int(PyList_GET_SIZE(self->entries))))
        goto out;
    PyObject *made[4] = {path, name, count, key};
    if (!(entry = PyObject_Vectorcall(self->entry_type, made, 4, NULL))) goto out;
    if (!(indices = PyList_AsTuple(producers)) ||
        PyObject_SetAttr(entry, str_input_indices, indices) < 0)
        goto out;
    PyObject *framed[5] = {module, path, count, start, entry};
    if (!(frame = PyObject_Vectorcall(self->frame_type, framed, 5, NULL))) goto out;
    if (more) {
        PyObject *extra = PyList_AsTuple(more);
        given = extra ? PySequence_Concat(indices, extra) : NULL;
        Py_XDECREF(extra);
        if (!given || PyObject_SetAttr(frame, str_given, given) < 0) goto out;
    }
    Py_ssize_t depth = PyList_GET_SIZE(self->stack);
    PyObject *root = Py_None;
    Py_INCREF(root);
    if (depth > 0) {
        Py_DECREF(root);
        if (!(root = PyObject_GetAttr(PyList_GET_ITEM(self->stack, depth - 1), str_root)))
            goto out;
    }
    if (root == Py_None && repeated) { /* a repeated call roots its ops */
        Py_DECREF(root);
        root = frame;
        Py_INCREF(root);
    }
    if (root != Py_None && PyObject_SetAttr(frame, str_root, root) < 0) {
        Py_DECREF(root);
        goto out;
    }
    if (PyErr_Occurred() || PyList_Append(self->stack, frame) < 0) {
        Py_DECREF(root);
        goto out;
    }
    PyObject *pair = PyTuple_Pack(2, path, count);
    PyObject *stack_key = pair ? PyTuple_Pack(1, pair) : NULL;
    PyObject *longer = stack_key ? PySequence_Concat(PyList_GET_ITEM(self->live, LIVE_STACK_KEY),
                                                     stack_key)
                                 : NULL;
    Py_XDECREF(pair);
    Py_XDECREF(stack_key);
    if (!longer || PyList_SetItem(self->live, LIVE_STACK_KEY, longer) < 0 ||
        PyList_SetItem(self->live, LIVE_ROOT, root) < 0) { /* (both steal) */
        if (!longer) Py_DECREF(root);
        goto out;
    }
    if (PyList_Append(self->entries, entry) < 0) goto out;
    PyObject *emitted[3] = {entry, tensors, producers};
    if (!(r = PyObject_Vectorcall(self->emit_enter, emitted, 3, NULL))) goto out;
    done = 1;
out:
    if (done == 0) PyErr_Clear();
    PyObject *const owned[] = {path,  tensors, producers, count, start,  name, entry,
                               frame, indices, key,      r,     values, given, more};
    for (size_t k = 0; k < sizeof owned / sizeof *owned; k++) Py_XDECREF(owned[k]);
    return done;
}

/* Whether any producer (>= 0) is among ``given`` (a tuple of ints). -1: an error. */
static int events_handed_back(PyObject *producers, PyObject *given) {
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(producers); k++) {
        PyObject *p = PyList_GET_ITEM(producers, k);
        if (PyObject_RichCompareBool(p, int_zero, Py_GE) != 1) continue;
        int in = PySequence_Contains(given, p);
        if (in != 0) return in;
    }
    return 0;
}

/* Labeller._is_identity: whether the module's class is named Identity (in any case), as
 * TorchLens tells, in the labeller's cache of classes. 1, 0, or -1 (an error set). */
static int events_identity(ModuleEvents *self, PyObject *module) {
    PyObject *cls = (PyObject *)Py_TYPE(module);
    PyObject *known = PyDict_GetItemWithError(self->identities, cls);
    if (known) return known == Py_True;
    if (PyErr_Occurred()) return -1;
    PyObject *name = PyType_GetName(Py_TYPE(module));
    PyObject *lower = name ? PyObject_CallMethod(name, "lower", NULL) : NULL;
    Py_XDECREF(name);
    if (!lower) return -1;
    int identity = PyUnicode_Check(lower) && PyUnicode_CompareWithASCIIString(lower, "identity") == 0;
    Py_DECREF(lower);
    if (PyDict_SetItem(self->identities, cls, identity ? Py_True : Py_False) < 0) return -1;
    return identity;
}

/* 1: the call's entry completed; 0: Python's (nothing changed); -1: an error (set). */
static int events_exit(ModuleEvents *self, PyObject *module, PyObject *output) {
    PyObject *tensors = NULL, *producers = NULL, *frame = NULL, *end = NULL, *pass = NULL,
             *fpath = NULL, *entry = NULL, *start = NULL, *span = NULL, *indices = NULL,
             *root = NULL, *r = NULL, *field = NULL;
    int done = 0;
    if (!events_path(self, module)) return PyErr_Occurred() ? -1 : 1;
    Py_ssize_t top = PyList_GET_SIZE(self->stack) - 1, depth = top;
    for (; depth >= 0; depth--) {
        field = PyObject_GetAttr(PyList_GET_ITEM(self->stack, depth), str_module);
        if (!field) goto out;
        int found = field == module;
        Py_CLEAR(field);
        if (found) break;
    }
    if (depth < 0) return 1; /* not on the stack: nothing (as Python) */
    frame = PyList_GET_ITEM(self->stack, depth);
    Py_INCREF(frame);
    if (!(tensors = events_flatten(self, output)) ||
        !(producers = events_producers(self, tensors)))
        goto out;
    if (PyList_GET_SIZE(producers) && depth == top) {
        /* an Identity, or an output handed back from the inputs: Python's identity op */
        int identity = events_identity(self, module);
        if (identity != 0) goto out;
        if (!(field = PyObject_GetAttr(frame, str_given)) || !PyTuple_CheckExact(field) ||
            events_handed_back(producers, field) != 0)
            goto out;
        Py_CLEAR(field);
    }
    if (!(field = PyObject_GetAttr(self->labeller, str_aliases)) || field != Py_False) goto out;
    Py_CLEAR(field);
    if (PyList_GET_SIZE(self->live) != 3 || !(pass = PyObject_GetAttr(frame, str_pass_num)) ||
        !(fpath = PyObject_GetAttr(frame, str_path)) ||
        !(entry = PyObject_GetAttr(frame, str_entry)) ||
        !(start = PyObject_GetAttr(frame, str_start)))
        goto out;
    PyObject *key = PyList_GET_ITEM(self->live, LIVE_STACK_KEY);
    if (!PyTuple_CheckExact(key) || PyTuple_GET_SIZE(key) < depth) goto out;
    if (depth > 0 &&
        !(root = PyObject_GetAttr(PyList_GET_ITEM(self->stack, depth - 1), str_root)))
        goto out;
    /* -- from here on, the changes -- */
    done = -1;
    PyObject *shorter = PyTuple_GetSlice(key, 0, depth);
    if (!shorter || PyList_SetSlice(self->stack, depth, top + 1, NULL) < 0) {
        Py_XDECREF(shorter);
        goto out;
    }
    if (PyList_SetItem(self->live, LIVE_STACK_KEY, shorter) < 0) goto out;
    PyObject *now = root ? root : Py_None;
    Py_INCREF(now);
    if (PyList_SetItem(self->live, LIVE_ROOT, now) < 0) goto out;
    if (!(end = shared_int(PyList_GET_SIZE(self->rows)))) goto out;
    if (PyObject_RichCompareBool(pass, int_one, Py_EQ) == 1) {
        PyObject *first = PyDict_GetItemWithError(self->first_call, fpath);
        if (!first) {
            if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, fpath);
            goto out;
        }
        if (PyObject_SetItem(first, int_one, end) < 0) goto out;
    }
    if (PyErr_Occurred()) goto out;
    if (!(span = PyTuple_Pack(2, start, end)) || PyObject_SetAttr(entry, str_op_range, span) < 0 ||
        !(indices = PyList_AsTuple(producers)) ||
        PyObject_SetAttr(entry, str_output_indices, indices) < 0)
        goto out;
    PyObject *emitted[4] = {entry, output, tensors, producers};
    if (!(r = PyObject_Vectorcall(self->emit_exit, emitted, 4, NULL))) goto out;
    done = 1;
out:
    if (done == 0) PyErr_Clear();
    PyObject *const owned[] = {tensors, producers, frame, end,     pass, fpath, entry,
                               start,   span,      indices, root, r,    field};
    for (size_t k = 0; k < sizeof owned / sizeof *owned; k++) Py_XDECREF(owned[k]);
    return done;
}

static PyObject *ModuleEvents_enter(ModuleEvents *self, PyObject *const *a, Py_ssize_t n) {
    if (!self->enter_fallback) {
        PyErr_SetString(PyExc_RuntimeError, "ModuleEvents was cleared");
        return NULL;
    }
    if (n == 2 || n == 3) {
        int r = events_enter(self, a[0], a[1], n == 3 ? a[2] : NULL);
        if (r < 0) return NULL;
        if (r > 0) Py_RETURN_NONE;
    }
    return PyObject_Vectorcall(self->enter_fallback, a, n, NULL);
}

static PyObject *ModuleEvents_exit(ModuleEvents *self, PyObject *const *a, Py_ssize_t n) {
    if (!self->exit_fallback) {
        PyErr_SetString(PyExc_RuntimeError, "ModuleEvents was cleared");
        return NULL;
    }
    if (n == 2) {
        int r = events_exit(self, a[0], a[1]);
        if (r < 0) return NULL;
        if (r > 0) Py_RETURN_NONE;
    }
    return PyObject_Vectorcall(self->exit_fallback, a, n, NULL);
}

static PyMethodDef ModuleEvents_methods[] = {
    {"enter", (PyCFunction)(void (*)(void))ModuleEvents_enter, METH_FASTCALL,
     "enter(module, args, kwargs=None): Labeller.on_module_enter."},
    {"exit", (PyCFunction)(void (*)(void))ModuleEvents_exit, METH_FASTCALL,
     "exit(module, output): Labeller.on_module_exit."},
    {NULL},
};

/* ModuleEvents(labeller, enter_fallback, exit_fallback, modules, calls, first_call, rows,
 *              entries, stack, live, producers, refs, params, identities, entry_type,
 *              frame_type, emit_enter, emit_exit, tensor_type) */
static PyObject *ModuleEvents_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    enum { N = 19 };
    PyObject *v[N];
    if (entry_args("ModuleEvents", args, kwargs, N, v) < 0) return NULL;
    if (!PyDict_CheckExact(v[3]) || !PyDict_CheckExact(v[4]) || !PyDict_CheckExact(v[5]) ||
        !PyList_CheckExact(v[6]) || !PyList_CheckExact(v[7]) || !PyList_CheckExact(v[8]) ||
        !PyList_CheckExact(v[9]) || !PyDict_Check(v[10]) || !PyList_CheckExact(v[11]) ||
        !PyDict_CheckExact(v[12]) || !PyDict_CheckExact(v[13]) || !PyType_Check(v[18])) {
        PyErr_SetString(PyExc_TypeError, "ModuleEvents: wrong arguments");
        return NULL;
    }
    ModuleEvents *self = (ModuleEvents *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    PyObject **const fields[N] = {
        &self->labeller,   &self->enter_fallback, &self->exit_fallback, &self->modules,
        &self->calls,      &self->first_call,     &self->rows,          &self->entries,
        &self->stack,      &self->live,           &self->producers,     &self->refs,
        &self->params,     &self->identities,     &self->entry_type,    &self->frame_type,
        &self->emit_enter, &self->emit_exit,      &self->tensor_type};
    keep_refs(fields, v, N);
    return (PyObject *)self;
}

static PyTypeObject ModuleEventsType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tracelake.recorder._hot.ModuleEvents",
    .tp_basicsize = sizeof(ModuleEvents),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Labeller.on_module_enter and on_module_exit for the common module call "
              "(see recorder/_hot.c).",
    .tp_traverse = (traverseproc)ModuleEvents_traverse,
    .tp_clear = (inquiry)ModuleEvents_clear,
    .tp_dealloc = (destructor)ModuleEvents_dealloc,
    .tp_methods = ModuleEvents_methods,
    .tp_new = ModuleEvents_new,
};

#if defined(__unix__) || defined(__APPLE__)
#include <errno.h>
#include <stdlib.h>
#include <sys/uio.h>
#include <unistd.h>

/* A raw pack's shard, written: its inner chunks each followed by its CRC32C, a last
 * partial one padded with zeros, then the index ((offset, nbytes) little-endian uint64
 * per slot, all ones where absent) and the index's CRC32C: format.encode_shard's bytes,
 * without a Python object per piece. */
#define SHARD_ZEROS (1 << 16)
static const unsigned char shard_zeros[SHARD_ZEROS];

static void put_le32(unsigned char *p, uint32_t v) {
    for (int k = 0; k < 4; k++) p[k] = (unsigned char)(v >> (8 * k));
}

static void put_le64(unsigned char *p, uint64_t v) {
    for (int k = 0; k < 8; k++) p[k] = (unsigned char)(v >> (8 * k));
}

/* Write every iovec (short writes finished, EINTR retried): 0, or -1 with errno set. */
static int writev_all(int fd, struct iovec *iov, int n) {
    while (n > 0) {
        ssize_t done = writev(fd, iov, n > 1024 ? 1024 : n);
        if (done < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        while (n > 0 && (size_t)done >= iov->iov_len) done -= (ssize_t)iov->iov_len, iov++, n--;
        if (n > 0) iov->iov_base = (char *)iov->iov_base + done, iov->iov_len -= (size_t)done;
    }
    return 0;
}

#include <fcntl.h>
#ifndef O_DIRECT
#define O_DIRECT 0
#endif
#define DIRECT_ALIGN 4096 /* O_DIRECT: buffer address, file offset and length aligned so */

static int write_all(int fd, const unsigned char *p, size_t n) {
    while (n > 0) {
        ssize_t done = write(fd, p, n);
        if (done < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        p += done, n -= (size_t)done;
    }
    return 0;
}

/* Write the n bytes at stage (DIRECT_ALIGN-aligned) to fd, a new file opened O_DIRECT:
 * the whole blocks straight to the device, the last partial block through the page
 * cache (O_DIRECT cleared), and everything so where the filesystem refuses the direct
 * write (EINVAL). 1: the blocks went direct, 0: all buffered, -1 with errno: failed. */
static int write_staged(int fd, const unsigned char *stage, size_t n) {
    size_t head = n & ~(size_t)(DIRECT_ALIGN - 1);
    int direct = 1;
    if (head && write_all(fd, stage, head) < 0) {
        if (errno != EINVAL || lseek(fd, 0, SEEK_CUR) != 0) return -1;
        direct = 0, head = 0;
    }
    int flags = fcntl(fd, F_GETFL);
    if (flags < 0 || fcntl(fd, F_SETFL, flags & ~O_DIRECT) < 0) return -1;
    return write_all(fd, stage + head, n - head) < 0 ? -1 : direct;
}

/* write_raw_shard(fd, address, nbytes, inner, slots, refs, nrefs[, stage, stage_bytes]):
 * write the shard of the nbytes at address (inner chunks of `inner` bytes, at most
 * `slots` of them) to fd; return the bytes written. refs: the address of nrefs rows of
 * four int64s (first inner chunk, how many, their bytes' address, the address of their
 * uint32 CRC32Cs or 0): whole inner chunks read there instead. With stage (DIRECT_ALIGN-
 * aligned, stage_bytes long, the whole shard fits): fd is a new file opened O_DIRECT;
 * the shard is gathered there (each inner chunk's CRC32C taken from the copy, still in
 * cache) and written by write_staged; return (bytes, whether its blocks went directly).
 * The GIL is released meanwhile. */
static PyObject *write_raw_shard_py(PyObject *module, PyObject *const *a, Py_ssize_t nargs) {
    if (nargs != 7 && nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "write_raw_shard(fd, address, nbytes, inner, slots, "
                                         "refs, nrefs[, stage, stage_bytes])");
        return NULL;
    }
    unsigned char *stage = nargs == 9 ? PyLong_AsVoidPtr(a[7]) : NULL;
    Py_ssize_t stage_bytes = nargs == 9 ? PyLong_AsSsize_t(a[8]) : 0;
    int fd = PyLong_AsLong(a[0]);
    const unsigned char *data = PyLong_AsVoidPtr(a[1]);
    Py_ssize_t nbytes = PyLong_AsSsize_t(a[2]), inner = PyLong_AsSsize_t(a[3]);
    Py_ssize_t slots = PyLong_AsSsize_t(a[4]);
    const int64_t *refs = PyLong_AsVoidPtr(a[5]);
    Py_ssize_t nrefs = PyLong_AsSsize_t(a[6]);
    if (PyErr_Occurred()) return NULL;
    Py_ssize_t count = inner > 0 ? (nbytes + inner - 1) / inner : 0;
    if (fd < 0 || nbytes < 0 || (nbytes && !data) || inner <= 0 || inner > SHARD_ZEROS ||
        slots <= 0 || slots > 4096 || count > slots || nrefs < 0 || (nrefs && !refs) ||
        (stage && ((uintptr_t)stage % DIRECT_ALIGN ||
                   stage_bytes < count * (inner + 4) + 16 * slots + 4))) {
        PyErr_SetString(PyExc_ValueError, "write_raw_shard: bad shard");
        return NULL;
    }
    for (Py_ssize_t r = 0; r < nrefs; r++) {
        const int64_t *row = refs + 4 * r;
        if (row[0] < 0 || row[1] < 0 || (row[0] + row[1]) * inner > nbytes || !row[2]) {
            PyErr_SetString(PyExc_ValueError, "write_raw_shard: a reference past the shard");
            return NULL;
        }
    }
    const unsigned char **at = malloc(sizeof(*at) * (size_t)(count + 1));
    unsigned char *crcs = malloc(4 * (size_t)(count + 1));
    unsigned char *known = calloc((size_t)count + 1, 1);
    unsigned char *table = malloc(16 * (size_t)slots + 4);
    struct iovec *iov = malloc(sizeof(*iov) * (size_t)(2 * count + 3));
    if (!at || !crcs || !known || !table || !iov) {
        free(at), free(crcs), free(known), free(table), free(iov);
        return PyErr_NoMemory();
    }
    int failed = 0, error = 0, direct = 0;
    Py_ssize_t total = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t j = 0; j < count; j++) at[j] = data + j * inner;
    for (Py_ssize_t r = 0; r < nrefs; r++) {
        const int64_t *row = refs + 4 * r;
        const unsigned char *src = (const unsigned char *)(intptr_t)row[2];
        const uint32_t *given = (const uint32_t *)(intptr_t)row[3];
        for (int64_t k = 0; k < row[1]; k++) {
            at[row[0] + k] = src + k * inner;
            if (given) put_le32(crcs + 4 * (row[0] + k), given[k]), known[row[0] + k] = 1;
        }
    }
    Py_ssize_t last = nbytes - (count - 1) * inner; /* bytes of the last inner chunk */
    Cut cut = crc32c_cut((size_t)inner);
    unsigned char *into = stage; /* staged: where the next inner chunk is gathered */
    int n = 0;
    for (Py_ssize_t j = 0; j < count; j++) {
        Py_ssize_t size = j == count - 1 ? last : inner;
        if (into) {
            memcpy(into, at[j], (size_t)size);
            if (size < inner) memset(into + size, 0, (size_t)(inner - size));
        }
        if (!known[j]) {
            uint32_t crc;
            if (into) /* (of the copy, still in cache) */
                crc = crc32c_with(0, into, (size_t)inner, cut);
            else {
                crc = size == inner ? crc32c_with(0, at[j], (size_t)inner, cut)
                                    : crc32c(0, at[j], (size_t)size);
                if (size < inner) crc = crc32c(crc, shard_zeros, (size_t)(inner - size));
            }
            put_le32(crcs + 4 * j, crc);
        }
        if (into) {
            memcpy(into + inner, crcs + 4 * j, 4);
            into += inner + 4;
        } else {
            iov[n].iov_base = (void *)at[j], iov[n++].iov_len = (size_t)size;
            if (size < inner)
                iov[n].iov_base = (void *)shard_zeros, iov[n++].iov_len = (size_t)(inner - size);
            iov[n].iov_base = crcs + 4 * j, iov[n++].iov_len = 4;
        }
        total += inner + 4;
    }
    unsigned char *index = into ? into : table;
    for (Py_ssize_t j = 0; j < slots; j++) {
        int here = j < count;
        put_le64(index + 16 * j, here ? (uint64_t)(j * (inner + 4)) : UINT64_MAX);
        put_le64(index + 16 * j + 8, here ? (uint64_t)(inner + 4) : UINT64_MAX);
    }
    put_le32(index + 16 * slots, crc32c(0, index, 16 * (size_t)slots));
    total += 16 * slots + 4;
    if (stage) {
        direct = write_staged(fd, stage, (size_t)total);
        if (direct < 0) failed = 1, error = errno;
    } else {
        iov[n].iov_base = table, iov[n++].iov_len = 16 * (size_t)slots + 4;
        if (writev_all(fd, iov, n) < 0) failed = 1, error = errno;
    }
    Py_END_ALLOW_THREADS
    free(at), free(crcs), free(known), free(table), free(iov);
    if (failed) {
        errno = error;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (stage) return Py_BuildValue("(nO)", total, direct ? Py_True : Py_False);
    return PyLong_FromSsize_t(total);
}
#define WRITE_RAW_SHARD                                                                    \
    {"write_raw_shard", (PyCFunction)(void (*)(void))write_raw_shard_py, METH_FASTCALL,    \
     "write_raw_shard(fd, address, nbytes, inner, slots, refs, nrefs[, stage, "          \
     "stage_bytes]): a raw pack's shard written to fd (store/format.py)."},
#else
#define WRITE_RAW_SHARD
#endif

/* producers_dict(): an empty dict with room for as many items as the last recording
 * made rows (rows_hint): the next recording's producers dict, which gets an item per
 * row, then never grows (each growth rehashes every item). */
static PyObject *producers_dict(PyObject *module, PyObject *Py_UNUSED(ignored)) {
#if PY_VERSION_HEX < 0x030D0000
    if (rows_hint > 0 && rows_hint <= RESERVE_MAX) return _PyDict_NewPresized(rows_hint);
#endif
    return PyDict_New();
}

/* may_hold(attrs, every, private, holders): held._may_hold's answer for a module's
 * __dict__ (``every``: the attributes every module has; ``private``: the prefixes of
 * names the scan skips; ``holders``: the types it looks into, isinstance's tuple), without
 * a set or a frame per module; None where it meets a key that is not a str (Python's
 * rule then answers, as it would have). */
static PyObject *may_hold(PyObject *module, PyObject *const *a, Py_ssize_t n) {
    if (n != 4 || !PyDict_Check(a[0]) || !PyAnySet_Check(a[1]) || !PyTuple_Check(a[2])) {
        PyErr_SetString(PyExc_TypeError, "may_hold(attrs, every, private, holders)");
        return NULL;
    }
    PyObject *attrs = a[0], *every = a[1], *prefixes = a[2], *holders = a[3];
    PyObject *key, *value;
    Py_ssize_t at = 0;
    int found = 0;
    Py_INCREF(attrs); /* (isinstance may run Python code) */
    while (!found && PyDict_Next(attrs, &at, &key, &value)) {
        if (!PyUnicode_Check(key)) {
            Py_DECREF(attrs);
            Py_RETURN_NONE;
        }
        int r = PySet_Contains(every, key);
        if (r != 0) {
            if (r < 0) goto fail;
            continue;
        }
        if (scalar_value(value))
            continue; /* (what most attributes are: never a holder, no isinstance asked) */
        Py_INCREF(key);
        Py_INCREF(value);
        r = PyObject_IsInstance(value, holders);
        int private = 0;
        for (Py_ssize_t k = 0; r > 0 && !private && k < PyTuple_GET_SIZE(prefixes); k++) {
            Py_ssize_t m = PyUnicode_Tailmatch(key, PyTuple_GET_ITEM(prefixes, k), 0,
                                               PY_SSIZE_T_MAX, -1);
            if (m < 0) r = -1;
            private = m > 0;
        }
        if (r > 0 && !private) {
            int sequence = PyObject_IsInstance(value, (PyObject *)&PyList_Type);
            if (sequence == 0) sequence = PyObject_IsInstance(value, (PyObject *)&PyTuple_Type);
            if (sequence < 0) r = -1;
            if (sequence > 0) {
                /* a sequence of numbers and strings gives the scan no tensor */
                PyObject *items = PySequence_Fast(value, "a list or tuple");
                r = items ? 0 : -1;
                for (Py_ssize_t k = 0; items && r == 0 && k < PySequence_Fast_GET_SIZE(items);
                     k++) {
                    PyObject *item = PySequence_Fast_GET_ITEM(items, k);
                    Py_INCREF(item);
                    r = PyObject_IsInstance(item, holders);
                    Py_DECREF(item);
                }
                Py_XDECREF(items);
            }
            found = r > 0;
        }
        Py_DECREF(value);
        Py_DECREF(key);
        if (r < 0) goto fail;
    }
    Py_DECREF(attrs);
    return PyBool_FromLong(found);
fail:
    Py_DECREF(attrs);
    return NULL;
}

static PyMethodDef hot_functions[] = {
    {"producers_dict", producers_dict, METH_NOARGS,
     "producers_dict(): an empty dict sized for the last recording's rows."},
    {"moments_f32", (PyCFunction)(void (*)(void))moments_f32_py, METH_FASTCALL,
     "moments_f32(address, run, count, step[, pass]): one pass's moments of float32s "
     "(recorder/stats.py)."},
    {"moment_passes", moment_passes, METH_NOARGS,
     "moment_passes(): {name: pass} of moments_f32's implementations this processor runs."},
    {"crc32c", (PyCFunction)(void (*)(void))crc32c_py, METH_FASTCALL,
     "crc32c(address, nbytes[, hardware]): the CRC32C of the bytes at address."},
    {"crc_moments_f32", (PyCFunction)(void (*)(void))crc_moments_f32_py, METH_FASTCALL,
     "crc_moments_f32(address, count, skip, blocks, block, crcs): moments_f32 and the "
     "CRC32C of each block in one pass (store/writer.py)."},
    WRITE_RAW_SHARD
    {"may_hold", (PyCFunction)(void (*)(void))may_hold, METH_FASTCALL,
     "may_hold(attrs, every, private, holders): held._may_hold of a module's "
     "__dict__ (None: a key that is not a str)."},
    {"labels", (PyCFunction)(void (*)(void))labels, METH_FASTCALL,
     "labels(rows, passes): every entry's final label (OpTable.finish)."},
    {"same_rows", (PyCFunction)(void (*)(void))same_rows, METH_FASTCALL,
     "same_rows(a, b): a == b for two tuples of rows, identity checked inline first."},
    {NULL},
};

static struct PyModuleDef hot_module = {
    PyModuleDef_HEAD_INIT, "_hot", "The recorder's compiled hot path.", -1, hot_functions,
};

PyMODINIT_FUNC PyInit__hot(void) {
    crc32c_init();
    find_defaulted();
#ifdef HAVE_SIMD
    crc32c_hardware = __builtin_cpu_supports("sse4.2");
    has_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    has_avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("popcnt");
#endif
#define INTERN(var, text)                                                                  \
    if (!(var = PyUnicode_InternFromString(text))) return NULL;
    INTERN(str_shape, "shape")
    INTERN(str_dtype, "dtype")
    INTERN(str_device, "device")
    INTERN(str_is_cpu, "is_cpu")
    INTERN(str_op, "op")
    INTERN(str_out, "out")
    INTERN(str_inplace, "inplace")
    INTERN(str_used, "used")
    INTERN(str_address, "address")
    INTERN(str_buffer, "buffer")
    INTERN(str_chunk, "chunk")
    INTERN(str_name, "name")
    INTERN(str_members, "members")
    INTERN(str_step, "step")
    INTERN(str_torch_function, "__torch_function__")
    INTERN(str_module, "module")
    INTERN(str_root, "root")
    INTERN(str_given, "given")
    INTERN(str_pass_num, "pass_num")
    INTERN(str_start, "start")
    INTERN(str_entry, "entry")
    INTERN(str_path, "path")
    INTERN(str_input_indices, "input_indices")
    INTERN(str_output_indices, "output_indices")
    INTERN(str_op_range, "op_range")
    INTERN(str_aliases, "_aliases")
#undef INTERN
    if (!(int_zero = PyLong_FromLong(0)) || !(int_one = PyLong_FromLong(1)) ||
        !(int_minus_one = PyLong_FromLong(-1)) || !(empty_tuple = PyTuple_New(0)))
        return NULL;
    for (int k = 0; k < MAX_ITEMS; k++) {
        PyObject *pos = PyLong_FromLong(k);
        if (!pos || !(single_where[k] = PyTuple_Pack(1, pos))) return NULL;
        Py_DECREF(pos);
    }
    if (PyType_Ready(&FusedType) < 0 || PyType_Ready(&PackerType) < 0 ||
        PyType_Ready(&ReducerType) < 0 || PyType_Ready(&FusedCallType) < 0 ||
        PyType_Ready(&ModuleEventsType) < 0)
        return NULL;
    /* (borrowed: the type's dict keeps it for the process) */
    if (!(fused_tf = PyDict_GetItemWithError(FusedType.tp_dict, str_torch_function))) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_SystemError, "Fused.__torch_function__");
        return NULL;
    }
    PyObject *m = PyModule_Create(&hot_module);
    if (!m) return NULL;
    Py_INCREF(&FusedType);
    if (PyModule_AddObject(m, "Fused", (PyObject *)&FusedType) < 0) {
        Py_DECREF(&FusedType);
        Py_DECREF(m);
        return NULL;
    }
    PyTypeObject *types[3] = {&PackerType, &ReducerType, &ModuleEventsType};
    const char *names[3] = {"Packer", "Reducer", "ModuleEvents"};
    for (int k = 0; k < 3; k++) {
        Py_INCREF(types[k]);
        if (PyModule_AddObject(m, names[k], (PyObject *)types[k]) < 0) {
            Py_DECREF(types[k]);
            Py_DECREF(m);
            return NULL;
        }
    }
    /* The row layout this build was compiled for: compiled.py uses the extension only
     * when it matches the declaration's. */
    if (PyModule_AddStringConstant(m, "ROW_FIELDS", ROW_FIELD_NAMES) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    /* The pass's lanes: a row cut at a multiple of this many elements gives the bits of
     * the whole (crc_moments_f32's blocks start at such cuts). */
    if (PyModule_AddIntConstant(m, "MOMENT_LANES", LANES) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
