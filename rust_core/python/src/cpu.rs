//! `moeq_rs._core.CpuMoeLayer`: the CPU MoE forward for the Python `MoELayer`.

use std::borrow::Cow;
use std::sync::Arc;

use half::slice::HalfFloatSliceExt;

use moeq_core::cpu::routing::Routed;
use moeq_core::cpu::CpuMoe;
use numpy::{IntoPyArray, PyReadonlyArray1, PyReadonlyArrayDyn};
use pyo3::prelude::*;

use crate::dlpack::{self, Elem, Values};
use crate::repack::{layout_error, slice as contiguous};
use crate::{parallel, to_py, Checkpoint};

#[pyclass(frozen, module = "moeq_rs._core")]
pub struct CpuMoeLayer {
    moe: Arc<CpuMoe>,
}

#[pymethods]
impl CpuMoeLayer {
    /// Loads decoder layer `layer` of an opened checkpoint for the CPU.
    #[staticmethod]
    fn from_checkpoint(py: Python<'_>, ckpt: &Checkpoint, layer: usize) -> PyResult<CpuMoeLayer> {
        let model = Arc::clone(&ckpt.model);
        let moe = parallel(py, || moeq_core::cpu::load::moe_layer(&model, layer))
            .map_err(|e| to_py(py, e))?;
        Ok(CpuMoeLayer { moe: Arc::new(moe) })
    }

    /// Builds a layer from raw stacked tensors (see `MoELayer.from_tensors`). Each projection
    /// passes its weights as int8 codes or int32 words, its scales as f32 `[E, N, G]`, optional
    /// zero points (int8 `[E, N, G]` or packed int32 `[E, N/8, G]`) and optional static
    /// activation scales `[E]`.
    #[staticmethod]
    #[pyo3(signature = (scheme, experts, hidden, intermediate, group_size, w13_i8, w13_u32, w13_scale, w13_zp_i8, w13_zp_u32, a13, w2_i8, w2_u32, w2_scale, w2_zp_i8, w2_zp_u32, a2, top_k, renormalize))]
    #[allow(clippy::too_many_arguments)]
    fn from_tensors(
        py: Python<'_>,
        scheme: &str,
        experts: usize,
        hidden: usize,
        intermediate: usize,
        group_size: i64,
        w13_i8: Option<PyReadonlyArray1<'_, i8>>,
        w13_u32: Option<PyReadonlyArray1<'_, u32>>,
        w13_scale: PyReadonlyArray1<'_, f32>,
        w13_zp_i8: Option<PyReadonlyArray1<'_, i8>>,
        w13_zp_u32: Option<PyReadonlyArray1<'_, u32>>,
        a13: Option<PyReadonlyArray1<'_, f32>>,
        w2_i8: Option<PyReadonlyArray1<'_, i8>>,
        w2_u32: Option<PyReadonlyArray1<'_, u32>>,
        w2_scale: PyReadonlyArray1<'_, f32>,
        w2_zp_i8: Option<PyReadonlyArray1<'_, i8>>,
        w2_zp_u32: Option<PyReadonlyArray1<'_, u32>>,
        a2: Option<PyReadonlyArray1<'_, f32>>,
        top_k: usize,
        renormalize: bool,
    ) -> PyResult<CpuMoeLayer> {
        use moeq_core::cpu::build::{from_raw, RawProj, RawScheme};
        let scheme = match scheme {
            "w8a8_dynamic" => RawScheme::W8a8Dynamic,
            "w8a8_static" => RawScheme::W8a8Static,
            "w8a16" => RawScheme::W8a16,
            "w4a16" => RawScheme::W4a16,
            other => {
                return Err(layout_error(
                    py,
                    "scheme",
                    format!("'{other}' is not one of w8a8_dynamic, w8a8_static, w8a16, w4a16"),
                ))
            }
        };
        let w13 = RawProj {
            weights: raw_weights(py, &w13_i8, &w13_u32, "w13")?,
            scales: contiguous(py, &w13_scale, "w13_scale")?,
            zero_points: raw_zero_points(py, &w13_zp_i8, &w13_zp_u32, "w13_zero_point")?,
            act_scales: match &a13 {
                Some(a) => Some(contiguous(py, a, "a13_scale")?),
                None => None,
            },
        };
        let w2 = RawProj {
            weights: raw_weights(py, &w2_i8, &w2_u32, "w2")?,
            scales: contiguous(py, &w2_scale, "w2_scale")?,
            zero_points: raw_zero_points(py, &w2_zp_i8, &w2_zp_u32, "w2_zero_point")?,
            act_scales: match &a2 {
                Some(a) => Some(contiguous(py, a, "a2_scale")?),
                None => None,
            },
        };
        let moe = parallel(py, || {
            from_raw(
                scheme,
                experts,
                hidden,
                intermediate,
                group_size,
                w13,
                w2,
                top_k,
                renormalize,
            )
        })
        .map_err(|e| to_py(py, e))?;
        Ok(CpuMoeLayer { moe: Arc::new(moe) })
    }

