//! stasis-store
