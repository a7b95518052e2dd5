//! stasis-gpu
