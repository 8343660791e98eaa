//! `moeq_rs._core`: thin PyO3 bindings over moeq-core. Python inputs are extracted first, then
//! the GIL is released for the Rust work; core errors become `moeq_rs.errors` exceptions.

use std::path::PathBuf;
use std::sync::Arc;

use moeq_core::checkpoint::DType;
use moeq_core::oracle::{self, Backend, CpuFeatures, Options, Platform};
use moeq_core::Model;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyDict};

mod cpu;
mod dlpack;
mod repack;

/// Runs `f` without the GIL on the CPU forward's threads (`moeq_core::cpu::on_threads`), not
/// on rayon's global pool: the work of opening, repacking and packing.
pub(crate) fn parallel<T: Send>(py: Python<'_>, f: impl FnOnce() -> T + Send) -> T {
    py.detach(|| moeq_core::cpu::on_threads(f))
}

/// Raises the `moeq_rs.errors` class matching the core error's kind.
pub(crate) fn to_py(py: Python<'_>, e: moeq_core::Error) -> PyErr {
    let msg = e.to_string();
    let class = e.kind().python_class();
    match py.import("moeq_rs.errors").and_then(|m| m.getattr(class)) {
        Ok(cls) => match cls.call1((msg,)) {
            Ok(inst) => PyErr::from_value(inst),
            Err(err) => err,
        },
        Err(_) => PyValueError::new_err(msg),
    }
}

/// A validated, memory-mapped checkpoint.
#[pyclass(frozen, module = "moeq_rs._core")]
pub(crate) struct Checkpoint {
    pub(crate) model: Arc<Model>,
}

/// A read-only view of one tensor's bytes inside a mapped file. Exposes the numpy array
/// interface; the array keeps this object (and so the mapping) alive.
#[pyclass(frozen, module = "moeq_rs._core")]
struct TensorBuffer {
    map: Arc<memmap2::Mmap>,
    start: usize,
    len: usize,
    dtype: DType,
    shape: moeq_core::checkpoint::header::Shape,
}

#[pymethods]
impl TensorBuffer {
    /// The safetensors dtype name (`"BF16"`, `"I32"`, ...).
    #[getter]
    fn dtype(&self) -> &'static str {
        self.dtype.name()
    }

    #[getter]
    fn shape(&self) -> Vec<usize> {
        self.shape.to_vec()
    }

    #[getter]
    fn nbytes(&self) -> usize {
        self.len
    }

    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        // The range was validated against the mapping when the header was parsed.
        let data = self
            .map
            .get(self.start..self.start + self.len)
            .unwrap_or(&[]);
        // Sub-byte dtypes (F4, F6) pack several values per byte: exported as their `len` raw
        // bytes, flat. As one byte per value (their shape with `|u1`) the array claimed more
        // bytes than the tensor has, and reading it ran past the mapping.
        let bits = self.dtype.bit_size();
        let elems: usize = self.shape.iter().product();
        let whole = bits >= 8 && elems.checked_mul(bits / 8) == Some(data.len());
        let (shape, typestr) = if whole {
            (self.shape.to_vec(), self.dtype.numpy_typestr())
        } else {
            (vec![data.len()], "|u1")
        };
        let d = PyDict::new(py);
        d.set_item("shape", pyo3::types::PyTuple::new(py, shape)?)?;
        d.set_item("typestr", typestr)?;
        // Read-only: the mapping is private and mapped without write permission.
        d.set_item("data", (data.as_ptr() as usize, true))?;
        d.set_item("version", 3)?;
        Ok(d)
    }
}

#[pymethods]
impl Checkpoint {
    /// Opens and validates a checkpoint directory (config, quantization config, every header,
    /// every module's tensors against its scheme). The GIL is released meanwhile.
    #[staticmethod]
    fn open(py: Python<'_>, path: PathBuf) -> PyResult<Checkpoint> {
        let model = parallel(py, || Model::open(&path)).map_err(|e| to_py(py, e))?;
        Ok(Checkpoint {
            model: Arc::new(model),
        })
    }

