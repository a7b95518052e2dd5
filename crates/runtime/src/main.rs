//! `stasis-runc`: see the crate documentation.

fn main() {
    stasis_runtime::wrapper::run(std::env::args_os().skip(1).collect())
}
