//! Logging: `tracing` with an `EnvFilter` (`RUST_LOG`, default `info`), text or JSON.

use tracing_subscriber::{fmt, prelude::*, EnvFilter};

/// Installs the global subscriber (once, from `main`).
pub fn init(json: bool) {
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("info,kube=warn,hyper=warn,rustls=warn"));
    let registry = tracing_subscriber::registry().with(filter);
    if json {
        let _ = registry
            .with(fmt::layer().json().with_writer(std::io::stderr))
            .try_init();
    } else {
        let _ = registry
            .with(fmt::layer().compact().with_writer(std::io::stderr))
            .try_init();
    }
}
