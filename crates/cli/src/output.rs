//! Printing results: human text, or one JSON document on stdout (`--output json`).

use std::sync::OnceLock;

use serde::Serialize;

use crate::args::Output;

static MODE: OnceLock<Output> = OnceLock::new();

pub fn set_mode(m: Output) {
    let _ = MODE.set(m);
}

pub fn json_mode() -> bool {
    MODE.get() == Some(&Output::Json)
}

/// Prints a command's result: `human` as text, or `value` as JSON.
pub fn emit<T: Serialize>(value: &T, human: impl FnOnce() -> String) {
    if json_mode() {
        println!(
            "{}",
            serde_json::to_string_pretty(value)
                .unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
        );
    } else {
        let text = human();
        if !text.is_empty() {
            println!("{text}");
        }
    }
}

/// Prints an error with its chain of causes: on stderr, and as `{"error": ...}` on stdout in
/// JSON mode so that scripts see it.
pub fn error(e: &anyhow::Error) {
    let chain: Vec<String> = e.chain().map(ToString::to_string).collect();
    if json_mode() {
        println!(
            "{}",
            serde_json::json!({ "error": chain.join(": "), "causes": chain })
        );
    }
    eprintln!("error: {}", chain.join("\n  caused by: "));
}

/// Bytes in binary units, for humans.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn byte_units() {
        assert_eq!(super::bytes(512), "512 B");
        assert_eq!(super::bytes(3 * 1024 * 1024 / 2), "1.5 MiB");
        assert_eq!(super::bytes(2 << 30), "2.0 GiB");
    }
}
