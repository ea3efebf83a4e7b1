//! The accept loop under the router: HTTP/1 connections with hyper's header-read timeout, a
//! cap on open connections (one more answered 503), and shutdown.

use super::state::AppState;
use std::sync::Arc;
use std::time::Duration;

/// Serves `app(state)` on `addr` until Ctrl-C.
pub async fn serve(state: AppState, addr: std::net::SocketAddr) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    serve_on(state, listener).await
}

/// Serves on an already bound listener (tests bind port 0) until Ctrl-C, then waits up to
/// [`SHUTDOWN_GRACE`] for open connections.
///
/// Each connection holds one of `max_connections` permits; one over the cap is answered 503
/// and closed at once. A client must send a request's headers within `header_read_timeout`
/// (an idle keep-alive connection is closed after it too), so slow or silent clients cannot
/// hold the permits.
pub async fn serve_on(state: AppState, listener: tokio::net::TcpListener) -> std::io::Result<()> {
    let max_connections = state.config.max_connections;
    let permits = Arc::new(tokio::sync::Semaphore::new(max_connections));
    let header_timeout = state.config.header_read_timeout;
    let metrics = state.metrics.clone();
    let app = super::routes::app(state);
    let shutdown = tokio::signal::ctrl_c();
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(conn) => conn,
                Err(e) => {
                    // Out of file descriptors and the like: wait, do not spin or exit.
                    tracing::warn!("accepting a connection failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            metrics.connection_refused();
            metrics.request("connection_cap", 503);
            tracing::info!(route = "connection_cap", status = 503u16, peer = %peer, "request");
            tokio::spawn(refuse_connection(stream));
            continue;
        };
        let metrics = metrics.clone();
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        tokio::spawn(async move {
            let _permit = permit;
            // HTTP/1 only: protocol detection would read before hyper's header timer starts,
            // so a silent client would hold its connection forever.
            let mut builder =
                hyper_util::server::conn::auto::Builder::new(hyper_util::rt::TokioExecutor::new())
                    .http1_only();
            builder
                .http1()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(header_timeout)
                // Above our own limits, so that `request_limits` answers those as problems.
                .max_headers(crate::http::limits::HYPER_MAX_HEADERS);
            let io = hyper_util::rt::TokioIo::new(stream);
            if let Err(e) = builder.serve_connection(io, service).await {
                // A request hyper could not parse: it answered a bare status and closed.
                match crate::http::limits::hyper_status(&*e) {
                    Some(status) => {
                        metrics.request("unparsed", status);
                        tracing::info!(route = "unparsed", status, reason = %e, "request");
                    }
                    None => tracing::debug!("connection ended: {e}"),
                }
            }
        });
    }
    // Every permit back means every connection has ended (the free ones are taken at once).
    let all = u32::try_from(max_connections).unwrap_or(u32::MAX);
    let _ = tokio::time::timeout(SHUTDOWN_GRACE, permits.acquire_many(all)).await;
    Ok(())
}

/// How long shutdown waits for open connections.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// Answers a connection over the cap with a 503 problem and closes it, spending at most a
/// second on a client that does not read.
pub(crate) async fn refuse_connection(mut stream: tokio::net::TcpStream) {
    use tokio::io::AsyncWriteExt;
    let body = r#"{"type":"about:blank","title":"Service Unavailable","status":503,"detail":"too many open connections; retry after the time in Retry-After"}"#;
    let answer = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/problem+json\r\n\
         retry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        let _ = stream.write_all(answer.as_bytes()).await;
        let _ = stream.shutdown().await;
    })
    .await;
}

/// The runtime the binaries serve on: two workers are plenty, model work runs on the engine
/// thread.
pub fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
}

/// Serves `state` on a free loopback port in the background of the current runtime (the demo,
/// the evaluation's load test) and returns the address.
pub async fn spawn_loopback(state: AppState) -> std::io::Result<std::net::SocketAddr> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(serve_on(state, listener));
    Ok(addr)
}
