//! `moeq_rs._core.CpuMoeLayer`: the CPU MoE forward for the Python `MoELayer`.

use std::sync::Arc;

use moeq_core::cpu::routing::Routed;
use moeq_core::cpu::CpuMoe;
use numpy::{PyArray1, PyReadonlyArray1};
use pyo3::prelude::*;

use crate::{to_py, Checkpoint};

#[pyclass(frozen, module = "moeq_rs._core")]
pub struct CpuMoeLayer {
    moe: Arc<CpuMoe>,
}

fn contiguous<'a, T: numpy::Element>(
    py: Python<'_>,
    a: &'a PyReadonlyArray1<'_, T>,
    name: &str,
) -> PyResult<&'a [T]> {
    a.as_slice().map_err(|_| {
        to_py(
            py,
            moeq_core::error::LayoutError {
                subject: name.to_string(),
                reason: "must be contiguous".into(),
            }
            .into(),
        )
    })
}

#[pymethods]
impl CpuMoeLayer {
    /// Loads decoder layer `layer` of an opened checkpoint for the CPU.
    #[staticmethod]
    fn from_checkpoint(py: Python<'_>, ckpt: &Checkpoint, layer: usize) -> PyResult<CpuMoeLayer> {
        let model = Arc::clone(&ckpt.model);
        let moe = py
            .detach(|| moeq_core::cpu::load::moe_layer(&model, layer))
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

    /// `[tokens * hidden]` f32 output for f32 `hidden_states` and `router_logits` (flattened).
    fn forward<'py>(
        &self,
        py: Python<'py>,
        hidden_states: PyReadonlyArray1<'py, f32>,
        tokens: usize,
        router_logits: PyReadonlyArray1<'py, f32>,
    ) -> PyResult<Bound<'py, PyArray1<f32>>> {
        let x = contiguous(py, &hidden_states, "hidden_states")?;
        let l = contiguous(py, &router_logits, "router_logits")?;
        let moe = Arc::clone(&self.moe);
        let out = py
            .detach(|| moe.forward(x, tokens, l))
            .map_err(|e| to_py(py, e))?;
        Ok(PyArray1::from_vec(py, out))
    }

    /// The weighted sum of the routed experts only.
    fn forward_topk<'py>(
        &self,
        py: Python<'py>,
        hidden_states: PyReadonlyArray1<'py, f32>,
        tokens: usize,
        topk_weights: PyReadonlyArray1<'py, f32>,
        topk_ids: PyReadonlyArray1<'py, i64>,
        top_k: usize,
    ) -> PyResult<Bound<'py, PyArray1<f32>>> {
        let x = contiguous(py, &hidden_states, "hidden_states")?;
        let w = contiguous(py, &topk_weights, "topk_weights")?;
        let ids = contiguous(py, &topk_ids, "topk_ids")?;
        if let Some((i, v)) = ids
            .iter()
            .enumerate()
            .find(|(_, &v)| v < 0 || v > u32::MAX as i64)
        {
            return Err(to_py(
                py,
                moeq_core::error::LayoutError {
                    subject: "topk_ids".into(),
                    reason: format!("entry {i} is {v}, not an expert index"),
                }
                .into(),
            ));
        }
        let routed = Routed {
            top_k,
            ids: ids.iter().map(|&v| v as u32).collect(),
            weights: w.to_vec(),
        };
        let moe = Arc::clone(&self.moe);
        let out = py
            .detach(|| moe.forward_topk(x, tokens, &routed))
            .map_err(|e| to_py(py, e))?;
        Ok(PyArray1::from_vec(py, out))
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<CpuMoeLayer>()
}