    #[getter]
    fn path(&self) -> PathBuf {
        self.model.checkpoint().dir().to_path_buf()
    }

    /// `config.json` as a JSON string.
    fn config_json(&self) -> String {
        self.model.checkpoint().config().to_string()
    }

    /// The checkpoint facts of `moeq inspect --json`, as a JSON string.
    fn summary_json(&self) -> String {
        self.model.summary_json().to_string()
    }

    /// `moeq inspect --json` for a platform (`"cpu"` or `"cuda"` with `sm`), an optional explicit
    /// backend, a tensor-parallel size, and optionally the vLLM compatibility report.
    #[pyo3(signature = (platform="cpu", sm=None, backend=None, tp_size=1, compat=false))]
    fn report_json(
        &self,
        py: Python<'_>,
        platform: &str,
        sm: Option<u32>,
        backend: Option<&str>,
        tp_size: usize,
        compat: bool,
    ) -> PyResult<String> {
        let platform = parse_platform(py, platform, sm)?;
        let backend = match backend {
            None => None,
            Some(b) => Some(Backend::parse(b).ok_or_else(|| {
                config_error(py, format!(
                    "backend: unknown backend '{b}' (expected one of cpu_simd, cuda_marlin_wna16, cuda_int8_w8a8)"
                ))
            })?),
        };
        if tp_size == 0 {
            return Err(config_error(py, "tp_size: must be at least 1".into()));
        }
        let opts = Options { backend, tp_size };
        Ok(self.model.report_json(platform, opts, compat).to_string())
    }

    /// Every tensor name, sorted.
    fn tensor_names(&self) -> Vec<String> {
        self.model
            .checkpoint()
            .tensor_names()
            .map(str::to_string)
            .collect()
    }

    /// `(dtype, shape, file)` of a tensor.
    fn tensor_info(
        &self,
        py: Python<'_>,
        name: &str,
    ) -> PyResult<(&'static str, Vec<usize>, PathBuf)> {
        let (f, t) = self.locate(py, name)?;
        Ok((t.dtype.name(), t.shape.to_vec(), f.path().to_path_buf()))
    }

    /// A zero-copy, read-only buffer of a tensor (numpy array interface).
    fn tensor_buffer(&self, py: Python<'_>, name: &str) -> PyResult<TensorBuffer> {
        let (f, t) = self.locate(py, name)?;
        Ok(TensorBuffer {
            map: Arc::clone(f.mmap()),
            start: t.start,
            len: t.len,
            dtype: t.dtype,
            shape: t.shape.clone(),
        })
    }

