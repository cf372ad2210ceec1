//! The CLI's client of the agent API: HTTP/1.1 over the unix socket.

use std::path::Path;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;

/// Errors of talking to the agent.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The agent is not reachable.
    #[error("cannot reach the agent at {socket} (is it running?)")]
    Connect {
        /// The socket.
        socket: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The HTTP exchange failed.
    #[error("talking to the agent failed")]
    Http(#[source] hyper::Error),
    /// The request could not be built.
    #[error("bad request to the agent")]
    Request(#[source] hyper::http::Error),
    /// The agent answered with an error.
    #[error("{code}: {message}")]
    Api {
        /// HTTP status.
        status: u16,
        /// Stable error code.
        code: String,
        /// Message.
        message: String,
    },
    /// The answer is not JSON.
    #[error("the agent's answer is not JSON")]
    Decode(#[source] serde_json::Error),
}

/// Sends one request and returns the JSON answer of a 2xx response.
///
/// # Errors
/// Connection, HTTP or API errors.
pub async fn call(
    socket: &Path,
    method: Method,
    path: &str,
    body: Option<serde_json::Value>,
) -> Result<serde_json::Value, ClientError> {
    let (status, bytes) = raw(
        socket,
        method,
        path,
        body.map(|b| b.to_string().into_bytes()),
    )
    .await?;
    let value: serde_json::Value = if bytes.is_empty() {
        serde_json::Value::Null
    } else {
        serde_json::from_slice(&bytes).map_err(ClientError::Decode)?
    };
    if status.is_success() {
        Ok(value)
    } else {
        Err(ClientError::Api {
            status: status.as_u16(),
            code: value["error"]["code"]
                .as_str()
                .unwrap_or("unknown")
                .to_string(),
            message: value["error"]["message"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
        })
    }
}

/// Sends raw bytes (used by tests of malformed requests); returns status and
/// body.
///
/// # Errors
/// Connection or HTTP errors.
pub async fn raw(
    socket: &Path,
    method: Method,
    path: &str,
    body: Option<Vec<u8>>,
) -> Result<(StatusCode, Bytes), ClientError> {
    let stream = UnixStream::connect(socket)
        .await
        .map_err(|source| ClientError::Connect {
            socket: socket.display().to_string(),
            source,
        })?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(ClientError::Http)?;
    tokio::spawn(conn);
    let mut req = Request::builder()
        .method(method)
        .uri(path)
        .header("host", "lockstep");
    if body.is_some() {
        req = req.header("content-type", "application/json");
    }
    let req = req
        .body(Full::new(Bytes::from(body.unwrap_or_default())))
        .map_err(ClientError::Request)?;
    let resp = sender.send_request(req).await.map_err(ClientError::Http)?;
    let status = resp.status();
    let bytes = resp
        .into_body()
        .collect()
        .await
        .map_err(ClientError::Http)?
        .to_bytes();
    Ok((status, bytes))
}