    #[getter]
    fn hidden_size(&self) -> usize {
        self.moe.hidden
    }

    #[getter]
    fn num_experts(&self) -> usize {
        self.moe.experts.len()
    }

    #[getter]
    fn top_k(&self) -> usize {
        self.moe.top_k
    }

    #[getter]
    fn has_shared_experts(&self) -> bool {
        self.moe.shared.is_some()
    }

    /// `[tokens, hidden]` output for `hidden_states` and f32 `router_logits` (contiguous
    /// arrays of any shape holding `tokens * hidden` and `tokens * experts` values).
    /// `hidden_states` is f32 (f32 out; `bf16`: the input was bf16, so weight-only layers may
    /// use bf16 dot products) or the raw bits of bf16 values as int16 (bf16 bits out, rounded
    /// as torch rounds): the bf16 form spares the caller two conversions.
    #[pyo3(signature = (hidden_states, tokens, router_logits, bf16 = false))]
    fn forward<'py>(
        &self,
        py: Python<'py>,
        hidden_states: &Bound<'py, PyAny>,
        tokens: usize,
        router_logits: PyReadonlyArrayDyn<'py, f32>,
        bf16: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        // A copy: the forward runs without the GIL (see `Hidden::run`).
        let l = contiguous(py, &router_logits, "router_logits")?.to_vec();
        let moe = Arc::clone(&self.moe);
        let h = self.moe.hidden;
        Hidden::of(py, hidden_states)?
            .run(py, bf16, tokens, h, |x, c| moe.forward(x, tokens, &l, c))
    }

    /// The weighted sum of the routed experts only.
    #[pyo3(signature = (hidden_states, tokens, topk_weights, topk_ids, top_k, bf16 = false))]
    #[allow(clippy::too_many_arguments)]
    fn forward_topk<'py>(
        &self,
        py: Python<'py>,
        hidden_states: &Bound<'py, PyAny>,
        tokens: usize,
        topk_weights: PyReadonlyArrayDyn<'py, f32>,
        topk_ids: PyReadonlyArrayDyn<'py, i64>,
        top_k: usize,
        bf16: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let w = contiguous(py, &topk_weights, "topk_weights")?;
        let ids = contiguous(py, &topk_ids, "topk_ids")?;
        if let Some((i, v)) = ids
            .iter()
            .enumerate()
            .find(|(_, &v)| v < 0 || v > u32::MAX as i64)
        {
            let experts = self.moe.experts.len();
            return Err(layout_error(
                py,
                "moe forward",
                moeq_core::cpu::moe::not_an_expert(i, top_k, *v, experts),
            ));
        }
        let routed = Routed {
            top_k,
            ids: ids.iter().map(|&v| v as u32).collect(),
            weights: w.to_vec(),
        };
        let moe = Arc::clone(&self.moe);
        let h = self.moe.hidden;
        Hidden::of(py, hidden_states)?.run(py, bf16, tokens, h, |x, c| {
            moe.forward_topk(x, tokens, &routed, c)
        })
    }

    /// `forward` for plain torch tensors, read and made through DLPack's C exchange table (no
    /// numpy, no Python-level conversions; see `dlpack`): `[T, H]` in the input's dtype, or
    /// `None` when an argument is not a row-major 2-d CPU `torch.Tensor` of a float dtype and
    /// the layer's shape, so that the caller takes its checked path (which names the argument).
    /// `eager`: `None` also unless torch is in eager mode with no gradient wanted
    /// (`dlpack::eager`) and the main thread's adoption is settled, so that the Python wrapper
    /// may call this before its own checks.
    #[pyo3(signature = (hidden_states, router_logits, eager = false))]
    fn forward_torch<'py>(
        &self,
        py: Python<'py>,
        hidden_states: &Bound<'py, PyAny>,
        router_logits: &Bound<'py, PyAny>,
        eager: bool,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        // All checks that may run Python first, then the exports (which run none).
        if !dlpack::plain(hidden_states) || !dlpack::plain(router_logits) {
            return Ok(None);
        }
        if eager && !eager_ready(py, &[hidden_states, router_logits]) {
            return Ok(None);
        }
        let (Some(x), Some(l)) = (dlpack::view(hidden_states), dlpack::view(router_logits)) else {
            return Ok(None);
        };
        let (h, e) = (self.moe.hidden, self.moe.experts.len());
        if !x.elem.is_float()
            || !l.elem.is_float()
            || x.cols != h
            || (l.rows, l.cols) != (x.rows, e)
        {
            return Ok(None);
        }
        let tokens = x.rows;
        let moe = Arc::clone(&self.moe);
        // SAFETY: no Python code runs from the exports above until the values are copied (in
        // `run_torch`, before the GIL is released), and callers may not resize, `set_` or write
        // an argument from another thread meanwhile (the contract of torch's own operators,
        // which run without the GIL; see `View::values`).
        let (x, logits) = unsafe { (x.values(), l.values()) };
        let logits = owned(widen(logits));
        run_torch(py, x, tokens, h, move |x, c| {
            let out = moe.forward(x, tokens, &logits, c);
            moeq_core::cpu::spare::give(logits);
            out
        })
        .map(Some)
    }

    /// `forward_topk` for plain torch tensors, as `forward_torch`; `topk_ids` int32 or int64.
    /// `None` also for an id outside `0..2^32`: the checked path names it.
    #[pyo3(signature = (hidden_states, topk_weights, topk_ids, eager = false))]
    fn forward_topk_torch<'py>(
        &self,
        py: Python<'py>,
        hidden_states: &Bound<'py, PyAny>,
        topk_weights: &Bound<'py, PyAny>,
        topk_ids: &Bound<'py, PyAny>,
        eager: bool,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let args = [hidden_states, topk_weights, topk_ids];
        if !args.into_iter().all(dlpack::plain) || (eager && !eager_ready(py, &args)) {
            return Ok(None);
        }
        let (Some(x), Some(w), Some(ids)) = (
            dlpack::view(hidden_states),
            dlpack::view(topk_weights),
            dlpack::view(topk_ids),
        ) else {
            return Ok(None);
        };
        let h = self.moe.hidden;
        if !x.elem.is_float()
            || !w.elem.is_float()
            || ids.elem.is_float()
            || x.cols != h
            || (w.rows, w.cols) != (x.rows, ids.cols)
            || ids.rows != x.rows
        {
            return Ok(None);
        }
        let (tokens, k) = (x.rows, w.cols);
        // SAFETY: as in `forward_torch` (the weights and ids are copied below, `x` in
        // `run_torch`, all before the GIL is released).
        let (x, w, ids) = unsafe { (x.values(), w.values(), ids.values()) };
        let expert = |v: i64| u32::try_from(v).ok();
        let ids: Option<Vec<u32>> = match ids {
            Values::I64(v) => v.iter().map(|&v| expert(v)).collect(),
            Values::I32(v) => v.iter().map(|&v| expert(i64::from(v))).collect(),
            _ => None,
        };
        let Some(ids) = ids else {
            return Ok(None);
        };
        let routed = Routed {
            top_k: k,
            ids,
            weights: widen(w).into_owned(),
        };
        let moe = Arc::clone(&self.moe);
        run_torch(py, x, tokens, h, move |x, c| {
            moe.forward_topk(x, tokens, &routed, c)
        })
        .map(Some)
    }
}

