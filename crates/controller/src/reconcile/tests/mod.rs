//! Unit tests of the reconcilers, against the stand-in API server of [`crate::testing`].

mod checkpoint;
mod pod;
mod restore;
mod sweep;

use super::*;
use crate::testing::*;
use stasis_core::lineage::RestoreChoice;
use stasis_core::reference::WorkloadName;
