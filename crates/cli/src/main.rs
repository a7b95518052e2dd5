//! `stasis`: checkpoint and restore containers and process trees.

fn main() -> std::process::ExitCode {
    stasis_cli::main()
}