/// The `eager` condition of `forward_torch`: the wrapper adopts Python's main thread into the
/// forward's threads (`moeq_rs._threads`) before its first forward, so until that has happened
/// its path runs.
fn eager_ready(py: Python<'_>, tensors: &[&Bound<'_, PyAny>]) -> bool {
    moeq_core::cpu::adoption_settled() && dlpack::eager(py, tensors)
}

/// Runs `f` on `x` widened to f32 and returns its `[tokens, h]` output as a torch tensor of
/// `x`'s dtype. bf16 input computes as for bf16 (see `compute`), other dtypes as f32. `x` is
/// copied (widened) before the GIL is released and `f` runs without it: a Python thread that
/// resized or re-pointed the tensor once the GIL was free made the forward read freed memory,
/// so `x` is read only during the copy. The conversions and the forward share one parked
/// region.
fn run_torch<'py>(
    py: Python<'py>,
    x: Values<'_>,
    tokens: usize,
    h: usize,
    f: impl FnOnce(&[f32], moeq_core::cpu::linear::Compute) -> moeq_core::error::Result<Vec<f32>> + Send,
) -> PyResult<Bound<'py, PyAny>> {
    use moeq_core::cpu::kernels::f32_to_bf16_bits;
    use moeq_core::cpu::spare::give;
    let elem = x.elem();
    let out = moeq_core::cpu::with_openmp_parked(|| {
        let wide = owned(widen(x));
        py.detach(|| {
            let y = f(&wide, compute(elem == Elem::Bf16));
            give(wide);
            y.map(|y| match elem {
                Elem::Bf16 => {
                    let bits = f32_to_bf16_bits(&y);
                    give(y);
                    Narrowed::Bf16(bits)
                }
                Elem::F16 => {
                    let mut v = vec![half::f16::ZERO; y.len()];
                    v.convert_from_f32_slice(&y);
                    give(y);
                    Narrowed::F16(v)
                }
                Elem::F64 => {
                    let v = y.iter().map(|&v| f64::from(v)).collect();
                    give(y);
                    Narrowed::F64(v)
                }
                // F32 (integer values never reach here: callers check `Elem::is_float`).
                _ => Narrowed::F32(y),
            })
        })
    })
    .map_err(|e| to_py(py, e))?;
    match out {
        Narrowed::F32(v) => dlpack::tensor(py, v, tokens, h),
        Narrowed::Bf16(v) => dlpack::tensor(py, v, tokens, h),
        Narrowed::F16(v) => dlpack::tensor(py, v, tokens, h),
        Narrowed::F64(v) => dlpack::tensor(py, v, tokens, h),
    }
}

