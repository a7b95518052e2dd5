//! Progress reporting hooks for long store operations.

/// Receives progress of a store operation, for progress bars. Implementations must be cheap:
/// `advance` is called once per chunk (about once per MiB).
pub trait Progress: Send + Sync {
    /// A phase begins (`"upload"`, `"download"`), covering `total_bytes` bytes of checkpoint data.
    fn start(&self, phase: &str, total_bytes: u64);
    /// `bytes` more bytes of the current phase are done.
    fn advance(&self, bytes: u64);
    /// The current phase is over (also called when it failed).
    fn finish(&self);
}

/// A [`Progress`] that ignores everything.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoProgress;

impl Progress for NoProgress {
    fn start(&self, _phase: &str, _total_bytes: u64) {}
    fn advance(&self, _bytes: u64) {}
    fn finish(&self) {}
}
