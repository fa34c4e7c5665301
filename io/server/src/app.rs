//! The whole application: the MCP server's routes ([`crate::server`]) and the Board's
//! ([`crate::board`]) composed into one router, and serving it with the background work of
//! both. The server knows nothing of the Board; the Board uses the server; this module is the
//! one place that puts them together, so neither imports the other back.
//!
//! These are methods of [`Server`], so callers start a whole application from a `Server` as
//! before: [`Server::router`], [`Server::run_background`], [`Server::serve`].

use tokio::sync::watch;

use crate::server::{Server, accept_loop};

impl Server {
    /// The HTTP routes, on any listener (a real socket, or a simulated one in tests): the MCP
    /// server's, and the Board's under `/board/` unless the config turns it off.
    pub fn router(&self) -> axum::Router {
        let mut app = self.mcp_routes();
        if self.config().board {
            app = app.merge(crate::board::router(self.clone()));
        }
        self.counting_in_flight(app)
    }

    /// Runs the reaper and the requeue/doorbell loops on the configured intervals, and the
    /// doorbell's notice listener ([`Server::follow_notices`]), until `shutdown` resolves. A
    /// failed sweep is logged and retried on the next tick.
    pub async fn run_background(&self, shutdown: impl std::future::Future<Output = ()> + Send) {
        // The Board's bulk actions a stop interrupted carry on where they were.
        if self.config().board {
            crate::board::resume_bulks(self.clone());
        }
        self.run_loops(shutdown).await;
    }

    /// Serves on `listener` until `shutdown` resolves, with the background loops. On shutdown it
    /// stops accepting, ends the doorbell streams, lets in-flight requests finish (each one's
    /// store transaction commits or rolls back whole) for at most the shutdown grace, drops
    /// what is left, then stops the background loops.
    pub async fn serve(
        &self,
        listener: tokio::net::TcpListener,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        self.serve_with_tls(listener, None, shutdown).await
    }

    /// [`Server::serve`], speaking TLS on every connection when `tls` is given.
    pub async fn serve_with_tls(
        &self,
        listener: tokio::net::TcpListener,
        tls: Option<tokio_rustls::TlsAcceptor>,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let (stop_bg, mut bg_rx) = watch::channel(false);
        let bg_server = self.clone();
        let background = tokio::spawn(async move {
            bg_server
                .run_background(async move {
                    let _ = bg_rx.wait_for(|v| *v).await;
                })
                .await;
        });
        let result = accept_loop(self.clone(), self.router(), listener, tls, shutdown).await;
        stop_bg.send_replace(true);
        let _ = background.await;
        tracing::info!("stopped");
        result
    }
}
