//! `moeq_rs._core` repack functions: flat numpy arrays in, flat numpy arrays out (the Python
//! layer in `moeq_rs/repack.py` handles shapes, dtypes and torch). The GIL is released while
//! the Rust code runs.

use moeq_core::repack::marlin;
use numpy::{PyArray1, PyReadonlyArray1};
use pyo3::prelude::*;

use crate::to_py;

fn layout(py: Python<'_>, e: moeq_core::error::LayoutError) -> PyErr {
    to_py(py, e.into())
}

/// A `LayoutError` (a `moeq_rs.LayoutError` in Python) about `subject`.
pub(crate) fn layout_error(py: Python<'_>, subject: &str, reason: impl Into<String>) -> PyErr {
    layout(
        py,
        moeq_core::error::LayoutError {
            subject: subject.to_string(),
            reason: reason.into(),
        },
    )
}

/// The data of a C-contiguous (row-major) numpy array of any number of dimensions, or a
/// `LayoutError` naming the argument. Fortran order is refused: read in memory order, a
/// transposed array would give silently wrong values.
pub(crate) fn slice<'a, T: numpy::Element, D: numpy::ndarray::Dimension>(
    py: Python<'_>,
    a: &'a numpy::PyReadonlyArray<'_, T, D>,
    name: &str,
) -> PyResult<&'a [T]> {
    use numpy::PyUntypedArrayMethods;
    if !a.is_c_contiguous() {
        return Err(layout_error(
            py,
            name,
            "must be a contiguous (row-major) array",
        ));
    }
    // A contiguous array can still start off its element alignment (a byte-offset view).
    a.as_slice().map_err(|_| {
        layout_error(
            py,
            name,
            "must be aligned to its element size (a byte-offset view is not; a copy is)",
        )
    })
}

#[pyfunction]
fn gptq_marlin_repack<'py>(
    py: Python<'py>,
    qweight: PyReadonlyArray1<'py, u32>,
    perm: PyReadonlyArray1<'py, u32>,
    size_k: usize,
    size_n: usize,
    num_bits: u32,
) -> PyResult<Bound<'py, PyArray1<u32>>> {
    let (q, p) = (slice(py, &qweight, "qweight")?, slice(py, &perm, "perm")?);
    let out = crate::parallel(py, || {
        marlin::gptq_marlin_repack(q, p, size_k, size_n, num_bits)
    })
    .map_err(|e| layout(py, e))?;
    Ok(PyArray1::from_vec(py, out))
}

#[pyfunction]
fn gptq_marlin_unrepack<'py>(
    py: Python<'py>,
    marlin_q: PyReadonlyArray1<'py, u32>,
    perm: PyReadonlyArray1<'py, u32>,
    size_k: usize,
    size_n: usize,
    num_bits: u32,
) -> PyResult<Bound<'py, PyArray1<u32>>> {
    let (q, p) = (slice(py, &marlin_q, "marlin_q")?, slice(py, &perm, "perm")?);
    let out = crate::parallel(py, || {
        marlin::gptq_marlin_unrepack(q, p, size_k, size_n, num_bits)
    })
    .map_err(|e| layout(py, e))?;
    Ok(PyArray1::from_vec(py, out))
}

#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn gptq_marlin_moe_repack<'py>(
    py: Python<'py>,
    qweight: PyReadonlyArray1<'py, u32>,
    perm: PyReadonlyArray1<'py, u32>,
    experts: usize,
    size_k: usize,
    size_n: usize,
    num_bits: u32,
) -> PyResult<Bound<'py, PyArray1<u32>>> {
    let (q, p) = (slice(py, &qweight, "qweight")?, slice(py, &perm, "perm")?);
    let out = crate::parallel(py, || {
        marlin::gptq_marlin_moe_repack(q, p, experts, size_k, size_n, num_bits)
    })
    .map_err(|e| layout(py, e))?;
    Ok(PyArray1::from_vec(py, out))
}

