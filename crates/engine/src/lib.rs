//! stasis-engine
pub mod cuda;