    /// Repacks this checkpoint into `out_dir` (`target` "marlin" or "cpu"). `progress(stage, done, total,
    /// bytes_written, bytes_total)` is called after each unit of work; an exception it raises
    /// (Ctrl-C included) aborts the repack and leaves nothing at `out_dir`.
    #[pyo3(signature = (out_dir, target="marlin", force=false, max_shard_size=5_000_000_000, verify=false, progress=None))]
    #[allow(clippy::too_many_arguments)]
    fn repack<'py>(
        &self,
        py: Python<'py>,
        out_dir: PathBuf,
        target: &str,
        force: bool,
        max_shard_size: u64,
        verify: bool,
        progress: Option<Py<PyAny>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        use moeq_core::repack::checkpoint::Target;
        let target = match target {
            "marlin" => Target::Marlin,
            "cpu" => Target::Cpu,
            other => {
                return Err(unsupported(
                    py,
                    "repack",
                    format!("target '{other}' is not available (supported: marlin, cpu)"),
                ))
            }
        };
        let model = Arc::clone(&self.model);
        let opts = moeq_core::repack::checkpoint::RepackOptions {
            force,
            max_shard_size,
            verify,
        };
        let callback_error: std::sync::Mutex<Option<PyErr>> = std::sync::Mutex::new(None);
        let result = parallel(py, || {
            let mut cb = |p: &moeq_core::repack::checkpoint::Progress| -> moeq_core::Result<()> {
                let outcome = Python::attach(|py| -> PyResult<()> {
                    if let Some(f) = &progress {
                        f.call1(
                            py,
                            (p.stage, p.done, p.total, p.bytes_written, p.bytes_total),
                        )?;
                    }
                    py.check_signals()
                });
                outcome.map_err(|e| {
                    if let Ok(mut slot) = callback_error.lock() {
                        *slot = Some(e);
                    }
                    moeq_core::error::CheckpointError::Output {
                        path: PathBuf::from("repack"),
                        reason: "interrupted".into(),
                    }
                    .into()
                })
            };
            moeq_core::repack::checkpoint::repack(&model, &out_dir, target, &opts, &mut cb)
        });
        if let Some(e) = callback_error.lock().ok().and_then(|mut s| s.take()) {
            // The callback's exception (Ctrl-C, say) is what the caller sees; what also went
            // wrong cleaning up after it (a temporary directory left behind) rides along as
            // a note (PEP 678; Python 3.11+), which the CLI prints.
            if let Some(note) = result.as_ref().err().and_then(|r| r.cleanup_note()) {
                // (Before 3.11 there is no add_note: the note is then dropped.)
                let _ = e.value(py).call_method1("add_note", (note,));
            }
            return Err(e);
        }
        let r = result.map_err(|e| to_py(py, e))?;
        let d = PyDict::new(py);
        d.set_item("out_dir", r.out_dir)?;
        d.set_item("layers", r.layers)?;
        d.set_item("tensors", r.tensors)?;
        d.set_item("bytes_written", r.bytes_written)?;
        d.set_item("seconds", r.seconds)?;
        d.set_item("verified_modules", r.verified_modules)?;
        d.set_item("leftover", r.leftover)?;
        Ok(d)
    }

    /// Every tensor as `{name: TensorBuffer}`, in name order, in one call.
    fn tensor_buffers<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        for (f, t) in self.model.checkpoint().tensors() {
            let buf = TensorBuffer {
                map: Arc::clone(f.mmap()),
                start: t.start,
                len: t.len,
                dtype: t.dtype,
                shape: t.shape.clone(),
            };
            out.set_item(&t.name, buf)?;
        }
        Ok(out)
    }

    /// The resolved scheme and facts of a Linear module, as a JSON string.
    fn module_json(&self, py: Python<'_>, module: &str) -> PyResult<String> {
        let m = self.model.module(module).map_err(|e| to_py(py, e))?;
        let (w, a, f) = moeq_core::model::module_scheme_json(m);
        let v = serde_json::json!({
            "module": m.name,
            "quantized": m.weights().is_some(),
            "group": m.scheme.as_ref().map(|s| s.group.clone()),
            "format": f,
            "weight": w,
            "activation": a,
            "out_features": m.out_features,
            "in_features": m.in_features,
            "weight_tensor": m.weight_tensor,
            "weight_dtype": m.weight_dtype.name(),
            "scale_dtype": m.scale_dtype.map(DType::name),
            "has_zero_point": m.zero_point.is_some(),
            "has_g_idx": m.has_g_idx,
            "has_input_scale": m.has_input_scale,
        });
        Ok(v.to_string())
    }

    /// Decoder layer `layer`'s MoE tensors in the Marlin layout, in memory (what `repack`
    /// writes for it): `(geometry, [(name, dtype, shape, bytearray)])`.
    fn marlin_layer<'py>(
        &self,
        py: Python<'py>,
        layer: usize,
    ) -> PyResult<(Bound<'py, PyDict>, Vec<MarlinTensor<'py>>)> {
        let model = Arc::clone(&self.model);
        let (g, tensors) = parallel(py, || {
            moeq_core::repack::checkpoint::marlin_layer(&model, layer)
        })
        .map_err(|e| to_py(py, e))?;
        let d = PyDict::new(py);
        d.set_item("prefix", &g.prefix)?;
        d.set_item("experts", g.experts)?;
        d.set_item("hidden", g.hidden)?;
        d.set_item("intermediate", g.intermediate)?;
        d.set_item("intermediate_padded", g.intermediate_padded)?;
        d.set_item("bits", g.bits)?;
        d.set_item("group_size", g.group_size)?;
        d.set_item("symmetric", g.symmetric)?;
        d.set_item("act_order", g.act_order)?;
        d.set_item("scale_dtype", g.scale_dtype.name())?;
        let out = tensors
            .into_iter()
            .map(|(name, dtype, shape, bytes)| {
                (name, dtype.name(), shape, PyByteArray::new(py, &bytes))
            })
            .collect();
        Ok((d, out))
    }

    /// Dequantises a module: `(bytearray, dtype, [out, in])`, bit-exact with compressed-tensors;
    /// with `exact` the unrounded values in F32.
    #[pyo3(signature = (module, exact=false))]
    fn dequantize<'py>(
        &self,
        py: Python<'py>,
        module: &str,
        exact: bool,
    ) -> PyResult<(Bound<'py, PyByteArray>, &'static str, Vec<usize>)> {
        let model = Arc::clone(&self.model);
        let module = module.to_string();
        let d = parallel(py, || model.dequantize_with(&module, exact)).map_err(|e| to_py(py, e))?;
        Ok((
            PyByteArray::new(py, &d.data),
            d.dtype.name(),
            d.shape.to_vec(),
        ))
    }

    /// A tensor of 8-bit integer weight codes as int8 `(bytearray, shape)`: read by its
    /// stored dtype's values (I16, I32 and U8 too), each within -128..=127, as the CPU loader
    /// reads them (`moeq_core::cpu::load::int8_codes`).
    fn int8_codes<'py>(
        &self,
        py: Python<'py>,
        name: &str,
    ) -> PyResult<(Bound<'py, PyByteArray>, Vec<usize>)> {
        let ckpt = self.model.checkpoint();
        let shape = self.locate(py, name)?.1.shape.to_vec();
        let codes = moeq_core::cpu::load::int8_codes(ckpt, name).map_err(|e| to_py(py, e))?;
        let bytes: Vec<u8> = codes.into_iter().map(|v| v as u8).collect();
        Ok((PyByteArray::new(py, &bytes), shape))
    }
}

