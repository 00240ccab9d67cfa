//! The control plane: pools, volumes and file datasets by name (`manager`),
//! the catalog that records them (`catalog.json`), the automatic snapshot
//! scheduler (`retention`) and the send stream's format (`stream`). The
//! admin API and the frontends go through the manager to find a volume;
//! after that a connection holds the volume itself and the control plane is
//! off its data path.

pub mod catalog;
pub mod fuzzing;
pub mod manager;
pub mod retention;
pub mod stream;
