//! turmoil's listener as axum's, for tests that serve a router inside the simulation (shared by
//! `io/worker/tests/turmoil.rs` and the lease client's unit tests).

pub struct SimListener(pub turmoil::net::TcpListener);

impl axum::serve::Listener for SimListener {
    type Io = turmoil::net::TcpStream;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            if let Ok(conn) = self.0.accept().await {
                return conn;
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.0.local_addr()
    }
}