/// `(name, dtype, shape, bytes)` of one converted tensor.
type MarlinTensor<'py> = (String, &'static str, Vec<usize>, Bound<'py, PyByteArray>);

impl Checkpoint {
    fn locate(
        &self,
        py: Python<'_>,
        name: &str,
    ) -> PyResult<(
        &moeq_core::checkpoint::SafetensorsFile,
        &moeq_core::checkpoint::TensorInfo,
    )> {
        self.model.checkpoint().locate(name).ok_or_else(|| {
            to_py(
                py,
                moeq_core::error::CheckpointError::MissingTensor {
                    name: name.to_string(),
                }
                .into(),
            )
        })
    }
}

/// A bad argument: `msg` is `"<argument>: <reason>"`.
fn config_error(py: Python<'_>, msg: String) -> PyErr {
    let (key, reason) = msg.split_once(": ").unwrap_or(("argument", msg.as_str()));
    to_py(
        py,
        moeq_core::error::ConfigError {
            file: PathBuf::from("arguments"),
            key: key.to_string(),
            reason: reason.to_string(),
        }
        .into(),
    )
}

fn unsupported(py: Python<'_>, subject: &str, reason: String) -> PyErr {
    to_py(
        py,
        moeq_core::error::UnsupportedSchemeError {
            subject: subject.to_string(),
            reason,
        }
        .into(),
    )
}

