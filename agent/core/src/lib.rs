//! lockstep core
pub mod cidr;
pub mod demand;
pub mod manager;
pub mod owner;
pub mod pool;
