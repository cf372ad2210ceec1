//! The first look at a connection's request head, before hyper's.
//!
//! hyper answers a head it cannot take (a garbage request line, a
//! `Content-Length` that overflows, a URI or head too long, too many
//! headers) with a bare status and no body, so those refusals did not have
//! the API's JSON error shape. The server reads each connection's head
//! itself — bounded in size, under the header timeout — and checks it with
//! `httparse` by the same rules; a head it refuses gets the documented
//! `{"error": {"code", "message"}}` body with the right status (400, 408,
//! 413, 414, 431) and the connection closes. A head it accepts is given to
//! hyper with the bytes already read replayed ([`Rewind`]). The server
//! serves one request per connection (the plugin and the CLI make one each),
//! so no later head on the connection escapes this check.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _, ReadBuf};

/// Largest request head (request line and headers) accepted: well under
/// hyper's own buffer limit, so a head that passes here always fits there.
pub(super) const MAX_HEAD: usize = 32 * 1024;
/// Most header fields accepted (hyper's own limit).
pub(super) const MAX_HEADERS: usize = 100;
/// Longest request target accepted.
pub(super) const MAX_URI: usize = 8 * 1024;

/// Why a head is refused: what the client is told.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Refusal {
    /// HTTP status.
    pub(super) status: u16,
    /// The API's stable error code.
    pub(super) code: &'static str,
    /// What is wrong.
    pub(super) message: String,
}

fn refuse(status: u16, code: &'static str, message: impl Into<String>) -> Refusal {
    Refusal {
        status,
        code,
        message: message.into(),
    }
}

/// Judges the head at the start of `buf`: `Ok(true)` when it is complete
/// and acceptable, `Ok(false)` when more bytes are needed, or why it is
/// refused. `max_body` is the largest body the API takes.
pub(super) fn check(buf: &[u8], max_body: usize) -> Result<bool, Refusal> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    let status = match req.parse(buf) {
        Ok(status) => status,
        Err(httparse::Error::TooManyHeaders) => {
            return Err(refuse(
                431,
                "headers_too_large",
                format!("more than {MAX_HEADERS} header fields"),
            ));
        }
        Err(e) => {
            return Err(refuse(
                400,
                "bad_request",
                format!("malformed HTTP request head: {e}"),
            ));
        }
    };
    let line_done = buf.contains(&b'\n');
    if req.path.is_some_and(|p| p.len() > MAX_URI) || (!line_done && buf.len() > MAX_URI + 32) {
        return Err(refuse(
            414,
            "uri_too_long",
            format!("the request target is longer than {MAX_URI} bytes"),
        ));
    }
    if status.is_partial() {
        if buf.len() >= MAX_HEAD {
            return Err(refuse(
                431,
                "headers_too_large",
                format!("the request head is larger than {} KiB", MAX_HEAD / 1024),
            ));
        }
        return Ok(false);
    }
    let path = req.path.unwrap_or_default();
    if let Err(e) = path.parse::<axum::http::Uri>() {
        return Err(refuse(
            400,
            "bad_request",
            format!("the request target does not parse: {e}"),
        ));
    }
    let mut length: Option<u64> = None;
    let mut chunked = false;
    for h in req.headers.iter() {
        if h.name.eq_ignore_ascii_case("content-length") {
            // A list of equal values is one value (RFC 9110 §8.6).
            let text = std::str::from_utf8(h.value).unwrap_or("\u{fffd}");
            for part in text.split(',') {
                let part = part.trim();
                let value = (!part.is_empty() && part.bytes().all(|b| b.is_ascii_digit()))
                    .then(|| part.parse::<u64>().ok())
                    .flatten()
                    .ok_or_else(|| {
                        refuse(
                            400,
                            "bad_request",
                            format!("Content-Length {text:?} is not a length (digits that fit in 64 bits)"),
                        )
                    })?;
                if length.is_some_and(|l| l != value) {
                    return Err(refuse(
                        400,
                        "bad_request",
                        "Content-Length is given twice with different values",
                    ));
                }
                length = Some(value);
            }
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            let text = std::str::from_utf8(h.value).unwrap_or_default();
            chunked = text
                .rsplit(',')
                .next()
                .is_some_and(|last| last.trim().eq_ignore_ascii_case("chunked"));
            if !chunked || req.version == Some(0) {
                return Err(refuse(
                    400,
                    "bad_request",
                    format!(
                        "Transfer-Encoding {text:?} is not accepted: send a Content-Length or chunked (HTTP/1.1)"
                    ),
                ));
            }
        }
    }
    if chunked && length.is_some() {
        return Err(refuse(
            400,
            "bad_request",
            "a request must not have both Content-Length and Transfer-Encoding",
        ));
    }
    if let Some(l) = length
        && l > max_body as u64
    {
        return Err(refuse(
            413,
            "too_large",
            format!("the body ({l} bytes) is over the length limit of {max_body} bytes"),
        ));
    }
    Ok(true)
}

/// The whole HTTP response for `refusal`: the API's JSON error shape, and
/// `Connection: close`.
pub(super) fn response(refusal: &Refusal) -> Vec<u8> {
    let reason = axum::http::StatusCode::from_u16(refusal.status)
        .ok()
        .and_then(|s| s.canonical_reason())
        .unwrap_or("Error");
    let body = serde_json::json!({"error": {"code": refusal.code, "message": refusal.message}})
        .to_string();
    format!(
        "HTTP/1.1 {} {reason}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        refusal.status,
        body.len()
    )
    .into_bytes()
}