fn parse_platform(py: Python<'_>, platform: &str, sm: Option<u32>) -> PyResult<Platform> {
    match platform {
        "cpu" => {
            if sm.is_some() {
                return Err(config_error(
                    py,
                    "sm: only meaningful with platform 'cuda'".into(),
                ));
            }
            Ok(Platform::Cpu(CpuFeatures::detect()))
        }
        "cuda" => Ok(Platform::Cuda {
            sm: sm.unwrap_or(90),
        }),
        other => Err(config_error(
            py,
            format!("platform: '{other}' is not 'cpu' or 'cuda'"),
        )),
    }
}

/// The scale kind of a weight-only scheme (`group_size` -1 or None = channelwise).
#[pyfunction]
#[pyo3(signature = (num_bits, group_size=None))]
fn wna16_scale_kind(
    py: Python<'_>,
    num_bits: u32,
    group_size: Option<i64>,
) -> PyResult<&'static str> {
    oracle::wna16_scale_kind(num_bits, group_size.unwrap_or(-1))
        .map_err(|r| unsupported(py, "wna16_scale_kind", r))
}

/// vLLM's fixed `make_int8_moe_quant_config` truth table: `"int8_w8a8"` or `"int8_w8a16"`.
#[pyfunction]
fn int8_moe_quant_kind(
    py: Python<'_>,
    has_a1_scale: bool,
    has_a2_scale: bool,
    per_act_token_quant: bool,
) -> PyResult<&'static str> {
    oracle::int8_moe_quant_kind(has_a1_scale, has_a2_scale, per_act_token_quant)
        .map(|k| k.name())
        .map_err(|r| config_error(py, format!("a1_scale/a2_scale: {r}")))
}

/// Why Marlin cannot run a MoE layer of these sizes, or None when it can.
#[pyfunction]
#[pyo3(signature = (hidden_size, intermediate_size_per_partition, group_size=None, allow_tile_padding=true))]
fn marlin_support_reason(
    hidden_size: usize,
    intermediate_size_per_partition: usize,
    group_size: Option<i64>,
    allow_tile_padding: bool,
) -> Option<String> {
    oracle::backends::marlin_support_reason(
        hidden_size,
        intermediate_size_per_partition,
        group_size.unwrap_or(-1),
        allow_tile_padding,
    )
}

/// CPU features the CPU kernels can use on this machine.
#[pyfunction]
fn cpu_features() -> Vec<&'static str> {
    CpuFeatures::detect().names()
}

/// The CPU kernel family in use (`MOEQ_CPU_ISA` caps it).
#[pyfunction]
fn cpu_kernel() -> &'static str {
    moeq_core::cpu::kernels::isa_name(moeq_core::cpu::kernels::isa())
}

/// Whether weight-only layers with bf16 inputs use bf16 dot products on this machine
/// (AVX512-BF16; `MOEQ_CPU_BF16=0` or a `MOEQ_CPU_ISA` cap below AVX-512 switch them off).
#[pyfunction]
fn cpu_bf16_dot() -> bool {
    moeq_core::cpu::kernels::bf16_dot()
}

/// Rows per expert up to which weight-only layers with bf16 inputs and `bits`-bit codes (4 or
/// 8) take the fixed-point int8 dot products on this machine (0: never). `bits` is any
/// integer (`operator.index`: Python's and numpy's; others a TypeError); one other than 4 or 8
/// is a ValueError however large (an `i64` argument would make those an OverflowError).
#[pyfunction]
fn cpu_fixed_point_rows(bits: &Bound<'_, PyAny>) -> PyResult<usize> {
    let value = bits
        .py()
        .import("operator")?
        .call_method1("index", (bits,))?;
    match value.extract::<i64>() {
        Ok(b @ (4 | 8)) => Ok(moeq_core::cpu::wo::fixed::fixed_point_rows(b == 4)),
        _ => Err(PyValueError::new_err(format!(
            "cpu_fixed_point_rows: bits must be 4 or 8, got {value}"
        ))),
    }
}

