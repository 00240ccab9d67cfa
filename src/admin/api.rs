//! The REST API (placeholder: only /metrics until the admin API lands).

use std::sync::Arc;

use axum::routing::get;
use axum::Router;

use crate::volume::manager::VolumeManager;

pub fn router(manager: Arc<VolumeManager>) -> Router {
    Router::new().route(
        "/metrics",
        get(move || {
            let manager = manager.clone();
            async move { super::metrics::render(&manager.volumes()) }
        }),
    )
}