macro_rules! permute_fn {
    ($name:ident, $t:ty, $core:path) => {
        #[pyfunction]
        fn $name<'py>(
            py: Python<'py>,
            s: PyReadonlyArray1<'py, $t>,
            size_k: usize,
            size_n: usize,
            group_size: i64,
        ) -> PyResult<Bound<'py, PyArray1<$t>>> {
            let v = slice(py, &s, "s")?;
            let out = crate::parallel(py, || $core(v, size_k, size_n, group_size))
                .map_err(|e| layout(py, e))?;
            Ok(PyArray1::from_vec(py, out))
        }
    };
}

permute_fn!(
    marlin_permute_scales_u16,
    u16,
    marlin::marlin_permute_scales
);
permute_fn!(
    marlin_permute_scales_u32,
    u32,
    marlin::marlin_permute_scales
);
permute_fn!(
    marlin_unpermute_scales_u16,
    u16,
    marlin::marlin_unpermute_scales
);
permute_fn!(
    marlin_unpermute_scales_u32,
    u32,
    marlin::marlin_unpermute_scales
);

macro_rules! bias_fn {
    ($name:ident, $t:ty, $core:path) => {
        #[pyfunction]
        fn $name<'py>(
            py: Python<'py>,
            b: PyReadonlyArray1<'py, $t>,
        ) -> PyResult<Bound<'py, PyArray1<$t>>> {
            let v = slice(py, &b, "b")?;
            let out = crate::parallel(py, || $core(v)).map_err(|e| layout(py, e))?;
            Ok(PyArray1::from_vec(py, out))
        }
    };
}

bias_fn!(marlin_permute_bias_u16, u16, marlin::marlin_permute_bias);
bias_fn!(marlin_permute_bias_u32, u32, marlin::marlin_permute_bias);
bias_fn!(
    marlin_unpermute_bias_u16,
    u16,
    marlin::marlin_unpermute_bias
);
bias_fn!(
    marlin_unpermute_bias_u32,
    u32,
    marlin::marlin_unpermute_bias
);

#[pyfunction]
fn marlin_zero_points<'py>(
    py: Python<'py>,
    zp: PyReadonlyArray1<'py, u32>,
    size_k: usize,
    size_n: usize,
    num_bits: u32,
) -> PyResult<Bound<'py, PyArray1<u32>>> {
    let v = slice(py, &zp, "zp")?;
    let out = crate::parallel(py, || {
        marlin::marlin_zero_points(v, size_k, size_n, num_bits)
    })
    .map_err(|e| layout(py, e))?;
    Ok(PyArray1::from_vec(py, out))
}

#[pyfunction]
fn marlin_zero_points_inverse<'py>(
    py: Python<'py>,
    zp: PyReadonlyArray1<'py, u32>,
    size_k: usize,
    size_n: usize,
    num_bits: u32,
) -> PyResult<Bound<'py, PyArray1<u32>>> {
    let v = slice(py, &zp, "zp")?;
    let out = crate::parallel(py, || {
        marlin::marlin_zero_points_inverse(v, size_k, size_n, num_bits)
    })
    .map_err(|e| layout(py, e))?;
    Ok(PyArray1::from_vec(py, out))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(gptq_marlin_repack, m)?)?;
    m.add_function(wrap_pyfunction!(gptq_marlin_unrepack, m)?)?;
    m.add_function(wrap_pyfunction!(gptq_marlin_moe_repack, m)?)?;
    m.add_function(wrap_pyfunction!(marlin_permute_scales_u16, m)?)?;
    m.add_function(wrap_pyfunction!(marlin_permute_scales_u32, m)?)?;
    m.add_function(wrap_pyfunction!(marlin_unpermute_scales_u16, m)?)?;
    m.add_function(wrap_pyfunction!(marlin_unpermute_scales_u32, m)?)?;
    m.add_function(wrap_pyfunction!(marlin_permute_bias_u16, m)?)?;
    m.add_function(wrap_pyfunction!(marlin_permute_bias_u32, m)?)?;
    m.add_function(wrap_pyfunction!(marlin_unpermute_bias_u16, m)?)?;
    m.add_function(wrap_pyfunction!(marlin_unpermute_bias_u32, m)?)?;
    m.add_function(wrap_pyfunction!(marlin_zero_points, m)?)?;
    m.add_function(wrap_pyfunction!(marlin_zero_points_inverse, m)?)?;
    Ok(())
}
