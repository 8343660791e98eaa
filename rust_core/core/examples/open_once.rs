//! Opens a checkpoint once (for profilers): `cargo run --release --example open_once -- DIR`.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::args().nth(1).ok_or("usage: open_once DIR")?;
    let m = moeq_core::Model::open(std::path::Path::new(&dir))?;
    println!("{} layers", m.moe_layers().len());
    Ok(())
}