/// The forward's f32 output in the input's dtype.
enum Narrowed {
    F32(Vec<f32>),
    Bf16(Vec<i16>),
    F16(Vec<half::f16>),
    F64(Vec<f64>),
}

/// Float values as f32: borrowed when they are f32, else converted (exactly, or rounded to
/// nearest even from f64, as torch's `.to(torch.float32)`) into a spare buffer. Integer values
/// never reach here (callers check `Elem::is_float`); they give an empty slice.
fn widen(v: Values<'_>) -> Cow<'_, [f32]> {
    use moeq_core::cpu::kernels::bf16_bits_to_f32;
    use moeq_core::cpu::spare::take;
    match v {
        Values::F32(v) => Cow::Borrowed(v),
        Values::Bf16(v) => Cow::Owned(bf16_bits_to_f32(v)),
        Values::F16(v) => {
            let mut out = take(v.len(), 0f32);
            v.convert_to_f32_slice(&mut out);
            Cow::Owned(out)
        }
        Values::F64(v) => {
            let mut out = take(v.len(), 0f32);
            for (o, &d) in out.iter_mut().zip(v) {
                *o = d as f32;
            }
            Cow::Owned(out)
        }
        Values::I32(_) | Values::I64(_) => Cow::Borrowed(&[]),
    }
}

/// `v` in a buffer of this thread's spares (a copy when it is borrowed): what a forward reads
/// once the GIL is released, when caller-owned memory may change or go away.
fn owned(v: Cow<'_, [f32]>) -> Vec<f32> {
    match v {
        Cow::Owned(v) => v,
        Cow::Borrowed(b) => {
            let mut out = moeq_core::cpu::spare::take_empty(b.len());
            out.extend_from_slice(b);
            out
        }
    }
}

/// `hidden_states` as f32 values or as the bits of bf16 values (int16), in a contiguous array
/// of any shape.
enum Hidden<'py> {
    F32(PyReadonlyArrayDyn<'py, f32>),
    Bf16Bits(PyReadonlyArrayDyn<'py, i16>),
}

/// `out` (`tokens * h` values) as a `[tokens, h]` numpy array, without a copy.
fn rows<'py, T: numpy::Element>(
    py: Python<'py>,
    out: Vec<T>,
    tokens: usize,
    h: usize,
) -> PyResult<Bound<'py, PyAny>> {
    let len = out.len();
    numpy::ndarray::Array2::from_shape_vec((tokens, h), out)
        .map(|a| a.into_pyarray(py).into_any())
        .map_err(|_| {
            layout_error(
                py,
                "output",
                format!("{len} values are not [{tokens}, {h}]"),
            )
        })
}

