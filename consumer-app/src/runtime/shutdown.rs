//! The one way the runtime's loops wait for shutdown, so the service, its
//! workers and the relay stop on the same signal in the same way.

use tokio::sync::watch;

/// Resolves when `shutdown` turns true or its sender is gone (a dropped
/// handle means nobody can ask to keep running).
pub(crate) async fn stopped(shutdown: &mut watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|stop| *stop).await;
}
