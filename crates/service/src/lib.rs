//! stasis-service: the service plumbing `stasisd` and `stasis-controller` share, so both
//! daemons take the same flags and answer the same way.
//!
//! - [`telemetry`]: `tracing` set up from [`telemetry::LogArgs`] (`--log-format text|json`,
//!   `RUST_LOG`);
//! - [`http`]: an HTTP/1.1 server (hyper) for any handler, plain or TLS, stopped by a future;
//! - [`admin`]: the admin routes, `/metrics` (a `prometheus-client` registry), `/livez` and a
//!   `/readyz` that answers ok only once the daemon says it is ready ([`admin::Readiness`]);
//! - [`shutdown`]: SIGTERM or SIGINT, handled once per process and handed to whoever stops on it.

pub mod admin;
pub mod http;
pub mod shutdown;
pub mod telemetry;