/// The compute limit of the CPU kernels' products (`kind`: `"int8"`, `"bf16"` or `"f32"`):
/// the instruction and its multiply-adds per second (GMAC/s) on `threads` threads (default:
/// the forward's), measured now with the GIL released; `None` where there is no probe for it
/// (scalar, NEON).
#[pyfunction]
#[pyo3(signature = (kind, threads = None))]
fn cpu_dot_peak(
    py: Python<'_>,
    kind: &str,
    threads: Option<usize>,
) -> PyResult<Option<(&'static str, f64)>> {
    use moeq_core::cpu::peak::{measure, Dot};
    let dot = match kind {
        "int8" => Dot::Int8,
        "bf16" => Dot::Bf16,
        "f32" => Dot::F32,
        other => {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "kind: {other:?} is not one of \"int8\", \"bf16\", \"f32\""
            )))
        }
    };
    let most = 4 * std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = threads.unwrap_or_else(moeq_core::cpu::num_threads);
    if !(1..=most).contains(&threads) {
        return Err(pyo3::exceptions::PyValueError::new_err(format!(
            "threads: {threads} is not a thread count from 1 to {most}"
        )));
    }
    Ok(py.detach(|| measure(dot, threads)))
}

/// Threads of the CPU forward's pool (`MOEQ_NUM_THREADS` sets it).
#[pyfunction]
fn cpu_threads() -> usize {
    moeq_core::cpu::threads()
}

/// Makes the calling thread one of the CPU forward's threads (see
/// `moeq_core::cpu::adopt_calling_thread`); `moeq_rs` calls it from the main thread.
#[pyfunction]
fn cpu_adopt_calling_thread() -> bool {
    moeq_core::cpu::adopt_calling_thread()
}

/// Turns on or off (`on`; `None` leaves it) the CPU forward's parking of the calling
/// thread's idle OpenMP threads (see `moeq_core::cpu::omp`); returns whether a forward called
/// now from this thread may park them (it does if they are spinning): only on the main thread
/// once Python has adopted it (`moeq_rs._threads`), with more than one thread.
/// `MOEQ_PARK_OPENMP=0` turns it off.
#[pyfunction]
#[pyo3(signature = (on=None))]
fn cpu_park_openmp(on: Option<bool>) -> bool {
    if let Some(on) = on {
        moeq_core::cpu::omp::set_parking(on);
    }
    moeq_core::cpu::parks_openmp_here()
}

/// Frees the CPU forward's spare scratch buffers on every thread; the bytes freed.
#[pyfunction]
fn cpu_release_scratch(py: Python<'_>) -> usize {
    py.detach(moeq_core::cpu::release_scratch)
}

/// Whether the CPU forward's reused scratch comes filled with NaN (`MOEQ_POISON_SCRATCH=1`),
/// checked on a buffer it hands out (for tests).
#[pyfunction]
fn _cpu_scratch_poisoned() -> bool {
    moeq_core::cpu::spare::hands_out_poison()
}

/// int8 GEMM calls (one per expert panel and thread) that ran on the AMX tiles in this process:
/// proof that AMX ran, for `scripts/amx_check.py`.
#[pyfunction]
fn cpu_amx_calls() -> u64 {
    moeq_core::cpu::amx::hardware_calls()
}

/// How many CPU forwards have run with the OpenMP team parked in this process.
#[pyfunction]
fn cpu_parked_regions() -> u64 {
    moeq_core::cpu::omp::parked_regions()
}

/// Whether a CUDA driver with a device is present (never raises, never panics).
#[pyfunction]
fn cuda_driver_available() -> bool {
    moeq_core::cuda::driver_available()
}

