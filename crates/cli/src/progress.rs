//! Progress bars on stderr (hidden in JSON mode, with --quiet, or when stderr is not a terminal).

use std::sync::Mutex;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Draws one bar per store phase, implementing the store's progress callbacks.
pub struct Bars {
    enabled: bool,
    current: Mutex<Option<ProgressBar>>,
}

impl Bars {
    pub fn new(enabled: bool) -> Self {
        Self {
            enabled: enabled && std::io::IsTerminal::is_terminal(&std::io::stderr()),
            current: Mutex::new(None),
        }
    }

    fn target(&self) -> ProgressDrawTarget {
        if self.enabled {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        }
    }

    /// A spinner for a phase of unknown length (the freeze and dump).
    pub fn spinner(&self, msg: &'static str) -> ProgressBar {
        let pb = ProgressBar::with_draw_target(None, self.target());
        pb.set_style(
            ProgressStyle::with_template("{spinner} {msg} {elapsed}").expect("valid template"),
        );
        pb.set_message(msg);
        pb.enable_steady_tick(Duration::from_millis(100));
        pb
    }
}

impl stasis_store::Progress for Bars {
    fn start(&self, phase: &str, total_bytes: u64) {
        let pb = ProgressBar::with_draw_target(Some(total_bytes), self.target());
        pb.set_style(
            ProgressStyle::with_template(
                "{msg:>10} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} {eta}",
            )
            .expect("valid template")
            .progress_chars("=> "),
        );
        pb.set_message(phase.to_owned());
        if let Ok(mut c) = self.current.lock() {
            *c = Some(pb);
        }
    }

    fn advance(&self, bytes: u64) {
        if let Ok(c) = self.current.lock() {
            if let Some(pb) = c.as_ref() {
                pb.inc(bytes);
            }
        }
    }

    fn finish(&self) {
        if let Ok(mut c) = self.current.lock() {
            if let Some(pb) = c.take() {
                pb.finish_and_clear();
            }
        }
    }
}
