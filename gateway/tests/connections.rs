//! The accept loop over a real loopback socket: a cap on open connections (one more is
//! answered 503 at once) and a header-read timeout that frees the connections of slow or
//! silent clients.

mod common;

use common::{server, TestResult};
use gateway::http::ServerConfig;
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
    let addr = gateway::http::spawn_loopback(s).await?;

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

/// A POST to `/rag/query` announcing a 1000-byte body, of which only `{` is sent now.
fn slow_body_head(addr: std::net::SocketAddr) -> String {
    format!(
        "POST /rag/query HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\
         content-length: 1000\r\n\r\n{{"
    )
}

/// Regression (issue 38): a body sent one byte at a time (or not at all) held its connection
/// forever, past the header timeout and the request deadline, so 256 of them answered every
/// other client 503. Now each is answered 408 (a problem) and closed once the body timeout
/// passes, and a normal client is served meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_bodies_are_answered_408_and_cannot_starve_the_server() -> TestResult {
    let dir = tempfile::tempdir()?;
    let body_timeout = Duration::from_secs(2);
    let s = server(
        dir.path(),
        ServerConfig {
            // The default cap: the attack takes every connection.
            max_connections: 256,
            body_timeout,
            ..Default::default()
        },
    )?;
    let addr = gateway::http::spawn_loopback(s).await?;
    let t0 = Instant::now();
    let mut attackers = Vec::new();
    for i in 0..256 {
        let mut conn = TcpStream::connect(addr).await?;
        conn.write_all(slow_body_head(addr).as_bytes()).await?;
        // Half trickle a byte every 200 ms until the server hangs up; half send nothing more.
        let trickle = i % 2 == 0;
        attackers.push(tokio::spawn(async move {
            let mut out = Vec::new();
            let mut buf = [0u8; 4096];
            loop {
                let step = tokio::time::timeout(Duration::from_millis(200), conn.read(&mut buf));
                match step.await {
                    Ok(Ok(0)) | Ok(Err(_)) => break,
                    Ok(Ok(n)) => out.extend_from_slice(&buf[..n]),
                    Err(_) => {
                        if t0.elapsed() > Duration::from_secs(30) {
                            break; // never closed: the assertion below says so
                        }
                        if trickle && conn.write_all(b" ").await.is_err() {
                            // The server closed its side; read what it answered.
                        }
                    }
                }
            }
            (String::from_utf8_lossy(&out).into_owned(), t0.elapsed())
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    // A normal client during the attack: refused while every connection is held, served as
    // soon as the body timeout frees them.
    let mut served = None;
    while t0.elapsed() < body_timeout * 4 {
        let mut conn = TcpStream::connect(addr).await?;
        conn.write_all(health_request(addr, false).as_bytes())
            .await?;
        let answer = read_to_close(&mut conn, Duration::from_secs(5)).await?;
        if answer.starts_with("HTTP/1.1 200") {
            served = Some(t0.elapsed());
            break;
        }
        assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let served = served.ok_or("a normal client was never served during the attack")?;
    for attacker in attackers {
        let (answer, closed_at) = attacker.await?;
        assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
        assert!(answer.contains("application/problem+json"), "{answer}");
        assert!(answer.contains("connection: close"), "{answer}");
        assert!(
            closed_at < body_timeout + Duration::from_secs(3),
            "closed only after {closed_at:?}"
        );
    }
    eprintln!("a normal client was served {served:?} into the attack");
    Ok(())
}

/// Requests over the server's own limits, which hyper would answer with a bare status and no
/// body, are answered as problems: a target over 8 KiB 414, over 100 headers 431, a path that
/// is not %-encoding 400 (a `%ZZ` id was looked up and answered 404).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_and_malformed_requests_are_answered_as_problems() -> TestResult {
    let dir = tempfile::tempdir()?;
    let s = server(dir.path(), ServerConfig::default())?;
    let addr = gateway::http::spawn_loopback(s).await?;
    let long_target = format!(
        "GET /health?x={} HTTP/1.1\r\nhost: {addr}\r\n\r\n",
        "a".repeat(9000)
    );
    let many_headers = format!(
        "GET /health HTTP/1.1\r\nhost: {addr}\r\n{}\r\n",
        (0..150)
            .map(|i| format!("x-h{i}: v\r\n"))
            .collect::<String>()
    );
    let bad_escape = format!("DELETE /documents/%ZZ HTTP/1.1\r\nhost: {addr}\r\n\r\n");
    for (request, status) in [(long_target, 414), (many_headers, 431), (bad_escape, 400)] {
        let mut conn = TcpStream::connect(addr).await?;
        conn.write_all(request.as_bytes()).await?;
        let mut out = vec![0u8; 8192];
        let n = tokio::time::timeout(Duration::from_secs(5), conn.read(&mut out)).await??;
        let answer = String::from_utf8_lossy(&out[..n]).into_owned();
        assert!(
            answer.starts_with(&format!("HTTP/1.1 {status}")),
            "{answer}"
        );
        assert!(answer.contains("application/problem+json"), "{answer}");
        assert!(answer.contains(&format!("\"status\":{status}")), "{answer}");
    }
    Ok(())
}

/// What `/metrics` answers.
async fn metrics_text(addr: std::net::SocketAddr) -> Result<String, String> {
    let mut conn = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    let request = format!("GET /metrics HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n");
    conn.write_all(request.as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    read_to_close(&mut conn, Duration::from_secs(5)).await
}

/// `specrag_body_bytes_in_flight` on `/metrics`.
async fn body_bytes_in_flight(addr: std::net::SocketAddr) -> Result<u64, String> {
    let text = metrics_text(addr).await?;
    text.lines()
        .find_map(|l| l.strip_prefix("specrag_body_bytes_in_flight "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map(|v| v as u64)
        .ok_or_else(|| format!("no specrag_body_bytes_in_flight in {text}"))
}

/// Waits until `/metrics` shows `bytes` of bodies in flight.
async fn wait_in_flight(addr: std::net::SocketAddr, bytes: u64) -> TestResult {
    let t0 = Instant::now();
    loop {
        let now = body_bytes_in_flight(addr).await?;
        if now == bytes {
            return Ok(());
        }
        if t0.elapsed() > Duration::from_secs(20) {
            return Err(format!("{now} body bytes in flight, not {bytes}").into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A POST to `path` announcing a `length`-byte body, of which only `{` is sent now.
async fn stalled_body(
    addr: std::net::SocketAddr,
    path: &str,
    length: usize,
) -> Result<TcpStream, Box<dyn std::error::Error>> {
    let mut conn = TcpStream::connect(addr).await?;
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\
         content-length: {length}\r\n\r\n{{"
    );
    conn.write_all(head.as_bytes()).await?;
    Ok(conn)
}

/// A server whose request bodies may hold at most `budget` bytes at once.
async fn budget_server(
    dir: &std::path::Path,
    budget: usize,
) -> Result<std::net::SocketAddr, Box<dyn std::error::Error>> {
    let s = server(
        dir,
        ServerConfig {
            max_body_bytes_in_flight: budget,
            ..Default::default()
        },
    )?;
    Ok(gateway::http::spawn_loopback(s).await?)
}

/// Regression (issue 88): each body was bounded by its route's limit only, so 256
/// connections could buffer 256 x 32 MiB before any check. Now bodies announced past the
/// bytes in flight are answered 503 with Retry-After at once (in each route's shape), and the
/// bytes come back when their requests end: a later request is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_past_the_bytes_in_flight_are_answered_503_until_released() -> TestResult {
    let dir = tempfile::tempdir()?;
    let addr = budget_server(dir.path(), 2500).await?;
    let holders = [
        stalled_body(addr, "/rag/query", 1000).await?,
        stalled_body(addr, "/documents", 1000).await?,
    ];
    wait_in_flight(addr, 2000).await?;

    let mut over = stalled_body(addr, "/rag/query", 1000).await?;
    let answer = read_to_close(&mut over, Duration::from_secs(5)).await?;
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(answer.contains("retry-after: 1"), "{answer}");
    assert!(answer.contains("connection: close"), "{answer}");
    assert!(answer.contains("application/problem+json"), "{answer}");
    assert!(answer.contains("--max-body-bytes-in-flight"), "{answer}");

    let mut over = stalled_body(addr, "/v1/chat/completions", 1000).await?;
    let answer = read_to_close(&mut over, Duration::from_secs(5)).await?;
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(answer.contains("retry-after: 1"), "{answer}");
    assert!(answer.contains("\"type\":\"server_error\""), "{answer}");
    assert!(answer.contains("--max-body-bytes-in-flight"), "{answer}");
    wait_in_flight(addr, 2000).await?;

    // The holders hang up: their bytes come back and a body of the same size is served.
    drop(holders);
    wait_in_flight(addr, 0).await?;
    let body = r#"{"documents": [{"id": "ants", "text": "The thin ant ran in the sand."}]}"#;
    let padded = format!("{body:<1000}");
    let mut conn = TcpStream::connect(addr).await?;
    let request = format!(
        "POST /documents HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{padded}",
        padded.len()
    );
    conn.write_all(request.as_bytes()).await?;
    let answer = read_to_close(&mut conn, Duration::from_secs(60)).await?;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    wait_in_flight(addr, 0).await?;
    let metrics = metrics_text(addr).await?;
    assert!(
        metrics.contains("specrag_rejected_total{reason=\"body_bytes\"} 2"),
        "{metrics}"
    );
    Ok(())
}

/// A request without a valid key is answered 401 before its body is read, on the OpenAI route
/// too (its key check was in the handler, after the body: a client without a key could hold
/// the bytes in flight for the body timeout), so it holds no body bytes while its connection
/// stays open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_without_a_key_is_refused_before_its_body_is_read() -> TestResult {
    let dir = tempfile::tempdir()?;
    let s = server(
        dir.path(),
        ServerConfig {
            max_body_bytes_in_flight: 2500,
            api_keys: vec!["sekrit".parse()?],
            ..Default::default()
        },
    )?;
    let addr = gateway::http::spawn_loopback(s).await?;
    for (path, shape) in [
        ("/v1/chat/completions", "\"code\":\"invalid_api_key\""),
        ("/rag/query", "application/problem+json"),
    ] {
        let mut conn = stalled_body(addr, path, 2000).await?;
        let mut out = vec![0u8; 4096];
        let n = tokio::time::timeout(Duration::from_secs(5), conn.read(&mut out)).await??;
        let answer = String::from_utf8_lossy(&out[..n]).into_owned();
        assert!(answer.starts_with("HTTP/1.1 401"), "{path}: {answer}");
        assert!(answer.contains(shape), "{path}: {answer}");
        // Its bytes are back while its connection is still open: another body fits.
        wait_in_flight(addr, 0).await?;
        drop(conn);
    }
    Ok(())
}

/// A body of unknown length (chunked) is charged as it arrives: past the bytes in flight it
/// is answered 503 mid-way; a body larger than all of them is answered 413, announced or not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunked_bodies_are_charged_as_they_grow() -> TestResult {
    let dir = tempfile::tempdir()?;
    let addr = budget_server(dir.path(), 2500).await?;
    let holder = stalled_body(addr, "/rag/query", 2000).await?;
    wait_in_flight(addr, 2000).await?;

    let chunked = |bytes: usize| {
        let piece = format!("{:<300}", "");
        let mut request = format!(
            "POST /rag/query HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\
             transfer-encoding: chunked\r\n\r\n"
        );
        for _ in 0..bytes / 300 {
            request.push_str(&format!("{:x}\r\n{piece}\r\n", piece.len()));
        }
        request
    };
    // 300 bytes fit beside the holder; 600 do not.
    let mut growing = TcpStream::connect(addr).await?;
    growing.write_all(chunked(600).as_bytes()).await?;
    let answer = read_to_close(&mut growing, Duration::from_secs(5)).await?;
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(answer.contains("retry-after: 1"), "{answer}");
    assert!(answer.contains("--max-body-bytes-in-flight"), "{answer}");

    drop(holder);
    wait_in_flight(addr, 0).await?;
    // Larger than the whole budget: 413, whether it grows there or announces it.
    let mut alone = TcpStream::connect(addr).await?;
    alone.write_all(chunked(3000).as_bytes()).await?;
    let answer = read_to_close(&mut alone, Duration::from_secs(5)).await?;
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.contains("--max-body-bytes-in-flight"), "{answer}");
    let mut announced = stalled_body(addr, "/rag/query", 3000).await?;
    let answer = read_to_close(&mut announced, Duration::from_secs(5)).await?;
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.contains("--max-body-bytes-in-flight"), "{answer}");
    wait_in_flight(addr, 0).await?;
    Ok(())
}
