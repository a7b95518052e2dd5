//! `stasis key generate`.

use std::process::ExitCode;

use serde_json::json;
use stasis_store::Key;

use crate::args::KeyCmd;
use crate::output;

pub fn run(cmd: KeyCmd) -> anyhow::Result<ExitCode> {
    match cmd {
        KeyCmd::Generate { file } => {
            let key = Key::generate(&file)?;
            let id = key.id().to_string();
            output::emit(&json!({ "file": file, "key_id": id }), || {
                format!("wrote a new key to {} (key id {id}); keep it safe: checkpoints made with it cannot be read without it", file.display())
            });
        }
    }
    Ok(ExitCode::SUCCESS)
}