impl<'py> Hidden<'py> {
    /// The int16 form by a type check, else the f32 form, else a `LayoutError` naming the
    /// argument. (Extracting as an enum tried f32 first and built a Python error for every
    /// bf16 call: ~0.1 ms of a decode step with cold caches.)
    fn of(py: Python<'py>, ob: &Bound<'py, PyAny>) -> PyResult<Self> {
        use numpy::PyArrayMethods;
        if let Ok(bits) = ob.cast::<numpy::PyArrayDyn<i16>>() {
            return Ok(Hidden::Bf16Bits(bits.try_readonly()?));
        }
        if let Ok(values) = ob.cast::<numpy::PyArrayDyn<f32>>() {
            return Ok(Hidden::F32(values.try_readonly()?));
        }
        Err(layout_error(
            py,
            "hidden_states",
            "expected a numpy array of float32 values or of bf16 bits (int16)",
        ))
    }

    /// Runs `f` on the f32 values without the GIL; the output (`[tokens, h]`) is f32, or bf16
    /// bits for bf16 input (which always computes as for bf16, see `compute`).
    fn run(
        &self,
        py: Python<'py>,
        bf16: bool,
        tokens: usize,
        h: usize,
        f: impl FnOnce(&[f32], moeq_core::cpu::linear::Compute) -> moeq_core::error::Result<Vec<f32>>
            + Send,
    ) -> PyResult<Bound<'py, PyAny>> {
        use moeq_core::cpu::kernels::{bf16_bits_to_f32, f32_to_bf16_bits};
        use moeq_core::cpu::spare::give;
        match self {
            // The input is copied (widened) before the GIL is released: another Python thread
            // may write the array once it is (a data race on the values read).
            Hidden::F32(a) => {
                let x = owned(Cow::Borrowed(contiguous(py, a, "hidden_states")?));
                let out = py
                    .detach(|| {
                        let out = f(&x, compute(bf16));
                        give(x);
                        out
                    })
                    .map_err(|e| to_py(py, e))?;
                rows(py, out, tokens, h)
            }
            Hidden::Bf16Bits(a) => {
                let bits = contiguous(py, a, "hidden_states")?;
                // One parked region for both conversions and the forward.
                let out = moeq_core::cpu::with_openmp_parked(|| {
                    let x = bf16_bits_to_f32(bits);
                    py.detach(|| {
                        // Both f32 buffers go back to this thread's spares for the next call.
                        let out = f(&x, compute(true)).map(|o| {
                            let bits = f32_to_bf16_bits(&o);
                            give(o);
                            bits
                        });
                        give(x);
                        out
                    })
                })
                .map_err(|e| to_py(py, e))?;
                rows(py, out, tokens, h)
            }
        }
    }
}

fn compute(bf16: bool) -> moeq_core::cpu::linear::Compute {
    use moeq_core::cpu::linear::Compute;
    if bf16 {
        Compute::Bf16
    } else {
        Compute::F32
    }
}

fn raw_weights<'a>(
    py: Python<'_>,
    i8s: &'a Option<PyReadonlyArray1<'_, i8>>,
    u32s: &'a Option<PyReadonlyArray1<'_, u32>>,
    name: &str,
) -> PyResult<moeq_core::cpu::build::RawWeights<'a>> {
    use moeq_core::cpu::build::RawWeights;
    match (i8s, u32s) {
        (Some(a), _) => Ok(RawWeights::Int8(contiguous(py, a, name)?)),
        (None, Some(a)) => Ok(RawWeights::Int4Packed(contiguous(py, a, name)?)),
        (None, None) => Err(layout_error(py, name, "missing")),
    }
}

fn raw_zero_points<'a>(
    py: Python<'_>,
    i8s: &'a Option<PyReadonlyArray1<'_, i8>>,
    u32s: &'a Option<PyReadonlyArray1<'_, u32>>,
    name: &str,
) -> PyResult<Option<moeq_core::cpu::build::RawZeroPoints<'a>>> {
    use moeq_core::cpu::build::RawZeroPoints;
    Ok(match (i8s, u32s) {
        (Some(a), _) => Some(RawZeroPoints::Int8(contiguous(py, a, name)?)),
        (None, Some(a)) => Some(RawZeroPoints::Int4Packed(contiguous(py, a, name)?)),
        (None, None) => None,
    })
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<CpuMoeLayer>()
}
