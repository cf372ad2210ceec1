//! lockstep core
pub mod cidr;
