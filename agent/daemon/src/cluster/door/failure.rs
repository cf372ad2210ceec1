//! What an etcd failure means: never sent, refused, or unknown outcome.

use super::super::ClusterStoreError;
use super::DoorOptions;

/// Whether `e` says the request was never sent: the connection to the
/// member could not be made (hyper's "tcp connect error", surfaced by tonic
/// as an Unavailable status or a transport error).
pub(super) fn never_sent(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::GRpcStatus(s) => s.message().contains("tcp connect error"),
        etcd_client::Error::TransportError(t) => t.to_string().contains("tcp connect error"),
        _ => false,
    }
}

/// What etcd answered when it refused the request outright — checked it
/// and said no before proposing anything, so nothing was written and
/// asking again will be refused again: an invalid request (too many
/// operations in a transaction, a request too large, a key or range
/// etcd does not accept), no permission, the space quota exceeded, a
/// precondition or range it will not serve. gRPC codes: 3 invalid
/// argument, 5 not found, 6 already exists, 7 permission denied, 8
/// resource exhausted, 9 failed precondition, 11 out of range, 16
/// unauthenticated. `None` for anything whose outcome is unknown
/// (unavailable, deadline, cancelled, internal, a transport failure).
pub(super) fn refusal(e: &etcd_client::Error) -> Option<String> {
    match e {
        etcd_client::Error::GRpcStatus(s) if refused_code(i32::from(s.code())) => {
            Some(s.message().to_string())
        }
        _ => None,
    }
}

/// Whether a gRPC status code from etcd is a definite refusal
/// ([`refusal`]).
pub(super) fn refused_code(code: i32) -> bool {
    matches!(code, 3 | 5..=9 | 11 | 16)
}

/// Whether `e` may pass by itself: the connection failed or broke (a member
/// stopped under the request), or etcd answered Unavailable (no leader for
/// a moment). gRPC codes: 1 cancelled, 14 unavailable. tonic reports a
/// connection that broke under a request in flight (a broken pipe, a reset
/// from a member just stopped) as code 2, Unknown, with the I/O error in
/// its source chain: that is a broken connection too, not an answer.
pub(super) fn transient(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::GRpcStatus(s) => {
            matches!(i32::from(s.code()), 1 | 14)
                || (i32::from(s.code()) == 2 && broken_connection(s))
        }
        etcd_client::Error::TransportError(_) => true,
        _ => false,
    }
}

/// Whether an I/O error lies in `e`'s source chain: the request's
/// connection failed, rather than etcd answering.
pub(super) fn broken_connection(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause = e.source();
    while let Some(c) = cause {
        if c.downcast_ref::<std::io::Error>().is_some() {
            return true;
        }
        cause = c.source();
    }
    false
}

pub(super) fn unavailable(
    opts: &DoorOptions,
    what: &str,
    why: &str,
    write: bool,
) -> ClusterStoreError {
    ClusterStoreError::Unavailable {
        endpoints: opts.endpoints.join(","),
        what: format!("{what}: {why}"),
        maybe_written: write,
    }
}
