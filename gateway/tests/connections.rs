//! The accept loop over a real loopback socket: a cap on open connections (one more is
//! answered 503 at once) and a header-read timeout that frees the connections of slow or
//! silent clients.

#![warn(clippy::too_many_lines, clippy::too_many_arguments)]

mod common;

use common::{server, TestResult};
use gateway::server::ServerConfig;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Reads until the server closes the connection (or `limit` passes) and returns what came.
async fn read_to_close(conn: &mut TcpStream, limit: Duration) -> Result<String, String> {
    let mut out = Vec::new();
    match tokio::time::timeout(limit, conn.read_to_end(&mut out)).await {
        Ok(Ok(_)) => Ok(String::from_utf8_lossy(&out).into_owned()),
        // A reset after the timeout also ends the connection.
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionReset => {
            Ok(String::from_utf8_lossy(&out).into_owned())
        }
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!(
            "still open after {limit:?}; read so far: {}",
            String::from_utf8_lossy(&out)
        )),
    }
}

fn health_request(addr: std::net::SocketAddr, keep_alive: bool) -> String {
    let connection = if keep_alive { "keep-alive" } else { "close" };
    format!("GET /health HTTP/1.1\r\nhost: {addr}\r\nconnection: {connection}\r\n\r\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_are_capped_and_slow_clients_are_timed_out() -> TestResult {
    let dir = tempfile::tempdir()?;
    let timeout = Duration::from_secs(1);
    let s = server(
        dir.path(),
        ServerConfig {
            max_connections: 2,
            header_read_timeout: timeout,
            ..Default::default()
        },
    )?;
    let addr = gateway::server::spawn_loopback(s).await?;

    // Two clients hold the two connections: one sends half a header, one nothing at all.
    let t0 = Instant::now();
    let mut slow = TcpStream::connect(addr).await?;
    slow.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\n")
        .await?;
    let mut silent = TcpStream::connect(addr).await?;
    tokio::time::sleep(Duration::from_millis(100)).await;

    // A third is refused at once with a problem and Retry-After.
    let mut third = TcpStream::connect(addr).await?;
    let answer = read_to_close(&mut third, Duration::from_secs(5)).await?;
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(answer.contains("retry-after: 1"), "{answer}");
    assert!(answer.contains("application/problem+json"), "{answer}");
    assert!(answer.contains("\"status\":503"), "{answer}");

    // Both holders are closed once the header timeout passes.
    for conn in [&mut slow, &mut silent] {
        read_to_close(conn, timeout * 5).await?;
    }
    let held = t0.elapsed();
    assert!(held >= timeout, "closed before the timeout: {held:?}");

    // Their connections are free again: a client is served, and its idle keep-alive
    // connection is closed after the timeout too.
    let mut fresh = TcpStream::connect(addr).await?;
    fresh
        .write_all(health_request(addr, true).as_bytes())
        .await?;
    let t1 = Instant::now();
    let answer = read_to_close(&mut fresh, timeout * 5).await?;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(t1.elapsed() >= timeout, "{:?}", t1.elapsed());
    let mut closing = TcpStream::connect(addr).await?;
    closing
        .write_all(health_request(addr, false).as_bytes())
        .await?;
    let answer = read_to_close(&mut closing, Duration::from_secs(5)).await?;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    Ok(())
}
