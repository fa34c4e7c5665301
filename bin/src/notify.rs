//! systemd's readiness protocol (sd_notify), the few lines it takes: when the service manager
//! set `NOTIFY_SOCKET`, `relay serve` and `relay daemon` send `READY=1` once they serve and
//! `STOPPING=1` when a stop begins, as one datagram each on that unix socket (a path, or an
//! abstract name written `@name`). Without `NOTIFY_SOCKET` nothing is sent. A failed send is
//! logged and otherwise ignored: the service works the same without a manager listening.

use std::os::unix::net::UnixDatagram;

/// Tells the service manager that the service is ready (`Type=notify` units start then).
pub fn ready() {
    send("READY=1");
}

/// Tells the service manager that the service is stopping.
pub fn stopping() {
    send("STOPPING=1");
}

fn send(state: &str) {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    if let Err(e) = send_to(&path, state) {
        tracing::warn!(error = %e, state, "cannot notify the service manager (NOTIFY_SOCKET)");
    }
}

fn send_to(path: &std::ffi::OsStr, state: &str) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt as _;
    let socket = UnixDatagram::unbound()?;
    let bytes = path.as_bytes();
    let sent = match bytes.strip_prefix(b"@") {
        Some(name) => {
            use std::os::linux::net::SocketAddrExt as _;
            let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
            socket.send_to_addr(state.as_bytes(), &addr)?
        }
        None => socket.send_to(state.as_bytes(), path)?,
    };
    if sent == state.len() {
        Ok(())
    } else {
        Err(std::io::Error::other("the datagram was cut short"))
    }
}
