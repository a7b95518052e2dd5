//! Logging: the setup both daemons share (`stasis_service::telemetry`: `--log-format text|json`,
//! the hidden `--log-json`, `RUST_LOG`).

pub use stasis_service::telemetry::{init, LogArgs, LogFormat};
