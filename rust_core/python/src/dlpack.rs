//! torch tensors in and out without numpy, through DLPack's C exchange API
//! (`torch.Tensor.__dlpack_c_exchange_api__`, a table of C functions that torch publishes for
//! libraries like this one).
//!
//! Why: at decode, every Python-level conversion costs 10-40 us once a cache flush (or the rest
//! of a model) has evicted its code, and a checked numpy round trip cost ~0.1 ms of a ~1 ms
//! layer. Through the table an argument is read with one C call and the output becomes a torch
//! tensor with one more, the output owning our buffer (no copy).
//!
//! Only plain `torch.Tensor`s (the exact type the table was read from, as the protocol asks) on
//! the CPU, row-major, of the dtypes the forward takes, are read here; [`view`] answers `None`
//! for anything else and the caller takes its checked Python path, which names the argument in
//! its error. torch builds without the table (before DLPack 1.2) always take that path.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::atomic::{AtomicUsize, Ordering};

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

use crate::repack::layout_error;

#[repr(C)]
#[derive(Clone, Copy)]
struct Version {
    major: u32,
    minor: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct Device {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct DataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct Tensor {
    data: *mut c_void,
    device: Device,
    ndim: i32,
    dtype: DataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct ManagedTensor {
    version: Version,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut ManagedTensor)>,
    flags: u64,
    dl_tensor: Tensor,
}

#[repr(C)]
struct ApiHeader {
    version: Version,
    prev_api: *mut ApiHeader,
}

type SetError = unsafe extern "C" fn(*mut c_void, *const c_char, *const c_char);

/// `DLPackExchangeAPI` of DLPack 1.x (fields in the header's order).
#[repr(C)]
struct ExchangeApi {
    header: ApiHeader,
    managed_tensor_allocator: Option<
        unsafe extern "C" fn(
            *mut Tensor,
            *mut *mut ManagedTensor,
            *mut c_void,
            Option<SetError>,
        ) -> c_int,
    >,
    managed_tensor_from_py_object_no_sync:
        Option<unsafe extern "C" fn(*mut c_void, *mut *mut ManagedTensor) -> c_int>,
    managed_tensor_to_py_object_no_sync:
        Option<unsafe extern "C" fn(*mut ManagedTensor, *mut *mut c_void) -> c_int>,
    dltensor_from_py_object_no_sync:
        Option<unsafe extern "C" fn(*mut c_void, *mut Tensor) -> c_int>,
    current_work_stream: Option<unsafe extern "C" fn(i32, i32, *mut *mut c_void) -> c_int>,
}

const CPU: i32 = 1;
const CODE_INT: u8 = 0;
const CODE_FLOAT: u8 = 2;
const CODE_BFLOAT: u8 = 4;

/// torch's table and the type it was read from.
struct Torch {
    /// `torch.Tensor`, held so that its address cannot be reused by another type.
    tensor_type: Py<PyType>,
    /// `torch.Tensor.is_neg`, unbound: an instance attribute of that name cannot stand in.
    is_neg: Py<PyAny>,
    export: unsafe extern "C" fn(*mut c_void, *mut Tensor) -> c_int,
    import: unsafe extern "C" fn(*mut ManagedTensor, *mut *mut c_void) -> c_int,
}

/// Read once; a `PyOnceLock` so that a thread waiting on it while another reads the table
/// (which calls Python) cannot deadlock on the GIL.
static TORCH: PyOnceLock<Option<Torch>> = PyOnceLock::new();

/// Reads the exchange table of `tensor_type` (`torch.Tensor`) once per process. Later calls
/// are ignored. Answers whether the fast path is on: false when this torch publishes no table,
/// a table of another major version, or one without the non-owning export.
#[pyfunction]
pub(crate) fn cpu_use_torch_tensors(tensor_type: &Bound<'_, PyType>) -> bool {
    TORCH
        .get_or_init(tensor_type.py(), || read_table(tensor_type))
        .is_some()
}

fn read_table(tensor_type: &Bound<'_, PyType>) -> Option<Torch> {
    let capsule = tensor_type.getattr("__dlpack_c_exchange_api__").ok()?;
    const NAME: &CStr = c"dlpack_exchange_api";
    // SAFETY: `capsule` is a live object; PyCapsule_GetPointer checks that it is a capsule of
    // that name and answers NULL (with an error set, cleared below) otherwise.
    let api = unsafe { pyo3::ffi::PyCapsule_GetPointer(capsule.as_ptr(), NAME.as_ptr()) };
    if api.is_null() {
        let _ = PyErr::take(tensor_type.py());
        return None;
    }
    // SAFETY: a capsule of that name holds a `DLPackExchangeAPI*` that lives as long as the
    // process (the protocol's rule); every version of the table starts with this header.
    let header = unsafe { &*(api as *const ApiHeader) };
    if header.version.major != 1 {
        return None;
    }
    // SAFETY: as above, and a major version 1 table has the layout of `ExchangeApi`.
    let api = unsafe { &*(api as *const ExchangeApi) };
    Some(Torch {
        tensor_type: tensor_type.clone().unbind(),
        is_neg: tensor_type.getattr("is_neg").ok()?.unbind(),
        export: api.dltensor_from_py_object_no_sync?,
        import: api.managed_tensor_to_py_object_no_sync?,
    })
}

/// The element types the CPU forward reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Elem {
    F32,
    Bf16,
    F16,
    F64,
    I32,
    I64,
}

impl Elem {
    fn of(t: DataType) -> Option<Elem> {
        if t.lanes != 1 {
            return None;
        }
        Some(match (t.code, t.bits) {
            (CODE_FLOAT, 32) => Elem::F32,
            (CODE_BFLOAT, 16) => Elem::Bf16,
            (CODE_FLOAT, 16) => Elem::F16,
            (CODE_FLOAT, 64) => Elem::F64,
            (CODE_INT, 32) => Elem::I32,
            (CODE_INT, 64) => Elem::I64,
            _ => return None,
        })
    }