/// Reads `io`'s request head (within `timeout`) and checks it. An
/// acceptable one comes back as an IO that replays what was read; a refused
/// one is answered and closed (`None`), as is a connection that closes or
/// times out first (a partial head gets a 408 answer).
pub(super) async fn admit<S>(mut io: S, timeout: Duration, max_body: usize) -> Option<Rewind<S>>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut buf = Vec::with_capacity(1024);
    let read = async {
        loop {
            match check(&buf, max_body) {
                Ok(true) => return Ok(()),
                Err(refusal) => return Err(Some(refusal)),
                Ok(false) => {}
            }
            let mut chunk = [0u8; 4096];
            match io.read(&mut chunk).await {
                Ok(0) | Err(_) => {
                    return Err(buf.iter().any(|b| !b.is_ascii_whitespace()).then(|| {
                        refuse(
                            400,
                            "bad_request",
                            "the connection ended inside the request head",
                        )
                    }));
                }
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
    };
    let refusal = match tokio::time::timeout(timeout, read).await {
        Ok(Ok(())) => {
            return Some(Rewind {
                pre: buf,
                at: 0,
                io,
            });
        }
        Ok(Err(refusal)) => refusal,
        Err(_) => (!buf.is_empty()).then(|| {
            refuse(
                408,
                "request_timeout",
                format!("the request head did not arrive within {timeout:?}"),
            )
        }),
    };
    if let Some(refusal) = refusal {
        let answer = async {
            io.write_all(&response(&refusal)).await?;
            io.shutdown().await?;
            // Read what the client still sends (a body) before closing, so
            // the close does not reset the connection under the answer.
            let mut sink = [0u8; 4096];
            let mut left = 256 * 1024usize;
            while left > 0 {
                let n = io.read(&mut sink).await?;
                if n == 0 {
                    break;
                }
                left = left.saturating_sub(n);
            }
            io::Result::Ok(())
        };
        let _ = tokio::time::timeout(Duration::from_secs(1), answer).await;
    }
    None
}

/// An IO that first replays bytes already read from it.
#[derive(Debug)]
pub(super) struct Rewind<S> {
    pre: Vec<u8>,
    at: usize,
    io: S,
}

impl<S: AsyncRead + Unpin> AsyncRead for Rewind<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.at < this.pre.len() {
            let n = out.remaining().min(this.pre.len() - this.at);
            out.put_slice(&this.pre[this.at..this.at + n]);
            this.at += n;
            if this.at == this.pre.len() {
                this.pre = Vec::new();
                this.at = 0;
            }
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.io).poll_read(cx, out)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Rewind<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn verdict(head: &[u8]) -> Result<bool, u16> {
        check(head, 64 * 1024).map_err(|r| r.status)
    }

    #[test]
    fn heads_are_judged_like_hyper_would_but_answered_in_json() {
        assert_eq!(
            verdict(b"GET /v1/status HTTP/1.1\r\nhost: x\r\n\r\n"),
            Ok(true)
        );
        assert_eq!(
            verdict(b"GET /v1/status HTTP/1.1\r\nhost: x\r\n"),
            Ok(false)
        );
        assert_eq!(verdict(b"\x00\x01garbage\r\n\r\n"), Err(400));
        assert_eq!(verdict(b"GET / HTTP/9.9\r\n\r\n"), Err(400));
        let overflow =
            b"POST /v1/release HTTP/1.1\r\ncontent-length: 99999999999999999999999\r\n\r\n";
        assert_eq!(verdict(overflow), Err(400));
        assert_eq!(
            verdict(b"POST / HTTP/1.1\r\ncontent-length: -1\r\n\r\n"),
            Err(400)
        );
        assert_eq!(
            verdict(b"POST / HTTP/1.1\r\ncontent-length: 5, 5\r\n\r\n"),
            Ok(true)
        );
        assert_eq!(
            verdict(b"POST / HTTP/1.1\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\n"),
            Err(400)
        );
        assert_eq!(
            verdict(b"POST / HTTP/1.1\r\ncontent-length: 70000\r\n\r\n"),
            Err(413)
        );
        assert_eq!(
            verdict(b"POST / HTTP/1.1\r\ntransfer-encoding: chunked\r\ncontent-length: 5\r\n\r\n"),
            Err(400)
        );
        assert_eq!(
            verdict(b"POST / HTTP/1.1\r\ntransfer-encoding: gzip\r\n\r\n"),
            Err(400)
        );
        assert_eq!(
            verdict(b"POST / HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n"),
            Ok(true)
        );
        let long_uri = format!("GET /{} HTTP/1.1\r\n\r\n", "a".repeat(MAX_URI));
        assert_eq!(verdict(long_uri.as_bytes()), Err(414));
        let unfinished_uri = format!("GET /{}", "a".repeat(MAX_URI + 100));
        assert_eq!(verdict(unfinished_uri.as_bytes()), Err(414));
        let many: String = (0..=MAX_HEADERS).map(|i| format!("x-{i}: y\r\n")).collect();
        assert_eq!(
            verdict(format!("GET / HTTP/1.1\r\n{many}\r\n").as_bytes()),
            Err(431)
        );
        let big = format!("GET / HTTP/1.1\r\nx-big: {}\r\n", "y".repeat(MAX_HEAD));
        assert_eq!(verdict(big.as_bytes()), Err(431));
    }

    #[test]
    fn a_refusal_is_the_documented_json_shape() {
        let bytes = response(&refuse(431, "headers_too_large", "too many"));
        let text = String::from_utf8(bytes).expect("utf-8");
        let (head, body) = text.split_once("\r\n\r\n").expect("head");
        assert!(
            head.starts_with("HTTP/1.1 431 Request Header Fields Too Large"),
            "{head}"
        );
        let v: serde_json::Value = serde_json::from_str(body).expect("json");
        assert_eq!(v["error"]["code"], "headers_too_large");
        assert_eq!(v["error"]["message"], "too many");
    }
}
