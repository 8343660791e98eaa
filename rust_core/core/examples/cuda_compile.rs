//! Compiles every CUDA kernel variant with NVRTC and prints the ptxas figures:
//! `MOEQ_NVRTC_PATH=.venv/lib/python3.11/site-packages/nvidia/cu13/lib cargo run --release
//! --example cuda_compile -- sm_90`. Needs NVRTC, not a GPU.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let arch = std::env::args().nth(1).unwrap_or_else(|| "sm_90".into());
    let reports = moeq_core::cuda::compile_all(&arch, &[])?;
    println!(
        "{:28} {:>11} {:>9} {:>12} {:>8}",
        "variant", "cubin bytes", "registers", "spill stores", "seconds"
    );
    for r in reports {
        println!(
            "{:28} {:>11} {:>9} {:>12} {:>8.3}",
            r.name, r.cubin_bytes, r.registers, r.spill_stores, r.seconds
        );
    }
    Ok(())
}
