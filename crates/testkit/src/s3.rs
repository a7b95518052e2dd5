//! A real S3-compatible server for the tests of the `s3://` store: s3s-fs (built by
//! `scripts/build-platform s3s-fs`), serving a directory whose subdirectories are buckets.

use std::net::{Ipv4Addr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The access key the server accepts.
pub const ACCESS_KEY: &str = "stasis";
/// The secret key the server accepts.
pub const SECRET_KEY: &str = "stasis-secret";
/// The region a client names (s3s-fs takes any).
pub const REGION: &str = "us-east-1";

/// The s3s-fs binary: `$STASIS_S3S_FS`, else the platform cache.
pub fn s3s_fs() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("STASIS_S3S_FS") {
        return Some(PathBuf::from(p));
    }
    let cache = PathBuf::from(std::env::var_os("HOME")?).join(".cache/stasis/platform");
    std::fs::read_dir(cache)
        .ok()?
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("s3s-fs-"))
        .map(|e| e.path().join("bin/s3s-fs"))
        .find(|p| p.exists())
}

/// A running s3s-fs on a loopback port, stopped on drop.
pub struct S3Server {
    child: Child,
    /// Its port on 127.0.0.1.
    pub port: u16,
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl S3Server {
    /// Starts s3s-fs serving `dir` for the test named `test`, once it accepts connections.
    /// `None` when s3s-fs is not built: the test prints why it did not run (a panic under `CI`,
    /// see [`crate::cannot_run`]).
    pub fn start(test: &str, dir: &Path) -> Option<S3Server> {
        let Some(bin) = s3s_fs() else {
            crate::cannot_run(
                test,
                "s3s-fs",
                "the s3s-fs server is not built (scripts/build-platform s3s-fs)",
            );
            return None;
        };
        let port = crate::free_port();
        let child = Command::new(bin)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY])
            .arg(dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start s3s-fs");
        let server = S3Server { child, port };
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect((Ipv4Addr::LOCALHOST, port)).is_err() {
            assert!(Instant::now() < deadline, "s3s-fs did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
        Some(server)
    }

    /// `http://127.0.0.1:<port>`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The environment of an S3 client of this server: `AWS_ENDPOINT_URL`, the keys, the region.
    pub fn client_env(&self) -> Vec<(String, String)> {
        [
            ("AWS_ENDPOINT_URL", self.endpoint()),
            ("AWS_ACCESS_KEY_ID", ACCESS_KEY.to_owned()),
            ("AWS_SECRET_ACCESS_KEY", SECRET_KEY.to_owned()),
            ("AWS_REGION", REGION.to_owned()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect()
    }
}