    fn size(self) -> usize {
        match self {
            Elem::Bf16 | Elem::F16 => 2,
            Elem::F32 | Elem::I32 => 4,
            Elem::F64 | Elem::I64 => 8,
        }
    }

    pub(crate) fn is_float(self) -> bool {
        !matches!(self, Elem::I32 | Elem::I64)
    }
}

/// A row-major `[rows, cols]` CPU tensor's data, borrowed from the Python object for the
/// length of the call.
pub(crate) struct View<'a> {
    pub(crate) elem: Elem,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    data: *const u8,
    _tensor: std::marker::PhantomData<&'a ()>,
}

/// The data of one view, typed.
#[derive(Clone, Copy)]
pub(crate) enum Values<'a> {
    F32(&'a [f32]),
    Bf16(&'a [i16]),
    F16(&'a [half::f16]),
    F64(&'a [f64]),
    I32(&'a [i32]),
    I64(&'a [i64]),
}

impl Values<'_> {
    /// The element type of these values.
    pub(crate) fn elem(&self) -> Elem {
        match self {
            Values::F32(_) => Elem::F32,
            Values::Bf16(_) => Elem::Bf16,
            Values::F16(_) => Elem::F16,
            Values::F64(_) => Elem::F64,
            Values::I32(_) => Elem::I32,
            Values::I64(_) => Elem::I64,
        }
    }
}

impl<'a> View<'a> {
    /// The tensor's values, borrowed.
    ///
    /// # Safety
    /// No Python code runs between [`view`] and the slice's last use, and no other thread
    /// resizes, `set_`s, frees or writes the tensor meanwhile: the contract of torch's own
    /// operators, which run without the GIL. (Callers copy the values before they release the
    /// GIL themselves, so that the window is the copy, not the whole forward.)
    pub(crate) unsafe fn values(&self) -> Values<'a> {
        let len = self.rows * self.cols;
        // SAFETY: `view` made `data` non-null and aligned for `elem`, and, unless `len` is 0
        // (then it is a dangling pointer, as an empty slice may have), the start of `len`
        // contiguous elements of type `elem` in a CPU tensor; the borrow of the Python object
        // (lifetime 'a) keeps the tensor alive, and the caller's contract keeps its storage
        // in place and unwritten while the slice is used. `half::f16` is a
        // `repr(transparent)` u16.
        unsafe {
            match self.elem {
                Elem::F32 => Values::F32(std::slice::from_raw_parts(self.data.cast(), len)),
                Elem::Bf16 => Values::Bf16(std::slice::from_raw_parts(self.data.cast(), len)),
                Elem::F16 => Values::F16(std::slice::from_raw_parts(self.data.cast(), len)),
                Elem::F64 => Values::F64(std::slice::from_raw_parts(self.data.cast(), len)),
                Elem::I32 => Values::I32(std::slice::from_raw_parts(self.data.cast(), len)),
                Elem::I64 => Values::I64(std::slice::from_raw_parts(self.data.cast(), len)),
            }
        }
    }
}

/// torch's eager-mode state, read by [`eager`]: the functions and modules that hold it.
struct EagerState {
    /// `torch._C._is_tracing` (inside `torch.jit.trace`).
    is_tracing: Py<PyAny>,
    /// `torch._C.is_grad_enabled`.
    grad_enabled: Py<PyAny>,
    /// `torch._C._len_torch_dispatch_stack`: how many TorchDispatchModes are active (`make_fx`'s
    /// proxy mode and `FakeTensorMode` among them).
    dispatch_modes: Py<PyAny>,
    /// `torch._C._is_torch_function_mode_enabled`: a TorchFunctionMode is active (a user's
    /// logging or tracing mode sees `torch.ops.moeq.*`, never the native call).
    function_modes: Py<PyAny>,
    /// `torch._C._len_torch_function_stack` and `_get_function_stack_at`: the active modes.
    function_stack_len: Py<PyAny>,
    function_stack_at: Py<PyAny>,
    /// `torch.utils._device.DeviceContext`: the mode of `with torch.device(...)` and
    /// `torch.set_default_device`, which changes factory functions only, so it never needs to
    /// see the op (`set_default_device("cpu")` would otherwise slow every call).
    device_context: Py<PyAny>,
    /// `torch.compiler`, whose `_is_compiling_flag` is `torch.compiler.is_compiling()`.
    compiler: Py<PyAny>,
    /// `torch.autograd.forward_ad`, whose `_current_level` is at least 0 inside a dual level.
    forward_ad: Py<PyAny>,
}

/// Read once, as [`TORCH`]; `None` where this torch lacks one of them (no fast path then).
static EAGER: PyOnceLock<Option<EagerState>> = PyOnceLock::new();

fn read_eager_state(py: Python<'_>) -> Option<EagerState> {
    let c = py.import("torch._C").ok()?;
    let compiler = py.import("torch.compiler").ok()?;
    let forward_ad = py.import("torch.autograd.forward_ad").ok()?;
    // Both flags must be there now, or the checks below could never pass.
    compiler.getattr("_is_compiling_flag").ok()?;
    forward_ad.getattr("_current_level").ok()?;
    Some(EagerState {
        is_tracing: c.getattr("_is_tracing").ok()?.unbind(),
        grad_enabled: c.getattr("is_grad_enabled").ok()?.unbind(),
        dispatch_modes: c.getattr("_len_torch_dispatch_stack").ok()?.unbind(),
        function_modes: c.getattr("_is_torch_function_mode_enabled").ok()?.unbind(),
        function_stack_len: c.getattr("_len_torch_function_stack").ok()?.unbind(),
        function_stack_at: c.getattr("_get_function_stack_at").ok()?.unbind(),
        device_context: py
            .import("torch.utils._device")
            .and_then(|m| m.getattr("DeviceContext"))
            .ok()?
            .unbind(),
        compiler: compiler.into_any().unbind(),
        forward_ad: forward_ad.into_any().unbind(),
    })
}

/// Whether a layer's forward may run natively on `tensors` without its Python wrapper's checks:
/// not inside `torch.compile`/`torch.export` (`torch.compiler.is_compiling()`; the caller has
/// ruled out dynamo's tracing, which never reaches native code), `torch.jit.trace`, a
/// TorchDispatchMode (`make_fx`, `FakeTensorMode`, a FLOP counter: each must see the op), a
/// TorchFunctionMode (likewise) or a forward-AD dual level, and no argument needs gradients
/// (the custom op's path gives those a backward that says there is none). The same answer as the wrapper's `_eager`, read in C:
/// its Python checks cost ~50 us per call once a cache flush (or the rest of a model) has
/// evicted them. Anything unexpected answers false, and the wrapper then decides.
pub(crate) fn eager(py: Python<'_>, tensors: &[&Bound<'_, PyAny>]) -> bool {
    let Some(state) = EAGER.get_or_init(py, || read_eager_state(py)).as_ref() else {
        return false;
    };
    let below_zero = |v: PyResult<Bound<'_, PyAny>>| matches!(v.and_then(|v| v.extract::<i64>()), Ok(level) if level < 0);
    if !falsy(
        state
            .compiler
            .bind(py)
            .getattr(pyo3::intern!(py, "_is_compiling_flag")),
    ) || !below_zero(
        state
            .forward_ad
            .bind(py)
            .getattr(pyo3::intern!(py, "_current_level")),
    ) || !falsy(state.is_tracing.bind(py).call0())
        || !falsy(state.dispatch_modes.bind(py).call0())
        || function_mode_active(py, state)
    {
        return false;
    }
    falsy(state.grad_enabled.bind(py).call0())
        || tensors
            .iter()
            .all(|t| falsy(t.getattr(pyo3::intern!(py, "requires_grad"))))
}

/// Whether a TorchFunctionMode other than `torch.device`'s ([`EagerState::device_context`]) is
/// active; anything unexpected answers true.
fn function_mode_active(py: Python<'_>, state: &EagerState) -> bool {
    if falsy(state.function_modes.bind(py).call0()) {
        return false;
    }
    let device_context = state.device_context.bind(py);
    let Ok(len) = state
        .function_stack_len
        .bind(py)
        .call0()
        .and_then(|v| v.extract::<usize>())
    else {
        return true;
    };
    (0..len).any(|i| {
        !matches!(
            state.function_stack_at.bind(py).call1((i,)),
            Ok(mode) if mode.get_type().is(device_context)
        )
    })
}

/// Whether `ob` is a plain `torch.Tensor` whose memory holds its values. A negative view
/// (`torch._neg_view`, the `.imag` of a conjugate view) keeps them un-negated with a flag that
/// DLPack cannot carry (torch exports the raw memory): the checked path resolves it. This may
/// run Python (a `__torch_function__` mode), so every argument is checked before any is
/// exported: nothing runs between an export and the forward that could resize a tensor.
pub(crate) fn plain(ob: &Bound<'_, PyAny>) -> bool {
    let py = ob.py();
    let Some(torch) = TORCH.get(py).and_then(Option::as_ref) else {
        return false;
    };
    ob.get_type().is(torch.tensor_type.bind(py)) && falsy(torch.is_neg.bind(py).call1((ob,)))
}

/// Whether a Python call or attribute read gave a false value (an error counts as true: the
/// callers then take their checked path).
fn falsy(v: PyResult<Bound<'_, PyAny>>) -> bool {
    matches!(v.map(|v| v.is_truthy()), Ok(Ok(false)))
}

/// `ob`, which [`plain`] accepted, as a 2-d row-major CPU tensor of a type the forward reads,
/// or `None` (another device, dimension count, dtype or layout): the caller then takes its
/// checked path, which raises the error that names the argument. Runs no Python code.
pub(crate) fn view<'a>(ob: &'a Bound<'_, PyAny>) -> Option<View<'a>> {
    let torch = TORCH.get(ob.py())?.as_ref()?;
    if !ob.get_type().is(torch.tensor_type.bind(ob.py())) {
        return None;
    }
    let mut t = Tensor {
        data: std::ptr::null_mut(),
        device: Device {
            device_type: 0,
            device_id: 0,
        },
        ndim: 0,
        dtype: DataType {
            code: 0,
            bits: 0,
            lanes: 0,
        },
        shape: std::ptr::null_mut(),
        strides: std::ptr::null_mut(),
        byte_offset: 0,
    };
    // SAFETY: `ob` is a live object of exactly the type the table was read from (the protocol's
    // precondition) and `t` is writable; the GIL is held. On failure torch sets a Python error,
    // which is cleared: the checked path reports the argument's problem in its own words.
    if unsafe { (torch.export)(ob.as_ptr().cast(), &mut t) } != 0 {
        let _ = PyErr::take(ob.py());
        return None;
    }
    if t.device.device_type != CPU || t.ndim != 2 || t.shape.is_null() {
        return None;
    }
    let elem = Elem::of(t.dtype)?;
    // SAFETY: torch filled `shape` (and `strides`, unless null: row-major) with `ndim` = 2
    // entries owned by the tensor, alive while `ob` is.
    let (shape, strides) = unsafe {
        let shape = [*t.shape, *t.shape.add(1)];
        let strides = if t.strides.is_null() {
            None
        } else {
            Some([*t.strides, *t.strides.add(1)])
        };
        (shape, strides)
    };
    let rows = usize::try_from(shape[0]).ok()?;
    let cols = usize::try_from(shape[1]).ok()?;
    // Row-major, ignoring the stride of a dimension of size 1 (as torch's is_contiguous does).
    if let Some([s0, s1]) = strides {
        if (cols > 1 && s1 != 1) || (rows > 1 && s0 != shape[1]) {
            return None;
        }
    }
    let data = if rows.checked_mul(cols)? == 0 {
        // Nothing is read: any non-null pointer aligned for every `Elem` (8 bytes) will do.
        std::ptr::NonNull::<u64>::dangling()
            .as_ptr()
            .cast_const()
            .cast::<u8>()
    } else {
        let data = (t.data as *const u8).wrapping_add(usize::try_from(t.byte_offset).ok()?);
        if data.is_null() || !(data as usize).is_multiple_of(elem.size()) {
            return None;
        }
        data
    };
    Some(View {
        elem,
        rows,
        cols,
        data,
        _tensor: std::marker::PhantomData,
    })
}

/// The element types an output tensor is made of: f32, bf16 as its bits (`i16`), `half::f16`
/// and f64. Sealed: torch may write any bits of the dtype into the buffer, which each of
/// these accepts.
pub(crate) trait Element: sealed::Sealed + Copy + Send + 'static {
    const CODE: u8;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for i16 {}
    impl Sealed for half::f16 {}
    impl Sealed for f64 {}
}

impl Element for f32 {
    const CODE: u8 = CODE_FLOAT;
}
/// bf16 values as their bits.
impl Element for i16 {
    const CODE: u8 = CODE_BFLOAT;
}
impl Element for half::f16 {
    const CODE: u8 = CODE_FLOAT;
}
impl Element for f64 {
    const CODE: u8 = CODE_FLOAT;
}

/// A `ManagedTensor` that owns the buffer it describes. `repr(C)` with the managed tensor
/// first, so that the pointer torch hands back to the deleter is a pointer to the whole.
#[repr(C)]
struct Owned<T> {
    managed: ManagedTensor,
    shape: [i64; 2],
    strides: [i64; 2],
    values: Vec<T>,
}

/// Output buffers made by [`tensor`] that torch has not freed yet.
static ALIVE: AtomicUsize = AtomicUsize::new(0);

/// How many output tensors made through DLPack still hold their buffer (for tests: each is
/// freed when torch frees its tensor).
#[pyfunction]
pub(crate) fn _cpu_torch_outputs_alive() -> usize {
    ALIVE.load(Ordering::Relaxed)
}

unsafe extern "C" fn drop_owned<T>(managed: *mut ManagedTensor) {
    if !managed.is_null() {
        ALIVE.fetch_sub(1, Ordering::Relaxed);
        // SAFETY: torch calls the deleter once, with the pointer `tensor` leaked from a
        // `Box<Owned<T>>` (the managed tensor is its first field, repr(C)); nothing reads it
        // afterwards. No Python API is touched, so any thread may run this.
        drop(unsafe { Box::from_raw(managed.cast::<Owned<T>>()) });
    }
}

/// `values` (`rows * cols` of them) as a `[rows, cols]` torch tensor that owns them: no copy.
pub(crate) fn tensor<T: Element>(
    py: Python<'_>,
    mut values: Vec<T>,
    rows: usize,
    cols: usize,
) -> PyResult<Bound<'_, PyAny>> {
    let Some(torch) = TORCH.get(py).and_then(Option::as_ref) else {
        return Err(layout_error(
            py,
            "output",
            "torch's DLPack table was not read",
        ));
    };
    let dtype = DataType {
        code: T::CODE,
        bits: (std::mem::size_of::<T>() * 8) as u8,
        lanes: 1,
    };
    if values.len() != rows * cols {
        return Err(layout_error(
            py,
            "output",
            format!("{} values are not [{rows}, {cols}]", values.len()),
        ));
    }
    let dims = |n: usize| i64::try_from(n).map_err(|_| layout_error(py, "output", "too large"));
    let (r, c) = (dims(rows)?, dims(cols)?);
    if values.capacity() == 0 {
        // An empty Vec's pointer is a placeholder (its alignment, the same for every empty
        // output of a dtype size), so torch took two empty outputs of different dtypes for
        // one storage viewed as both, and `torch.save` of them together failed. A real
        // allocation gives each its own address.
        values.reserve_exact(1);
    }
    let owned = Box::new(Owned {
        managed: ManagedTensor {
            version: Version { major: 1, minor: 0 },
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(drop_owned::<T>),
            flags: 0,
            dl_tensor: Tensor {
                data: std::ptr::null_mut(),
                device: Device {
                    device_type: CPU,
                    device_id: 0,
                },
                ndim: 2,
                dtype,
                shape: std::ptr::null_mut(),
                strides: std::ptr::null_mut(),
                byte_offset: 0,
            },
        },
        shape: [r, c],
        strides: [c, 1],
        values,
    });
    let raw = Box::into_raw(owned);
    // SAFETY: `raw` is the sole pointer to a live `Owned<T>` (just leaked); the pointers stored
    // into it are derived from `raw` itself, so they stay valid until the deleter frees it.
    unsafe {
        (*raw).managed.dl_tensor.data = (*raw).values.as_mut_ptr().cast();
        (*raw).managed.dl_tensor.shape = std::ptr::addr_of_mut!((*raw).shape).cast();
        (*raw).managed.dl_tensor.strides = std::ptr::addr_of_mut!((*raw).strides).cast();
    }
    ALIVE.fetch_add(1, Ordering::Relaxed);
    let mut made: *mut c_void = std::ptr::null_mut();
    // SAFETY: `raw` is a fully built owning managed tensor whose deleter frees it; the import
    // takes ownership of it ("the ownership of the tensor is stolen") and, on success, stores a
    // new reference in `made`. The GIL is held. Should torch refuse it (it never does for the
    // dtypes of `Element`), it may not have freed it: the buffer leaks, it is never freed twice.
    let rc = unsafe { (torch.import)(raw.cast(), &mut made) };
    if rc != 0 || made.is_null() {
        return Err(PyErr::take(py).unwrap_or_else(|| {
            layout_error(py, "output", "torch did not accept the output tensor")
        }));
    }
    // SAFETY: on success `made` is a new (owned) reference to the tensor object.
    Ok(unsafe { Bound::from_owned_ptr(py, made.cast()) })
}
