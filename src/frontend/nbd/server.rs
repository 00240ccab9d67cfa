use crate::daemon::Shutdown;
use crate::volume::manager::VolumeManager;
use std::sync::Arc;
use tokio::net::TcpListener;

pub async fn serve(_listener: TcpListener, _manager: Arc<VolumeManager>, mut stop: Shutdown) {
    let _ = stop.wait_for(|s| *s).await;
}
