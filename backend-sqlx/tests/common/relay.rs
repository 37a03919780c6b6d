//! A TCP relay between a pool and PostgreSQL, to lose the answer to a
//! COMMIT that did commit.
//!
//! Killing the server process races with COMMIT and mostly loses (the
//! answer is out before the signal lands). Through the relay the loss is
//! deterministic: swallow what the server sends on one connection, let the
//! COMMIT run, then cut that connection. The server has committed; the
//! client sees a broken connection and cannot know.
//!
//! Connections are told apart by the relay's own port towards the server,
//! which the server reports as `inet_client_port()` in that session.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// Control over one relayed connection.
struct Link {
    swallow: Arc<AtomicBool>,
    cut: watch::Sender<bool>,
}

/// A running relay; it stops with the runtime that started it.
pub struct Relay {
    port: u16,
    links: Arc<Mutex<HashMap<u16, Link>>>,
}

impl Relay {
    /// Listens on a free loopback port and relays every connection to
    /// `target`.
    pub async fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind relay");
        let port = listener.local_addr().expect("relay address").port();
        let links: Arc<Mutex<HashMap<u16, Link>>> = Arc::default();
        let registry = links.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(target).await else {
                    continue;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let Ok(server_port) = server.local_addr().map(|a| a.port()) else {
                    continue;
                };
                let swallow = Arc::new(AtomicBool::new(false));
                let (cut, _) = watch::channel(false);
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = server.into_split();
                tokio::spawn(pump(client_read, server_write, None, cut.subscribe()));
                tokio::spawn(pump(
                    server_read,
                    client_write,
                    Some(swallow.clone()),
                    cut.subscribe(),
                ));
                registry
                    .lock()
                    .expect("relay registry")
                    .insert(server_port, Link { swallow, cut });
            }
        });
        Self { port, links }
    }

    /// The loopback port to connect to instead of the server's.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// From now on, drop what the server sends on the connection whose
    /// server session reports `inet_client_port() = server_port`.
    pub fn swallow_answers(&self, server_port: u16) {
        let links = self.links.lock().expect("relay registry");
        let link = links.get(&server_port).expect("a relayed connection");
        link.swallow.store(true, Ordering::SeqCst);
    }

    /// Closes that connection on both sides.
    pub fn cut(&self, server_port: u16) {
        let link = self
            .links
            .lock()
            .expect("relay registry")
            .remove(&server_port);
        if let Some(link) = link {
            link.cut.send_replace(true);
        }
    }
}

/// Copies `from` to `to` until either closes or the link is cut; with
/// `swallow` set, reads and discards instead.
async fn pump(
    mut from: impl AsyncRead + Unpin,
    mut to: impl AsyncWrite + Unpin,
    swallow: Option<Arc<AtomicBool>>,
    mut cut: watch::Receiver<bool>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        tokio::select! {
            _ = cut.changed() => return,
            n = from.read(&mut buf) => match n {
                Ok(0) | Err(_) => return,
                Ok(_) if swallow.as_ref().is_some_and(|s| s.load(Ordering::SeqCst)) => {}
                Ok(n) => {
                    if to.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                }
            },
        }
    }
}
