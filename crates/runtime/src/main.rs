//! `stasis-runc`: see the crate documentation.

fn main() {
    // Before any thread: runc's CRIU inherits this environment (an empty plugin directory, so
    // that CRIU's own CUDA plugin leaves the CUDA processes stasis drives alone), and the GPU
    // steps of a restore must see every GPU.
    let _ = stasis_engine::cuda::prepare_process_env();
    stasis_runtime::wrapper::run(std::env::args_os().skip(1).collect())
}