/// Compiles every kernel variant for `arch` with NVRTC (`nvrtc_dirs`: where the Python side
/// found the nvidia wheels) -> `{variant: {"cubin_bytes", "registers", "spill_stores",
/// "seconds", "entries"}}`.
#[pyfunction]
fn cuda_compile_kernels<'py>(
    py: Python<'py>,
    arch: &str,
    nvrtc_dirs: Vec<PathBuf>,
) -> PyResult<Bound<'py, PyDict>> {
    let reports = py
        .detach(|| moeq_core::cuda::compile_all(arch, &nvrtc_dirs))
        .map_err(|e| to_py(py, e.into()))?;
    let out = PyDict::new(py);
    for r in reports {
        let d = PyDict::new(py);
        d.set_item("cubin_bytes", r.cubin_bytes)?;
        d.set_item("registers", r.registers)?;
        d.set_item("spill_stores", r.spill_stores)?;
        d.set_item("seconds", r.seconds)?;
        let entries: Vec<String> = r.entries.iter().map(|(n, _)| n.clone()).collect();
        d.set_item("entries", entries)?;
        out.set_item(r.name, d)?;
    }
    Ok(out)
}

/// Launches one kernel (internal: `moeq_rs.cuda` checks every tensor's device, dtype, shape,
/// alignment and contiguity before calling). `args`: `("ptr" | "i32" | "i64" | "f32", value)`.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn _cuda_launch(
    py: Python<'_>,
    ordinal: i32,
    variant: &str,
    entry: &str,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    shared_bytes: u32,
    stream: u64,
    args: Vec<(String, Bound<'_, PyAny>)>,
    nvrtc_dirs: Vec<PathBuf>,
) -> PyResult<()> {
    use moeq_core::cuda::launch::Arg;
    let mut parsed = Vec::with_capacity(args.len());
    for (kind, value) in &args {
        parsed.push(match kind.as_str() {
            "ptr" => Arg::Ptr(value.extract()?),
            "i32" => Arg::I32(value.extract()?),
            "i64" => Arg::I64(value.extract()?),
            "f32" => Arg::F32(value.extract()?),
            other => {
                return Err(PyValueError::new_err(format!(
                    "kernel argument kind '{other}' (expected ptr, i32, i64 or f32)"
                )))
            }
        });
    }
    // SAFETY: the only caller, moeq_rs.cuda, passes pointers of CUDA tensors on `ordinal` that
    // it checked against the kernel's contract, and torch's current stream of that device.
    unsafe {
        moeq_core::cuda::launch::launch(
            ordinal,
            variant,
            entry,
            grid,
            block,
            shared_bytes,
            stream,
            &parsed,
            &nvrtc_dirs,
        )
    }
    .map_err(|e| to_py(py, e.into()))
}

/// The NVRTC moeq_rs uses: `(major, minor, path or None)`.
#[pyfunction]
fn cuda_nvrtc_version(
    py: Python<'_>,
    nvrtc_dirs: Vec<PathBuf>,
) -> PyResult<(i32, i32, Option<String>)> {
    let n = moeq_core::cuda::nvrtc::load(&nvrtc_dirs).map_err(|e| to_py(py, e.into()))?;
    Ok((n.major, n.minor, n.path.map(|p| p.display().to_string())))
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(wna16_scale_kind, m)?)?;
    m.add_function(wrap_pyfunction!(int8_moe_quant_kind, m)?)?;
    m.add_function(wrap_pyfunction!(marlin_support_reason, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_features, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_kernel, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_bf16_dot, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_fixed_point_rows, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_dot_peak, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_threads, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_adopt_calling_thread, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_park_openmp, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_parked_regions, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_release_scratch, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_amx_calls, m)?)?;
    m.add_function(wrap_pyfunction!(dlpack::cpu_use_torch_tensors, m)?)?;
    m.add_function(wrap_pyfunction!(dlpack::_cpu_torch_outputs_alive, m)?)?;
    m.add_function(wrap_pyfunction!(_cpu_scratch_poisoned, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_driver_available, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_compile_kernels, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_nvrtc_version, m)?)?;
    m.add_function(wrap_pyfunction!(_cuda_launch, m)?)?;
    repack::register(m)?;
    cpu::register(m)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<Checkpoint>()?;
    m.add_class::<TensorBuffer>()?;
    Ok(())
}
